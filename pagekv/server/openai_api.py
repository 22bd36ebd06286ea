"""The ``/v1`` routes: models, completions and chat completions, whole or streamed (SSE).

Each handler validates its body (protocol.py), fills unset sampling fields from the server's
defaults (``--generation-config``), builds one ``EngineRequest`` per prompt and leaves the rest
to ``handling.py`` (admission, the engine thread, a client that leaves) and ``sse.py``.
Completions with ``echo`` or ``prompt_logprobs`` are answered by ``scoring.py``. The render
routes answer with the token ids a request would feed the engine (a router's input).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pagekv.engine.llm_engine import LLMEngine
from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import SamplingParams, StructuredOutputsParams
from pagekv.server.chat_prompt import chat_prompt
from pagekv.server.engine_loop import EngineRequest
from pagekv.server.errors import ModelCardNotFoundError
from pagekv.server.formats import ChatFormat, CompletionFormat, Context, TokenNamer
from pagekv.server.handling import (
    admit,
    client_of,
    collect,
    read_json,
    require_api_key,
    state_of,
    streamed,
    tokenized,
)
from pagekv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptInput,
    chat_logprobs,
    chat_max_tokens,
    chat_messages,
    completion_prompts,
    refuse_unhonoured,
    sampling_params,
    validate,
    with_defaults,
)
from pagekv.server.scoring import PromptScoring, raw_prompt_logprobs
from pagekv.server.sse import Reply, completion_events, first_choice
from pagekv.server.state import ServerState
from pagekv.server.structured import constraint_of, relabel
from pagekv.server.tools import ToolPlan

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
TOKEN_ID_NAMER = TokenNamer(lambda ids: f"token_id:{ids[0]}")


def model_card(state: ServerState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "pagekv",
        "root": state.model_names[0],
        "parent": None,
        "max_model_len": state.context_tokens,
    }


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {"object": "list", "data": [model_card(state, name) for name in state.model_names]}


@router.get("/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    """One model's card (OpenAI's "retrieve model"); 404 for a name this server lacks."""
    state = state_of(request)
    if model_id not in state.model_names:
        raise ModelCardNotFoundError(f"the model {model_id!r} does not exist", "model")
    return model_card(state, model_id)


@dataclass(frozen=True)
class _Prepared:
    """A generation request validated, with its prompts as the token ids the engine is fed."""

    req: CompletionRequest | ChatCompletionRequest
    params: SamplingParams
    prompts: list[PromptInput]
    ids: list[list[int]]
    field: str | None  # the structured-output field that constrains it, if any
    tools: ToolPlan | None = None


async def _prepare_completion(request: Request) -> _Prepared:
    state = state_of(request)
    data = await read_json(request)
    refuse_unhonoured(data, chat=False)
    req = validate(CompletionRequest, data)
    state.check_model(req.model)
    req = with_defaults(req, state.config.sampling_defaults)
    max_tokens = req.max_tokens
    if max_tokens is None and "max_tokens" in state.defaults:  # as vLLM: the server's default
        max_tokens = int(state.defaults["max_tokens"])  # (None: up to the end of the context)
    constraint, field = constraint_of(req)
    params = sampling_params(req, max_tokens, req.logprobs, state.config.max_n, constraint)
    prompts = completion_prompts(req, state.config.max_choices)
    ids = await asyncio.to_thread(tokenized, state, prompts, max_tokens, req.add_special_tokens)
    state.check_priority(req.priority)
    return _Prepared(req, params, prompts, ids, field)


@router.post("/completions")
async def create_completion(request: Request) -> Response:
    state = state_of(request)
    prep = await _prepare_completion(request)
    req, params, prompts = prep.req, prep.params, prep.prompts
    assert isinstance(req, CompletionRequest)
    ctx = _context(state, "cmpl", params, req)
    client = client_of(request)
    extra = (req.priority, req.cache_salt)
    requests = [
        EngineRequest(f"{ctx.response_id}-{i}", p, params, client, *extra)
        for i, p in enumerate(prep.ids)
    ]
    scoring = None
    if req.echo or req.prompt_logprobs is not None:
        texts = [p if isinstance(p, str) else state.tokenizer.decode(p, False) for p in prompts]
        asked = req.prompt_logprobs is not None or (req.echo and req.logprobs is not None)
        shown = asked and not req.stream  # vLLM's chunks carry no prompt_logprobs
        scoring = PromptScoring(tuple(texts) if req.echo else None, shown)
    reply = Reply(CompletionFormat(), ctx, req.stream, prep.field, scoring)
    return await _respond(request, reply, requests)


async def _prepare_chat(request: Request) -> _Prepared:
    state = state_of(request)
    data = await read_json(request)
    refuse_unhonoured(data, chat=True)
    req = validate(ChatCompletionRequest, data)
    state.check_model(req.model)
    req = with_defaults(req, state.config.sampling_defaults)
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
    messages = chat_messages(req.messages)

    def render() -> list[int]:
        text = chat_prompt(
            state.render_chat,
            messages,
            list(tools.tools),
            req.add_generation_prompt,
            req.continue_final_message,
        )
        return state.tokenizer.encode(text, req.add_special_tokens) if text else []

    prompt = await asyncio.to_thread(render)
    max_tokens = chat_max_tokens(req)
    if max_tokens is None:  # as OpenAI: up to the end of the context (or the server's default)
        room = max(1, state.context_tokens - len(prompt))
        max_tokens = min(room, int(state.defaults.get("max_tokens", room)))
    params = sampling_params(req, max_tokens, chat_logprobs(req), state.config.max_n, constraint)
    ids = tokenized(state, [prompt], max_tokens)
    state.check_priority(req.priority)
    return _Prepared(req, params, [prompt], ids, field, tools)


@router.post("/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state = state_of(request)
    prep = await _prepare_chat(request)
    req, params, tools = prep.req, prep.params, prep.tools
    assert isinstance(req, ChatCompletionRequest) and tools is not None
    ctx = _context(state, "chatcmpl", params, req)
    rid, client = f"{ctx.response_id}-0", client_of(request)
    requests = [EngineRequest(rid, prep.ids[0], params, client, req.priority, req.cache_salt)]
    fmt = ChatFormat(req.stream, tools if tools.active else None)
    scoring = None
    if req.prompt_logprobs is not None:
        scoring = PromptScoring(None, True, in_choices=False)
    return await _respond(request, Reply(fmt, ctx, req.stream, prep.field, scoring), requests)


# ---- render: the token ids a request would feed the engine, without running it ----------------
# vLLM's render routes, which vllm-router's cache_aware and kv_aware policies call on every
# worker before they choose one: the ids of each prompt exactly as generation computes them
# (same validation, template and special tokens), so the router hashes the blocks the engine
# will. ``features`` is null: pagekv takes no multimodal input.


@router.post("/completions/render")
async def render_completion(request: Request) -> Response:
    prep = await _prepare_completion(request)
    return JSONResponse([{"token_ids": ids, "features": None} for ids in prep.ids])


@router.post("/chat/completions/render")
async def render_chat_completion(request: Request) -> Response:
    prep = await _prepare_chat(request)
    return JSONResponse({"token_ids": prep.ids[0], "features": None})


async def _check_tool_schemas(state: ServerState, tools: ToolPlan) -> None:
    """400 naming the tool whose parameters are no schema the grammar compiler takes."""
    for i, tool in enumerate(tools.tools):
        schema = StructuredOutputsParams(json=tools.parameters(tool["function"]["name"]))
        try:
            await state.loop.call(partial(LLMEngine.check_structured_outputs, constraint=schema))
        except InvalidRequestError as exc:
            raise relabel(exc, f"tools[{i}].function.parameters") from None


def _context(
    state: ServerState,
    prefix: str,
    params: SamplingParams,
    req: CompletionRequest | ChatCompletionRequest,
) -> Context:
    as_ids = req.return_tokens_as_token_ids
    if as_ids is None:
        as_ids = state.config.return_tokens_as_token_ids
    return Context(
        response_id=f"{prefix}-{uuid.uuid4().hex}",
        model=state.model_name,
        created=int(time.time()),
        namer=TOKEN_ID_NAMER if as_ids else state.namer,
        n=params.n,
        logprobs=params.logprobs,
        include_usage=req.include_usage,
    )


async def _respond(request: Request, reply: Reply, requests: list[EngineRequest]) -> Response:
    """Queue ``requests``; stream their chunks, or answer with every choice when all finish."""
    outputs, release = await admit(request, requests, reply.constraint_field)
    params = requests[0].params
    if reply.stream:
        hold_chars = max((len(s) for s in params.stop), default=1) - 1
        events = completion_events(reply, outputs, hold_chars)
        return streamed(request, outputs, release, events)
    finals = await collect(request, outputs, release)
    choices = [
        first_choice(reply, p, o, final, 0)[0]
        for p, final in enumerate(finals)
        for o in final.outputs
    ]
    body = reply.fmt.response(reply.ctx, choices, finals)
    if reply.scoring is not None and not reply.scoring.in_choices:  # vLLM's chat: beside
        body["prompt_logprobs"] = raw_prompt_logprobs(finals[0].prompt_logprobs)
    return JSONResponse(body)
