"""The ``/v1`` routes: models, completions and chat completions, whole or streamed (SSE).

A handler reads the body (JSON only: 415 otherwise; 408 past the body deadline), validates it
(400 before anything reaches the engine), tokenizes its prompts in a worker thread (the engine
thread only checks ids), counts it against its client's limits (429), queues one engine
request per prompt, then either streams chunks as outputs arrive or waits for the finals. A
client that goes away aborts its engine requests: the streaming response aborts on close (and
when its client reads nothing for ``stream_stall_timeout_s``), and a non-streaming handler
polls for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from pagekv.engine.llm_engine import LLMEngine
from pagekv.engine.outputs import RequestOutput
from pagekv.errors import InvalidRequestError, PagekvError, PromptTooLongError
from pagekv.sampling_params import SamplingParams, StructuredOutputsParams
from pagekv.server.clients import Usage
from pagekv.server.engine_loop import EngineRequest
from pagekv.server.errors import (
    AuthenticationError,
    BodyTooLargeError,
    ClientGoneError,
    RequestTimeoutError,
    UnsupportedMediaTypeError,
    error_body,
)
from pagekv.server.formats import ChatFormat, CompletionFormat, Context, Cursor, usage
from pagekv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptInput,
    chat_logprobs,
    chat_max_tokens,
    chat_messages,
    completion_prompts,
    parse_json,
    sampling_params,
    validate,
)
from pagekv.server.state import ServerState
from pagekv.server.streams import OutputStream
from pagekv.server.structured import constraint_of, relabel
from pagekv.server.tools import ToolPlan

DISCONNECT_POLL_S = 0.5
DRAIN_LIMIT_BYTES = 64 << 20  # read (and drop) this much of an oversized body, then stop
logger = logging.getLogger("pagekv.server")


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


router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


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


def tokenized(state: ServerState, prompts: list[PromptInput], max_tokens: int) -> list[list[int]]:
    """Each prompt as token ids, text tokenized here (off the engine thread). A prompt that
    cannot fit the context whatever ``max_tokens`` is refused here, before the engine thread
    checks its ids; the engine judges the rest (``Scheduler.check_fits``)."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty", "prompt")
            ids = state.tokenizer.encode(prompt)
        else:
            ids = prompt
        if len(ids) >= state.context_tokens:
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds this "
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


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    card = {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "pagekv",
        "max_model_len": state.context_tokens,
    }
    return {"object": "list", "data": [card]}


@router.post("/completions")
async def create_completion(request: Request) -> Response:
    state = state_of(request)
    req = validate(CompletionRequest, await read_json(request))
    state.check_model(req.model)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    constraint, field = constraint_of(req)
    params = sampling_params(req, max_tokens, req.logprobs, state.config.max_n, constraint)
    prompts = completion_prompts(req, state.config.max_choices)
    ids = await asyncio.to_thread(tokenized, state, prompts, max_tokens)
    ctx = _context(state, "cmpl", params, req.include_usage)
    client = client_of(request)
    requests = [
        EngineRequest(f"{ctx.response_id}-{i}", p, params, client) for i, p in enumerate(ids)
    ]
    return await _respond(request, CompletionFormat(), ctx, requests, req.stream, field)


