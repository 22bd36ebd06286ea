"""Simulated vs real throughput on the standard ``random`` workload, at block sizes 16 and 32.

For each block size: the real engine (``LLMEngine``, float32, one torch thread) steps the 64
``random`` requests (all queued at t = 0, greedy, ignore_eos, exactly ``output_len`` tokens) to
the end and its throughput is timed; then the simulator replays the same token ids through the
same scheduler settings, with a cost model instead of the model, and the ratio sim / real is
printed. The engine's every step is recorded too (its plan's shape and wall time), so the
report can also say how well the cost model predicts the steps the engine actually ran, apart
from any difference in scheduling (there should be none: same core, same requests).

    OMP_NUM_THREADS=1 python benchmarks/bench_sim_calibration.py [--block-sizes 16,32]
        [--cost FILE | --calibrate] [--num-requests N] [--json-out FILE] [--record]

``--calibrate`` first fits a cost model in this process (``pagekv sim calibrate``'s grid);
without it the shipped default is used. Cost models are calibrated in process CPU seconds, so
the real engine is timed both ways: wall time (what a user waits; on a shared machine it
stretches with the neighbours' load) and the
process's CPU time (what the steps cost on an otherwise idle core; the like-for-like figure).
Takes minutes per block size, more on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pagekv.bench.workloads import random_workload
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.sampling_params import SamplingParams
from pagekv.sim.calibrate import CalibrationSettings, calibrate
from pagekv.sim.cost_model import CostModel, StepShape
from pagekv.sim.simulator import SimConfig, simulate
from pagekv.sim.workload import from_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

KV_CACHE_MEMORY = "2GiB"  # as pagekv.bench's offline runs


def _greedy(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def run_real(block_size: int, prompts: list[list[int]], output_lens: list[int]) -> dict:
    engine = LLMEngine(
        EngineConfig(block_size=block_size, kv_cache_memory=KV_CACHE_MEMORY, dtype="float32")
    )
    engine.add_request("warmup", list(range(100, 164)), _greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    for i, (prompt, out_len) in enumerate(zip(prompts, output_lens, strict=True)):
        engine.add_request(f"req-{i}", prompt, _greedy(out_len))
    schedule, shapes = engine.scheduler.schedule, []

    def recording_schedule():  # type: ignore[no-untyped-def]
        plan = schedule()
        shapes.append(StepShape.of_plan(plan))
        return plan

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    steps_s: list[float] = []
    start, start_cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        t = time.process_time()
        engine.step()
        steps_s.append(time.process_time() - t)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    return {
        "elapsed_s": elapsed,
        "cpu_s": cpu,
        "throughput": sum(output_lens) / elapsed,
        "cpu_throughput": sum(output_lens) / cpu,
        "num_steps": len(steps_s),
        "num_kv_tokens": engine.kv.pool.num_blocks * block_size,
        "max_model_len": engine.max_model_len,
        "steps": [[*asdict(s).values(), dt] for s, dt in zip(shapes, steps_s, strict=True)],
        "shapes": shapes,
        "steps_s": steps_s,
    }


def run_sim(
    block_size: int, prompts: list[list[int]], output_lens: list[int], real: dict, cost: CostModel
) -> dict:
    config = SimConfig(
        block_size=block_size,
        num_kv_tokens=real["num_kv_tokens"],
        max_model_len=real["max_model_len"],
    )
    start = time.perf_counter()
    result = simulate(from_prompts(prompts, output_lens), config, cost)
    return {
        "throughput": result.throughput,
        "sim_time_s": result.sim_time_s,
        "num_steps": result.num_steps,
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-sizes", default="16,32")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--cost", default=None, help="cost model JSON (default: shipped)")
    source.add_argument("--calibrate", action="store_true", help="fit one here first")
    parser.add_argument("--num-requests", type=int, default=64, help="a prefix of the workload")
    parser.add_argument("--json-out", default=None)
    record.add_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    workload = random_workload()
    requests = workload.requests[: args.num_requests]
    prompts = [r.prompt_token_ids for r in requests]
    output_lens = [r.output_len for r in requests]
    if args.calibrate:
        cost, _ = calibrate(CalibrationSettings(), log=print)
    else:
        cost = CostModel.load(args.cost) if args.cost else CostModel.default()
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, torch threads 1")
    print(f"cost model: {cost.meta.get('measured')} ({cost.meta.get('grid')})")
    rows = []
    for block_size in [int(b) for b in args.block_sizes.split(",")]:
        real = run_real(block_size, prompts, output_lens)
        sim = run_sim(block_size, prompts, output_lens, real, cost)
        predicted = sum(cost.step_s(s) for s in real["shapes"])
        row = {
            "block_size": block_size,
            "real_tok_s": real["throughput"],
            "real_cpu_tok_s": real["cpu_throughput"],
            "sim_tok_s": sim["throughput"],
            "ratio": sim["throughput"] / real["throughput"],
            "cpu_ratio": sim["throughput"] / real["cpu_throughput"],
            "real_s": real["elapsed_s"],
            "real_cpu_s": real["cpu_s"],
            "sim_s": sim["sim_time_s"],
            "cost_of_real_plans_s": predicted,
            "real_steps": real["num_steps"],
            "sim_steps": sim["num_steps"],
            "sim_wall_s": sim["wall_s"],
            "real_step_log": real["steps"],
        }
        rows.append(row)
        print(
            f"block {block_size:>3}: real {row['real_tok_s']:.2f} tok/s wall "
            f"({real['elapsed_s']:.0f} s), {row['real_cpu_tok_s']:.2f} tok/s CPU "
            f"({real['cpu_s']:.0f} s), {real['num_steps']} steps | sim {row['sim_tok_s']:.2f} "
            f"tok/s ({sim['sim_time_s']:.0f} simulated s, {sim['num_steps']} steps) | sim/real "
            f"{row['ratio']:.3f} wall, {row['cpu_ratio']:.3f} CPU | cost model on the engine's "
            f"own plans: {predicted:.0f} s = {predicted / real['cpu_s']:.3f} of its CPU time",
            flush=True,
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"cost": json.loads(cost.to_json()), "rows": rows}, f)
    if args.record is not None:
        save_record(
            args.record or "sim_calibration", rows, "fitted here" if args.calibrate else args.cost
        )


def save_record(name: str, rows: list[dict[str, Any]], cost_source: str | None) -> None:
    def rate(tok_s: float, seconds: float) -> str:
        return f"{tok_s:.2f} tok/s ({seconds:.0f} s)"

    table: list[list[record.Cell]] = [
        [
            row["block_size"],
            rate(row["real_tok_s"], row["real_s"]),
            rate(row["real_cpu_tok_s"], row["real_cpu_s"]),
            rate(row["sim_tok_s"], row["sim_s"]),
            round(row["ratio"], 3),
            f"{row['real_steps']} / {row['sim_steps']}",
        ]
        for row in rows
    ]
    record.save(
        name,
        "Simulator against the real engine on `random`",
        [
            "block size",
            "real, wall",
            "real, CPU",
            "simulated",
            "sim / real (wall)",
            "steps real / sim",
        ],
        table,
        f"Real LLMEngine float32, 1 thread, {KV_CACHE_MEMORY} of KV; cost model "
        f"{cost_source or 'shipped (pagekv/sim/default_cost.json)'}; sim / real 1.0 is exact, "
        "the target within 15%.",
    )


if __name__ == "__main__":
    main()
