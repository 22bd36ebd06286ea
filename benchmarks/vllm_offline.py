"""One offline pass of a standard workload through vLLM; prints one JSON line. Benchmark only.

Runs inside benchmarks/.venv-vllm (see setup_vllm_cpu.sh), never in pagekv's environment:
    benchmarks/.venv-vllm/bin/python benchmarks/vllm_offline.py --model DIR --workload random
Start-up (import + LLM construction), a one-token warm-up request (whose completion time is
reported as a wall-clock timestamp, so the caller can measure process spawn -> first token) and
the generate() pass over the workload are timed separately. ``--limit N`` keeps the first N
requests of the workload.

``--passes-on-stdin``: after the warm-up, print a ``"ready"`` line, then run one pass per
"run" line read from stdin (a result line each) until stdin closes. Every pass starts with an
empty prefix cache (``LLM.reset_prefix_cache``), as a fresh process would, so a caller can
alternate this engine's passes with another engine's without paying vLLM's start-up each time.

``--isa avx2``: run as on a CPU with AVX2 + FMA and nothing wider, on this one. torch's own
kernels are capped by their documented variables (ATen, oneDNN, MKL) and torch reports no
AVX-512 or AMX, so vLLM loads its AVX2 library (``_C_AVX2``) and picks its AVX2 attention, as it
does on an AVX2-only CPU. The caps and the reports hold in vLLM's engine process too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
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
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
)


AS_AVX2 = Path(__file__).resolve().parent / "as_avx2"  # its sitecustomize.py caps a process


def run_as_avx2_only() -> None:
    """Before vLLM is imported: this process and every Python process it spawns as on an
    AVX2-only CPU (as_avx2/sitecustomize.py, run here and put on the children's PYTHONPATH)."""
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(AS_AVX2), *([path] if path else [])])
    runpy.run_path(str(AS_AVX2 / "sitecustomize.py"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", default="random")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gib", default="2")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--passes-on-stdin", action="store_true", help="one pass per 'run' line")
    parser.add_argument(
        "--speculative-ngram",
        type=int,
        default=0,
        help="vLLM's n-gram (prompt lookup) speculation with this many draft tokens; 0: off",
    )
    parser.add_argument(
        "--isa", choices=("native", "avx2"), default="native", help="avx2: as on an AVX2-only CPU"
    )
    args = parser.parse_args()
    if args.isa == "avx2":
        run_as_avx2_only()
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
        speculative_config=(
            {
                "method": "ngram",
                "num_speculative_tokens": args.speculative_ngram,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 1,
            }
            if args.speculative_ngram
            else None
        ),
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
    info = {
        "engine": "vllm",
        "workload": workload.name,
        "dtype": args.dtype,
        "startup_s": startup,
        "first_token_s": first_token_s,
        "first_token_unix": first_token_unix,
        "speculative_ngram": args.speculative_ngram,
        "env": {k: os.environ.get(k, "") for k in ENV_KEYS},
        "isa": args.isa,
    }

    def one_pass() -> dict[str, object]:
        llm.reset_prefix_cache()  # cold, like the first pass of a fresh process
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert generated == workload.num_output_tokens, generated
        return {
            **info,
            "elapsed_s": elapsed,
            "output_tokens": generated,
            "output_tok_s": generated / elapsed,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

    if not args.passes_on_stdin:
        print(json.dumps(one_pass()), flush=True)
        return
    print(json.dumps({**info, "event": "ready"}), flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            print(json.dumps(one_pass()), flush=True)


if __name__ == "__main__":
    main()
