"""The offline API: ``LLM(...).generate(prompts, params)`` and ``.chat(messages, params)``.

Owns nothing but its engine; every call runs the engine's step loop until its requests end.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tqdm import tqdm

from pagekv.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagekv.engine.config import EngineConfig
from pagekv.engine.llm_engine import LLMEngine
from pagekv.engine.outputs import RequestOutput
from pagekv.engine.prompts import PromptInput
from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import SamplingParams

Prompt = str | Mapping[str, Any]
Message = Mapping[str, str]


class LLM:
    """A vLLM-style offline engine. ``model=None`` loads the default SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        print(self.engine.system_line, self.engine.capacity_line, sep="\n", file=sys.stderr)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built elsewhere (tests share one loaded model across engines)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def close(self) -> None:
        """Finish writing to the storage tier (``kv_store=``) and release the store."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for a str, a list of str, or ``{"prompt_token_ids": [...]}`` items."""
        inputs = _prompt_inputs(prompts)
        params = _per_prompt(sampling_params, len(inputs))
        return self._run(inputs, params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of message dicts) or a
        list of them, as vLLM does; a bare string is refused (``tools``: OpenAI tool
        definitions, laid out by the template or in a system message)."""
        conversations = _conversations(messages)
        _check_tools(tools)
        params = _per_prompt(sampling_params, len(conversations))  # before any template runs
        tok = self.engine.tokenizer
        texts = [tok.apply_chat_template(c, tools=tools) for c in conversations]
        return self._run(_prompt_inputs(texts), params, use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = True
    ) -> list[BeamSearchOutput]:
        """Beam search inside the engine's batching; sequences come best first."""
        inputs = _prompt_inputs(prompts)
        engine = self.engine
        ids = [f"beam-{next(self._ids)}" for _ in inputs]
        try:
            for rid, prompt in zip(ids, inputs, strict=True):
                engine.add_beam_search_request(rid, prompt, params)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        results: dict[str, BeamSearchOutput] = {}
        bar = tqdm(total=len(ids), desc="beam search", disable=not use_tqdm or len(ids) < 2)
        while len(results) < len(ids):
            engine.step()
            for rid in ids:
                out = engine.pop_beam_search_output(rid)
                if out is not None:
                    results[rid] = out
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in ids]

    def _run(
        self, inputs: list[PromptInput], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"gen-{next(self._ids)}" for _ in inputs]
        try:
            for rid, prompt, p in zip(ids, inputs, params, strict=True):
                engine.add_request(rid, prompt, p)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)  # a bad prompt leaves nothing of the batch behind
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2)
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in ids]


def _prompt_inputs(prompts: Prompt | Sequence[Prompt]) -> list[PromptInput]:
    """The engine's prompt for ``prompts`` if it is one prompt, else for each of its items."""
    if isinstance(prompts, str | Mapping):
        return [_prompt_input(prompts)]
    if not isinstance(prompts, Iterable):
        raise InvalidRequestError(
            f"prompts: a prompt or a list of prompts, got {type(prompts).__name__}", "prompt"
        )
    return [_prompt_input(p) for p in prompts]


def _prompt_input(prompt: Prompt) -> PromptInput:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, str) or not isinstance(ids, Iterable):
                raise InvalidRequestError(
                    f"prompt_token_ids: a list of token ids, got {type(ids).__name__}", "prompt"
                )
            return list(ids)
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return str(prompt["prompt"])
    raise InvalidRequestError(
        f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}",
        "prompt",
    )


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, num: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt: None (the defaults) or one for all, or a list or tuple
    of exactly one per prompt."""
    if params is None:
        return [SamplingParams()] * num
    if isinstance(params, SamplingParams):
        return [params] * num
    if not isinstance(params, list | tuple):
        raise InvalidRequestError(
            f"sampling_params: a SamplingParams or a list of them, got {type(params).__name__}",
            "sampling_params",
        )
    if not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidRequestError(
            "sampling_params: every item must be a SamplingParams", "sampling_params"
        )
    if len(params) != num:
        raise InvalidRequestError(
            f"{len(params)} sampling params for {num} prompts", "sampling_params"
        )
    return list(params)


def _conversations(messages: object) -> list[list[dict[str, Any]]]:
    """``messages`` as a list of conversations: one conversation (a list of message dicts) or a
    list of them. Roles and contents are the chat template's to check."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise InvalidRequestError(
            f"messages: a list of message dicts, or a list of such lists; got "
            f"{type(messages).__name__}",
            "messages",
        )
    if not messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    nested = not isinstance(messages[0], Mapping)
    conversations = list(messages) if nested else [messages]
    out: list[list[dict[str, Any]]] = []
    for i, conversation in enumerate(conversations):
        where = f"messages[{i}]" if nested else "messages"
        if isinstance(conversation, str | bytes | Mapping) or not isinstance(
            conversation, Sequence
        ):
            raise InvalidRequestError(f"{where}: a list of message dicts", where)
        if not all(isinstance(m, Mapping) for m in conversation):
            raise InvalidRequestError(f"{where}: every message must be a dict", where)
        out.append([dict(m) for m in conversation])
    return out


def _check_tools(tools: object) -> None:
    """``tools`` is None or a list of JSON-serializable tool definitions (dicts)."""
    if tools is None:
        return
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise InvalidRequestError("tools: a list of tool definitions (dicts)", "tools")
    try:
        json.dumps(tools)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"tools: not JSON: {exc}", "tools") from exc
