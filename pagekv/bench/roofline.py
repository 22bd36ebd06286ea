"""The fastest a workload could possibly run here: its least work against this machine's peaks.

    pagekv bench roofline --workload random --dtype bfloat16 --num-threads 2 --target 462

Counts what any engine must do for a workload, done once and no more: every matmul of every
computed token (the LM head only where a token is sampled), every attention product (causal in
prefill; a decode token against its whole history), a prefix common to every prompt computed
once; and the least it must read from memory: the weights once per decode step (a step needs
the previous one's token, and weights larger than the last-level cache cannot stay in it), each
decode token's K/V history (a common prefix once per step). Then measures the machine: float32
FMAs and bf16 dot products in registers on every thread, and a streaming read of memory. The
floor is max(work / peak, bytes / bandwidth): compute and memory fully overlapped, no kernel
below peak, nothing else. A target slower than the floor by less than real kernels lose is out
of reach on this machine; one far above it is a matter of engineering.

No engine runs here: the model's shapes come from its config, the work from the workload's
lengths. On CPUs with AMX the bf16 dot-product peak is not what AMX does, so no bf16 floor is
given there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagekv.bench.workloads import Workload
from pagekv.kernels import build, isa
from pagekv.models.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
READ_BUFFER_BYTES = 512 << 20  # far past any last-level cache

# flops a lane of one chain does an iteration: float32 FMAs on the target's vectors, bf16 pairs
FLOPS_PER_LANE = {"fma_f32": 2, "dot_bf16": 2 * 2}


@dataclass(frozen=True)
class Work:
    """The least a pass does: floating-point operations and bytes read from memory."""

    prefill_matmul_flops: float
    decode_matmul_flops: float
    attention_flops: float
    weight_bytes: float  # over the whole pass
    kv_bytes: float  # K/V histories read by decode steps
    decode_steps: int
    output_tokens: int

    @property
    def flops(self) -> float:
        return self.prefill_matmul_flops + self.decode_matmul_flops + self.attention_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class Peaks:
    """What this machine does at best with ``threads`` threads (None: not measured here)."""

    threads: int
    f32_flops: float | None  # per second
    bf16_flops: float | None
    read_bytes: float | None
    note: str = ""

    def compute(self, dtype: str) -> float | None:
        return self.f32_flops if dtype == "float32" else self.bf16_flops


def common_prefix_len(prompts: list[list[int]]) -> int:
    """Tokens every prompt begins with (0 for fewer than two prompts)."""
    if len(prompts) < 2:
        return 0
    first, length = prompts[0], min(len(p) for p in prompts)
    for i in range(length):
        if any(p[i] != first[i] for p in prompts):
            return i
    return length


def count_work(
    config: ModelConfig,
    workload: Workload,
    dtype: str,
    share_prefix: bool = True,
    cache_bytes: int = 0,
) -> Work:
    """The least work of ``workload`` on a model of ``config``'s shapes in ``dtype``.

    Each request's first token comes from its prefill and the rest from one decode step each;
    a prefix common to every prompt (``share_prefix``: prefix caching) is computed once and its
    K/V read once per decode step. Weights count once per decode step (and once for prefill)
    unless they fit in ``cache_bytes``, then once in all.
    """
    hidden, q_size, kv_size = config.hidden_size, config.q_size, config.kv_size
    inter, layers, width = config.intermediate_size, config.num_hidden_layers, DTYPE_BYTES[dtype]
    layer_macs = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter
    token_macs, head_macs = layers * layer_macs, hidden * config.vocab_size
    pair_macs = layers * 2 * q_size  # one query against one key position: q.k and p.v
    kv_position_bytes = layers * 2 * kv_size * width

    prompts = [r.prompt_token_ids for r in workload.requests]
    outputs = np.array([r.output_len for r in workload.requests], dtype=np.int64)
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    shared = common_prefix_len(prompts) if share_prefix else 0
    starts = np.full(len(prompts), shared, dtype=np.int64)
    starts[0] = 0  # the first computes the prefix every other one reuses
    prefill_tokens = int((lengths - starts).sum())
    prefill_pairs = int(((lengths * (lengths + 1) - starts * (starts + 1)) // 2).sum())

    steps = outputs - 1  # decode steps of each request; step t sees lengths + t positions
    decode_tokens = int(steps.sum())
    decode_pairs = int((steps * lengths + steps * (steps + 1) // 2).sum())
    max_steps = int(steps.max())
    active = np.array([(steps >= t).sum() for t in range(1, max_steps + 1)], dtype=np.int64)
    unshared_positions = decode_pairs - shared * int(np.maximum(active - 1, 0).sum())
    weights = (token_macs + head_macs) * width
    weight_reads = 1 if weights <= cache_bytes else max_steps + 1
    return Work(
        prefill_matmul_flops=2.0 * (prefill_tokens * token_macs + len(prompts) * head_macs),
        decode_matmul_flops=2.0 * decode_tokens * (token_macs + head_macs),
        attention_flops=2.0 * pair_macs * (prefill_pairs + decode_pairs),
        weight_bytes=float(weight_reads * weights),
        kv_bytes=float(unshared_positions * kv_position_bytes),
        decode_steps=max_steps,
        output_tokens=int(outputs.sum()),
    )


def floor_seconds(work: Work, peaks: Peaks, dtype: str) -> float | None:
    """max(work / compute peak, bytes / read bandwidth); None where a peak is unmeasured."""
    compute = peaks.compute(dtype)
    if compute is None or peaks.read_bytes is None:
        return None
    return max(work.flops / compute, work.bytes / peaks.read_bytes)


def measure_peaks(threads: int, repeats: int = 3) -> Peaks:
    """This machine's float32 FMA and bf16 dot-product rates in registers and memory read rate,
    best of ``repeats``, with the best kernel target here. Raises build.KernelUnavailable
    without a C++ compiler."""
    lib = build.load("roofline", isa.selected() or isa.best())
    lanes = int(lib.f32_lanes()) * int(lib.peak_chains())  # every chain's, in one iteration

    def rate(name: str) -> float | None:
        fn, iters = getattr(lib, name), 20_000_000
        if fn(1, threads) < 0:
            return None
        best = min(_timed(lambda: fn(iters, threads)) for _ in range(repeats))
        return threads * iters * FLOPS_PER_LANE[name] * lanes / best

    buffer = np.ones(READ_BUFFER_BYTES // 4, dtype=np.float32)  # written: every page resident
    address, count = buffer.ctypes.data, buffer.size
    read: float | None = None
    if lib.read_f32(address, 16384, threads) >= 0:
        best = min(_timed(lambda: lib.read_f32(address, count, threads)) for _ in range(repeats))
        read = READ_BUFFER_BYTES / best
    bf16 = rate("dot_bf16")
    note = ""
    if _has_amx():
        bf16, note = None, "AMX here: its bf16 rate is above the vector peak, so no bf16 floor"
    return Peaks(threads, rate("fma_f32"), bf16, read, note)


def last_level_cache_bytes() -> int:
    """The L3's size as the C library reports it (0 where unknown)."""
    try:
        return max(0, os.sysconf("SC_LEVEL3_CACHE_SIZE"))
    except (ValueError, OSError):
        return 0


