"""Measure the two constants of the preemption cost model (``preemption_mode="auto"``).

    OMP_NUM_THREADS=1 python benchmarks/bench_swap_cost.py [--dtype float32|bfloat16] [--record]

A preempted request costs either its recompute (its computed tokens prefilled again, batched
with other work) or a swap round trip (its blocks copied to the host pool and back). This script
measures, on the default model (SmolLM2-135M-Instruct) and this machine:

- ``recompute_s_per_token``: the marginal cost of one more prefill token, the slope of a line
  fitted to the time of one prefill step of 32 .. 512 tokens run through ``ModelRunner``;
- ``swap_s_per_block`` and ``swap_s_fixed``: slope and intercept of a line fitted to the time
  of one ``KVCache.transfer`` (device pool -> host pool) of 1 .. 256 blocks of 16 tokens.

It prints a ``PreemptionCostModel(...)`` to paste into ``pagekv/core/preemption.py``. Each point
is the median of 7 runs after a warm-up. On a CPU-only machine both pools live in host memory,
so a swap is a memcpy and wins by orders of magnitude; on a GPU the swap crosses PCIe and the
balance is closer. Rerun this script on the machine that serves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv.core import KVCacheManager, Plan, Request, ScheduledRequest
from pagekv.core.plan import BlockTransfers
from pagekv.core.preemption import PreemptionCostModel
from pagekv.models import load_model
from pagekv.runner.kv_cache import KVCache
from pagekv.runner.model_runner import ModelRunner
from pagekv.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

BLOCK_SIZE = 16
REPEATS = 7
PREFILL_SIZES = (32, 64, 128, 256, 512)
SWAP_SIZES = (1, 4, 16, 64, 256)


def median_s(run: Callable[[], object], repeats: int = REPEATS) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit_line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = slope * x + intercept``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return slope, my - slope * mx


def prefill_times(runner: ModelRunner, num_blocks: int) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for n in PREFILL_SIZES:
        kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
        request = Request("r", [(7 * i) % 1000 + 5 for i in range(n)], params)
        kv.allocate(request, n)
        entry = ScheduledRequest(request, 0, n, kv.block_table("r"))
        plan = Plan(1, (entry,), BlockTransfers())
        times.append(median_s(partial(runner.execute, plan)))
        print(f"  prefill {n:4d} tokens: {times[-1] * 1e3:8.2f} ms", flush=True)
    return times


def swap_times(device: KVCache, host: KVCache) -> list[float]:
    times = []
    for n in SWAP_SIZES:
        pairs = [(b, b) for b in range(n)]
        times.append(median_s(partial(device.transfer, host, pairs)))
        print(f"  swap out {n:4d} blocks: {times[-1] * 1e3:8.3f} ms", flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    record.add_argument(parser)
    args = parser.parse_args()
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    loaded = load_model(None, dtype)
    cfg = loaded.config
    num_blocks = max(*SWAP_SIZES, max(PREFILL_SIZES) // BLOCK_SIZE)
    runner = ModelRunner(loaded, num_blocks, BLOCK_SIZE, num_blocks)
    print(f"threads={torch.get_num_threads()} dtype={args.dtype} block_size={BLOCK_SIZE}")
    token_slope, token_fixed = fit_line(list(PREFILL_SIZES), prefill_times(runner, num_blocks))
    assert runner.host_kv is not None
    block_slope, block_fixed = fit_line(list(SWAP_SIZES), swap_times(runner.kv, runner.host_kv))
    block_bytes = KVCache.bytes_per_block(
        cfg.num_hidden_layers, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim, dtype
    )
    print(f"prefill: {token_slope * 1e6:.1f} us/token + {token_fixed * 1e3:.2f} ms/step")
    print(
        f"swap:    {block_slope * 1e6:.1f} us/block ({block_bytes / 1024:.0f} KiB) "
        f"+ {block_fixed * 1e6:.1f} us/transfer"
    )
    fitted = PreemptionCostModel(*(max(v, 0.0) for v in (token_slope, block_slope, block_fixed)))
    print(
        "PreemptionCostModel("
        f"recompute_s_per_token={fitted.recompute_s_per_token:.3g}, "
        f"swap_s_per_block={fitted.swap_s_per_block:.3g}, "
        f"swap_s_fixed={fitted.swap_s_fixed:.3g})"
    )
    if args.record is not None:
        setting = f"{args.dtype}, {torch.get_num_threads()} thread(s), blocks of {BLOCK_SIZE} "
        setting += f"tokens ({block_bytes / 1024:.0f} KiB)"
        save_record(args.record or "swap_cost", fitted, setting)


def save_record(name: str, fitted: PreemptionCostModel, setting: str) -> None:
    default = PreemptionCostModel()
    rows: list[list[record.Cell]] = [
        [label, f"{getattr(fitted, key) * 1e3:.3g} ms", f"{getattr(default, key) * 1e3:.3g} ms"]
        for label, key in (
            (
                f"prefill, per token (fit over {PREFILL_SIZES[0]}-{PREFILL_SIZES[-1]})",
                "recompute_s_per_token",
            ),
            ("device -> host, per block", "swap_s_per_block"),
            ("fixed, per call", "swap_s_fixed"),
        )
    ]
    record.save(
        name,
        "Preemption cost model: recompute against swap on this machine",
        ["constant", "measured", "PreemptionCostModel default"],
        rows,
        f"{setting}; medians of {REPEATS} runs, lines fitted by least squares; the default is "
        "what pagekv/core/preemption.py ships.",
    )


if __name__ == "__main__":
    main()
