"""What every generating handler does around its own logic: read the body, check the key,
tokenize, admit the request against its client's limits, hand it to the engine thread, and
either stream its outputs or collect them (aborting its engine requests if the client leaves).

A handler reads the body (JSON only: 415 otherwise; 408 past the body deadline), validates it
(400 before anything reaches the engine), tokenizes its prompts in a worker thread (the engine
thread never tokenizes text), then ``admit``s it. A client that goes away aborts its engine
requests: a stream aborts them on close (and when its client reads nothing for
``stream_stall_timeout_s``), and ``collect`` polls for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from pagekv.engine.outputs import RequestOutput
from pagekv.errors import InvalidRequestError, PromptTooLongError
from pagekv.server.clients import Usage
from pagekv.server.engine_loop import EngineRequest
from pagekv.server.errors import (
    AuthenticationError,
    BodyTooLargeError,
    ClientGoneError,
    RequestTimeoutError,
    UnsupportedMediaTypeError,
)
from pagekv.server.protocol import PromptInput, parse_json
from pagekv.server.sse import AbortOnClose
from pagekv.server.state import ServerState
from pagekv.server.streams import OutputStream
from pagekv.server.structured import relabel

DISCONNECT_POLL_S = 0.5
DRAIN_LIMIT_BYTES = 64 << 20  # read (and drop) this much of an oversized body, then stop
logger = logging.getLogger("pagekv.server")
request_logger = logging.getLogger("pagekv.requests")

Release = Callable[[], None]


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.pagekv
    return state


def require_api_key(request: Request) -> None:
    """401 unless ``Authorization: Bearer <key>`` matches ``--api-key`` (when one is set)."""
    key = state_of(request).config.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise AuthenticationError("missing or wrong API key (Authorization: Bearer <key>)")


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object: 415 unless it says it is JSON (so a web page cannot post one
    without a CORS preflight), 413 past the size limit, 408 past the body deadline, 400 if it
    is no JSON object; parsed in a worker thread."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise UnsupportedMediaTypeError(
            f"Content-Type must be application/json, got {media_type or 'none'!r}"
        )
    config = state_of(request).config
    try:
        async with asyncio.timeout(config.body_timeout_s):
            raw = await read_body(request, config.max_request_body_bytes)
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request body did not arrive within {config.body_timeout_s:g} s"
        ) from None
    return await asyncio.to_thread(parse_json, raw)


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The body, or 413 past ``limit_bytes`` (the rest is drained so the client reads the 413)."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit_bytes:
                chunks.append(chunk)
            elif size > DRAIN_LIMIT_BYTES:
                break
    except ClientDisconnect:
        raise ClientGoneError("the client closed the connection while sending the body") from None
    if size > limit_bytes:
        raise BodyTooLargeError(f"request body is over the limit of {limit_bytes} bytes")
    return b"".join(chunks)


def client_of(request: Request) -> str:
    """Whom a request counts against: the address it comes from."""
    return request.client.host if request.client is not None else "unknown"


def tokenized(
    state: ServerState,
    prompts: list[PromptInput],
    max_tokens: int | None,
    add_special_tokens: bool = True,
) -> list[list[int]]:
    """Each prompt as token ids, text tokenized here (off the engine thread). A prompt that
    cannot fit the context whatever ``max_tokens`` is refused here, before the engine thread
    checks its ids; the engine judges the rest (``Scheduler.check_fits``). A prompt only
    scored (``max_tokens`` 0) may fill the context."""
    room = 0 if max_tokens == 0 else 1
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty", "prompt")
            ids = state.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = prompt
        if len(ids) + room > state.context_tokens:
            shown = "until the context ends" if max_tokens is None else max_tokens
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) + max_tokens ({shown}) exceeds this "
                f"server's context of {state.context_tokens} tokens",
                "prompt",
            )
        out.append(ids)
    return out


def usage_of(state: ServerState, requests: list[EngineRequest]) -> Usage:
    """What a request holds in flight against its client: its prompts' tokens, and the
    tokens its sequences may generate (each at most what the context leaves)."""
    params = requests[0].params
    room = [min(params.max_tokens, state.context_tokens - len(r.prompt)) for r in requests]
    return Usage(
        requests=1,
        prompt_tokens=sum(len(r.prompt) for r in requests),
        output_tokens=params.num_branches * sum(max(r, 0) for r in room),
    )


async def admit(
    request: Request, requests: list[EngineRequest], constraint_field: str | None = None
) -> tuple[OutputStream, Release]:
    """Count the requests against their client and queue them; their outputs, and the release
    of the client's count (call it when the response ends). A constraint the engine cannot
    compile is a 400 naming ``constraint_field``."""
    state = state_of(request)
    release = state.clients.admit(client_of(request), usage_of(state, requests))
    try:
        outputs = await state.loop.add(requests)
    except InvalidRequestError as exc:
        release()
        raise relabel(exc, constraint_field) from None
    except BaseException:
        release()
        raise
    if state.config.logs.log_requests:  # vLLM's line, for each engine request
        for r in requests:
            request_logger.info(
                "Received request %s: prompt: %d tokens, params: %s", r.request_id,
                len(r.prompt), r.params,
            )  # fmt: skip
    return outputs, release


def streamed(
    request: Request, outputs: OutputStream, release: Release, events: AsyncIterator[str]
) -> AbortOnClose:
    """The SSE response of ``events``; its engine requests are aborted however it ends."""
    state = state_of(request)

    def close() -> None:
        state.loop.abort(outputs.unfinished_request_ids)
        release()

    return AbortOnClose(events, close, state.config.stream_stall_timeout_s, client_of(request))


async def collect(request: Request, outputs: OutputStream, release: Release) -> list[RequestOutput]:
    """The final outputs in prompt order; ClientGoneError (requests aborted) if the client
    disconnected first."""
    state = state_of(request)
    task = asyncio.ensure_future(outputs.finals())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGoneError("the client closed the connection before the answer")
    finally:
        release()
        if not task.done():
            task.cancel()
            state.loop.abort(outputs.unfinished_request_ids)
