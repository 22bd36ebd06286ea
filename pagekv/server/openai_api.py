"""The ``/v1`` routes: models, completions and chat completions, whole or streamed (SSE).

A handler validates the body (400 before anything reaches the engine), queues one engine
request per prompt, then either streams chunks as outputs arrive or waits for the finals. A
client that goes away aborts its engine requests: the streaming response aborts on close, and
a non-streaming handler polls for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagekv.engine.llm_engine import LLMEngine
from pagekv.engine.outputs import RequestOutput
from pagekv.errors import InvalidRequestError, PagekvError
from pagekv.sampling_params import SamplingParams, StructuredOutputsParams
from pagekv.server.engine_loop import EngineRequest
from pagekv.server.errors import AuthenticationError, BodyTooLargeError, error_body
from pagekv.server.formats import ChatFormat, CompletionFormat, Context, Cursor, usage
from pagekv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
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


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The body, or 413 past ``limit_bytes`` (the rest is drained so the client reads the 413)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit_bytes:
            chunks.append(chunk)
        elif size > DRAIN_LIMIT_BYTES:
            break
    if size > limit_bytes:
        raise BodyTooLargeError(f"request body is over the limit of {limit_bytes} bytes")
    return b"".join(chunks)


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
    body = parse_json(await read_body(request, state.config.max_request_body_bytes))
    req = validate(CompletionRequest, body)
    state.check_model(req.model)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    constraint, field = constraint_of(req)
    params = sampling_params(req, max_tokens, req.logprobs, state.config.max_n, constraint)
    prompts = completion_prompts(req, state.config.max_choices)
    ctx = _context(state, "cmpl", params, req.include_usage)
    requests = [EngineRequest(f"{ctx.response_id}-{i}", p, params) for i, p in enumerate(prompts)]
    return await _respond(request, CompletionFormat(), ctx, requests, req.stream, field)


@router.post("/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state = state_of(request)
    body = parse_json(await read_body(request, state.config.max_request_body_bytes))
    req = validate(ChatCompletionRequest, body)
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
    text = state.tokenizer.apply_chat_template(chat_messages(req), tools=list(tools.tools))
    prompt: str | list[int] = text
    max_tokens = chat_max_tokens(req)
    if max_tokens is None:  # as OpenAI: up to the end of the context
        prompt = await asyncio.to_thread(state.tokenizer.encode, text)
        max_tokens = max(1, state.context_tokens - len(prompt))
    params = sampling_params(req, max_tokens, chat_logprobs(req), state.config.max_n, constraint)
    ctx = _context(state, "chatcmpl", params, req.include_usage)
    requests = [EngineRequest(f"{ctx.response_id}-0", prompt, params)]
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
    try:
        outputs = await state.loop.add(requests)
    except InvalidRequestError as exc:  # a constraint that does not compile: name the field
        raise relabel(exc, constraint_field) from None
    hold_chars = max((len(s) for s in requests[0].params.stop), default=1) - 1
    if stream:
        events = _events(fmt, ctx, outputs, hold_chars)
        return AbortOnClose(events, lambda: state.loop.abort(outputs.unfinished_request_ids))
    finals = await _collect(request, state, outputs)
    if finals is None:
        return Response(status_code=499)  # nobody is listening
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


class AbortOnClose(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends (done, disconnect, error)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
