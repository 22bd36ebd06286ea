"""Request bodies of the OpenAI API, parsed strictly, and their translation to engine inputs.

A body is decoded as UTF-8, parsed as JSON, validated by a pydantic model in strict mode (no
"5" for 5, no true for 1) and turned into ``SamplingParams``, whose own checks name the bad
parameter. Every failure is an ``InvalidRequestError`` carrying ``param``: HTTP 400. Unknown
fields are ignored, as OpenAI-compatible servers do; known but unsupported features
(``echo``, ``suffix``, ``logit_bias``, JSON mode, tools, ``best_of != n``) are rejected rather
than silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import MAX_LOGPROBS, SamplingParams

PromptInput = str | list[int]
M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
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


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


_MODELS: tuple[type[BaseModel], ...] = (
    StreamOptions,
    CompletionRequest,
    TextPart,
    ChatMessage,
    ChatCompletionRequest,
)
_FIELDS = {name for m in _MODELS for name in m.model_fields}


def parse_json(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``; 400 for bad UTF-8, bad JSON or a non-object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid UTF-8: {exc.reason}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return data


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
    if isinstance(req, ChatCompletionRequest):
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise InvalidRequestError(
                'response_format: only {"type": "text"} is supported', "response_format"
            )
        if req.tools and req.tool_choice != "none":
            raise InvalidRequestError("tools: tool calling is not supported", "tools")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise InvalidRequestError("echo: not supported", "echo")
        if req.suffix:
            raise InvalidRequestError("suffix: not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError("best_of: only best_of == n is supported", "best_of")


def sampling_params(
    req: _Sampling, max_tokens: int, logprobs: int | None, max_n: int
) -> SamplingParams:
    """The engine's ``SamplingParams`` for a validated request body."""
    _reject_unsupported(req)
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
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
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


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template takes them (text parts joined; developer -> system)."""
    if not req.messages:
        raise InvalidRequestError("messages: must not be empty", "messages")
    out = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else ""
        if isinstance(m.content, list):
            content = "".join(part.text for part in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


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
