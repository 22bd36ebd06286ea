"""Server-sent events: the stream of a completion or chat response, and the response that
aborts its engine requests however the stream ends.

Each chunk carries ONE choice (as OpenAI streams ``n > 1``): a choice's new text goes out as
soon as its output arrives, in a chunk of its own, with ``index`` saying whose it is. A
completion that echoes its prompt sends it in the choice's first chunk (``scoring.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from pagekv.engine.outputs import CompletionOutput, RequestOutput
from pagekv.errors import PagekvError
from pagekv.server.errors import error_body
from pagekv.server.formats import CompletionFormat, Context, Cursor, usage
from pagekv.server.scoring import PromptScoring
from pagekv.server.streams import OutputStream

logger = logging.getLogger("pagekv.server")


def sse(body: dict[str, Any], event: str | None = None) -> str:
    """One event: ``data: <json>``, named by ``event`` when given (the Responses API's)."""
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {json.dumps(body, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class Reply:
    """How a response is written: its body format, what its bodies share, whether it streams,
    the request field its output constraint came from, and how a completion shows its prompt."""

    fmt: CompletionFormat
    ctx: Context
    stream: bool
    constraint_field: str | None = None
    scoring: PromptScoring | None = None


def first_choice(
    reply: Reply, prompt_index: int, out: CompletionOutput, output: RequestOutput, hold_chars: int
) -> tuple[dict[str, Any], Cursor]:
    """A choice's first body (all of it when not held back) and the cursor for the rest; a
    completion's prompt part first when it shows one."""
    ctx, scoring = reply.ctx, reply.scoring
    prefix = None
    if scoring is not None and scoring.ready(ctx, output):
        prefix = scoring.prefix(ctx, output, prompt_index)
    cursor = Cursor(text_offset=0 if prefix is None else prefix.end_offset)
    index = prompt_index * ctx.n + out.index
    choice = reply.fmt.choice(ctx, index, out, cursor, hold_chars)
    return (choice if prefix is None else prefix.put_before(choice)), cursor


async def completion_events(
    reply: Reply, outputs: OutputStream, hold_chars: int
) -> AsyncIterator[str]:
    """Chunks as outputs arrive, one choice each, then (if asked) a usage chunk, then
    ``[DONE]``. ``hold_chars``: text held back while it may be the start of a stop string."""
    fmt, ctx = reply.fmt, reply.ctx
    for choice in fmt.opening_choices(ctx, len(outputs.request_ids) * ctx.n):
        yield sse(_chunk(fmt, ctx, [choice]))
    cursors: dict[int, Cursor] = {}
    try:
        while not outputs.finished:
            p, output = await outputs.get()
            for o in output.outputs:
                index = p * ctx.n + o.index
                cursor = cursors.get(index)
                if cursor is not None and cursor.done:
                    continue
                counted = ctx.logprobs is not None
                before = (0, 0) if cursor is None else (cursor.num_chars, cursor.num_tokens)
                if cursor is None:
                    waits = reply.scoring is not None and not reply.scoring.ready(ctx, output)
                    if waits and not output.finished:
                        continue  # its prompt's logprobs come with a later output
                    choice, cursor = first_choice(reply, p, o, output, hold_chars)
                    cursors[index] = cursor
                    shows_prompt = reply.scoring is not None
                else:
                    choice, shows_prompt = fmt.choice(ctx, index, o, cursor, hold_chars), False
                after = (cursor.num_chars, cursor.num_tokens)
                moved = after[0] != before[0] or (counted and after[1] != before[1])
                if moved or o.finished or shows_prompt:
                    yield sse(_chunk(fmt, ctx, [choice]))
    except PagekvError as exc:  # the engine stopped: tell the client in-band
        yield sse(error_body(exc)[1])
    else:
        if ctx.include_usage:
            finals = [outputs.latest[p] for p in sorted(outputs.latest)]
            yield sse({**fmt.chunk(ctx, []), "usage": usage(finals)})
    yield "data: [DONE]\n\n"


def _chunk(fmt: CompletionFormat, ctx: Context, choices: list[dict[str, Any]]) -> dict[str, Any]:
    body = fmt.chunk(ctx, choices)
    if ctx.include_usage:
        body["usage"] = None
    return body


class StreamStalled(Exception):
    """The client of a stream took nothing for ``stream_stall_timeout_s``."""


class AbortOnClose(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends (done, disconnect, error), and
    gives up on a client that takes nothing for ``stall_s`` (its socket full: a send waits)."""

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], None],
        stall_s: float,
        client: str,
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close
        self._stall_s = stall_s
        self._client = client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_or_give_up(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self._stall_s)
            except TimeoutError:
                raise StreamStalled from None

        try:
            await super().__call__(scope, receive, send_or_give_up)
        except StreamStalled:
            logger.warning(
                "499 %s: stream aborted, its client read nothing for %g s",
                self._client,
                self._stall_s,
            )
        except (ClientDisconnect, OSError):
            logger.info("499 %s: the client closed its stream", self._client)
        finally:
            self._on_close()
