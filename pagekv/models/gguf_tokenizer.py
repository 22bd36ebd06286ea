"""Building a `tokenizers` BPE tokenizer from a GGUF file's tokenizer metadata.

Owns the mapping from llama.cpp's tokenizer description (tokenizer.ggml.model = "gpt2", a
pre-tokenizer name, tokens, merges, token types) to a byte-level BPE with the same splitting
rules as the model's original tokenizer.json. Only byte-level BPE ("gpt2") vocabularies are
supported; SentencePiece GGUFs raise ModelLoadError (load the HF directory instead).
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from pagekv.errors import ModelLoadError

CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
USER_DEFINED_TOKEN_TYPE = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre values we know how to reproduce.
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt-2", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """Splitting rules matching each model family's original tokenizer.json."""
    if name in ("default", "gpt-2", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":  # every digit alone, then GPT-2's regex (as SmolLM2's tokenizer.json)
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _QWEN2_SPLIT if name == "qwen2" else _LLAMA3_SPLIT
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _string_list(metadata: Mapping[str, object], key: str, path: str) -> list[str]:
    value = metadata.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} missing or not a list of strings")
    return value


def _vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id. A token spelled with characters outside the byte alphabet is respelled
    from its UTF-8 bytes (as transformers does), so BPE can reach it."""
    alphabet = byte_alphabet()
    allowed = set(alphabet.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= allowed:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab[token] = index
    return vocab


def _added_tokens(tokens: list[str], token_types: list[int]) -> list[AddedToken]:
    """Control tokens become special added tokens (so "<|im_start|>" is one id), user-defined
    ones plain added tokens. Control tokens outside the byte alphabet are llama.cpp mislabels;
    adding them would grow the vocabulary, so they are skipped (as transformers does)."""
    allowed = set(byte_alphabet().values())
    added = []
    for token, token_type in zip(tokens, token_types, strict=False):
        if token_type == CONTROL_TOKEN_TYPE and set(token) <= allowed:
            added.append(AddedToken(token, special=True, normalized=False))
        elif token_type == USER_DEFINED_TOKEN_TYPE:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")  # byte-level tokens never contain a real space
    return left, right


def backend_from_gguf(metadata: Mapping[str, object], path: str) -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` equivalent to the model's original one."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"{path}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE "
            "'gpt2'); load the model's Hugging Face directory instead"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{path}: GGUF pre-tokenizer {pre!r} is not supported; known: "
            f"{SUPPORTED_PRE_TOKENIZERS}"
        )
    tokens = _string_list(metadata, "tokenizer.ggml.tokens", path)
    merges = [_merge_pair(m) for m in _string_list(metadata, "tokenizer.ggml.merges", path)]
    bpe = models.BPE(
        vocab=_vocab(tokens),
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in ("llama-bpe", "llama3"),  # as Llama 3's tokenizer.json
    )
    backend = BackendTokenizer(bpe)
    if pre == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer(str(pre))
    backend.decoder = decoders.ByteLevel()
    token_types = metadata.get("tokenizer.ggml.token_type", [])
    assert isinstance(token_types, list)
    backend.add_special_tokens(_added_tokens(tokens, token_types))
    _set_post_processor(backend, metadata, tokens)
    return backend


def _set_post_processor(
    backend: BackendTokenizer, metadata: Mapping[str, object], tokens: list[str]
) -> None:
    """BOS/EOS added by encode() exactly when the file's add_bos_token/add_eos_token say so."""
    pieces = ["$A"]
    specials = []
    for flag, id_key in (
        ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id"),
        ("tokenizer.ggml.add_eos_token", "tokenizer.ggml.eos_token_id"),
    ):
        token_id = metadata.get(id_key)
        if metadata.get(flag) is True and isinstance(token_id, int):
            # BOS goes in front, EOS at the end.
            pieces.insert(0 if "bos" in flag else len(pieces), tokens[token_id])
            specials.append((tokens[token_id], token_id))
    if specials:
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(pieces), special_tokens=specials
        )
