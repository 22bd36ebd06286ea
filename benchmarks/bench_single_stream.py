"""Single-stream decode speed per kernel target and dtype, side by side in one process.

    python benchmarks/bench_single_stream.py [--targets avx2,avx512bf16] [--dtypes float32,bfloat16]
                                             [--quantization gguf,none] [--prompt-tokens 256]
                                             [--new-tokens 128] [--rounds 3]

One request at a time on the default model (SmolLM2-135M-Instruct): a prompt of
``--prompt-tokens`` token ids, ``--new-tokens`` greedy tokens with ``ignore_eos``. Decode tok/s
is (new tokens - 1) / (time of the last token - time of the first): the steps after prefill,
at 256-384 tokens of context by default; prefill is reported apart. Each (target, dtype) keeps
its own engine; rounds alternate over them so the machine's drift hits all alike, and each
figure is the median over rounds. ``--targets`` defaults to every kernel target this CPU runs;
``--quantization`` gguf keeps the GGUF file's quant blocks (dequantized in the matmul kernels),
none dequantizes them to the dtype at load.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv import SamplingParams
from pagekv.config import EngineConfig
from pagekv.engine import LLMEngine
from pagekv.kernels import isa

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(isa.runnable()))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--quantization", default="gguf,none")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prompt = [(17 + 31 * i) % 40000 + 100 for i in range(args.prompt_tokens)]
    engines: dict[tuple[str, str, str], LLMEngine] = {}
    for target, dtype, quantization in itertools.product(
        args.targets.split(","), args.dtypes.split(","), args.quantization.split(",")
    ):
        os.environ[isa.ISA_ENV] = target  # read as the runner loads its kernels
        config = EngineConfig(dtype=dtype, quantization=quantization, enable_prefix_caching=False)
        engine = LLMEngine(config)
        print(engine.system_line, file=sys.stderr)
        one_request(engine, prompt, 8)  # warm-up
        engines[(target, dtype, quantization)] = engine
    results: dict[tuple[str, str, str], list[tuple[float, float]]] = {k: [] for k in engines}
    for _ in range(args.rounds):
        for key, engine in engines.items():
            results[key].append(one_request(engine, prompt, args.new_tokens))
    print(f"CPU: {isa.cpu_name()} ({isa.shown_features()}), {os.cpu_count()} CPUs")
    print(
        f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, median of {args.rounds}"
    )
    print("| target | dtype | weights | decode tok/s | prefill s |")
    print("| --- | --- | --- | --- | --- |")
    for (target, dtype, quantization), runs in results.items():
        decode = statistics.median(r[1] for r in runs)
        prefill = statistics.median(r[0] for r in runs)
        weights = "GGUF blocks" if quantization == "gguf" else f"{dtype} (dequantized)"
        print(f"| {target} | {dtype} | {weights} | {decode:.1f} | {prefill:.3f} |")


if __name__ == "__main__":
    main()
