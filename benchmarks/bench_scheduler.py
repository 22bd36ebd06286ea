"""Scheduling overhead: ``schedule()`` + ``update()`` per step with 256 running requests.

    python benchmarks/bench_scheduler.py [--record]

No model and no torch: a fake runner "samples" a fixed token for every request that reaches
the end of its tokens (building that dict is not timed). Invariant checks off. Each request has
a 64-token prompt and decodes until the run ends (ignore_eos, large max_tokens), so every
measured step is 256 decodes: the steady state of a full batch. Every 16th step all 256 requests
open a new block at once (lock-step decoding: the worst case for p99).

Scenarios: FCFS and priority policy on an ample pool; and FCFS on a pool ~2% too small for
the whole run, so requests are preempted (recompute) and resumed as it goes (the mean then
includes the preemption and re-admission work).

Each figure is the median of 5 repeats of 1,000 steps after 100 warm-up steps. Target: < 1 ms
mean per step. Besides wall-clock time (mean and p99) it reports CPU time of the process
(``time.process_time``, mean per step), which on a shared machine leaves out the time the OS
gave the core to someone else.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv.core import KVCacheManager, Request
from pagekv.core.scheduler import Scheduler, SchedulerConfig
from pagekv.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

NUM_REQUESTS = 256
PROMPT_TOKENS = 64
BLOCK_SIZE = 16
WARMUP_STEPS = 100
STEPS = 1000
REPEATS = 5
TARGET_MS = 1.0


def make_scheduler(num_blocks: int, policy: str) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE)
    config = SchedulerConfig(
        max_num_seqs=NUM_REQUESTS,
        max_num_batched_tokens=NUM_REQUESTS * PROMPT_TOKENS,
        block_size=BLOCK_SIZE,
        policy=policy,  # type: ignore[arg-type]
        preemption_log_interval_s=3600.0,
    )
    sched = Scheduler(config, kv)
    params = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        prompt = [(i * 7 + j) % 50_000 for j in range(PROMPT_TOKENS)]
        sched.add(Request(f"r{i}", prompt, params, priority=i % 4))
    return sched


def run(num_blocks: int, policy: str) -> tuple[float, float, float, int]:
    """(mean ms, p99 ms, mean CPU ms, preemptions) per schedule+update step, over STEPS."""
    sched = make_scheduler(num_blocks, policy)
    times: list[float] = []
    cpu_s = 0.0
    clock, cpu = time.perf_counter, time.process_time
    for step in range(WARMUP_STEPS + STEPS):
        start, start_cpu = clock(), cpu()
        plan = sched.schedule()
        mid, mid_cpu = clock(), cpu()
        sampled = {s.request.request_id: 1 for s in plan.scheduled if s.samples}
        resume, resume_cpu = clock(), cpu()
        sched.update(plan, sampled)
        end, end_cpu = clock(), cpu()
        if step >= WARMUP_STEPS:
            times.append((mid - start) + (end - resume))
            cpu_s += (mid_cpu - start_cpu) + (end_cpu - resume_cpu)
    c = sched.counters
    times.sort()
    mean = statistics.fmean(times) * 1e3
    p99 = times[int(0.99 * len(times))] * 1e3
    return mean, p99, cpu_s / STEPS * 1e3, c.preemptions_recompute + c.preemptions_swap


def median_of_repeats(num_blocks: int, policy: str) -> tuple[float, float, float, int]:
    results = []
    for _ in range(REPEATS):
        gc.collect()
        gc.disable()
        try:
            results.append(run(num_blocks, policy))
        finally:
            gc.enable()
    return (
        statistics.median(r[0] for r in results),
        statistics.median(r[1] for r in results),
        statistics.median(r[2] for r in results),
        results[0][3],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    record.add_argument(parser)
    args = parser.parse_args()
    total_tokens = PROMPT_TOKENS + WARMUP_STEPS + STEPS
    ample = NUM_REQUESTS * (total_tokens // BLOCK_SIZE + 2)
    tight = int(ample * 0.98)
    print(f"{NUM_REQUESTS} running requests, block_size {BLOCK_SIZE}, {STEPS} steps x {REPEATS}")
    print(f"{'scenario':<40} {'mean ms':>8} {'p99 ms':>8} {'CPU ms':>8} {'preemptions':>12}")
    rows: list[list[record.Cell]] = []
    for name, blocks, policy in [
        (f"fcfs, ample pool ({ample} blocks)", ample, "fcfs"),
        (f"priority, ample pool ({ample} blocks)", ample, "priority"),
        (f"fcfs, tight pool ({tight} blocks)", tight, "fcfs"),
    ]:
        mean, p99, cpu_ms, preemptions = median_of_repeats(blocks, policy)
        flag = "ok" if mean < TARGET_MS else "over target"
        print(f"{name:<40} {mean:8.3f} {p99:8.3f} {cpu_ms:8.3f} {preemptions:12d}  {flag}")
        rows.append([name, round(mean, 3), round(p99, 3), round(cpu_ms, 3), preemptions])
    if args.record is not None:
        record.save(
            args.record or "scheduler",
            "Scheduler overhead: schedule() + update() per step, 256 requests decoding",
            ["scenario", "mean wall ms", "p99 wall ms", "mean CPU ms", "preemptions"],
            rows,
            f"A fake runner, no torch; median of {REPEATS} x {STEPS} steps; target < "
            f"{TARGET_MS:g} ms mean; p99 is the steps where all 256 open a block at once.",
        )


if __name__ == "__main__":
    main()
