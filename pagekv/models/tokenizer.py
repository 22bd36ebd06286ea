"""`Tokenizer`: text <-> token ids, stop ids, and chat formatting for one model.

Owns a `tokenizers.Tokenizer` (built from GGUF metadata by gguf_tokenizer, or read from an HF
directory's tokenizer.json), the model's BOS / EOS ids and its chat template. Whether encode()
adds BOS is the backend's post-processor's business, set from the model's own metadata.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from pagekv.errors import InvalidRequestError, ModelLoadError
from pagekv.models.chat_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ChatTemplate
from pagekv.models.gguf_tokenizer import backend_from_gguf


class Tokenizer:
    """One model's tokenizer. Immutable after construction."""

    # How the chat prompt tells the model to write a tool call (``chat_template``), for parsers.
    tool_call_tags = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)

    def __init__(
        self,
        backend: BackendTokenizer,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        for token_id in (*eos_token_ids, *([] if bos_token_id is None else [bos_token_id])):
            if not 0 <= token_id < self.vocab_size:
                raise ModelLoadError(f"special token id {token_id} is outside the vocabulary")
        special = {"eos_token": self.id_to_token(eos_token_ids[0])} if eos_token_ids else {}
        if bos_token_id is not None:
            special["bos_token"] = self.id_to_token(bos_token_id)
        self.special_tokens: Mapping[str, str] = special  # what a chat template may refer to
        self._template = None if chat_template is None else ChatTemplate(chat_template, special)

    @property
    def backend(self) -> BackendTokenizer:
        """The ``tokenizers`` object (vocabulary queries; ``HFTokenizer`` reads it)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; BOS only if the model's metadata asks for it (and
        ``add_special_tokens``: False for a fragment such as a bad word)."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; control tokens such as <|im_end|> are dropped unless asked for."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The backend tokenizer serialized as tokenizer.json (for grammar libraries)."""
        return str(self._backend.to_str())

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of an id, as spelled in the vocabulary (e.g. "Ġhello")."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise InvalidRequestError(f"token id {token_id} is outside the vocabulary")
        return token

    def compile_chat_template(self, source: str) -> ChatTemplate:
        """Another chat template than the model's, with this model's special tokens."""
        return ChatTemplate(source, self.special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        template: ChatTemplate | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation (InvalidRequestError on bad messages), with the
        model's template or ``template``; the options are ``ChatTemplate.render``'s."""
        template = template or self._template
        if template is None:
            raise InvalidRequestError("this model has no chat template", param="messages")
        return template.render(
            messages,
            add_generation_prompt,
            tools,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )


def tokenizer_from_gguf(metadata: Mapping[str, object], path: str) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes."""
    backend = backend_from_gguf(metadata, path)
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(token_id, int) and token_id not in eos_ids:
            eos_ids.append(token_id)
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    template = metadata.get("tokenizer.chat_template")
    return Tokenizer(
        backend,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=tuple(eos_ids),
        chat_template=template if isinstance(template, str) else None,
    )


def read_json(path: str) -> dict[str, object]:
    """A JSON object from a file, or {} when the file does not exist."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return value


def tokenizer_from_hf_dir(directory: str) -> Tokenizer:
    """The tokenizer of an HF model directory: tokenizer.json, plus the chat template and
    special tokens from tokenizer_config.json / chat_template.jinja / generation_config.json /
    config.json."""
    tokenizer_file = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise ModelLoadError(f"{directory}: no tokenizer.json")
    try:
        backend = BackendTokenizer.from_file(tokenizer_file)
    except Exception as exc:  # the Rust side raises plain Exception on a bad file
        raise ModelLoadError(f"{tokenizer_file}: cannot load tokenizer: {exc}") from exc
    tok_config = read_json(os.path.join(directory, "tokenizer_config.json"))
    model_config = read_json(os.path.join(directory, "config.json"))
    gen_config = read_json(os.path.join(directory, "generation_config.json"))

    eos_ids: list[int] = []
    for value in (
        gen_config.get("eos_token_id"),
        model_config.get("eos_token_id"),
        tok_config.get("eos_token"),
    ):
        eos_ids += [i for i in _token_ids(backend, value) if i not in eos_ids]
    bos_ids = _token_ids(backend, model_config.get("bos_token_id")) or _token_ids(
        backend, tok_config.get("bos_token")
    )
    return Tokenizer(
        backend,
        bos_token_id=bos_ids[0] if bos_ids else None,
        eos_token_ids=tuple(eos_ids),
        chat_template=_hf_chat_template(directory, tok_config),
    )


def _token_ids(backend: BackendTokenizer, value: object) -> list[int]:
    """Ids from a config value: an int, a list of ints, a token string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, str):
        found = backend.token_to_id(value)
        return [] if found is None else [found]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _hf_chat_template(directory: str, tok_config: Mapping[str, object]) -> str | None:
    """chat_template.jinja (transformers >= 4.50 writes it) or tokenizer_config's entry, which
    may be a string or a list of named templates (we take "default")."""
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
