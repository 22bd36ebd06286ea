"""Microbenchmark of pagekv.core's hot paths (no torch; invariant checks off).

    python benchmarks/bench_core.py [--record]

(a) BlockPool(num_blocks=65536, block_size=16): single-block ``allocate_one`` / ``free([b])``
    calls per second (one call = one op), and blocks per second for batched
    ``allocate(n)`` / ``free(list)``.
(b) ``KVCacheManager.append_slots`` for 256 decoding requests per step: each request sets
    ``num_computed_tokens``, appends one token and calls ``append_slots(req, 1)``; mean and p99
    microseconds per step over ~2000 steps.

Each figure is the median of 5 repeats after a warm-up. Targets: >= 1,000,000 single-block
ops/s; < 500 us per 256-request step.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv.core import BlockPool, KVCacheManager, Request
from pagekv.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

NUM_BLOCKS = 65536
BLOCK_SIZE = 16
REPEATS = 5
TARGET_OPS = 1_000_000
TARGET_STEP_US = 500.0


def best_of(run: Callable[[], float], repeats: int = REPEATS) -> float:
    """Median of ``repeats`` runs of ``run`` (which returns a rate or a time), after a warm-up."""
    run()
    gc.collect()
    gc.disable()
    try:
        return statistics.median(run() for _ in range(repeats))
    finally:
        gc.enable()


def single_block_ops_per_s() -> float:
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
    allocate_one, free = pool.allocate_one, pool.free
    n = NUM_BLOCKS

    def run() -> float:
        start = time.perf_counter()
        blocks = [allocate_one() for _ in range(n)]
        for b in blocks:
            free([b])
        return 2 * n / (time.perf_counter() - start)

    return best_of(run)


def batched_blocks_per_s(batch: int) -> float:
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
    num_batches = NUM_BLOCKS // batch

    def run() -> float:
        start = time.perf_counter()
        held = [pool.allocate(batch) for _ in range(num_batches)]
        for blocks in held:
            pool.free(blocks)
        return 2 * num_batches * batch / (time.perf_counter() - start)

    return best_of(run)


def append_slots_step_us(
    num_requests: int = 256, num_steps: int = 2000, prompt_tokens: int = 100
) -> tuple[float, float]:
    """Mean and p99 microseconds of one decode step over ``num_requests`` requests."""
    params = SamplingParams(max_tokens=num_steps + 1)
    blocks_per_request = -(-(prompt_tokens + num_steps + 1) // BLOCK_SIZE)
    # Every repeat starts from a fresh manager, so the pool never runs out mid-run.
    num_blocks = num_requests * blocks_per_request

    def run() -> tuple[float, float]:
        mgr = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
        requests = []
        for i in range(num_requests):
            r = Request(f"r{i}", [i % 50_000, *range(prompt_tokens - 1)], params)
            hits = mgr.allocate(r, prompt_tokens)
            assert hits == 0
            r.num_computed_tokens = prompt_tokens
            r.append_token(1)
            requests.append(r)
        append_slots = mgr.append_slots
        step_times = []
        perf_counter = time.perf_counter
        for step in range(num_steps):
            start = perf_counter()
            for r in requests:
                r.num_computed_tokens += 1  # the previous step's token is now computed
                r.append_token(step)  # the token it sampled
                if not append_slots(r, 1):
                    raise RuntimeError("pool too small for the benchmark")
            step_times.append(perf_counter() - start)
        step_times.sort()
        mean = statistics.fmean(step_times) * 1e6
        p99 = step_times[int(0.99 * (len(step_times) - 1))] * 1e6
        return mean, p99

    run()  # warm-up
    gc.collect()
    gc.disable()
    try:
        results = [run() for _ in range(REPEATS)]
    finally:
        gc.enable()
    return (
        statistics.median(m for m, _ in results),
        statistics.median(p for _, p in results),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    record.add_argument(parser)
    args = parser.parse_args()
    single = single_block_ops_per_s()
    batched = {n: batched_blocks_per_s(n) for n in (16, 256)}
    mean_us, p99_us = append_slots_step_us()
    rows = [
        (
            "allocate_one + free([b])",
            f"{single:,.0f} ops/s",
            f">= {TARGET_OPS:,}",
            single >= TARGET_OPS,
        ),
        *(
            (f"allocate({n}) + free(list)", f"{rate:,.0f} blocks/s", "", None)
            for n, rate in batched.items()
        ),
        (
            "append_slots, 256 requests: mean",
            f"{mean_us:,.1f} us/step",
            f"< {TARGET_STEP_US:.0f} us",
            mean_us < TARGET_STEP_US,
        ),
        (
            "append_slots, 256 requests: p99",
            f"{p99_us:,.1f} us/step",
            f"< {TARGET_STEP_US:.0f} us",
            p99_us < TARGET_STEP_US,
        ),
    ]
    print(f"pagekv.core microbenchmark (Python {sys.version.split()[0]}, median of {REPEATS})")
    print(f"{'measure':<34} {'result':>22} {'target':>14}  ok")
    table: list[list[record.Cell]] = [
        [name, result, target, "" if ok is None else ("yes" if ok else "NO")]
        for name, result, target, ok in rows
    ]
    for name, result, target, verdict in table:
        print(f"{name:<34} {result:>22} {target:>14}  {verdict}")
    if args.record is not None:
        save_record(args.record or "core", table)


def save_record(name: str, table: list[list[record.Cell]]) -> None:
    record.save(
        name,
        "Core memory manager: block pool and append_slots",
        ["measure", "result", "target", "ok"],
        table,
        f"BlockPool(num_blocks={NUM_BLOCKS}, block_size={BLOCK_SIZE}), no torch, invariant "
        f"checks off, median of {REPEATS} after a warm-up; append_slots: 256 requests decoding "
        "in lock-step (every 16th step all open a block: the p99).",
    )


if __name__ == "__main__":
    main()
