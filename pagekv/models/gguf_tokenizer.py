"""Building a `tokenizers` BPE tokenizer from a GGUF file's tokenizer metadata.

Owns the mapping from llama.cpp's tokenizer description (tokenizer.ggml.model = "gpt2", a
pre-tokenizer name, tokens, merges, token types) to a byte-level BPE with the same splitting
rules as the model's original tokenizer.json; and from a SentencePiece BPE description
(tokenizer.ggml.model = "llama": pieces spelled with "▁" for a space, byte pieces <0xNN> for
what the vocabulary lacks) to a BPE with byte fallback, as Gemma's and Llama 2's tokenizers are.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from pagekv.errors import ModelLoadError

SPACE = "\u2581"  # SentencePiece's spelling of a space
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


def _add_file_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: list[int], byte_level: bool = True
) -> None:
    """Control tokens become special added tokens (so "<|im_start|>" is one id and decoding
    may skip it), user-defined ones plain added tokens (matched whole, always decoded: Gemma's
    "\n" is one). In a byte-level vocabulary, control tokens outside the byte alphabet are
    llama.cpp mislabels; adding them would grow the vocabulary, so they are skipped (as
    transformers does)."""
    allowed = set(byte_alphabet().values())
    special, plain = [], []
    for token, token_type in zip(tokens, token_types, strict=False):
        if token_type == CONTROL_TOKEN_TYPE and (not byte_level or set(token) <= allowed):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == USER_DEFINED_TOKEN_TYPE:
            plain.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")  # byte-level tokens never contain a real space
    return left, right


def backend_from_gguf(metadata: Mapping[str, object], path: str) -> BackendTokenizer:
    """A `tokenizers.Tokenizer` equivalent to the model's original one: byte-level BPE
    ("gpt2") or SentencePiece BPE ("llama")."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "llama":
        return _sentencepiece_from_gguf(metadata, path)
    if model != "gpt2":
        raise ModelLoadError(
            f"{path}: GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' "
            "and SentencePiece BPE 'llama' are); load the model's Hugging Face directory instead"
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
    _add_file_tokens(backend, tokens, token_types)
    _set_post_processor(backend, metadata, tokens)
    return backend


def _sentencepiece_from_gguf(metadata: Mapping[str, object], path: str) -> BackendTokenizer:
    """SentencePiece BPE: spaces become "▁" before the merges (and one is put in front where
    the file says ``add_space_prefix``), unknown characters fall back to byte pieces. The file
    carries no merges: a BPE-trained vocabulary lists each piece after the pieces it is merged
    from, so every split of a piece into two pieces is a merge ranked by the piece's place in
    the list (its score is no rank for every model: Gemma's are not)."""
    tokens = _string_list(metadata, "tokenizer.ggml.tokens", path)
    # Gemma's files spell pieces of two or more spaces as spaces; its text has "▁" there.
    tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges_from_pieces(vocab),
        unk_token=tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = BackendTokenizer(bpe)
    replace = normalizers.Replace(" ", SPACE)
    decode: list[decoders.Decoder] = [
        decoders.Replace(SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace])
        decode.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = replace
    backend.decoder = decoders.Sequence(decode)
    token_types = metadata.get("tokenizer.ggml.token_type", [])
    assert isinstance(token_types, list)
    _add_file_tokens(backend, tokens, token_types, byte_level=False)
    _set_post_processor(backend, metadata, tokens)
    return backend


def _merges_from_pieces(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Each piece's splits into two pieces of the vocabulary, pieces in vocabulary order; one
    piece's splits with the longer left part first (transformers' order for the same files)."""
    ranked = []
    for piece, rank in vocab.items():
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append(
                    (rank, -len(left), -len(right), vocab[left], vocab[right], left, right)
                )
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


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
