"""The offline API: ``LLM(...).generate(prompts, params)``, ``.chat(messages, params)`` and
``.beam_search(prompts, params)``, taking vLLM's arguments with vLLM's meanings.

Owns nothing but its engine and its chat template; every call runs the engine's step loop until
its requests end. ``LLM(...)``'s arguments are read by ``engine/llm_args.py``, prompts by
``engine/prompts.py``; a value this engine cannot honour is an ``InvalidRequestError`` naming it.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tqdm import tqdm

from pagekv.engine import llm_args
from pagekv.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagekv.engine.llm_engine import LLMEngine
from pagekv.engine.outputs import RequestOutput
from pagekv.engine.prompts import ParsedPrompt, parse_prompts
from pagekv.errors import InvalidRequestError
from pagekv.inputs import PromptType
from pagekv.models.chat_template import ChatTemplate, read_chat_template
from pagekv.models.hf_tokenizer import HFTokenizer
from pagekv.models.tokenizer import Tokenizer
from pagekv.sampling_params import SamplingParams, check_text

Message = Mapping[str, Any]
Progress = bool | Callable[..., tqdm]


class LLM:
    """A vLLM-style offline engine. ``model=None`` loads the default SmolLM2-135M-Instruct; else
    a GGUF file, an HF directory, or a Hugging Face id from the local HF cache.

    Takes vLLM's ``LLM`` arguments (``seed``, ``dtype``, ``max_model_len="4k"``,
    ``swap_space`` in GiB, ``tensor_parallel_size=1`` ...; see ``EngineConfig`` and
    ``engine/llm_args.py``) and ``chat_template`` (a path or the template's text)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        template = _template_text(kwargs.pop("chat_template", None))  # read before loading
        config = llm_args.engine_config(model, kwargs)
        self.engine = LLMEngine(config)
        print(self.engine.system_line, self.engine.capacity_line, sep="\n", file=sys.stderr)
        self._ids = itertools.count()
        self._chat_template = self._compile(template)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built elsewhere (tests share one loaded model across engines)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        llm._chat_template = None
        return llm

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine."""
        return self.engine

    def get_tokenizer(self) -> HFTokenizer:
        """The model's tokenizer with transformers' calls (``tok("text").input_ids``,
        ``apply_chat_template(..., tokenize=False)``, ``eos_token_id`` ...)."""
        return HFTokenizer(self.engine.tokenizer, self.engine.loaded.path)

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters ``generate`` and ``chat`` use when given none."""
        return SamplingParams()

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
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Progress = True,
        lora_request: object = None,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list: strings, token-id lists, ``TextPrompt`` /
        ``TokensPrompt`` dicts; outputs in the prompts' order."""
        llm_args.check_inert("lora_request", lora_request)
        inputs = parse_prompts(prompts)
        params = _per_prompt(sampling_params, len(inputs))
        return self._run(inputs, params, _priorities(priority, len(inputs)), use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Progress = True,
        lora_request: object = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the model's, ``LLM(chat_template=)`` or ``chat_template``)
        to one conversation (a list of message dicts) or a list of them, as vLLM does; a bare
        string is refused. ``tools``: OpenAI tool definitions, laid out by the template or in
        a system message. Text content parts are joined as vLLM's string format does."""
        llm_args.check_inert("lora_request", lora_request)
        llm_args.check_inert("mm_processor_kwargs", mm_processor_kwargs)
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise InvalidRequestError(
                "chat_template_content_format: auto, string or openai",
                "chat_template_content_format",
            )
        conversations = _conversations(messages)
        _check_tools(tools)
        params = _per_prompt(sampling_params, len(conversations))  # before any template runs
        template = self._compile(_template_text(chat_template)) or self._chat_template
        tok = self.engine.tokenizer
        texts = [
            tok.apply_chat_template(
                c,
                add_generation_prompt,
                tools,
                continue_final_message=continue_final_message,
                template=template,
                template_kwargs=chat_template_kwargs,
            )
            for c in conversations
        ]
        inputs = [_templated(tok, t) for t in texts]
        return self._run(inputs, params, _priorities(priority, len(inputs)), use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: object = None,
        use_tqdm: Progress = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search inside the engine's batching; each output's ``sequences`` come best
        first, vLLM's way: ``tokens`` (prompt and generated), ``text``, ``cum_logprob``,
        ``logprobs``. ``concurrency_limit`` is accepted: the engine's batching bounds the
        beams in flight."""
        llm_args.check_inert("lora_request", lora_request)
        if concurrency_limit is not None and (
            isinstance(concurrency_limit, bool)
            or not isinstance(concurrency_limit, int)
            or concurrency_limit < 1
        ):
            raise InvalidRequestError(
                "concurrency_limit: None or an integer >= 1", "concurrency_limit"
            )
        inputs = parse_prompts(prompts)
        if any(p.cache_salt is not None for p in inputs):
            raise InvalidRequestError("cache_salt: not taken by beam search", "cache_salt")
        engine = self.engine
        ids = [f"beam-{next(self._ids)}" for _ in inputs]
        try:
            for rid, prompt in zip(ids, inputs, strict=True):
                engine.add_beam_search_request(rid, prompt.prompt, params)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        results: dict[str, BeamSearchOutput] = {}
        bar = _progress(use_tqdm, len(ids), "beam search")
        while len(results) < len(ids):
            engine.step()
            for rid in ids:
                out = engine.pop_beam_search_output(rid)
                if out is not None:
                    results[rid] = out
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in ids]

    def _compile(self, source: str | None) -> ChatTemplate | None:
        return None if source is None else self.engine.tokenizer.compile_chat_template(source)

    def _run(
        self,
        inputs: list[ParsedPrompt],
        params: list[SamplingParams],
        priorities: list[int],
        use_tqdm: Progress,
    ) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"gen-{next(self._ids)}" for _ in inputs]
        try:
            for rid, prompt, p, prio in zip(ids, inputs, params, priorities, strict=True):
                engine.add_request(
                    rid, prompt.prompt, p, cache_salt=prompt.cache_salt, priority=prio
                )
        except Exception:
            for rid in ids:
                engine.abort_request(rid)  # a bad prompt leaves nothing of the batch behind
            raise
        done: dict[str, RequestOutput] = {}
        bar = _progress(use_tqdm, len(ids), "generate")
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        outputs = [done[rid] for rid in ids]
        for out, prompt in zip(outputs, inputs, strict=True):
            if out.prompt is None:
                out.prompt = prompt.text  # a TokensPrompt's own text, if it gave one
        return outputs


def _templated(tok: Tokenizer, text: str) -> ParsedPrompt:
    """A chat template's text as token ids: the template writes the special tokens (BOS)
    itself, so none is added, as vLLM tokenizes it."""
    check_text(text, "prompt")  # e.g. a lone surrogate in a message
    return ParsedPrompt(tok.encode(text, add_special_tokens=False) or text, text)


def _template_text(template: object) -> str | None:
    """vLLM's ``chat_template``: None, a file's path, or the template's own text."""
    if template is None:
        return None
    if not isinstance(template, str):
        raise InvalidRequestError("chat_template: a path or the template's text", "chat_template")
    return read_chat_template(template)


def _progress(use_tqdm: Progress, total: int, desc: str) -> tqdm:
    """vLLM's ``use_tqdm``: True, False, or a tqdm-like factory (e.g. ``partial(tqdm, ...)``)."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc)
    return tqdm(total=total, desc=desc, disable=not use_tqdm or total < 2)


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


def _priorities(priority: int | Sequence[int] | None, num: int) -> list[int]:
    """vLLM's ``priority``: None (0), one for all, or one per prompt."""
    if priority is None:
        return [0] * num
    if isinstance(priority, int) and not isinstance(priority, bool):
        return [priority] * num
    if not isinstance(priority, list | tuple) or len(priority) != num:
        raise InvalidRequestError(
            f"priority: an integer or a list of one per prompt ({num})", "priority"
        )
    return list(priority)


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
        out.append([_text_content(dict(m), where) for m in conversation])
    return out


def _text_content(message: dict[str, Any], where: str) -> dict[str, Any]:
    """A message whose content is OpenAI's list of parts, with its text parts joined by
    newlines (vLLM's "string" content format); other parts are refused."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError(
                f"{where}: content part {kind!r}: text-only models take text parts only", where
            )
        texts.append(str(part.get("text", "")))
    return {**message, "content": "\n".join(texts)}


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
