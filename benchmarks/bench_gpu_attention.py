"""Paged decode attention (Triton, through block tables) vs contiguous SDPA at the same shapes.

    python benchmarks/bench_gpu_attention.py            # on a CUDA GPU: bf16, batch 64-256,
                                                        # context 512-8192, Llama-8B heads
    python benchmarks/bench_gpu_attention.py --smoke    # tiny shapes, any machine (CPU tensors
                                                        # in Triton's interpreter): checks the
                                                        # script, measures nothing
    python benchmarks/bench_gpu_attention.py --sweep    # also every launch (keys per tile,
                                                        # warps, pipeline stages) per shape

Per shape: the median time of each, their ratio, and the bandwidth the paged kernel reaches
(K and V bytes read / time) against the device's peak (``--peak-gbs``; default: H200, 4800).
Physical blocks are a random permutation, so the table really scatters the reads.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagekv.kernels import triton_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def _time(fn, device: torch.device, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of ``fn()`` over ``repeats`` calls after two warm-up calls."""
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


SWEEP = [
    triton_attention.Launch(block_n=n, num_warps=w, num_stages=s)
    for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))
]


def run_shape(
    batch: int, context: int, device: torch.device, repeats: int, launches: list
) -> list[dict[str, float]]:
    """One row per launch: the paged kernel's time, SDPA's, the paged kernel's GB/s and its
    largest difference from SDPA."""
    dtype = torch.bfloat16
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype, device=device)
    scale = HEAD_DIM**-0.5
    # the same K/V laid out contiguously per sequence, for SDPA: [B, KVH, S, D]
    k = k_cache[tables.long()].reshape(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = v_cache[tables.long()].reshape(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
    k, v = k.contiguous(), v.contiguous()

    def paged(launch: triton_attention.Launch) -> torch.Tensor:
        return triton_attention.paged_attention(
            q, k_cache, v_cache, tables, seq_lens, starts, 1, scale, launch=launch
        )

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k, v, scale=scale, enable_gqa=True
        )

    expected = sdpa()[:, :, 0].float()
    t_sdpa = _time(sdpa, device, repeats)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize
    rows = []
    for launch in launches:
        error = float((paged(launch).float() - expected).abs().max())
        t_paged = _time(lambda launch=launch: paged(launch), device, repeats)
        gbs = kv_bytes / t_paged / 1e9
        rows.append({"paged_s": t_paged, "sdpa_s": t_sdpa, "gbs": gbs, "err": error})
    return rows


def _describe(launch: triton_attention.Launch) -> str:
    return f"{launch.block_n} keys, {launch.num_warps} warps, {launch.num_stages} stages"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; measures nothing")
    parser.add_argument("--peak-gbs", type=float, default=4800.0, help="the device's bandwidth")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="every launch in SWEEP per shape")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shapes = [(2, 64)] if args.smoke else [(b, c) for b in (64, 256) for c in (512, 2048, 8192)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    print(f"device: {name}; bf16; {HEADS} heads over {KV_HEADS} KV heads, head_dim {HEAD_DIM}")
    print("| batch | context | launch | paged (ms) | SDPA (ms) | paged / SDPA | GB/s | of peak "
          "| max err |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = False
    for batch, context in shapes:
        launches = [triton_attention.Launch.for_step(1, context)]  # the runner's choice first
        if args.sweep:
            launches += [x for x in SWEEP if x not in launches]
        rows = run_shape(batch, context, device, 1 if args.smoke else args.repeats, launches)
        for launch, r in zip(launches, rows, strict=True):
            print(
                f"| {batch} | {context} | {_describe(launch)} | {r['paged_s'] * 1e3:.3f} | "
                f"{r['sdpa_s'] * 1e3:.3f} | {r['paged_s'] / r['sdpa_s']:.2f}x | {r['gbs']:.0f} | "
                f"{r['gbs'] / args.peak_gbs:.0%} | {r['err']:.3f} |",
                flush=True,
            )
            if r["err"] > 0.05:
                print(f"{_describe(launch)}: differs from SDPA by {r['err']}", file=sys.stderr)
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
