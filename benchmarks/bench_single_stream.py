"""Single-stream decode speed per kernel target and dtype, side by side in one process.

    python benchmarks/bench_single_stream.py [--targets avx2,avx512bf16] [--dtypes float32,bfloat16]
                                             [--quantization gguf,none] [--prompt-tokens 256]
                                             [--gguf-activations auto,dtype,int8]
                                             [--new-tokens 128] [--rounds 3] [--model GGUF]
                                             [--num-threads N] [--llama-bench]

One request at a time on the default model (SmolLM2-135M-Instruct, or ``--model``): a prompt of
``--prompt-tokens`` token ids, ``--new-tokens`` greedy tokens with ``ignore_eos``. Decode tok/s
is (new tokens - 1) / (time of the last token - time of the first): the steps after prefill,
at 256-384 tokens of context by default; prefill is reported apart. Each (target, dtype) keeps
its own engine; rounds alternate over them so the machine's drift hits all alike, and each
figure is the median over rounds. ``--targets`` defaults to every kernel target this CPU runs;
``--quantization`` gguf keeps the GGUF file's quant blocks (dequantized in the matmul kernels),
none dequantizes them to the dtype at load; ``--gguf-activations`` int8 rounds the activations
the GGUF blocks multiply to int8 (integer dot products, as llama.cpp).

``--llama-bench`` adds llama.cpp's ``llama-bench`` (benchmarks/setup_llama_cpp.sh) on the same
GGUF with ``-t`` = torch's thread count (the engines': ``--num-threads``, else torch's default),
as one more row, and each pagekv row's decode ratio to it. Its decode is
``-p 0 -n NEW -d PROMPT``: NEW tokens generated one at a time after a PROMPT-token context was
filled (the fill untimed), i.e. the same PROMPT..PROMPT+NEW context as pagekv's decode; its
prefill is ``-p PROMPT -n 0``, PROMPT tokens in one batch (seconds = PROMPT / its t/s; pagekv's
also includes the first token's sampling). One llama-bench run of each per round (its own
warm-up run, then ``-r 1``), alternating with the engines; KV cache f16, its other settings at
their defaults.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv import SamplingParams
from pagekv.bench.roofline import measure_peaks
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.kernels import isa
from pagekv.models.loader import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from compare import LLAMA_CPP_BIN

_ids = itertools.count()


def one_request(engine: LLMEngine, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tok/s) of one greedy request run alone."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(f"r{next(_ids)}", prompt, params)
    first = last = None
    count = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            produced = len(out.outputs[0].token_ids)
            if produced > count:
                count = produced
                first = now if first is None else first
                last = now
    assert first is not None and last is not None and count == new_tokens
    return first - start, (new_tokens - 1) / (last - first)


def llama_bench(
    model: str, threads: int, prompt_tokens: int, new_tokens: int
) -> tuple[float, float]:
    """(prefill seconds, decode tok/s) of one ``llama-bench`` run each (see the docstring)."""
    common = [str(LLAMA_CPP_BIN / "llama-bench"), "-m", model, "-t", str(threads), "-r", "1"]
    prefill = _llama_bench_test([*common, "-p", str(prompt_tokens), "-n", "0"])
    decode = _llama_bench_test(
        [*common, "-p", "0", "-n", str(new_tokens), "-d", str(prompt_tokens)]
    )
    return prompt_tokens / prefill, decode


def _llama_bench_test(command: list[str]) -> float:
    """The t/s of the one test ``command`` asks ``llama-bench`` for."""
    done = subprocess.run([*command, "-o", "json"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    (test,) = json.loads(done.stdout)
    return float(test["avg_ts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(isa.runnable()))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--quantization", default="gguf,none")
    parser.add_argument(
        "--gguf-activations",
        default="auto",
        help="with GGUF blocks: auto (the default: int8), dtype (exact) and/or int8",
    )
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="threads (default: torch's, one per core)"
    )
    parser.add_argument(
        "--llama-bench", action="store_true", help="also llama.cpp's llama-bench, same GGUF"
    )
    record.add_argument(parser)
    args = parser.parse_args()
    model = args.model or default_model_path()
    if args.llama_bench and not (LLAMA_CPP_BIN / "llama-bench").exists():
        raise SystemExit(f"{LLAMA_CPP_BIN / 'llama-bench'} missing: run setup_llama_cpp.sh")
    prompt = [(17 + 31 * i) % 40000 + 100 for i in range(args.prompt_tokens)]
    engines: dict[tuple[str, str, str, str], LLMEngine] = {}
    labels: dict[tuple[str, ...], str] = {}
    weight_bytes: dict[tuple[str, ...], int] = {}
    target_env = os.environ.get(isa.ISA_ENV)
    for target, dtype, quantization, activations in itertools.product(
        args.targets.split(","),
        args.dtypes.split(","),
        args.quantization.split(","),
        args.gguf_activations.split(","),
    ):
        if quantization == "none" and activations == "int8":
            continue  # dequantized weights multiply the activations as they are
        os.environ[isa.ISA_ENV] = target  # read as the runner loads its kernels
        config = EngineConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            gguf_activations=activations,
            enable_prefix_caching=False,
            num_threads=args.num_threads,
        )
        engine = LLMEngine(config)
        print(engine.system_line, file=sys.stderr)
        one_request(engine, prompt, 8)  # warm-up
        key = (target, dtype, quantization, activations)
        engines[key] = engine
        kernels = engine.runner.kernels
        labels[key] = weights_label(kernels["weights"], dtype, activations)
        weight_bytes[key] = int(kernels.get("gguf_bytes", kernels["weight_bytes"]))
    threads = torch.get_num_threads()  # the engines' (EngineConfig.num_threads sets it)
    read_peak = measure_peaks(threads).read_bytes
    results: dict[tuple[str, ...], list[tuple[float, float]]] = {k: [] for k in engines}
    llama: list[tuple[float, float]] = []
    for _ in range(args.rounds):
        for key, engine in engines.items():
            results[key].append(one_request(engine, prompt, args.new_tokens))
        if args.llama_bench:
            llama.append(llama_bench(model, threads, args.prompt_tokens, args.new_tokens))
    print(f"CPU: {isa.cpu_name()} ({isa.shown_features()}), {os.cpu_count()} CPUs")
    setting = (
        f"{os.path.basename(model)}, {threads} thread(s), {args.prompt_tokens}-token prompt, "
        f"{args.new_tokens} new tokens, median of {args.rounds}"
    )
    print(setting)
    if read_peak:
        print(f"memory read peak ({threads} threads): {read_peak / 1e9:.1f} GB/s")
    columns, rows = table(results, llama, labels, weight_bytes, read_peak)
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join("" if c is None else str(c) for c in row) + " |")
    if args.record is not None:
        # the engines' loop forced each target in turn; the record names the one this CPU takes
        os.environ.pop(isa.ISA_ENV, None)
        os.environ.update({isa.ISA_ENV: target_env} if target_env is not None else {})
        note = f"{setting}. Decode tok/s: (new tokens - 1) over the decode steps"
        if read_peak:
            note += (
                "; of roofline: the weights' bytes (a GGUF file's: its blocks) read per token "
                f"at the decode rate, against this machine's measured read peak, "
                f"{read_peak / 1e9:.1f} GB/s"
            )
        if llama:
            note += "; the last column divides by llama-bench's decode on the same file"
        title = "Single-stream decode per kernel target, dtype and weights"
        title += ": pagekv against llama.cpp's llama-bench" if llama else ""
        record.save(args.record or "single_stream", title, columns, rows, note + ".")


def weights_label(weights: str, dtype: str, activations: str) -> str:
    """How a row's weights multiply, from the engine's own description of them."""
    if not weights.startswith("GGUF"):
        return f"{dtype} (dequantized)"
    label = "GGUF blocks, " + ("int8 activations" if "int8" in weights else "exact")
    return label + (" (default)" if activations == "auto" else "")


def table(
    results: dict[tuple[str, ...], list[tuple[float, float]]],
    llama: list[tuple[float, float]],
    labels: dict[tuple[str, ...], str],
    weight_bytes: dict[tuple[str, ...], int],
    read_peak: float | None,
) -> tuple[list[str], list[list[record.Cell]]]:
    """The Markdown table's columns and rows: medians per engine, llama-bench's last."""
    columns = ["target", "dtype", "weights", "decode tok/s", "prefill s"]
    if read_peak:
        columns.append("of roofline")
    llama_decode = statistics.median(r[1] for r in llama) if llama else None
    rows: list[list[record.Cell]] = []
    for key, runs in results.items():
        target, dtype = key[0], key[1]
        decode = statistics.median(r[1] for r in runs)
        prefill = statistics.median(r[0] for r in runs)
        rows.append([target, dtype, labels[key], round(decode, 1), round(prefill, 3)])
        if read_peak:
            rows[-1].append(f"{decode * weight_bytes[key] / read_peak:.0%}")
        if llama_decode:
            rows[-1].append(f"{decode / llama_decode:.2f}x")
    if llama_decode:
        columns.append("decode / llama.cpp")
        prefill = statistics.median(r[0] for r in llama)
        llama_row: list[record.Cell] = ["llama.cpp llama-bench", "f16 KV", "GGUF blocks"]
        llama_row.append(round(llama_decode, 1))
        rows.append([*llama_row, round(prefill, 3), *([""] if read_peak else []), "1.00x"])
    return columns, rows


if __name__ == "__main__":
    main()
