"""Request bodies of the OpenAI API, parsed strictly, and their translation to engine inputs.

A body is parsed as a JSON object (``json_body.py``: UTF-8, a nesting limit, valid Unicode),
validated by a pydantic model in strict mode (no "5" for 5, no true for 1, no NaN or infinity)
and turned into ``SamplingParams``, whose own checks name the bad parameter. Every failure is
an ``InvalidRequestError`` carrying ``param``: HTTP 400. Unknown fields are ignored, as
OpenAI-compatible servers do; every known field is honoured, or refused where it cannot be
(``suffix``, ``best_of != n``, ``prompt_logprobs`` on a stream) rather than silently ignored.
``echo`` and ``prompt_logprobs`` score the prompt (``scoring.py``): with ``echo`` and
``logprobs``, the prompt's logprobs are asked for as vLLM asks, and ``max_tokens`` 0 scores the
prompt alone.
Constraints on the output are read by ``structured.py``, tools by ``tools.py``; unset sampling
fields take the server's defaults (``--generation-config``), then the API's.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, ValidationError

from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from pagekv.server import json_body
from pagekv.server.json_body import MAX_JSON_DEPTH

__all__ = ["MAX_JSON_DEPTH"]  # re-exported: the limit on this API's bodies

PromptInput = str | list[int]
M = TypeVar("M", bound=BaseModel)

MAX_TEMPERATURE = 2.0  # OpenAI's API takes temperature in [0, 2]


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
    priority: int = 0  # vLLM's: lower first, with --scheduling-policy priority only
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks shared only with the same salt
    # vLLM's token controls (the engine checks the ids against the vocabulary)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
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
    prompt_logprobs: int | None = None


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
    prompt_logprobs: int | None = None  # vLLM's: beside the choices


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
    """The JSON object in ``raw`` (``json_body.parse_json``), a field too deep named as one of
    these request bodies' fields."""
    return json_body.parse_json(raw, _TOP_FIELDS)


# Fields of vLLM's (and OpenAI's) requests that this server does not honour, with the values
# that ask for nothing (as good as absent). Any other value is refused by name, not ignored as
# an unknown field would be.
UNHONOURED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "truncation_side": (),
    "logprob_token_ids": ([],),
    "return_token_ids": (False,),
    "prompt_embeds": (),
    "kv_transfer_params": ({},),
    "vllm_xargs": ({},),
    "repetition_detection": (),
    "thinking_token_budget": (),
    "mm_processor_kwargs": ({},),
}
UNHONOURED_IN_CHAT: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": ([],),
    "functions": ([],),
    "function_call": (),
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": (),
}


def refuse_unhonoured(data: dict[str, Any], chat: bool) -> None:
    """400 naming the first field of ``UNHONOURED`` (and, for chat, ``UNHONOURED_IN_CHAT``)
    that asks for something (null, or its value that asks for nothing, is accepted)."""
    table = {**UNHONOURED, **UNHONOURED_IN_CHAT} if chat else UNHONOURED
    for field, neutral in table.items():
        value = data.get(field)
        if value is not None and value not in neutral:
            raise InvalidRequestError(
                f"{field}: not supported by this server (give it unset or null)", field
            )


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
    prompt_logprobs = getattr(req, "prompt_logprobs", None)
    if prompt_logprobs is not None and req.stream:
        raise InvalidRequestError(
            "prompt_logprobs: not available when stream is true (echo with logprobs is)",
            "prompt_logprobs",
        )
    if isinstance(req, CompletionRequest):
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


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` with its keys (token ids as JSON text) as integers."""
    if bias is None:
        return None
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError:
        raise InvalidRequestError(
            "logit_bias: keys must be token ids (integers as text)", "logit_bias"
        ) from None


def prompt_logprobs_of(req: _Sampling, max_tokens: int | None) -> int | None:
    """``SamplingParams.prompt_logprobs``: as asked, or with ``echo`` the ``logprobs`` (vLLM's
    rule); a prompt echoed with nothing generated (``max_tokens`` 0) is scored all the same."""
    asked: int | None = getattr(req, "prompt_logprobs", None)
    if not isinstance(req, CompletionRequest) or asked is not None or not req.echo:
        return asked
    if req.logprobs is None and max_tokens == 0:
        return 0
    return req.logprobs


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
        prompt_logprobs=prompt_logprobs_of(req, max_tokens),
        logit_bias=_token_keys(req.logit_bias),
        allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
        bad_words=tuple(req.bad_words or ()),
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
