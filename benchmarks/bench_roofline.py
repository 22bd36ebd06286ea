"""``pagekv bench roofline`` for several workloads and dtypes in one table, which it can record.

    python benchmarks/bench_roofline.py [--workloads random,prefix] [--dtypes bfloat16,float32]
                                        [--num-threads N] [--record]

Measures this machine's peaks once (``pagekv.bench.roofline``: float32 FMAs, bf16 dot
products, memory read) and sets each workload's least work against them: the floor is
max(work / peak, bytes / bandwidth), nothing can run faster here. Where ``benchmarks/results/``
holds a ``compare.py`` record of the same workload and dtype against vLLM-CPU, pagekv's and
vLLM-CPU's measured medians are set against the floor too (``1.65x`` = a pass takes 1.65 times
the floor).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv.bench import roofline
from pagekv.bench.workloads import load_workload
from pagekv.models import read_config
from pagekv.models.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

COLUMNS = ["workload", "dtype", "least work", "floor", "pagekv measured", "vLLM-CPU measured"]


def measured_tok_s(workload: str, dtype: str) -> tuple[str, dict[str, float]]:
    """The first ``compare-WORKLOAD-DTYPE-vs-...vllm...`` record's median rates per engine, and
    its name ("" and {} when there is none)."""
    for path in sorted(record.RESULTS_DIR.glob(f"compare-{workload}-{dtype}-vs-*.json")):
        if "vllm" in path.stem.split("-vs-")[1]:
            rows = record.load(path).rows
            return path.stem, {str(r[0]): float(r[1]) for r in rows if isinstance(r[1], float)}
    return "", {}


def against_floor(tok_s: float | None, output_tokens: int, floor_s: float | None) -> str | None:
    if tok_s is None or floor_s is None:
        return None
    seconds = output_tokens / tok_s
    return f"{seconds:.1f} s: {seconds / floor_s:.2f}x"


def row_for(
    name: str, dtype: str, config: ModelConfig, peaks: roofline.Peaks
) -> tuple[list[record.Cell], str]:
    """The workload's row, and the compare record its measured rates come from ("": none)."""
    workload = load_workload(name)
    cache_bytes = roofline.last_level_cache_bytes()
    work = roofline.count_work(config, workload, dtype, cache_bytes=cache_bytes)
    floor, tokens = roofline.floor_seconds(work, peaks, dtype), work.output_tokens
    least = f"{work.flops / 1e12:.2f} TFLOP, {work.weight_bytes / 1e9:.1f} GB of weights + "
    least += f"{work.kv_bytes / 1e9:.1f} GB of K/V"
    floor_cell = "not measured" if floor is None else f"{floor:.2f} s ({tokens / floor:,.0f} tok/s)"
    source, rates = measured_tok_s(name, dtype)
    measured = [against_floor(rates.get(engine), tokens, floor) for engine in ("pagekv", "vllm")]
    return [name, dtype, least, floor_cell, *measured], source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="random,prefix")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--model", default=None, help="GGUF (default: the default model)")
    parser.add_argument("--num-threads", type=int, default=len(os.sched_getaffinity(0)))
    record.add_argument(parser)
    args = parser.parse_args()
    config = read_config(args.model)
    peaks = roofline.measure_peaks(args.num_threads)
    pairs = itertools.product(args.workloads.split(","), args.dtypes.split(","))
    rows, sources = zip(
        *(row_for(name, dtype, config, peaks) for name, dtype in pairs), strict=True
    )
    machine = f"{peaks.threads} thread(s): float32 FMA {giga(peaks.f32_flops)} GFLOPS, bf16 dot "
    machine += f"{giga(peaks.bf16_flops)} GFLOPS, memory read {giga(peaks.read_bytes)} GB/s"
    print(machine + (f" ({peaks.note})" if peaks.note else ""))
    print(f"| {' | '.join(COLUMNS)} |")
    print("|" + " --- |" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join("" if c is None else str(c) for c in row) + " |")
    if args.record is not None:
        used = sorted(set(sources) - {""})
        note = machine + (f" ({peaks.note})" if peaks.note else "")
        note += ". The floor is max(work / peak, bytes / bandwidth)"
        if used:
            note += f"; measured: a pass at the median rate in {', '.join(used)}, its seconds "
            note += "and their ratio to the floor"
        note += "."
        title = "Roofline: the least time each workload can take on this machine"
        record.save(args.record or "roofline", title, COLUMNS, list(rows), note)


def giga(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.1f}"


if __name__ == "__main__":
    main()
