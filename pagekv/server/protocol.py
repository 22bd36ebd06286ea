"""Request bodies of the OpenAI API, parsed strictly, and their translation to engine inputs.

A body is decoded as UTF-8, scanned for nesting deeper than ``MAX_JSON_DEPTH`` (refused before
the parser recurses into it), parsed as JSON, checked for strings that are not valid Unicode
(lone UTF-16 surrogates such as ``"\\ud800"`` decode, but no tokenizer or encoder takes them),
validated by a pydantic model in strict mode (no "5" for 5, no true for 1, no NaN or infinity)
and turned into ``SamplingParams``, whose own checks name the bad parameter. Every failure is
an ``InvalidRequestError`` carrying ``param``: HTTP 400. Unknown fields are ignored, as
OpenAI-compatible servers do; every known field is honoured, or refused where it cannot be
(``suffix``, ``best_of != n``, ``echo`` and ``logit_bias``) rather than silently ignored.
Constraints on the output are read by ``structured.py``, tools by ``tools.py``; unset sampling
fields take the server's defaults (``--generation-config``), then the API's.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, ValidationError

from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

PromptInput = str | list[int]
M = TypeVar("M", bound=BaseModel)

MAX_JSON_DEPTH = 32  # arrays and objects inside each other; the bodies of this API need few
MAX_TEMPERATURE = 2.0  # OpenAI's API takes temperature in [0, 2]
_STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"'  # a JSON string, escapes included
_STRING_OR_BRACKET = re.compile(_STRING + rb"|[\[\]{}]")
_STRINGS = re.compile(_STRING)
_NOT_OPENING = bytes(b for b in range(256) if b not in b"[{")
_SURROGATE = re.compile("[\ud800-\udfff]")


class Body(BaseModel):
    """A request body (or a part of one): strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: bool = False


class _Sampling(Body):
    """Fields shared by completions and chat, including vLLM's extra body parameters."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras: top_k of -1 or 0 means off, as in vLLM.
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-...
    # vLLM's constraints on the output (structured.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # the model's BOS (if it has one) before a text prompt
    response_format: dict[str, Any] | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str


class AssistantToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: how the conversation becomes the prompt (chat_prompt.py)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of what the template writes


_MODELS: tuple[type[BaseModel], ...] = (
    StreamOptions,
    CompletionRequest,
    TextPart,
    FunctionCall,
    AssistantToolCall,
    ChatMessage,
    FunctionDefinition,
    Tool,
    FunctionName,
    NamedToolChoice,
    ChatCompletionRequest,
)
_FIELDS = {name for m in _MODELS for name in m.model_fields}
_TOP_FIELDS = {*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields}


def parse_json(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``; 400 for bad UTF-8, deep nesting, bad JSON, a non-object or
    a string that is not valid Unicode."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid UTF-8: {exc.reason}") from None
    check_depth(raw)
    try:
        data = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than int() takes
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    bad_text = invalid_text_path(data)
    if bad_text is not None:
        param = bad_text or "body"
        raise InvalidRequestError(f"{param}: not valid Unicode (a lone UTF-16 surrogate)", param)
    return data


def check_depth(raw: bytes) -> None:
    """Refuse JSON whose arrays and objects nest deeper than ``MAX_JSON_DEPTH``, from the raw
    bytes and before any parser recurses; ``param`` is the top-level field holding the depth.

    Brackets inside strings do not count. A body with fewer opening brackets than the limit
    cannot be too deep, so an ordinary body costs one substitution and one ``translate``.
    """
    skeleton = _STRINGS.sub(b'""', raw)
    if len(skeleton.translate(None, _NOT_OPENING)) <= MAX_JSON_DEPTH:
        return
    depth, outer, key = 0, 0, b""
    for match in _STRING_OR_BRACKET.finditer(raw):
        first = raw[match.start()]
        if first == ord('"'):
            key = match.group() if depth == 1 else key
        elif first in b"[{":
            depth += 1
            outer = outer or first
            if depth > MAX_JSON_DEPTH:
                param = _field_named(key) if outer == ord("{") else "body"
                raise InvalidRequestError(
                    f"{param}: nested deeper than {MAX_JSON_DEPTH} arrays or objects", param
                )
        else:
            depth -= 1


def _field_named(key: bytes) -> str:
    """The request field a raw JSON key names, or ``body`` for a key that names none."""
    try:
        name = json.loads(key)
    except ValueError:
        return "body"
    return name if name in _TOP_FIELDS else "body"


def invalid_text_path(value: Any, path: str = "") -> str | None:
    """Where the first string (object key or value) in ``value`` that is not valid Unicode is,
    as ``messages[0].content`` ("" for the top); None if every string is valid.

    A bad key is reported as the object holding it, so a reported path is itself valid text.
    """
    if isinstance(value, str):
        return None if _is_unicode(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            if not _is_unicode(key):
                return path
            found = invalid_text_path(item, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, str | dict | list):
                continue  # a number, a bool or null: no text (and token id lists are long)
            found = invalid_text_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _is_unicode(text: str) -> bool:
    """No lone surrogate: ``text`` encodes as UTF-8."""
    return text.isascii() or _SURROGATE.search(text) is None


def validate(model: type[M], data: dict[str, Any]) -> M:
    """``model`` built from ``data``; the first invalid field becomes ``InvalidRequestError``."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        param = _param(errors[0]["loc"])
        reasons = dict.fromkeys(e["msg"] for e in errors if _param(e["loc"]) == param)
        raise InvalidRequestError(f"{param}: {' or '.join(list(reasons)[:4])}", param) from None


