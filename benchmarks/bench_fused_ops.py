"""Fused layer ops (``kernels/fused_ops.py``) against torch ops, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_fused_ops.py [--steps 15] [--rounds 2] [--record]

1. One decode step of the default model in bfloat16: 64 requests with ~300-token prompts are
   prefilled, then decode steps alternate between torch ops and fused ops on the same engine
   (``model.use_layer_ops``); medians of ``engine.step()`` and of the model forward alone.
   Also the ops alone at the decode shapes (one layer's worth, per call).
2. End to end: ``pagekv bench --workload random --dtype bfloat16 --num-threads 1`` in fresh
   processes, ``PAGEKV_FUSED_OPS=0`` and ``=1`` alternating, ``--rounds`` each.

The machine is noisy (shared hyperthreads), so everything alternates and reports medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.kernels import fused_ops
from pagekv.models.layer_ops import TORCH_OPS, LayerOps
from pagekv.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

BATCH, PROMPT_TOKENS = 64, 300
SUMMARY_KEYS = ("elapsed_s", "output_tokens_per_s", "tpot_p50_ms")


def _median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:8.2f} ms"


def _decoding_engine() -> LLMEngine:
    """64 requests, every one past its prefill: each further step() is a pure decode step."""
    engine = LLMEngine(EngineConfig(dtype="bfloat16", max_num_seqs=BATCH))
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i in range(BATCH):
        ids = torch.randint(100, 10000, (PROMPT_TOKENS + i % 7,), generator=gen).tolist()
        engine.add_request(f"r{i}", ids, params)
    generated: set[str] = set()
    while len(generated) < BATCH:
        generated.update(out.request_id for out in engine.step())
    engine.step()  # the last prefill chunks' requests decode once too
    return engine


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


Row = list[record.Cell]  # measure, torch ops, fused ops, speed-up (times faster fused)


def decode_step(steps: int, fused: LayerOps) -> list[Row]:
    engine = _decoding_engine()
    model = engine.runner.model
    ops: dict[str, LayerOps] = {"torch": TORCH_OPS, "fused": fused}
    step: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(steps):
        for name, layer_ops in ops.items():
            model.use_layer_ops(layer_ops)
            step[name].append(_timed(engine.step))
    print(f"decode step, bf16, batch {BATCH}, context ~{PROMPT_TOKENS}, {steps} steps each:")
    for name in ops:
        print(f"  engine.step() {name:5s} {_median_ms(step[name])}")
    torch_ms, fused_ms = (statistics.median(step[name]) * 1e3 for name in ops)
    print(f"  speed-up {torch_ms / fused_ms:.3f}x")
    engine.close()
    measure = f"engine.step(), bf16 decode, batch {BATCH}, ms"
    rows: list[Row] = [
        [measure, round(torch_ms, 2), round(fused_ms, 2), round(torch_ms / fused_ms, 3)]
    ]
    return rows + ops_alone(model.config.hidden_size, model.config.intermediate_size, fused)


def ops_alone(hidden: int, inter: int, fused: LayerOps, repeat: int = 200) -> list[Row]:
    """One layer's elementwise work at batch 64 (2 norms, rope+split, silu*up), per call."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).bfloat16()

    x, res, w = rand(BATCH, hidden), rand(BATCH, hidden), rand(hidden)
    qkv, gate_up = rand(BATCH, 15 * 64), rand(BATCH, 2 * inter)
    cos, sin = torch.rand(BATCH, 32), torch.rand(BATCH, 32)
    work: dict[str, Callable[[LayerOps], object]] = {
        "add_rms_norm": lambda o: o.add_rms_norm(x, res, w, 1e-5),
        "split_rope": lambda o: o.split_rope(qkv, cos, sin, 9, 3),
        "silu_mul": lambda o: o.silu_mul(gate_up),
    }
    print(f"ops alone, bf16, {BATCH} tokens (median of 7 x {repeat} calls):")
    rows: list[Row] = []
    for name, fn in work.items():
        us = []
        for ops in (TORCH_OPS, fused):
            times = [_timed(lambda o=ops, f=fn: [f(o) for _ in range(repeat)]) for _ in range(7)]
            us.append(statistics.median(times) / repeat * 1e6)
        print(f"  {name:13s} torch {us[0]:7.1f} us   fused {us[1]:7.1f} us")
        measure = f"{name} alone, bf16, {BATCH} tokens, us a call"
        rows.append([measure, round(us[0], 1), round(us[1], 1), round(us[0] / us[1], 2)])
    return rows


def end_to_end(rounds: int) -> list[Row]:
    results: dict[str, list[dict[str, float]]] = {"0": [], "1": []}
    for _ in range(rounds):
        for flag in ("0", "1"):
            results[flag].append(_bench_once(flag))
    print("pagekv bench --workload random --dtype bfloat16 --num-threads 1:")
    for flag, runs in results.items():
        for run in runs:
            shown = ", ".join(f"{k} {v:.2f}" for k, v in run.items())
            print(f"  PAGEKV_FUSED_OPS={flag}: {shown}")
    rows: list[Row] = []
    for key in SUMMARY_KEYS:
        off = statistics.median(r[key] for r in results["0"])
        on = statistics.median(r[key] for r in results["1"])
        print(f"  median {key}: off {off:.2f}, on {on:.2f} ({on / off:.3f}x)")
        faster = on / off if key.endswith("_per_s") else off / on
        measure = f"pagekv bench random bf16, 1 thread: {key}"
        rows.append([measure, round(off, 2), round(on, 2), round(faster, 3)])
    return rows


def _bench_once(flag: str) -> dict[str, float]:
    env = {**os.environ, "PAGEKV_FUSED_OPS": flag, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "pagekv.cli", "bench", "--workload", "random"]
        cmd += ["--dtype", "bfloat16", "--num-threads", "1", "--json-out", str(out)]
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        data = json.loads(out.read_text())
    return {
        "elapsed_s": data["elapsed_s"],
        "output_tokens_per_s": data["output_tokens_per_s"],
        "total_tokens_per_s": data["total_tokens_per_s"],
        "tpot_p50_ms": data["tpot_ms"]["p50"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="decode steps per mode")
    parser.add_argument("--rounds", type=int, default=2, help="end-to-end runs per mode")
    parser.add_argument("--skip-end-to-end", action="store_true")
    record.add_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fused = fused_ops.load()
    if fused is None:
        sys.exit("fused ops unavailable (no compiler, or PAGEKV_FUSED_OPS=0)")
    rows = decode_step(args.steps, fused)
    if not args.skip_end_to_end:
        rows += end_to_end(args.rounds)
    if args.record is not None:
        record.save(
            args.record or "fused_ops",
            "Fused layer ops (C) against torch ops",
            ["measure", "torch ops", "fused ops", "speed-up"],
            rows,
            f"One thread; medians of {args.steps} alternating decode steps, and of "
            f"{args.rounds} alternating runs per mode end to end (PAGEKV_FUSED_OPS=0 / 1); "
            "speed-up: how many times faster the fused ops are (above 1: faster).",
        )


if __name__ == "__main__":
    main()
