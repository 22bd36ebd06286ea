"""Engine configuration: one frozen dataclass, validated once. No torch.

Sizes accept ints (bytes) or strings like "1GiB", "512MiB", "2GB"; ``swap_space`` is vLLM's,
in GiB when a number. vLLM's spellings (``dtype="auto"``, ``max_model_len="4k"``, None for
"the default") are read into this engine's values as the config is built (vllm_forms.py), so
a config holds resolved values only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagekv.core.scheduler import PreemptionCostModel, PreemptionMode, SchedulingPolicy
from pagekv.core.tier_policy import WritePolicy
from pagekv.engine import vllm_forms
from pagekv.engine.kv_events import KVEventsConfig
from pagekv.errors import InvalidRequestError
from pagekv.models.config import ModelConfig
from pagekv.sampling_params import MAX_LOGPROBS
from pagekv.tiering.store import KVStore

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | str, param: str) -> int:
    """``"1GiB"`` -> 1073741824; rejects negatives and unknown units by name."""
    if isinstance(value, bool):
        raise InvalidRequestError(f"{param}: expected a size, got {value!r}", param)
    if isinstance(value, int):
        num = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidRequestError(
                f"{param}: cannot read {value!r} as a size like '1GiB'", param
            )
        num = int(float(match.group(1)) * _UNITS[unit])
    if num < 0:
        raise InvalidRequestError(f"{param}: must be >= 0, got {value!r}", param)
    return num


def swap_space_bytes(value: float | str) -> int:
    """vLLM's ``swap_space``: a number, or a string of one as on the command line ("4"), is
    GiB; a string with a unit ("512MiB") is read by ``parse_bytes``."""
    if isinstance(value, bool):
        raise InvalidRequestError(f"swap_space: GiB, got {value!r}", "swap_space")
    if isinstance(value, str) and not re.fullmatch(r"\s*\d+(\.\d+)?\s*", value):
        return parse_bytes(value, "swap_space")
    try:
        gib = float(value)
    except (TypeError, ValueError):
        raise InvalidRequestError(
            f"swap_space: GiB or a size like '512MiB', got {value!r:.80}", "swap_space"
        ) from None
    if not 0 <= gib < float("inf"):
        raise InvalidRequestError(f"swap_space: must be >= 0 GiB, got {value!r}", "swap_space")
    return int(gib * 2**30)


QUANTIZATION_MODES = ("auto", "gguf", "none")
GGUF_ACTIVATIONS = ("auto", "dtype", "int8")


@dataclass(frozen=True)
class EngineConfig:
    # None: the default SmolLM2-135M-Instruct GGUF; else a GGUF file, an HF directory, or a
    # Hugging Face model id found in the local HF cache (models/hub.py; never downloaded)
    model: str | None = None
    # Another tokenizer than the model's (a GGUF file, an HF directory or id); None: the model's
    tokenizer: str | None = None
    # "float32" | "bfloat16": activations, KV cache, dense weights. vLLM's names are read too:
    # "auto" (float32), "float", "half"/"float16" (run as bfloat16, with a warning).
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"  # the KV cache is in dtype: "auto" or dtype's own name
    # A GGUF file's quantized matmul weights: "gguf" keeps them GGUF blocks (the kernels
    # dequantize them as they multiply), "none" dequantizes them to dtype at load, "auto"
    # keeps them where the C kernels run here.
    quantization: str = "auto"
    # What GGUF blocks kept quantized multiply: "int8" the activations rounded per 32 inputs
    # and integer dot products (llama.cpp's Q8 blocks), "dtype" the activations as they are
    # (every weight exactly dequantized: the exact path), "auto" int8 wherever the blocks are
    # kept quantized.
    gguf_activations: str = "auto"
    device: str = "auto"  # "cpu" | "cuda" | "auto" (CUDA when torch sees a GPU): engine/device.py
    gpu_memory_utilization: float = 0.9  # on a GPU: the share of its memory the engine may use
    block_size: int = 16
    kv_cache_memory: int | str = "1GiB"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    # host pool for swap preemption (the same pool as below): GiB (vLLM's unit), or a size
    # with a unit such as "512MiB"
    swap_space: float | str = 0
    host_cache_memory: int | str = 0  # host pool bytes: a host prefix cache, and swap space
    kv_store: str | KVStore | None = None  # "file:DIR", "redis://H:P", "mooncake://H:P", a store
    cache_write_policy: str = "write_through"  # | "write_through_selective" | "write_back"
    kv_store_required: bool = False  # an unreachable store fails start-up (else: a warning)
    kv_store_timeout_s: float = 5.0  # per store call; also the longest wait for a prefetch
    # Authenticates storage records with HMAC-SHA256 keyed by this secret (tiering/blob.py):
    # a shared store's forged records are refused. None: a CRC32 only, as before. Engines
    # sharing a store read each other's records only with the same secret (or both none).
    kv_store_secret: str | None = field(default=None, repr=False)
    # vLLM's KVEventsConfig (its JSON, a dict, or the object): publish where prefix blocks live
    # (device pool, host cache, storage) for a KV-aware router (engine/kv_events.py)
    kv_events_config: KVEventsConfig | Mapping[str, Any] | str | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # or vLLM's human-readable form: "8k", "2K"
    # None (or "auto", -1): the model's context length; an int or "4k" (4000), "1K" (1024)
    max_model_len: int | None = None
    max_logprobs: int = 20  # the most logprobs (and prompt_logprobs) a request may ask for
    # Unseeded requests draw from seeds derived from this one and their arrival order, so a
    # run is reproducible (as vLLM's seed makes it); None: they draw from torch's global RNG.
    seed: int | None = None
    # vLLM's arguments that change nothing on this engine: one process, one device; no CUDA
    # graphs to turn off; no code in a model directory is ever run.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool = False
    trust_remote_code: bool = False
    # torch's intra-op threads (process-wide), which the C kernels follow; None: torch's default
    num_threads: int | None = None
    preemption_mode: str = "recompute"  # "recompute" | "swap" | "auto" (per victim, by cost)
    preemption_cost: PreemptionCostModel | None = None  # None: defaults measured on CPU
    # "fair": clients in turn (add_request's client), each first come first served (with one
    # client: fcfs); "fcfs"; "priority" (lower priority value first)
    scheduling_policy: str = "fair"
    priority_aging_steps: int = 100  # waiting requests gain a priority level per this; 0: off
    long_prefill_token_threshold: int = 0  # per-request prefill tokens per step; 0: no cap
    # fair: a step's prefill tokens while 2+ clients have requests in, shared among them
    shared_prefill_tokens: int = 256
    # a step with prompt tokens kept to about this long, by measured step times; 0: off
    # (``pagekv serve``: 0.5, so a request that arrives never waits long for the step in flight)
    prefill_step_seconds: float = 0.0
    # Speculative decoding by n-gram lookup in each greedy request's own tokens
    # (core/speculation.py): up to this many draft tokens per step (0: off), found by matching
    # the last prompt_lookup_max .. prompt_lookup_min tokens. Outputs are unchanged.
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    check_invariants: bool = False
    trace: str | None = None  # append each finished request's lengths + prefix hashes here
    kv_sanitizer: bool = False  # debug: fingerprint shared blocks, check them every step

    def _check_device(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise InvalidRequestError(
                f"device must be auto, cpu or cuda, got {self.device!r}", "device"
            )
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not 0 < utilization <= 1:
            raise InvalidRequestError(
                f"gpu_memory_utilization must be in (0, 1], got {utilization!r}",
                "gpu_memory_utilization",
            )

    def _resolve_vllm_forms(self) -> None:
        """vLLM's spellings and None-for-default, replaced by the values they mean here (the
        config is still being built: frozen from here on)."""
        for name, default in _NONE_MEANS_DEFAULT.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        object.__setattr__(self, "dtype", vllm_forms.engine_dtype(self.dtype))
        object.__setattr__(self, "max_model_len", vllm_forms.context_length(self.max_model_len))
        batched = vllm_forms.human_readable_int(
            self.max_num_batched_tokens, "max_num_batched_tokens"
        )
        object.__setattr__(self, "max_num_batched_tokens", batched)
        if self.kv_events_config is not None:
            events = KVEventsConfig.parse(self.kv_events_config)
            object.__setattr__(self, "kv_events_config", events)

    def _check_vllm_arguments(self) -> None:
        vllm_forms.check_kv_cache_dtype(self.kv_cache_dtype, self.dtype)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                raise InvalidRequestError(
                    f"{name} must be 1: this engine runs one model on one device, got "
                    f"{getattr(self, name)!r}",
                    name,
                )
        for name in ("enforce_eager", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be True or False", name)
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidRequestError(f"seed must be an integer or None, got {seed!r}", "seed")
        most = self.max_logprobs
        if isinstance(most, bool) or not isinstance(most, int) or not 0 <= most <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"max_logprobs must be an integer in [0, {MAX_LOGPROBS}] on this engine, "
                f"got {most!r}",
                "max_logprobs",
            )
        tokenizer = self.tokenizer
        if tokenizer is not None and (not isinstance(tokenizer, str) or not tokenizer):
            raise InvalidRequestError("tokenizer: a path or model id, or None", "tokenizer")

    def __post_init__(self) -> None:
        self._resolve_vllm_forms()
        self._check_vllm_arguments()
        _check_one_of("quantization", self.quantization, QUANTIZATION_MODES)
        _check_one_of("gguf_activations", self.gguf_activations, GGUF_ACTIVATIONS)
        self._check_device()
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise InvalidRequestError(
                f"block_size must be >= 1, got {self.block_size!r}", "block_size"
            )
        threads = self.num_threads
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise InvalidRequestError(f"num_threads must be >= 1, got {threads!r}", "num_threads")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequestError("num_kv_blocks must be >= 1", "num_kv_blocks")
        parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        swap_space_bytes(self.swap_space)
        parse_bytes(self.host_cache_memory, "host_cache_memory")
        WritePolicy.parse(self.cache_write_policy)
        store = self.kv_store
        if store is not None and (not store if isinstance(store, str) else not _is_store(store)):
            raise InvalidRequestError(
                f"kv_store: expected a spec like 'file:DIR' or a KVStore, got {store!r}",
                "kv_store",
            )
        timeout = self.kv_store_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise InvalidRequestError(
                f"kv_store_timeout_s must be > 0, got {timeout!r}", "kv_store_timeout_s"
            )
        secret = self.kv_store_secret
        if secret is not None and (not isinstance(secret, str) or not secret):
            raise InvalidRequestError(
                "kv_store_secret must be a non-empty string or None", "kv_store_secret"
            )
        _check_one_of("preemption_mode", self.preemption_mode, [m.value for m in PreemptionMode])
        policies = [p.value for p in SchedulingPolicy]
        _check_one_of("scheduling_policy", self.scheduling_policy, policies)
        step_s = self.prefill_step_seconds
        if isinstance(step_s, bool) or not isinstance(step_s, int | float) or not 0 <= step_s < 1e6:
            raise InvalidRequestError(
                f"prefill_step_seconds must be >= 0, got {step_s!r}", "prefill_step_seconds"
            )
        if self.max_num_seqs < 1:
            raise InvalidRequestError(
                f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}", "max_num_seqs"
            )
        if self.max_num_batched_tokens < self.block_size:
            raise InvalidRequestError(
                "max_num_batched_tokens must be >= block_size", "max_num_batched_tokens"
            )


# vLLM's None for "the engine's default" (its LLM passes None for unset arguments)
_NONE_MEANS_DEFAULT = {
    "quantization": "auto",
    "enable_prefix_caching": True,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 2048,
    "kv_cache_dtype": "auto",
}


def _check_one_of(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise InvalidRequestError(f"{name} must be one of {list(choices)}, got {value!r}", name)


logger = logging.getLogger("pagekv")


def max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    """The configured context, capped at the model's positions: a longer one is used at the
    model's length, with a warning, rather than refused."""
    context = model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > context:
        logger.warning(
            "max_model_len %d is beyond the model's context of %d tokens; using %d",
            config.max_model_len,
            context,
            context,
        )
    return min(config.max_model_len or context, context)


DEFAULT_STORE_HOST_CACHE = 256 * 2**20  # host pool given to a storage tier configured without one


def host_pool_bytes(config: EngineConfig) -> int:
    """One host pool serves swapping and the host cache; a storage tier needs one to land in."""
    size = max(
        swap_space_bytes(config.swap_space),
        parse_bytes(config.host_cache_memory, "host_cache_memory"),
    )
    if config.kv_store is not None and size == 0:
        size = DEFAULT_STORE_HOST_CACHE
    return size


def uses_lower_tiers(config: EngineConfig) -> bool:
    """Whether prefix blocks are written below the device (else the host pool only swaps)."""
    return (
        config.kv_store is not None
        or parse_bytes(config.host_cache_memory, "host_cache_memory") > 0
    )


def _is_store(value: object) -> bool:
    names = ("batch_exists", "batch_get", "batch_put", "get", "put", "close")
    return all(callable(getattr(value, n, None)) for n in names)
