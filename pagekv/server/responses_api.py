"""``POST /v1/responses``: OpenAI's Responses API, for text.

``input`` is a string (one user message) or a list of messages (``role`` and ``content``: a
string, or ``input_text`` / ``output_text`` parts); ``instructions`` becomes the leading system
message. ``max_output_tokens``, ``temperature`` and ``top_p`` sample as in chat (unset ones take
the server's defaults, ``--generation-config``); ``text.format`` may ask for ``json_schema`` or
``json_object`` output. Anything that is not text (images, files, tool calls and their outputs,
tools, reasoning), and what needs a stored response (``previous_response_id``, ``store: true``,
``background``), is a 400 naming the field. Responses are not stored.

A streamed response sends the events OpenAI defines for one text message, each named in its
``event:`` line and numbered by ``sequence_number``:

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta ..., response.output_text.done,
    response.content_part.done, response.output_item.done, response.completed (or .incomplete)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pagekv.engine.outputs import RequestOutput
from pagekv.errors import InvalidRequestError, PagekvError
from pagekv.sampling_params import SamplingParams, StructuredOutputsParams
from pagekv.server.chat_prompt import chat_prompt
from pagekv.server.engine_loop import EngineRequest
from pagekv.server.errors import error_body
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
from pagekv.server.protocol import Body, validate
from pagekv.server.sse import sse
from pagekv.server.state import ServerState
from pagekv.server.streams import OutputStream

responses_router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # refused unless unset or empty (refuse_unsupported)
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None


def refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming the first field that asks for more than text."""
    refused = {
        "tools": bool(req.tools),
        "tool_choice": req.tool_choice not in (None, "none", "auto"),
        "reasoning": bool(req.reasoning),
        "previous_response_id": req.previous_response_id is not None,
        "store": req.store is True,
        "background": req.background is True,
        "truncation": req.truncation not in (None, "disabled"),
        "include": bool(req.include),
        "top_logprobs": bool(req.top_logprobs),
    }
    for field, asked in refused.items():
        if asked:
            raise InvalidRequestError(
                f"{field}: not supported here (text responses only; responses are not stored)",
                field,
            )


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    if not req.input:
        raise InvalidRequestError("input: must not be empty", "input")
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if item.get("type", "message") != "message":
            raise InvalidRequestError(f"{where}.type: only messages (text) are supported", where)
        role = item.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}.role: one of {sorted(ROLES)}", f"{where}.role")
        messages.append({"role": ROLES[role], "content": _text(item.get("content"), where)})
    return messages


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content: text or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        field = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(
                f"{field}.type: only text parts ({', '.join(TEXT_PARTS)}) are supported, got "
                f"{kind!r}",
                f"{field}.type",
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{field}.text: must be a string", f"{field}.text")
        texts.append(part["text"])
    return "".join(texts)


def text_constraint(text: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """``text.format``: text (None), ``json_object``, or ``json_schema`` (its ``schema``)."""
    spec = (text or {}).get("format") or {"type": "text"}
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema" and isinstance(spec.get("schema"), dict):
        return StructuredOutputsParams(json=spec["schema"])
    raise InvalidRequestError(
        "text.format: {type: text}, {type: json_object} or {type: json_schema, schema: {...}}",
        "text.format",
    )


@dataclass(frozen=True)
class Shell:
    """What every body of one response shares; ``body`` fills in the rest."""

    response_id: str
    message_id: str
    created_at: int
    model: str
    req: ResponsesRequest
    params: SamplingParams

    def body(self, status: str, text: str | None, final: RequestOutput | None) -> dict[str, Any]:
        output = [] if text is None else [self.message(status, text)]
        incomplete = status == "incomplete"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.req.instructions,
            "max_output_tokens": self.req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": self.params.temperature,
            "text": self.req.text or {"format": {"type": "text"}},
            "tool_choice": self.req.tool_choice or "auto",
            "tools": [],
            "top_p": self.params.top_p,
            "truncation": "disabled",
            "usage": None if final is None else _usage(final),
            "user": self.req.user,
            "metadata": self.req.metadata or {},
        }

    def message(self, status: str, text: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [self.part(text)],
        }

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(final: RequestOutput) -> dict[str, Any]:
    num_in = len(final.prompt_token_ids)
    num_out = sum(len(o.token_ids) for o in final.outputs)
    return {
        "input_tokens": num_in,
        "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
        "output_tokens": num_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_in + num_out,
    }


def _status(final: RequestOutput) -> str:
    return "incomplete" if final.outputs[0].finish_reason == "length" else "completed"


@responses_router.post("/responses")
async def create_response(request: Request) -> Response:
    state = state_of(request)
    req = validate(ResponsesRequest, await read_json(request))
    state.check_model(req.model)
    refuse_unsupported(req)
    messages = input_messages(req)
    constraint = text_constraint(req.text)

    def render() -> list[int]:
        ids: list[int] = state.tokenizer.encode(
            chat_prompt(state.render_chat, messages, None), False
        )
        return ids

    prompt = await asyncio.to_thread(render)
    params = _sampling(state, req, constraint)
    (prompt,) = tokenized(state, [prompt], req.max_output_tokens)
    shell = Shell(
        f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time()),
        state.model_name, req, params,
    )  # fmt: skip
    engine_request = EngineRequest(shell.response_id, prompt, params, client_of(request))
    field = "text.format" if constraint is not None else None
    outputs, release = await admit(request, [engine_request], field)
    if req.stream:
        return streamed(request, outputs, release, _events(shell, outputs))
    (final,) = await collect(request, outputs, release)
    return JSONResponse(shell.body(_status(final), final.outputs[0].text, final))