@router.post("/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state = state_of(request)
    req = validate(ChatCompletionRequest, await read_json(request))
    state.check_model(req.model)
    tags = state.tokenizer.tool_call_tags
    tools = ToolPlan.of(req.tools, req.tool_choice, req.parallel_tool_calls, tags)
    constraint, field = constraint_of(req)
    if tools.constraint() is not None:
        if constraint is not None:
            raise InvalidRequestError(
                f"{field}: not with tool_choice {tools.mode!r}, which constrains the output",
                field,
            )
        constraint, field = tools.constraint(), "tools"
    await _check_tool_schemas(state, tools)
    messages = chat_messages(req)

    def render() -> list[int]:
        text = state.tokenizer.apply_chat_template(messages, tools=list(tools.tools))
        return list(state.tokenizer.encode(text)) if text else []

    prompt = await asyncio.to_thread(render)
    max_tokens = chat_max_tokens(req)
    if max_tokens is None:  # as OpenAI: up to the end of the context
        max_tokens = max(1, state.context_tokens - len(prompt))
    params = sampling_params(req, max_tokens, chat_logprobs(req), state.config.max_n, constraint)
    (prompt,) = tokenized(state, [prompt], max_tokens)
    ctx = _context(state, "chatcmpl", params, req.include_usage)
    requests = [EngineRequest(f"{ctx.response_id}-0", prompt, params, client_of(request))]
    fmt = ChatFormat(req.stream, tools if tools.active else None)
    return await _respond(request, fmt, ctx, requests, req.stream, field)


async def _check_tool_schemas(state: ServerState, tools: ToolPlan) -> None:
    """400 naming the tool whose parameters are no schema the grammar compiler takes."""
    for i, tool in enumerate(tools.tools):
        schema = StructuredOutputsParams(json=tools.parameters(tool["function"]["name"]))
        try:
            await state.loop.call(partial(LLMEngine.check_structured_outputs, constraint=schema))
        except InvalidRequestError as exc:
            raise relabel(exc, f"tools[{i}].function.parameters") from None


def _context(
    state: ServerState, prefix: str, params: SamplingParams, include_usage: bool
) -> Context:
    return Context(
        response_id=f"{prefix}-{uuid.uuid4().hex}",
        model=state.model_name,
        created=int(time.time()),
        namer=state.namer,
        n=params.n,
        logprobs=params.logprobs,
        include_usage=include_usage,
    )


async def _respond(
    request: Request,
    fmt: CompletionFormat,
    ctx: Context,
    requests: list[EngineRequest],
    stream: bool,
    constraint_field: str | None = None,
) -> Response:
    state = state_of(request)
    params = requests[0].params
    release = state.clients.admit(client_of(request), usage_of(state, requests))
    try:
        outputs = await state.loop.add(requests)
    except InvalidRequestError as exc:  # a constraint that does not compile: name the field
        release()
        raise relabel(exc, constraint_field) from None
    except BaseException:
        release()
        raise
    hold_chars = max((len(s) for s in params.stop), default=1) - 1
    if stream:
        events = _events(fmt, ctx, outputs, hold_chars)

        def close() -> None:
            state.loop.abort(outputs.unfinished_request_ids)
            release()

        return AbortOnClose(events, close, state.config.stream_stall_timeout_s, client_of(request))
    try:
        finals = await _collect(request, state, outputs)
    finally:
        release()
    if finals is None:
        raise ClientGoneError("the client closed the connection before the answer")
    choices = [
        fmt.choice(ctx, p * ctx.n + o.index, o, Cursor())
        for p, final in enumerate(finals)
        for o in final.outputs
    ]
    return JSONResponse(fmt.response(ctx, choices, finals))


async def _collect(
    request: Request, state: ServerState, outputs: OutputStream
) -> list[RequestOutput] | None:
    """The final outputs, or None when the client disconnected first (its requests aborted)."""
    task = asyncio.ensure_future(outputs.finals())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            state.loop.abort(outputs.unfinished_request_ids)


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _events(
    fmt: CompletionFormat, ctx: Context, outputs: OutputStream, hold_chars: int
) -> AsyncIterator[str]:
    """SSE chunks as outputs arrive, then (if asked) a usage chunk, then ``[DONE]``."""
    opening = fmt.opening_choices(ctx, len(outputs.request_ids) * ctx.n)
    if opening:
        yield _sse(_chunk(fmt, ctx, opening))
    cursors: dict[int, Cursor] = {}
    try:
        while not outputs.finished:
            p, output = await outputs.get()
            choices = []
            for o in output.outputs:
                cursor = cursors.setdefault(p * ctx.n + o.index, Cursor())
                if cursor.done:
                    continue
                before = (cursor.num_chars, cursor.num_tokens if ctx.logprobs is not None else 0)
                choice = fmt.choice(ctx, p * ctx.n + o.index, o, cursor, hold_chars)
                after = (cursor.num_chars, cursor.num_tokens if ctx.logprobs is not None else 0)
                if after != before or o.finished:
                    choices.append(choice)
            if choices:
                yield _sse(_chunk(fmt, ctx, choices))
    except PagekvError as exc:  # the engine stopped: tell the client in-band
        yield _sse(error_body(exc)[1])
    else:
        if ctx.include_usage:
            finals = [outputs.latest[p] for p in sorted(outputs.latest)]
            yield _sse({**fmt.chunk(ctx, []), "usage": usage(finals)})
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
