"""``HFTokenizer``: a model's ``Tokenizer`` with the face of a transformers tokenizer, which is
what ``LLM.get_tokenizer()`` returns (vLLM hands out a transformers one).

Owns nothing but a reference to the engine's tokenizer; it keeps transformers' defaults where
they differ from the engine's (``decode`` keeps special tokens; ``apply_chat_template``
tokenizes, returns a dict and adds no generation prompt unless asked). Plain lists only:
padding, truncation and tensors are refused by name rather than ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, overload

from pagekv.errors import InvalidRequestError
from pagekv.models.chat_template import read_chat_template
from pagekv.models.tokenizer import Tokenizer

Conversation = list[dict[str, Any]]


class BatchEncoding(dict[str, Any]):
    """transformers' result of calling a tokenizer: ``enc.input_ids`` or ``enc["input_ids"]``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFTokenizer:
    """The transformers calls vLLM users make on ``llm.get_tokenizer()``."""

    is_fast = True

    def __init__(self, tokenizer: Tokenizer, name_or_path: str) -> None:
        self.tokenizer = tokenizer  # the engine's own
        self.name_or_path = name_or_path
        backend = tokenizer.backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=False)
        added = backend.get_added_tokens_decoder()
        self.all_special_ids = sorted(i for i, token in added.items() if token.special)
        self.all_special_tokens = [added[i].content for i in self.all_special_ids]

    # ---- special tokens -------------------------------------------------------------------------

    @property
    def eos_token_id(self) -> int | None:
        ids = self.tokenizer.eos_token_ids
        return ids[0] if ids else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (pagekv's name; transformers has one)."""
        return self.tokenizer.eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def eos_token(self) -> str | None:
        return self.tokenizer.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.tokenizer.special_tokens.get("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return None  # no padding: every result is a plain list

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def __len__(self) -> int:
        return self.tokenizer.vocab_size  # added tokens included, as transformers counts

    def get_vocab(self) -> dict[str, int]:
        return dict(self.tokenizer.backend.get_vocab(with_added_tokens=True))

    # ---- text <-> ids ---------------------------------------------------------------------------

    def __call__(
        self, text: str | Sequence[str], add_special_tokens: bool = True, **options: Any
    ) -> BatchEncoding:
        """``tok("text").input_ids``; a list of texts gives a list of id lists."""
        _refuse_tensor_options(options)
        if isinstance(text, str):
            ids: Any = self.encode(text, add_special_tokens)
            mask: Any = [1] * len(ids)
        else:
            ids = [self.encode(t, add_special_tokens) for t in text]
            mask = [[1] * len(i) for i in ids]
        return BatchEncoding(input_ids=ids, attention_mask=mask)

    def encode(self, text: str, add_special_tokens: bool = True, **options: Any) -> list[int]:
        _refuse_tensor_options(options)
        if not isinstance(text, str):
            raise InvalidRequestError(f"text: a string, got {type(text).__name__}", "text")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens))

    @overload
    def convert_ids_to_tokens(self, ids: int, skip_special_tokens: bool = False) -> str: ...
    @overload
    def convert_ids_to_tokens(
        self, ids: Sequence[int], skip_special_tokens: bool = False
    ) -> list[str]: ...
    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | list[str]:
        if isinstance(ids, int):
            return self.tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.tokenizer.id_to_token(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int | None] | None:
        backend = self.tokenizer.backend
        if isinstance(tokens, str):
            return backend.token_to_id(tokens)
        return [backend.token_to_id(t) for t in tokens]

    # ---- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: Conversation | Sequence[Conversation],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        return_dict: bool = True,
        **template_kwargs: Any,
    ) -> Any:
        """transformers' (5.x, as vLLM 0.32 ships) call: text (``tokenize=False``) or, for one
        conversation or a list of them, ``{"input_ids", "attention_mask"}`` (``return_dict``,
        the default) or the ids alone; extra keyword arguments reach the template (those it
        reads)."""
        _pop_tensor_options(template_kwargs)
        template = None
        if chat_template is not None:
            template = self.tokenizer.compile_chat_template(read_chat_template(chat_template))
        batched = bool(conversation) and not isinstance(conversation[0], Mapping)
        results: list[Any] = []
        for messages in conversation if batched else [conversation]:
            text = self.tokenizer.apply_chat_template(
                list(messages),  # type: ignore[arg-type]
                add_generation_prompt,
                tools,
                continue_final_message=continue_final_message,
                template=template,
                template_kwargs=template_kwargs,
            )
            # the template writes the special tokens itself, as transformers assumes
            ids = self.encode(text, add_special_tokens=False) if tokenize else None
            if return_dict and ids is not None:
                results.append(BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids)))
            else:
                results.append(text if ids is None else ids)
        return results if batched else results[0]


def _pop_tensor_options(options: dict[str, Any]) -> None:
    """Options that would change the result's shape are refused by name, not ignored."""
    for name in ("padding", "truncation", "return_tensors", "max_length"):
        if options.pop(name, None) not in (None, False):
            raise InvalidRequestError(
                f"{name}: this tokenizer returns plain lists, unpadded and untruncated", name
            )


def _refuse_tensor_options(options: dict[str, Any]) -> None:
    _pop_tensor_options(options)
    if options:
        name = sorted(options)[0]
        raise InvalidRequestError(f"tokenizer option {name!r} is not taken here", name)