def _param(loc: tuple[int | str, ...]) -> str:
    """``('messages', 0, 'role')`` -> ``messages[0].role``; union member tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELDS:
            out += f".{part}" if out else part
    return out or "body"


def _reject_unsupported(req: _Sampling) -> None:
    """Refuse what would change the output if honoured, rather than ignore it."""
    if req.logit_bias:
        raise InvalidRequestError("logit_bias: not supported", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise InvalidRequestError("echo: not supported", "echo")
        if req.suffix:
            raise InvalidRequestError("suffix: not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError("best_of: only best_of == n is supported", "best_of")


def _check_api_ranges(req: _Sampling) -> None:
    """OpenAI's limits where they are narrower than the engine's (``SamplingParams``)."""
    if req.temperature is not None and req.temperature > MAX_TEMPERATURE:
        raise InvalidRequestError(
            f"temperature: must be in [0, {MAX_TEMPERATURE}], got {req.temperature}",
            "temperature",
        )


SAMPLING_DEFAULTS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
S = TypeVar("S", bound="_Sampling")


def with_defaults(req: S, defaults: tuple[tuple[str, float], ...]) -> S:
    """``req`` with each sampling field it leaves unset taken from ``defaults`` (the server's,
    from ``--generation-config``); a field the request sets is kept."""
    update = {
        name: value
        for name, value in defaults
        if name in SAMPLING_DEFAULTS and getattr(req, name) is None
    }
    return req.model_copy(update=update) if update else req


def sampling_params(
    req: _Sampling,
    max_tokens: int | None,
    logprobs: int | None,
    max_n: int,
    constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's ``SamplingParams`` for a validated request body (``max_tokens`` None:
    up to the end of the context)."""
    _reject_unsupported(req)
    _check_api_ranges(req)
    if req.n > max_n:
        raise InvalidRequestError(f"n: must be <= {max_n}, got {req.n}", "n")
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=None if req.top_k in (None, -1, 0) else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        max_tokens=cast(int, max_tokens),  # None: SamplingParams fills the context
        min_tokens=req.min_tokens,
        stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured_outputs=constraint,
    )


def completion_prompts(req: CompletionRequest, max_choices: int) -> list[PromptInput]:
    """One engine prompt per item: a string, a list of strings, ids, or a list of id lists;
    at most ``max_choices`` sequences in all (prompts x n)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt: must not be empty", "prompt")
    items: list[PromptInput] = [list(prompt)] if isinstance(prompt[0], int) else list(prompt)
    if len(items) * req.n > max_choices:
        raise InvalidRequestError(
            f"prompt: {len(items)} prompts x n={req.n} is over {max_choices} choices", "prompt"
        )
    return items


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (text parts joined; developer -> system; an
    assistant's tool calls with their arguments as objects, as templates expect)."""
    if not messages:
        raise InvalidRequestError("messages: must not be empty", "messages")
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else ""
        if isinstance(m.content, list):
            content = "".join(part.text for part in m.content)
        message: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content,
        }
        if m.tool_calls:
            message["tool_calls"] = [_template_call(call) for call in m.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        out.append(message)
    return out


def _template_call(call: AssistantToolCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """``SamplingParams.logprobs`` for chat: ``top_logprobs`` alternatives, if logprobs is on."""
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs: requires logprobs to be true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
            "top_logprobs",
        )
    return (req.top_logprobs or 0) if req.logprobs else None


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    """``max_completion_tokens`` wins over the older ``max_tokens``; None: fill the context."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
