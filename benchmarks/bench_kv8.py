"""KV blocks in 8 bits against bf16 blocks on the same weights: one stream's decode rate at long
contexts, the offline ``random`` workload's throughput, and the tokens a GiB of KV memory holds.

    python benchmarks/bench_kv8.py [--contexts 4096,8192] [--kv-dtypes auto,int8,fp8]
                                   [--new-tokens 64] [--rounds 3] [--model GGUF] [--record]

One engine per KV dtype (``--kv-cache-dtype``; auto: the model's bf16), all on the default
model in bfloat16 with its GGUF blocks kept (unless ``--model``), side by side in one process;
rounds alternate over the engines so the machine's drift hits all alike, and each figure is the
median over rounds. A stream: a prompt of CONTEXT - NEW token ids, then NEW (``--new-tokens``)
greedy tokens, so that its context reaches CONTEXT (decode tok/s over the steps after the first
token).
``random``: ``pagekv bench``'s offline workload (64 requests, 32-512 prompt tokens, 16-256 new),
output tok/s over one pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv.bench.offline import run_offline, warm_up
from pagekv.bench.workloads import random_workload
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.kernels import isa
from pagekv.models.loader import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from bench_single_stream import one_request

COLUMNS = ["KV dtype", "workload", "tok/s", "vs bf16 KV", "KV tokens / GiB", "vs bf16 KV "]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,8192")
    parser.add_argument("--kv-dtypes", default="auto,int8,fp8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-random", action="store_true", help="skip the random workload")
    record.add_argument(parser)
    args = parser.parse_args()
    model = args.model or default_model_path()
    contexts = [int(c) for c in args.contexts.split(",")]
    engines: dict[str, LLMEngine] = {}
    for kv in args.kv_dtypes.split(","):
        config = EngineConfig(
            model=model,
            dtype=args.dtype,
            kv_cache_dtype=kv,
            enable_prefix_caching=False,
            max_num_batched_tokens=8192,
        )
        engines[kv] = LLMEngine(config)
        print(engines[kv].system_line, file=sys.stderr)
        warm_up(engines[kv])
    streams: dict[tuple[str, int], list[float]] = {(kv, c): [] for kv in engines for c in contexts}
    randoms: dict[str, list[float]] = {kv: [] for kv in engines}
    workload = random_workload()
    for _ in range(args.rounds):
        for kv, engine in engines.items():
            for context in contexts:
                prompt = [(17 + 31 * i) % 40000 + 100 for i in range(context - args.new_tokens)]
                streams[kv, context].append(one_request(engine, prompt, args.new_tokens)[1])
            if not args.no_random:
                result = run_offline(engine, workload)
                randoms[kv].append(result.num_output_tokens / result.elapsed_s)
    rows = table(engines, streams, randoms, contexts)
    setting = (
        f"{os.path.basename(model)} in {args.dtype}, {torch.get_num_threads()} thread(s); "
        f"a stream: CONTEXT - {args.new_tokens} prompt tokens, then {args.new_tokens} greedy "
        f"tokens; median of {args.rounds}"
    )
    print(f"CPU: {isa.cpu_name()}, {os.cpu_count()} CPUs; {setting}")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    if args.record is not None:
        record.save(
            args.record or "kv8",
            "KV blocks in 8 bits against bf16 blocks",
            COLUMNS,
            rows,
            setting + ".",
        )


def table(
    engines: dict[str, LLMEngine],
    streams: dict[tuple[str, int], list[float]],
    randoms: dict[str, list[float]],
    contexts: list[int],
) -> list[list[record.Cell]]:
    """A row per (KV dtype, workload): its median rate and its ratio to the auto (bf16) row."""
    per_gib = {kv: round(e.stats()["kv_tokens_per_gib"]) for kv, e in engines.items()}
    base = next(iter(engines))
    rows: list[list[record.Cell]] = []
    workloads = [f"one stream at {c} tokens" for c in contexts] + (
        ["random"] if randoms[base] else []
    )
    for kv in engines:
        name = "bf16 (auto)" if kv == "auto" else kv
        for index, workload in enumerate(workloads):
            runs = randoms[kv] if workload == "random" else streams[kv, contexts[index]]
            base_runs = randoms[base] if workload == "random" else streams[base, contexts[index]]
            rate = statistics.median(runs)
            ratio = rate / statistics.median(base_runs)
            rows.append(
                [
                    name,
                    workload,
                    round(rate, 1),
                    f"{ratio:.2f}x",
                    per_gib[kv],
                    f"{per_gib[kv] / per_gib[base]:.2f}x",
                ]
            )
    return rows


if __name__ == "__main__":
    main()
