"""Start-up to first token: a fresh ``python`` process runs ``LLM().generate`` for one token.

    python benchmarks/bench_startup.py [--runs 3] [--dtype bfloat16]

Measured from just before the child process is spawned to the child's report that the token
is back (so interpreter start and every import count). Each run is reported with the child's
own split: imports, ``LLM()`` (load model + build engine), ``generate`` (one token). Runs
alternate between a cold weights cache (``PAGEKV_WEIGHTS_CACHE=0``: dequantize the GGUF) and a
warm one, so the figure is the ratio of the two medians measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def one_run(dtype: str, cache: bool) -> dict[str, float]:
    env = {**os.environ, "PAGEKV_WEIGHTS_CACHE": "1" if cache else "0"}
    code = CHILD.format(repo=str(REPO), dtype=dtype)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    total = time.perf_counter() - start
    split = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"total_s": total, **split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    one_run(args.dtype, cache=True)  # make sure the warm cache exists
    results: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    for _ in range(args.runs):
        for label in ("cold", "warm"):
            run = one_run(args.dtype, cache=label == "warm")
            results[label].append(run)
            print(
                f"{label}: total {run['total_s']:.2f} s = interpreter+imports "
                f"{run['total_s'] - run['llm_s'] - run['generate_s']:.2f} + LLM() "
                f"{run['llm_s']:.2f} + first token {run['generate_s']:.2f}"
            )
    medians = {k: statistics.median(r["total_s"] for r in v) for k, v in results.items()}
    print(
        f"median start-up to first token ({args.dtype}): cold cache {medians['cold']:.2f} s, "
        f"warm cache {medians['warm']:.2f} s ({medians['cold'] / medians['warm']:.2f}x)"
    )


if __name__ == "__main__":
    main()
