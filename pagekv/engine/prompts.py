"""A user's prompt as the token ids the engine queues, checked before anything is allocated.

Owns nothing: functions of the tokenizer and the vocabulary's size. Every bad prompt raises
``InvalidRequestError`` naming the parameter: empty text or ids, text that is not valid Unicode
(a lone surrogate such as "\\ud800", which a JSON body can carry), ids that are not integers of
the vocabulary. Must not import ``core``, ``runner`` or ``server``.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

from pagekv.errors import InvalidRequestError
from pagekv.models.tokenizer import Tokenizer
from pagekv.sampling_params import SamplingParams, check_text

PromptInput = str | Sequence[int]


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


def check_logprobs_limit(params: SamplingParams, max_logprobs: int) -> None:
    """Refuse ``logprobs`` or ``prompt_logprobs`` above the engine's ``max_logprobs``."""
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name, None)
        if asked is not None and asked > max_logprobs:
            raise InvalidRequestError(
                f"{name}: {asked} requested, more than the engine's max_logprobs ({max_logprobs})",
                name,
            )
