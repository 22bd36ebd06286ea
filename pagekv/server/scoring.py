"""Completions that score their prompt: ``echo`` and ``prompt_logprobs``, in the shapes of
OpenAI's legacy completions and vLLM, which evaluation harnesses read (lm-evaluation-harness's
``local-completions`` sends ``echo: true, logprobs: 1, max_tokens: 0 or 1`` and reads
``choices[i].logprobs.tokens / token_logprobs / top_logprobs / text_offset``).

With ``echo`` a choice's text begins with its prompt, and with ``logprobs`` its logprobs begin
with one entry per prompt token: the first has no logprob (``null``, and ``null`` top
alternatives), each later one its log-probability given the tokens before it and the top
``logprobs`` alternatives (the token itself among them). ``text_offset`` runs on through the
prompt's tokens into the completion's, each token's offset the previous one's plus the
previous token's length. A streamed choice sends its prompt in its first chunk.
``prompt_logprobs=k`` adds vLLM's raw list to each choice: ``null`` for the first token, then
``{token id: {logprob, rank, decoded_token}}`` for each later one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagekv.engine.outputs import Logprob, RequestOutput
from pagekv.server.formats import Context

MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM's and OpenAI's floor)

PositionLogprobs = dict[int, Logprob]


def _value(logprob: Logprob) -> float:
    value = logprob.logprob
    return MIN_LOGPROB if math.isnan(value) else max(value, MIN_LOGPROB)


@dataclass(frozen=True)
class PromptScoring:
    """How a request shows its prompt. ``echo_texts``: each prompt's text (the request's, or
    its ids decoded), when ``echo`` is on; ``show_prompt_logprobs``: the response carries
    vLLM's ``prompt_logprobs`` (asked for, or implied by echo with logprobs), in each choice
    (completions) or, with ``in_choices`` false, beside them (chat, one prompt)."""

    echo_texts: tuple[str, ...] | None
    show_prompt_logprobs: bool
    in_choices: bool = True

    def ready(self, ctx: Context, output: RequestOutput) -> bool:
        """Whether ``output`` holds what the prompt part needs (its logprobs, once prefilled)."""
        needs_scores = self.show_prompt_logprobs or (
            self.echo_texts is not None and ctx.logprobs is not None
        )
        return not needs_scores or output.prompt_logprobs is not None

    def prefix(self, ctx: Context, output: RequestOutput, prompt_index: int) -> Prefix:
        """What a choice of prompt ``prompt_index`` begins with (``output`` is ``ready``)."""
        text, logprobs = "", None
        if self.echo_texts is not None:
            text = self.echo_texts[prompt_index]
            if ctx.logprobs is not None:
                assert output.prompt_logprobs is not None
                logprobs = prompt_part(ctx, output.prompt_token_ids, output.prompt_logprobs)
        shown = self.show_prompt_logprobs and self.in_choices
        raw = raw_prompt_logprobs(output.prompt_logprobs) if shown else None
        return Prefix(text, logprobs, shown, raw)


@dataclass(frozen=True)
class Prefix:
    """A choice's prompt part: its text, its legacy logprobs (None: none shown), and vLLM's
    raw ``prompt_logprobs`` (``show_raw``: the choice carries the field)."""

    text: str
    logprobs: dict[str, list[Any]] | None
    show_raw: bool
    raw: list[dict[str, dict[str, Any]] | None] | None

    @property
    def end_offset(self) -> int:
        """Where the completion's first token starts in ``text_offset`` terms: give the
        choice's cursor this before formatting its completion part."""
        if not self.logprobs or not self.logprobs["tokens"]:
            return 0
        return int(self.logprobs["text_offset"][-1]) + len(self.logprobs["tokens"][-1])

    def put_before(self, choice: dict[str, Any]) -> dict[str, Any]:
        """``choice`` (formatted with a cursor at ``end_offset``) with this part first."""
        if self.text:  # echo (completions only)
            choice["text"] = self.text + choice["text"]
        if self.logprobs is not None:
            rest = choice.get("logprobs") or {}
            choice["logprobs"] = {
                key: value + rest.get(key, []) for key, value in self.logprobs.items()
            }
        if self.show_raw:
            choice["prompt_logprobs"] = self.raw
        return choice


def prompt_part(
    ctx: Context, token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None]
) -> dict[str, list[Any]]:
    """The legacy-completions logprobs of the prompt tokens, offsets from 0."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    offsets, offset = [], 0
    for token_id, entry in zip(token_ids, positions, strict=True):
        chosen = None if entry is None else entry.get(token_id)
        name = _name(ctx, token_id, chosen)
        out["tokens"].append(name)
        out["token_logprobs"].append(None if chosen is None else _value(chosen))
        if entry is None:
            out["top_logprobs"].append(None)
        else:
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
            out["top_logprobs"].append({_name(ctx, t, lp): _value(lp) for t, lp in ranked})
        offsets.append(offset)
        offset += len(name)
    out["text_offset"] = offsets
    return out


def _name(ctx: Context, token_id: int, logprob: Logprob | None) -> str:
    """A token as vLLM names it in logprobs: its decoded text in context when the engine gave
    it (and token ids are not asked for), else the token alone."""
    if ctx.namer(token_id).startswith("token_id:") or logprob is None:
        return ctx.namer(token_id)
    return logprob.decoded_token if logprob.decoded_token is not None else ctx.namer(token_id)


def raw_prompt_logprobs(
    positions: Sequence[PositionLogprobs | None] | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` as JSON: token ids as keys, -inf floored."""
    if positions is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in positions
    ]
