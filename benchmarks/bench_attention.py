"""Paged decode attention vs contiguous SDPA: batch 64, 9 query / 3 KV heads, head dim 64.

    python benchmarks/bench_attention.py [--dtype bfloat16] [--threads 1] [--repeat 5] [--record]

One decode step of one layer: each of 64 sequences has one query over ``context`` cached
tokens. "paged" reads K/V through shuffled block tables (block size 16) with pagekv's decode
path (the C kernel, or its torch fallback with --torch-fallback); "sdpa" is
``F.scaled_dot_product_attention`` over the same K/V laid out contiguously [B, KVH, S, D]
(the layout a non-paged engine keeps). The two run alternately in one process; the figure is
the ratio of medians, paged / sdpa (1.0 = as fast as contiguous).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from pagekv.kernels import decode
from pagekv.kernels.decode import DecodeBatch
from pagekv.runner.fast_attention import decode_attention_torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

BATCH, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 64, 9, 3, 64, 16
CONTEXTS = (64, 128, 256, 512, 1024, 2048)


def _time(fn: Callable[[], object], min_s: float = 0.2) -> float:
    """Mean seconds per call over at least ``min_s`` of repeated calls."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def _case(
    context: int, dtype: torch.dtype, gen: torch.Generator
) -> dict[str, torch.Tensor | DecodeBatch]:
    blocks_per_seq = context // BLOCK
    num_blocks = BATCH * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(BATCH, blocks_per_seq)
    # The same tokens, contiguous per sequence: [B, KVH, S, D]
    k = k_cache[tables].view(BATCH, context, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    v = v_cache[tables].view(BATCH, context, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    q = torch.randn(BATCH, HEADS, HEAD_DIM, generator=gen).to(dtype)
    batch = DecodeBatch(
        tables.to(torch.int32), torch.full((BATCH,), context, dtype=torch.int32), context
    )
    return {"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "q": q, "batch": batch}


def _measure(
    c: dict[str, torch.Tensor | DecodeBatch], kernel: decode.DecodeKernel | None, repeat: int
) -> tuple[float, float]:
    """Median seconds of (paged, sdpa) for one case, alternating the two."""
    q, batch, k_cache, v_cache = c["q"], c["batch"], c["k_cache"], c["v_cache"]
    k, v = c["k"], c["v"]
    assert isinstance(batch, DecodeBatch)
    assert isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor)
    assert isinstance(v_cache, torch.Tensor)
    assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    scale = HEAD_DIM**-0.5

    def paged() -> torch.Tensor:
        if kernel is not None:
            return kernel(q, k_cache, v_cache, batch, scale).to(q.dtype)
        return decode_attention_torch(q, k_cache, v_cache, batch, scale).to(q.dtype)

    def sdpa() -> torch.Tensor:
        # 4-D [B, H, 1, D] against [B, KVH, S, D]: torch's fused CPU kernel, GQA in place
        out = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)
        return out[:, :, 0]

    torch.testing.assert_close(paged(), sdpa(), atol=3e-2, rtol=3e-2)
    paged_s, sdpa_s = [], []
    for _ in range(repeat):  # alternate, so drift in machine load hits both alike
        paged_s.append(_time(paged))
        sdpa_s.append(_time(sdpa))
    return statistics.median(paged_s), statistics.median(sdpa_s)


def run(dtype: torch.dtype, repeat: int, use_kernel: bool) -> list[tuple[int, float, float]]:
    kernel = decode.load() if use_kernel else None
    gen = torch.Generator().manual_seed(0)
    return [(ctx, *_measure(_case(ctx, dtype, gen), kernel, repeat)) for ctx in CONTEXTS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--torch-fallback", action="store_true", help="paged via torch ops")
    record.add_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    path = "torch fallback" if args.torch_fallback else "C kernel"
    setting = (
        f"batch {BATCH}, heads {HEADS}/{KV_HEADS}, head dim {HEAD_DIM}, {args.dtype}, "
        f"{args.threads} thread(s), paged = {path}"
    )
    print(setting)
    print(f"{'context':>8} {'paged ms':>9} {'sdpa ms':>9} {'paged/sdpa':>11}")
    rows: list[list[record.Cell]] = []
    for context, paged_s, sdpa_s in run(dtype, args.repeat, not args.torch_fallback):
        print(f"{context:>8} {paged_s * 1e3:>9.3f} {sdpa_s * 1e3:>9.3f} {paged_s / sdpa_s:>11.2f}")
        paged_ms, sdpa_ms = round(paged_s * 1e3, 3), round(sdpa_s * 1e3, 3)
        rows.append([context, paged_ms, sdpa_ms, round(paged_s / sdpa_s, 2)])
    if args.record is not None:
        record.save(
            args.record or f"attention-{args.dtype}" + ("-torch" if args.torch_fallback else ""),
            f"Paged decode attention against SDPA over contiguous K/V, {args.dtype}",
            ["context", "paged ms", "sdpa ms", "paged / sdpa"],
            rows,
            f"One layer's decode step: {setting}; shuffled block tables of {BLOCK} tokens; "
            f"medians of {args.repeat} alternating runs; paged / sdpa below 1: paged faster.",
        )


if __name__ == "__main__":
    main()
