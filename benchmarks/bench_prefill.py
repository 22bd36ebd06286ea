"""Prefill throughput on a real model's widths: the attention kernels against SDPA, and
llama.cpp's ``llama-bench`` pp512 on the same file.

    python benchmarks/bench_prefill.py [--shape qwen2.5-1.5b] [--type Q4_K_M]
                                       [--dtypes float32,bfloat16] [--prompt-tokens 512]
                                       [--rounds 3] [--num-threads N] [--no-llama-bench]

The model is ``shape_model.py``'s GGUF of the shape's widths with random weights (built once,
kept in benchmarks/.models). Per dtype one engine, its GGUF blocks kept quantized; each request
is one prompt of ``--prompt-tokens`` token ids (a new prompt each time: no prefix hits) and one
new token, so its time is the prefill's, the first token's sampling included. Each engine runs
every request twice per round: with the C attention kernels (prefill, and the rest of the
fast path), then with its prefill kernel set aside so that prefill attention runs torch's SDPA
(what ``PAGEKV_PREFILL_KERNEL=0`` gives), everything else the same. llama-bench runs
``-p PROMPT -n 0`` with ``-t`` = the engines' threads once per round (its own warm-up, then
``-r 1``). Figures are medians over rounds, in prompt tokens per second.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv import SamplingParams
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.kernels import isa
from pagekv.runner.attention_backends import CpuKernelBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
import shape_model
from bench_single_stream import _llama_bench_test
from compare import LLAMA_CPP_BIN

_ids = itertools.count()


def prefill_seconds(engine: LLMEngine, prompt_tokens: int) -> float:
    """Seconds of one request of ``prompt_tokens`` fresh token ids and one new token."""
    first = next(_ids)
    prompt = [(first * 7919 + 31 * i) % 40000 + 100 for i in range(prompt_tokens)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(f"r{first}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


class PrefillKernelSwitch:
    """Sets an engine's prefill kernel aside (prefill attention on SDPA) and back."""

    def __init__(self, engine: LLMEngine) -> None:
        backend = engine.runner.backend
        assert isinstance(backend, CpuKernelBackend), "the kernels run on the CPU backend"
        self.backend, self.kernel = backend, backend.prefill_kernel
        if self.kernel is None:
            raise SystemExit("no prefill kernel here: nothing to compare")

    def use(self, on: bool) -> None:
        self.backend.prefill_kernel = self.kernel if on else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(shape_model.SHAPES))
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--no-llama-bench", action="store_true")
    record.add_argument(parser)
    args = parser.parse_args()
    model = str(shape_model.build(args.shape, args.type))
    use_llama = not args.no_llama_bench
    if use_llama and not (LLAMA_CPP_BIN / "llama-bench").exists():
        raise SystemExit(f"{LLAMA_CPP_BIN / 'llama-bench'} missing: run setup_llama_cpp.sh")
    engines: dict[str, tuple[LLMEngine, PrefillKernelSwitch]] = {}
    for dtype in args.dtypes.split(","):
        config = EngineConfig(
            model=model,
            dtype=dtype,
            quantization="gguf",
            enable_prefix_caching=False,
            num_threads=args.num_threads,
            max_num_batched_tokens=max(2048, args.prompt_tokens),
        )
        engine = LLMEngine(config)
        print(engine.system_line, file=sys.stderr)
        switch = PrefillKernelSwitch(engine)
        for on in (True, False):  # warm-up: both paths
            switch.use(on)
            prefill_seconds(engine, args.prompt_tokens)
        engines[dtype] = (engine, switch)
    threads = torch.get_num_threads()
    runs: dict[tuple[str, str], list[float]] = {}
    llama: list[float] = []
    for _ in range(args.rounds):
        for dtype, (engine, switch) in engines.items():
            for path, on in (("C++ kernels", True), ("SDPA", False)):
                switch.use(on)
                seconds = prefill_seconds(engine, args.prompt_tokens)
                runs.setdefault((dtype, path), []).append(args.prompt_tokens / seconds)
        if use_llama:
            command = [str(LLAMA_CPP_BIN / "llama-bench"), "-m", model, "-t", str(threads)]
            command += ["-r", "1", "-p", str(args.prompt_tokens), "-n", "0"]
            llama.append(_llama_bench_test(command))
    setting = (
        f"{Path(model).name} ({args.shape} widths, random weights), {threads} thread(s), "
        f"{args.prompt_tokens}-token prompts, median of {args.rounds}"
    )
    print(f"CPU: {isa.cpu_name()} ({isa.shown_features()}), {os.cpu_count()} CPUs")
    print(setting)
    columns = ["engine", "dtype", "prefill attention", "prompt tok/s", "vs SDPA"]
    rows: list[list[record.Cell]] = []
    for (dtype, path), figures in runs.items():
        rate = statistics.median(figures)
        sdpa = statistics.median(runs[(dtype, "SDPA")])
        rows.append(["pagekv", dtype, path, round(rate, 1), f"{rate / sdpa:.2f}x"])
    if llama:
        columns.append("vs llama.cpp")
        peer = statistics.median(llama)
        for row in rows:
            row.append(f"{float(row[3]) / peer:.2f}x")  # type: ignore[arg-type]
        rows.append(["llama.cpp llama-bench", "f16 KV", "its own", round(peer, 1), None, "1.00x"])
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join("" if c is None else str(c) for c in row) + " |")
    if args.record is not None:
        title = f"Prefill throughput on {args.shape}'s widths ({args.type}): kernels, SDPA"
        title += ", llama.cpp pp" + str(args.prompt_tokens) if llama else ""
        note = f"{setting}; GGUF blocks kept quantized in pagekv"
        record.save(args.record or "prefill_shapes", title, columns, rows, note + ".")


if __name__ == "__main__":
    main()
