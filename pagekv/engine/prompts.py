"""A user's prompt as the token ids the engine queues, checked before anything is allocated.

Owns nothing: functions of the tokenizer and the vocabulary's size. Every bad prompt raises
``InvalidRequestError`` naming the parameter: empty text or ids, text that is not valid Unicode
(a lone surrogate such as "\\ud800", which a JSON body can carry), ids that are not integers of
the vocabulary. Must not import ``core``, ``runner`` or ``server``.

Also the offline API's prompt forms, as vLLM takes them (``parse_prompts``): a string, a list
of token ids (one tokenized prompt; a list of such lists is several), ``TextPrompt`` /
``TokensPrompt`` dicts (pagekv.inputs), or a list mixing these. Multi-modal data and
embeddings are refused by name: this engine runs text-only models.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagekv.errors import InvalidRequestError
from pagekv.models.tokenizer import Tokenizer
from pagekv.sampling_params import check_text

PromptInput = str | Sequence[int]


_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
_TEXT_ONLY_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


@dataclass(frozen=True)
class ParsedPrompt:
    """One prompt of a call: what the engine queues, the text reported back, its salt."""

    prompt: PromptInput
    text: str | None = None
    cache_salt: str | None = None


def parse_prompts(prompts: object) -> list[ParsedPrompt]:
    """``prompts`` as one prompt (a string, a dict, a non-empty list of ints) or as a sequence
    of prompts, each checked for its form (token ids are checked when queued)."""
    if isinstance(prompts, str | Mapping) or _is_token_list(prompts):
        return [_parse_one(prompts)]
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise InvalidRequestError(
            f"prompts: a prompt or a list of prompts, got {type(prompts).__name__}", "prompt"
        )
    return [_parse_one(p) for p in prompts]


def _is_token_list(value: object) -> bool:
    return (
        isinstance(value, list | tuple)
        and len(value) > 0
        and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value)
    )


def _parse_one(prompt: object) -> ParsedPrompt:
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, prompt)
    if isinstance(prompt, list | tuple):
        return ParsedPrompt(list(prompt))  # ids checked against the vocabulary when queued
    if not isinstance(prompt, Mapping):
        raise InvalidRequestError(
            "a prompt is a string, a list of token ids, or a dict with 'prompt' or "
            f"'prompt_token_ids', got {type(prompt).__name__}",
            "prompt",
        )
    _check_prompt_keys(prompt)
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError("cache_salt: a non-empty string", "cache_salt")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise InvalidRequestError(f"prompt: a string, got {type(text).__name__}", "prompt")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str | bytes | Mapping) or not isinstance(ids, Iterable):
            raise InvalidRequestError(
                f"prompt_token_ids: a list of token ids, got {type(ids).__name__}", "prompt"
            )
        return ParsedPrompt(list(ids), text, salt)
    if text is None:
        raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
    return ParsedPrompt(text, text, salt)


def _check_prompt_keys(prompt: Mapping[Any, Any]) -> None:
    for key in _TEXT_ONLY_KEYS:
        if prompt.get(key) is not None:
            raise InvalidRequestError(
                f"{key}: this engine runs text-only models; multi-modal inputs are not taken",
                key,
            )
    if "prompt_embeds" in prompt:
        raise InvalidRequestError(
            "prompt_embeds: prompts are text or token ids here, not embeddings", "prompt_embeds"
        )
    unknown = [k for k in prompt if k not in _PROMPT_KEYS and k not in _TEXT_ONLY_KEYS]
    if unknown:
        raise InvalidRequestError(
            f"prompt dict: unknown key {unknown[0]!r} (known: {sorted(_PROMPT_KEYS)})",
            str(unknown[0]),
        )


def tokenize_prompt(
    tokenizer: Tokenizer, vocab_size: int, prompt: PromptInput
) -> tuple[str | None, list[int]]:
    """Tokenize text, or check token ids against the vocabulary; neither may be empty."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        check_text(prompt, "prompt")
        return prompt, tokenizer.encode(prompt)
    if not isinstance(prompt, Iterable):
        raise InvalidRequestError(
            f"prompt: a string or token ids, got {type(prompt).__name__}", "prompt"
        )
    given = list(prompt)
    if not given:
        raise InvalidRequestError("prompt_token_ids must not be empty", "prompt")
    check_token_ids(given, vocab_size, "prompt")
    return None, [int(t) for t in given]


def check_token_ids(ids: Iterable[Any], vocab_size: int, param: str) -> None:
    """Refuse anything in ``ids`` that is not a token id of the vocabulary (``param`` named)."""
    for t in ids:  # numpy's integers too; not bools
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InvalidRequestError(f"{param}: token ids must be integers, got {t!r:.80}", param)
        if not 0 <= int(t) < vocab_size:
            raise InvalidRequestError(
                f"{param}: token id {t!r} is outside the vocabulary [0, {vocab_size})", param
            )
