"""Time to first token with the shared prefix only in the storage tier, vs cold recompute.

    python benchmarks/bench_tiers.py [--kv-store SPEC] [--requests 6] [--dtype float32] [--record]

Workload: every request is one 2,000-token system prompt plus a unique 50-token
question (raw token ids from ``numpy.random.default_rng(0)``, as in benchmarks/workloads.py),
one greedy output token. A writer engine puts the prompt's blocks into the store first. Then,
alternating in one run so the machine's noise hits both alike:

    cold      a fresh engine with no storage tier recomputes the whole prompt
    storage   a fresh engine (empty device and host cache) with the store: the prefix arrives
              from storage (prefetched into host blocks, copied in), only the question computes
    slow      the same store behind a 0.3 s delay per call: loading would be slower than
              recomputing, and the scheduler must choose to recompute (``load_skipped``)

Each mode measures ``--requests`` requests, one at a time, with the device and host caches
reset before each, so every request of ``storage`` really loads from storage. Reports the
median TTFT per mode and the ratios, and the tier counters that show what happened.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.models.loader import LoadedModel, load_model
from pagekv.sampling_params import SamplingParams
from pagekv.tiering.faults import SlowStore
from pagekv.tiering.registry import open_store

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

PREFIX_LEN, QUESTION_LEN = 2000, 50
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def workload(num_requests: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 10000, size=PREFIX_LEN, endpoint=True).tolist()
    questions = rng.integers(100, 10000, size=(num_requests, QUESTION_LEN), endpoint=True)
    return [prefix + q.tolist() for q in questions]


def ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    engine.reset_prefix_cache()  # device and host forget: only storage may help
    start = time.perf_counter()
    engine.add_request(rid, prompt, ONE_TOKEN)
    while not engine.step():
        pass
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def engine_for(loaded: LoadedModel, dtype: str, store: Any) -> LLMEngine:
    config = EngineConfig(
        dtype=dtype,
        num_kv_blocks=256,
        host_cache_memory="512MiB" if store is not None else 0,
        kv_store=store,
        enable_prefix_caching=True,
    )
    return LLMEngine(config, loaded)


def save_record(name: str, args: argparse.Namespace, rows: list[list[record.Cell]]) -> None:
    record.save(
        name,
        "Time to first token with a shared prefix in the storage tier against recomputing it",
        ["mode", "median TTFT s", "min s", "max s", "vs cold"],
        rows,
        f"{args.requests} requests of a {PREFIX_LEN}-token prefix + {QUESTION_LEN} own tokens, "
        f"{args.dtype}, caches reset before each; cold: no storage tier (the baseline); "
        "storage: the prefix loaded from the store; slow: the store 0.3 s a call, so the "
        "scheduler must recompute.",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-store", default=None, help="default: a fresh file store")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    record.add_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = args.kv_store or f"file:{tempfile.mkdtemp(prefix='pagekv-bench-')}"
    loaded = load_model(None, torch.float32 if args.dtype == "float32" else torch.bfloat16)
    prompts = workload(args.requests)

    writer = engine_for(loaded, args.dtype, spec)
    ttft(writer, "fill", prompts[0])
    writer.close()  # flushes the writes

    cold = engine_for(loaded, args.dtype, None)
    stored = engine_for(loaded, args.dtype, spec)
    slow = engine_for(loaded, args.dtype, SlowStore(open_store(spec), delay_s=0.3))
    times: dict[str, list[float]] = {"cold": [], "storage": [], "slow": []}
    for i, prompt in enumerate(prompts):  # alternate, so noise hits every mode alike
        times["cold"].append(ttft(cold, f"c{i}", prompt))
        times["storage"].append(ttft(stored, f"s{i}", prompt))
        times["slow"].append(ttft(slow, f"w{i}", prompt))

    med = {mode: statistics.median(ts) for mode, ts in times.items()}
    print(f"store {spec}, {args.dtype}, {args.requests} requests of {PREFIX_LEN}+{QUESTION_LEN}")
    print(f"{'mode':<10}{'median TTFT s':>15}{'min':>9}{'max':>9}{'vs cold':>10}")
    rows: list[list[record.Cell]] = []
    for mode, ts in times.items():
        print(
            f"{mode:<10}{med[mode]:>15.3f}{min(ts):>9.3f}{max(ts):>9.3f}"
            f"{med['cold'] / med[mode]:>9.2f}x"
        )
        row: list[record.Cell] = [mode, round(med[mode], 3), round(min(ts), 3), round(max(ts), 3)]
        rows.append([*row, f"{med['cold'] / med[mode]:.2f}x"])
    if args.record is not None:
        save_record(args.record or "tiers", args, rows)
    for name, engine in (("storage", stored), ("slow", slow)):
        stats = engine.stats()
        keys = (
            "storage_hit_blocks",
            "storage_hit_bytes",
            "host_hit_blocks",
            "load_waits",
            "loads_arrived",
            "load_give_ups",
            "load_skipped",
            "storage_load_failures",
        )
        print(f"{name}: " + ", ".join(f"{k}={stats[k]}" for k in keys))
        engine.close()


if __name__ == "__main__":
    main()