def format_roofline(
    work: Work,
    peaks: Peaks,
    dtype: str,
    title: str,
    target_tok_s: float | None = None,
    measured_tok_s: float | None = None,
) -> str:
    """The work, the machine, the floor, and where a target and a measured rate stand."""

    def at(amount: float, peak: float | None) -> str:
        return "-" if peak is None else f"{amount / peak:.2f} s"

    compute, read = peaks.compute(dtype), peaks.read_bytes
    lines = [
        title,
        f"machine, {peaks.threads} threads: float32 FMA {_giga(peaks.f32_flops)} GFLOPS, "
        f"bf16 dot {_giga(peaks.bf16_flops)} GFLOPS, memory read {_giga(read)} GB/s",
        *([peaks.note] if peaks.note else []),
        "",
        "| work | amount | at peak |",
        "| --- | --- | --- |",
        f"| matmuls, prefill | {work.prefill_matmul_flops / 1e12:.2f} TFLOP | "
        f"{at(work.prefill_matmul_flops, compute)} |",
        f"| matmuls, decode | {work.decode_matmul_flops / 1e12:.2f} TFLOP | "
        f"{at(work.decode_matmul_flops, compute)} |",
        f"| attention | {work.attention_flops / 1e12:.2f} TFLOP | "
        f"{at(work.attention_flops, compute)} |",
        f"| weights ({work.decode_steps} decode steps) | {work.weight_bytes / 1e9:.1f} GB | "
        f"{at(work.weight_bytes, read)} |",
        f"| K/V histories | {work.kv_bytes / 1e9:.1f} GB | {at(work.kv_bytes, read)} |",
        "",
    ]
    floor = floor_seconds(work, peaks, dtype)
    if floor is None:
        lines.append("floor: not measured on this machine")
        return "\n".join(lines)
    lines.append(
        f"floor (compute and memory fully overlapped, every unit at peak): {floor:.2f} s = "
        f"{work.output_tokens / floor:.1f} output tok/s"
    )
    for label, rate, verb in (
        ("target", target_tok_s, "may lose"),
        ("measured", measured_tok_s, "loses"),
    ):
        if rate:
            seconds = work.output_tokens / rate
            lines.append(
                f"{label} {rate:.1f} tok/s: {seconds:.2f} s a pass, {seconds / floor:.2f}x the "
                f"floor (the pass {verb} {1 - floor / seconds:.0%} to everything below peak)"
            )
    return "\n".join(lines)


def _giga(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.1f}"


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any("amx_bf16" in line for line in f if line.startswith("flags"))
    except OSError:
        return False
