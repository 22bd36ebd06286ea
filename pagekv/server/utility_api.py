"""vLLM's routes beside the OpenAI API: ``/tokenize``, ``/detokenize``, ``/version`` and
``/ping`` (SageMaker's health check, GET or POST), in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (text, with the model's special tokens unless
``add_special_tokens`` is false) or chat ``messages`` (through the chat template, as a chat
completion would see them: ``add_generation_prompt``, ``continue_final_message``, ``tools``);
it answers the ids, their count and the context a request may hold (``max_model_len``), and
with ``return_token_strs`` the vocabulary's spelling of each id. ``/detokenize`` turns ids back
into text (special tokens kept). Both need the API key when one is set; they never reach the
engine thread (the tokenizer is immutable after load).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pagekv.errors import InvalidRequestError
from pagekv.server.chat_prompt import chat_prompt
from pagekv.server.errors import EngineDeadError
from pagekv.server.handling import read_json, require_api_key, state_of
from pagekv.server.protocol import Body, ChatMessage, Tool, chat_messages, validate
from pagekv.server.state import ServerState

utility_router = APIRouter()
MAX_TOKEN_ID = 2**63 - 1


class TokenizeCompletionRequest(Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Body):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of what the template writes
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    chat_template: str | None = None  # refused: the server's template only


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


@utility_router.post("/tokenize", dependencies=[Depends(require_api_key)])
async def tokenize(request: Request) -> Response:
    state = state_of(request)
    data = await read_json(request)
    if "messages" in data:
        ids = await _chat_ids(state, validate(TokenizeChatRequest, data))
        wants_strs = bool(data.get("return_token_strs"))
    else:
        req = validate(TokenizeCompletionRequest, data)
        state.check_model(req.model)
        ids = await asyncio.to_thread(state.tokenizer.encode, req.prompt, req.add_special_tokens)
        wants_strs = req.return_token_strs
    body: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": state.context_tokens,
        "tokens": ids,
        "token_strs": [state.tokenizer.id_to_token(i) for i in ids] if wants_strs else None,
    }
    return JSONResponse(body)


async def _chat_ids(state: ServerState, req: TokenizeChatRequest) -> list[int]:
    state.check_model(req.model)
    if req.chat_template is not None:
        raise InvalidRequestError(
            "chat_template: a request's own template is not taken; the server's is used "
            "(--chat-template)",
            "chat_template",
        )
    messages = chat_messages(req.messages)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]

    def render() -> list[int]:
        text = chat_prompt(
            state.render_chat,
            messages,
            tools,
            req.add_generation_prompt,
            req.continue_final_message,
        )
        ids: list[int] = state.tokenizer.encode(text, req.add_special_tokens)
        return ids

    return await asyncio.to_thread(render)


@utility_router.post("/detokenize", dependencies=[Depends(require_api_key)])
async def detokenize(request: Request) -> Response:
    state = state_of(request)
    req = validate(DetokenizeRequest, await read_json(request))
    state.check_model(req.model)
    vocab_size = state.tokenizer.vocab_size
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"tokens[{i}]: {token} is outside the vocabulary [0, {vocab_size})", "tokens"
            )
    text = state.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


@utility_router.get("/version")
async def version() -> Response:
    try:
        number = importlib.metadata.version("pagekv")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        number = "unknown"
    return JSONResponse({"version": number})


@utility_router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    """200 (no body) while the engine thread runs, else 503: as ``/health``."""
    if not state_of(request).loop.alive:
        raise EngineDeadError("the engine thread is not running")
    return Response(status_code=200)
