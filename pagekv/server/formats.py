"""Response bodies of the OpenAI API: completions and chat, whole and as stream chunks.

Owns nothing but formatting. ``Cursor`` remembers what of one choice was already streamed;
``TokenNamer`` spells token ids for logprobs. The tokenizer is immutable after load (its class
docstring), so the HTTP thread may decode with it; the engine is never called from here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagekv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagekv.server.tools import ToolPlan

MIN_LOGPROB = -9999.0  # JSON has no -inf


def _lp(value: Logprob | None) -> float:
    if value is None or math.isnan(value.logprob):
        return MIN_LOGPROB
    return max(value.logprob, MIN_LOGPROB)


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """A position's tokens, most likely first."""
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)


class TokenNamer:
    """Token id -> text of that token alone (special tokens spelled out), memoised."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._names: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._names[token_id] = self._decode([token_id])
        return name


@dataclass
class Cursor:
    """How much of one choice was sent: characters of text, tokens (for logprobs)."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    done: bool = False

    def advance(self, out: CompletionOutput, hold_chars: int) -> tuple[str, int, int]:
        """New text and the token range [start, end) to send now.

        While unfinished, the last ``hold_chars`` characters stay back: they might be the start
        of a stop string that the engine will cut off the text.
        """
        end_chars = len(out.text) if out.finished else max(0, len(out.text) - hold_chars)
        end_chars = max(end_chars, self.num_chars)
        text = out.text[self.num_chars : end_chars]
        start = self.num_tokens
        self.num_chars, self.num_tokens = end_chars, len(out.token_ids)
        self.done = out.finished
        return text, start, self.num_tokens


@dataclass
class Context:
    """What every body of one response shares."""

    response_id: str
    model: str
    created: int
    namer: TokenNamer
    n: int
    logprobs: int | None = None
    include_usage: bool = False


def usage(finals: Sequence[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
    cached = sum(f.num_cached_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class CompletionFormat:
    """``/v1/completions``: ``text_completion`` objects."""

    object_name = "text_completion"
    chunk_object = "text_completion"

    def opening_choices(self, ctx: Context, num_choices: int) -> list[dict[str, Any]]:
        return []

    def choice(
        self, ctx: Context, index: int, out: CompletionOutput, cursor: Cursor, hold_chars: int = 0
    ) -> dict[str, Any]:
        """The next part of choice ``index`` (all of it when ``cursor`` is fresh and not held)."""
        text, start, end = cursor.advance(out, hold_chars)
        logprobs = None
        if ctx.logprobs is not None and out.logprobs is not None:
            logprobs = self._logprobs(ctx, out, start, end, cursor)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }

    def _logprobs(
        self, ctx: Context, out: CompletionOutput, start: int, end: int, cursor: Cursor
    ) -> dict[str, Any]:
        assert out.logprobs is not None
        tokens, token_lps, tops, offsets = [], [], [], []
        for i in range(start, end):
            token_id, entry = out.token_ids[i], out.logprobs[i]
            name = ctx.namer(token_id)
            tokens.append(name)
            token_lps.append(_lp(entry.get(token_id)))
            ranked = _ranked(entry)
            tops.append({ctx.namer(t): _lp(v) for t, v in ranked})
            offsets.append(cursor.text_offset)
            cursor.text_offset += len(name)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chunk(self, ctx: Context, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": ctx.response_id,
            "object": self.chunk_object,
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
        }

    def response(
        self, ctx: Context, choices: list[dict[str, Any]], finals: Sequence[RequestOutput]
    ) -> dict[str, Any]:
        body = self.chunk(ctx, choices)
        body["object"] = self.object_name
        body["usage"] = usage(finals)
        return body


class ChatFormat(CompletionFormat):
    """``/v1/chat/completions``: ``chat.completion`` and ``chat.completion.chunk`` objects."""

    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, streaming: bool, tools: ToolPlan | None = None) -> None:
        self.streaming = streaming
        self.tools = tools  # the request's tool plan, when it may call tools

    def opening_choices(self, ctx: Context, num_choices: int) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [
            {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
            for i in range(num_choices)
        ]

    def choice(
        self, ctx: Context, index: int, out: CompletionOutput, cursor: Cursor, hold_chars: int = 0
    ) -> dict[str, Any]:
        if self.tools is not None:
            return self._tool_choice(ctx, index, out, cursor, self.tools)
        text, start, end = cursor.advance(out, hold_chars)
        logprobs = None
        if ctx.logprobs is not None and out.logprobs is not None:
            logprobs = {"content": self._content_logprobs(ctx, out, start, end)}
        body: dict[str, Any] = {"index": index, "logprobs": logprobs}
        if self.streaming:
            body["delta"] = {"content": text} if text or not out.finished else {}
        else:
            body["message"] = {"role": "assistant", "content": text}
        body["finish_reason"] = out.finish_reason
        body["stop_reason"] = out.stop_reason
        return body

    def _tool_choice(
        self, ctx: Context, index: int, out: CompletionOutput, cursor: Cursor, tools: ToolPlan
    ) -> dict[str, Any]:
        """A choice that may call tools: content only as far as it cannot be part of a call;
        the calls, parsed, when the choice finishes (finish_reason ``tool_calls``)."""
        content, calls = tools.split(out.text) if out.finished else (None, [])
        visible = out.text if out.finished and not calls else tools.streamable(out.text, False)
        start, text = cursor.num_tokens, visible[cursor.num_chars :]
        cursor.num_chars = max(cursor.num_chars, len(visible))
        cursor.num_tokens, cursor.done = len(out.token_ids), out.finished
        logprobs = None
        if ctx.logprobs is not None and out.logprobs is not None:
            logprobs = {"content": self._content_logprobs(ctx, out, start, cursor.num_tokens)}
        body: dict[str, Any] = {"index": index, "logprobs": logprobs}
        if self.streaming:
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = [call.body(i) for i, call in enumerate(calls)]
            body["delta"] = delta
        else:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [call.body() for call in calls]
            body["message"] = message
        # a call cut off by max_tokens is still reported, with finish_reason "length"
        ended = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        body["finish_reason"] = ended
        body["stop_reason"] = out.stop_reason
        return body

    def _content_logprobs(
        self, ctx: Context, out: CompletionOutput, start: int, end: int
    ) -> list[dict[str, Any]]:
        assert out.logprobs is not None
        top_n = ctx.logprobs or 0
        content = []
        for i in range(start, end):
            token_id, entry = out.token_ids[i], out.logprobs[i]
            ranked = _ranked(entry)[:top_n]
            content.append(
                {
                    **self._token(ctx, token_id, entry.get(token_id)),
                    "top_logprobs": [self._token(ctx, t, v) for t, v in ranked],
                }
            )
        return content

    @staticmethod
    def _token(ctx: Context, token_id: int, logprob: Logprob | None) -> dict[str, Any]:
        name = ctx.namer(token_id)
        return {"token": name, "logprob": _lp(logprob), "bytes": list(name.encode("utf-8"))}
