"""``LLM(...)``'s keyword arguments, as vLLM's ``LLM`` takes them, onto an ``EngineConfig``.

Owns the table of vLLM's arguments that have no field here: the values that change nothing on
this engine are accepted, any other value is refused naming the argument, and a name neither
here nor in ``EngineConfig`` is refused as unknown (an ``InvalidRequestError``, not Python's
TypeError). No torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from pagekv.engine.config import EngineConfig
from pagekv.errors import InvalidRequestError

# vLLM's names for a field this engine has under another name
ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}


@dataclass(frozen=True)
class Inert:
    """A vLLM argument with no effect here, and the values that say so."""

    accepts: Callable[[Any], bool]
    means: str  # shown when another value is refused


def _any(value: Any) -> bool:
    return True


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value is v or value == v for v in values)


def _zero(value: Any) -> bool:
    return not isinstance(value, bool) and value in (0, 0.0, None)


INERT: Mapping[str, Inert] = {
    "disable_log_stats": Inert(_one_of(True, False), "the offline API logs no periodic stats"),
    "hf_token": Inert(_any, "nothing is downloaded"),
    "revision": Inert(_one_of(None, "main"), "the local HF cache's main snapshot is loaded"),
    "tokenizer_revision": Inert(_one_of(None, "main"), "the cache's main snapshot is read"),
    "tokenizer_mode": Inert(_one_of("auto", "hf"), "the model's own tokenizer.json or GGUF"),
    "skip_tokenizer_init": Inert(_one_of(False), "the tokenizer is always loaded"),
    "load_format": Inert(_one_of("auto", "gguf", "safetensors"), "the format is found"),
    "download_dir": Inert(_one_of(None), "nothing is downloaded; HF_HUB_CACHE names the cache"),
    "generation_config": Inert(_one_of("auto", "vllm"), "sampling defaults are pagekv's"),
    "data_parallel_size": Inert(_one_of(1), "one engine in one process"),
    "distributed_executor_backend": Inert(_one_of(None, "mp", "uni"), "one process"),
    "disable_custom_all_reduce": Inert(_one_of(True, False), "one device"),
    "cpu_offload_gb": Inert(_zero, "the weights stay where the model runs"),
    "compilation_config": Inert(_any, "nothing is compiled by torch.compile here"),
    "max_seq_len_to_capture": Inert(_any, "no CUDA graphs are captured"),
    "disable_async_output_proc": Inert(_one_of(True, False), "outputs are processed in step"),
    "enable_chunked_prefill": Inert(_one_of(None, True), "long prompts are always chunked"),
    "max_num_partial_prefills": Inert(_one_of(1), "one partial prefill per step"),
    "lora_request": Inert(_one_of(None), "LoRA adapters are not supported"),
    "enable_lora": Inert(_one_of(None, False), "LoRA adapters are not supported"),
    "mm_processor_kwargs": Inert(_one_of(None), "text-only models"),
    "limit_mm_per_prompt": Inert(_one_of(None), "text-only models"),
}

_FIELDS = frozenset(f.name for f in fields(EngineConfig))


def engine_config(model: str | None, given: Mapping[str, Any]) -> EngineConfig:
    """The config for ``LLM(model, **given)`` (``chat_template`` taken off by the caller)."""
    values: dict[str, Any] = {"model": model}
    for name, value in given.items():
        target = ALIASES.get(name, name)
        if target in _FIELDS:
            if target in values and target != "model":
                raise InvalidRequestError(f"{name}: given twice (also as {target})", name)
            values[target] = value
        elif name in INERT:
            check_inert(name, value)
        else:
            raise InvalidRequestError(
                f"LLM() got an unknown argument {name!r} (no such vLLM argument is taken here)",
                name,
            )
    return EngineConfig(**values)


def check_inert(name: str, value: Any) -> None:
    """Accept ``value`` of a vLLM argument that changes nothing here, or refuse it by name."""
    inert = INERT[name]
    if not inert.accepts(value):
        raise InvalidRequestError(f"{name}={value!r:.80} is not supported: {inert.means}", name)
