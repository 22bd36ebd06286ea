"""KV memory saved by sharing: parallel sampling (n=4) and beam search (width 4 and 6).

    python benchmarks/bench_sharing.py [--prompts 8] [--max-tokens 64] [--block-size 16] [--record]

Workload: prompts of a few hundred tokens (a fixed paragraph plus a varying question), run one
group at a time so the figures are per group. After every engine step we read the KV manager's
usage: *logical* blocks (the entries of every branch's block table: what the same branches would
need without sharing) against *physical* blocks in use. The saving is 1 - physical / logical,
averaged over the steps of the run (the PagedAttention paper reports 6-10% for parallel
sampling and 38-55% for beam search on its workloads).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from pagekv import BeamSearchParams, SamplingParams
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

PARAGRAPH = (
    "Paged attention stores the key and value cache of a language model in fixed-size blocks, "
    "like pages of virtual memory. A block table maps each sequence's logical blocks to physical "
    "blocks, so a sequence needs no contiguous memory, finished sequences give their blocks back "
    "at once, and sequences that share a prefix can point at the same physical blocks. "
) * 6


# The savings the PagedAttention paper reports on its own workloads.
PAPER_PARALLEL, PAPER_BEAM = "6-10%", "38-55% (widths 2-6)"


def measure(engine: LLMEngine, add: Callable[[str], None], prompts: list[str]) -> tuple[float, int]:
    """Mean saving over steps, and the peak of physical blocks, one group at a time."""
    savings: list[float] = []
    peak = 0
    for prompt in prompts:
        add(prompt)
        while engine.has_unfinished_requests():
            engine.step()
            usage = engine.kv.usage()
            if usage.num_logical_blocks:
                savings.append(usage.sharing_saving)
                peak = max(peak, usage.num_used_blocks)
    return statistics.fmean(savings), peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    record.add_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(None, torch.float32)
    prompts = [f"{PARAGRAPH}Question {i}: what does a block table do?" for i in range(args.prompts)]
    num_tokens = [len(loaded.tokenizer.encode(p)) for p in prompts]
    setting = (
        f"{len(prompts)} prompts of {min(num_tokens)}-{max(num_tokens)} tokens, "
        f"max_tokens={args.max_tokens}, block_size={args.block_size}"
    )
    print(setting)
    counter = iter(range(10**9))

    def engine_for() -> LLMEngine:
        config = EngineConfig(
            num_kv_blocks=4096, block_size=args.block_size, enable_prefix_caching=False
        )
        return LLMEngine(config, loaded)

    rows = []
    engine = engine_for()
    sampling = SamplingParams(
        n=4, temperature=1.0, seed=0, max_tokens=args.max_tokens, ignore_eos=True
    )
    saving, peak = measure(
        engine, lambda p: engine.add_request(f"s{next(counter)}", p, sampling), prompts
    )
    rows.append(("parallel sampling n=4", saving, peak))
    for width in (4, 6):
        engine = engine_for()
        params = BeamSearchParams(beam_width=width, max_tokens=args.max_tokens, ignore_eos=True)
        saving, peak = measure(
            engine,
            lambda p, e=engine, bp=params: e.add_beam_search_request(f"b{next(counter)}", p, bp),
            prompts,
        )
        rows.append((f"beam search width {width}", saving, peak))
    print(f"{'workload':<26}{'mean saving':>14}{'peak blocks':>14}")
    for name, saving, peak in rows:
        print(f"{name:<26}{saving:>13.1%}{peak:>14}")
    if args.record is not None:
        record.save(
            args.record or "sharing",
            "KV memory saved by sharing in parallel sampling and beam search",
            ["workload", "mean saving", "peak physical blocks", "PagedAttention paper"],
            [
                [name, f"{saving:.1%}", peak, PAPER_BEAM if "beam" in name else PAPER_PARALLEL]
                for name, saving, peak in rows
            ],
            f"{setting}, float32, prefix caching off (all sharing from forks); saving = 1 - "
            "physical / logical blocks (what the branches would hold unshared), over steps.",
        )


if __name__ == "__main__":
    main()