def _sampling(
    state: ServerState, req: ResponsesRequest, constraint: StructuredOutputsParams | None
) -> SamplingParams:
    defaults = state.defaults
    picked = {"temperature": req.temperature, "top_p": req.top_p}
    values = {k: v if v is not None else defaults.get(k, 1.0) for k, v in picked.items()}
    if values["temperature"] > 2:  # OpenAI's range, as for chat
        raise InvalidRequestError("temperature: must be in [0, 2]", "temperature")
    top_k = defaults.get("top_k")
    return SamplingParams(
        temperature=values["temperature"],
        top_p=values["top_p"],
        top_k=None if top_k is None else int(top_k),
        min_p=defaults.get("min_p", 0.0),
        repetition_penalty=defaults.get("repetition_penalty", 1.0),
        max_tokens=req.max_output_tokens,  # type: ignore[arg-type]  # None: the context's end
        structured_outputs=constraint,
    )


async def _events(shell: Shell, outputs: OutputStream) -> AsyncIterator[str]:
    """The stream's events (the module docstring lists them)."""
    number = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(number), **fields}, event=kind)

    at = {"item_id": shell.message_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=shell.body("in_progress", None, None))
    yield event("response.in_progress", response=shell.body("in_progress", None, None))
    yield event("response.output_item.added", output_index=0, item=shell.message("in_progress", ""))
    yield event("response.content_part.added", part=shell.part(""), **at)
    sent, final = "", None
    try:
        while not outputs.finished:
            _, final = await outputs.get()
            text = final.outputs[0].text
            if len(text) > len(sent):
                yield event(
                    "response.output_text.delta", delta=text[len(sent) :], logprobs=[], **at
                )
                sent = text
    except PagekvError as exc:  # the engine stopped: tell the client in-band
        code, body = error_body(exc)
        yield event("error", code=str(code), message=body["error"]["message"], param=None)
        return
    assert final is not None
    status = _status(final)
    yield event("response.output_text.done", text=sent, logprobs=[], **at)
    yield event("response.content_part.done", part=shell.part(sent), **at)
    yield event("response.output_item.done", output_index=0, item=shell.message(status, sent))
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield event(kind, response=shell.body(status, sent, final))
