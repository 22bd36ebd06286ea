"""Command-line options for an ``EngineConfig``: one definition for every command that builds an
engine (``pagekv generate/chat/serve`` and ``pagekv bench``).

Owns only the mapping between flags and config fields. Each option's ``dest`` is the field's
name, so ``engine_config`` reads back every field the parser defined and nothing else; the
checks stay in ``EngineConfig.__post_init__`` (a bad value is an ``InvalidRequestError`` there,
whichever front end it came from), which also reads vLLM's forms: ``--max-model-len 4k``,
``--max-num-batched-tokens 8k``, ``--swap-space 4`` (GiB), ``--dtype half``.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from pagekv.engine.config import EngineConfig


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    *,
    title: str = "engine",
    kv_cache_memory: str = "1GiB",
    tiers: bool = True,
    prefill_step_seconds: float = 0.0,
) -> None:
    """The engine's options as one argument group (and the KV tier options when ``tiers``)."""
    group = parser.add_argument_group(title)
    _add_model_options(group)
    _add_kv_cache_options(group, kv_cache_memory)
    _add_batching_options(group)
    _add_block_reuse_options(group, prefill_step_seconds)
    _add_speculation_options(group)
    if tiers:
        _add_tier_options(parser.add_argument_group("KV tiers"))


def _add_model_options(g: argparse._ArgumentGroup) -> None:
    """Which weights, in which dtype, kept quantized or not."""
    g.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF directory, or HF model id in the local HF cache (default: "
        "SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--tokenizer", default=None, help="another tokenizer than the model's (path or HF id)"
    )
    g.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", "float32", "float", "bfloat16", "half", "float16"],
        help="auto and float are float32; half and float16 run as bfloat16 (default: float32)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (default): the KV cache in --dtype; int8 or fp8 (e4m3): 8-bit blocks with a "
        "float16 scale per token and KV head (about 2x bf16's tokens, 3.9x float32's)",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "gguf", "none"],
        help="a GGUF file's quantized weights: gguf keeps them quantized (dequantized inside "
        "the matmul kernels), none dequantizes them to --dtype at load, auto (default) keeps "
        "them where the C kernels run",
    )
    g.add_argument(
        "--gguf-activations",
        default="auto",
        choices=["auto", "dtype", "int8"],
        help="what GGUF blocks kept quantized multiply: int8 the activations rounded to int8 "
        "per 32 inputs and integer dot products, as llama.cpp (every format: Q4_0 to Q8_0, "
        "Q4_K, Q5_K, Q6_K); dtype the activations as they are, every weight exactly "
        "dequantized (the exact path); auto (default) int8 wherever the blocks are kept "
        "quantized",
    )
    g.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="cpu (C kernels) or cuda (Triton kernels); auto (default): cuda when torch sees a GPU",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="on a GPU: the share of its memory the engine may use (weights, KV blocks)",
    )
    _add_single_device_options(g)


def _add_single_device_options(g: argparse._ArgumentGroup) -> None:
    """vLLM's options that change nothing here (one process, one device, no model code run);
    other values than these are refused by name."""
    for name in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        g.add_argument(name, type=int, default=1, help="1 only: one model on one device")
    g.add_argument(
        "--enforce-eager", action="store_true", help="accepted; no CUDA graphs are captured here"
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted; no code from a model directory is ever run here",
    )


def _add_kv_cache_options(g: argparse._ArgumentGroup, kv_cache_memory: str) -> None:
    """The device pool: block size and how many blocks (by memory or by count)."""
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default=kv_cache_memory)
    g.add_argument("--num-kv-blocks", type=int, default=None)


def _add_batching_options(g: argparse._ArgumentGroup) -> None:
    """What one step may hold, and the threads that run it."""
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument(
        "--max-num-batched-tokens", default=2048, help="tokens in one step; 8k = 8000, 2K = 2048"
    )
    g.add_argument(
        "--max-model-len",
        default=None,
        help="context per request: an int, or 4k (4000), 32K (32768), 25.6k (25600); default "
        "(or auto): the model's",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="the most logprobs or prompt_logprobs a request may ask for (default: 20)",
    )
    g.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="threads for torch and the C kernels (default: torch's, one per core)",
    )


def _add_block_reuse_options(g: argparse._ArgumentGroup, prefill_step_seconds: float) -> None:
    """Prefix caching, what preemption does with a request's blocks, and how steps are shared."""
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached KV blocks of shared prompt prefixes (default: on)",
    )
    g.add_argument(
        "--preemption-mode",
        default="recompute",
        help="what to do when blocks run out: recompute or swap (EngineConfig checks the value)",
    )
    g.add_argument(
        "--swap-space",
        default="0",
        help="host memory for swapped blocks in GiB, as vLLM (4 = 4 GiB), or with a unit "
        "(512MiB); default: 0",
    )
    g.add_argument(
        "--scheduling-policy",
        default="fair",
        help="fair (clients in turn; the server's clients are addresses), fcfs or priority "
        "(default: fair, which is fcfs for one client)",
    )
    g.add_argument(
        "--shared-prefill-tokens",
        type=int,
        default=256,
        help="fair: a step's prefill tokens while 2+ clients have requests in (default: 256)",
    )
    g.add_argument(
        "--prefill-step-seconds",
        type=float,
        default=prefill_step_seconds,
        help="a step that computes prompt tokens is kept to about this long (its prompt tokens "
        "set by the step times measured so far), so a request that arrives waits about this "
        f"long at most for the step in flight; 0: off (default: {prefill_step_seconds:g})",
    )


def _add_speculation_options(g: argparse._ArgumentGroup) -> None:
    """N-gram speculative decoding: how many tokens a draft has, and how it is looked up."""
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="n-gram speculative decoding: draft up to this many tokens per greedy decode from "
        "the request's own history, checked by the model in the same step (default: 0, off)",
    )
    g.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=4,
        help="longest suffix looked up for a draft (default: 4)",
    )
    g.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=1,
        help="shortest suffix looked up for a draft (default: 1)",
    )


def _add_tier_options(t: argparse._ArgumentGroup) -> None:
    """The KV tiers below the device pool: host cache and storage."""
    t.add_argument(
        "--host-cache-memory",
        default="0",
        help="host memory for a host prefix cache (shared with swap space), e.g. 4GiB",
    )
    t.add_argument(
        "--kv-store",
        default=None,
        help="storage tier: file:DIR | mooncake://HOST:PORT | redis://HOST:PORT",
    )
    t.add_argument(
        "--cache-write-policy",
        default="write_through",
        help="write_through | write_through_selective | write_back (EngineConfig checks it)",
    )
    t.add_argument(
        "--kv-store-secret",
        default=None,
        help="authenticate storage records with HMAC-SHA256 keyed by this secret, so forged "
        "records in a shared store are refused; engines share records only with the same one",
    )
    t.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's KVEventsConfig as JSON: publish where prefix blocks live (device pool, "
        'host cache, storage) for a KV-aware router, e.g. \'{"enable_kv_cache_events": true, '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'',
    )
    t.add_argument(
        "--kv-store-required",
        action="store_true",
        help="fail at start-up if the store is unreachable (default: warn, run without it)",
    )


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The config of every ``EngineConfig`` field the parsed arguments hold, then ``overrides``.

    Fields no option defines (e.g. ``trace`` outside ``serve``) keep their defaults.
    """
    given = vars(args)
    values = {f.name: given[f.name] for f in fields(EngineConfig) if f.name in given}
    return EngineConfig(**{**values, **overrides})
