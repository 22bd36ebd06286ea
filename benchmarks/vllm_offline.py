"""One offline pass of a standard workload through vLLM; prints one JSON line. Benchmark only.

Runs inside benchmarks/.venv-vllm (see setup_vllm_cpu.sh), never in pagekv's environment:
    benchmarks/.venv-vllm/bin/python benchmarks/vllm_offline.py --model DIR --workload random
Start-up (import + LLM construction), a one-token warm-up request (whose completion time is
reported as a wall-clock timestamp, so the caller can measure process spawn -> first token) and
the generate() pass over the workload are timed separately. ``--limit N`` keeps the first N
requests of the workload.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv.bench.workloads import load_workload  # numpy only: no torch, no engine

ENV_KEYS = (
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "OMP_NUM_THREADS",
    "LD_PRELOAD",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", default="random")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gib", default="2")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)
    workload = load_workload(args.workload)
    if args.limit is not None:
        workload = replace(workload, requests=workload.requests[: args.limit])
    start = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=2048,
        seed=0,
    )
    startup = time.perf_counter() - start
    # Warm-up and first token: one request, one token, outside the timed pass (pagekv and HF
    # get a warm-up too). Its ids are not a prefix of any workload prompt.
    llm.generate(
        [TokensPrompt(prompt_token_ids=list(range(100, 164)))],
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        use_tqdm=False,
    )
    first_token_unix = time.time()
    first_token_s = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in workload.requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        for r in workload.requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == workload.num_output_tokens, generated
    print(
        json.dumps(
            {
                "engine": "vllm",
                "workload": workload.name,
                "dtype": args.dtype,
                "startup_s": startup,
                "first_token_s": first_token_s,
                "first_token_unix": first_token_unix,
                "env": {k: os.environ.get(k, "") for k in ENV_KEYS},
                "elapsed_s": elapsed,
                "output_tokens": generated,
                "output_tok_s": generated / elapsed,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    )


if __name__ == "__main__":
    main()
