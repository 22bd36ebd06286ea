"""Start-up to first token: a fresh ``python`` process runs ``LLM().generate`` for one token.

    python benchmarks/bench_startup.py [--runs 3] [--dtype bfloat16]

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
    args = parser.parse_args()
    runs = []
    for i in range(args.runs + 1):
        run = one_run(args.dtype)
        label = "first" if i == 0 else f"run {i}"
        print(
            f"{label}: total {run['total_s']:.2f} s = interpreter+imports "
            f"{run['total_s'] - run['llm_s'] - run['generate_s']:.2f} + LLM() "
            f"{run['llm_s']:.2f} + first token {run['generate_s']:.2f}"
        )
        if i:
            runs.append(run["total_s"])
    print(f"median start-up to first token ({args.dtype}): {statistics.median(runs):.2f} s")


if __name__ == "__main__":
    main()
