"""Start-up to first token: a fresh ``python`` process runs ``LLM().generate`` for one token.

    python benchmarks/bench_startup.py [--runs 3] [--dtype bfloat16] [--record]

Measured from just before the child process is spawned to the child's report that the token
is back (so interpreter start and every import count). Each run is reported with the child's
own split: imports, ``LLM()`` (load model: dequantize the GGUF, pack weights, build the
engine; there is no weights cache), ``generate`` (one token). The first run, which also builds
the C kernels if ``~/.cache/pagekv/kernels`` lacks them, is reported apart from the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {repo!r})
from pagekv import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(dtype={dtype!r})
t2 = time.perf_counter()
out = llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
t3 = time.perf_counter()
assert len(out[0].outputs[0].token_ids) == 1
print(json.dumps({{"import_s": t1 - t0, "llm_s": t2 - t1, "generate_s": t3 - t2}}))
"""


def one_run(dtype: str) -> dict[str, float]:
    code = CHILD.format(repo=str(REPO), dtype=dtype)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    total = time.perf_counter() - start
    split = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"total_s": total, **split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    record.add_argument(parser)
    args = parser.parse_args()
    runs = []
    for i in range(args.runs + 1):
        run = one_run(args.dtype)
        run["rest_s"] = run["total_s"] - run["llm_s"] - run["generate_s"]
        label = "first" if i == 0 else f"run {i}"
        print(
            f"{label}: total {run['total_s']:.2f} s = interpreter+imports {run['rest_s']:.2f} "
            f"+ LLM() {run['llm_s']:.2f} + first token {run['generate_s']:.2f}"
        )
        runs.append(run)
    totals = [run["total_s"] for run in runs[1:]]
    print(f"median start-up to first token ({args.dtype}): {statistics.median(totals):.2f} s")
    if args.record is not None:
        save_record(args.record or "startup", args.dtype, runs)


def save_record(name: str, dtype: str, runs: list[dict[str, float]]) -> None:
    """The first run apart (it may build the C kernels), then the others' range and median."""
    others = sorted(runs[1:], key=lambda run: run["total_s"])
    low, high = others[0]["total_s"], others[-1]["total_s"]
    median = statistics.median(run["total_s"] for run in others)
    middle = others[(len(others) - 1) // 2]
    split = " + ".join(f"{middle[k]:.2f}" for k in ("rest_s", "llm_s", "generate_s"))
    rows: list[list[record.Cell]] = [
        [
            f"spawn to first token, {len(others)} runs",
            f"{low:.2f}-{high:.2f} s, median {median:.2f} s",
        ],
        ["the first run (builds the C kernels if not cached)", f"{runs[0]['total_s']:.2f} s"],
        ["a middle run: interpreter and imports + LLM() + first token", f"{split} s"],
    ]
    record.save(
        name,
        f"Start-up: a fresh process to the first token of LLM().generate, {dtype}",
        ["measure", "pagekv"],
        rows,
        "LLM() loads the model (dequantizes the GGUF, packs the weights) and builds the engine.",
    )


if __name__ == "__main__":
    main()
