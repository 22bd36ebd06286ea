"""Offline throughput: every request of a workload added at once, the engine stepped to the end.

Owns one timed pass over an ``LLMEngine`` (built by the caller, e.g. from ``pagekv bench``'s
engine options, with ``bench.BENCH_KV_CACHE_MEMORY`` of KV unless told otherwise). All
requests are queued at t = 0, so a request's TTFT includes its wait for a batch slot, as in
vLLM's ``benchmark_throughput``. A short warm-up request runs first, outside the timing, so
one-off costs (first matmul of each shape, allocator growth) are not charged to the run.
"""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any

import torch

from pagekv.bench.report import BenchResult, peak_rss_bytes
from pagekv.bench.workloads import Workload
from pagekv.engine.config import EngineConfig
from pagekv.engine.llm_engine import LLMEngine
from pagekv.sampling_params import SamplingParams, StructuredOutputsParams


def greedy_params(
    output_len: int, constraint: StructuredOutputsParams | None = None
) -> SamplingParams:
    """Up to ``output_len`` tokens, greedy, no EOS stop: the benchmark's only sampling
    (``constraint``: under structured output, which may end a request earlier)."""
    return SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_outputs=constraint
    )


def warm_up(engine: LLMEngine) -> None:
    engine.add_request("warmup", list(range(100, 164)), greedy_params(4))
    while engine.has_unfinished_requests():
        engine.step()


def run_offline(
    engine: LLMEngine, workload: Workload, constraint: StructuredOutputsParams | None = None
) -> BenchResult:
    """Queue every request, step until all finish; per-request first/last token times.
    ``constraint``: every request under this structured output; the tokens counted are the
    ones generated.

    The pass starts with an empty prefix cache: a previous pass over the same workload must not
    turn this one's prompts into cache hits (vLLM's runs start cold too).
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("run_offline needs an idle engine")
    engine.reset_prefix_cache()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    lens: dict[str, int] = {}
    cached = 0
    start = time.perf_counter()
    for i, request in enumerate(workload.requests):
        engine.add_request(
            f"bench-{i}", request.prompt_token_ids, greedy_params(request.output_len, constraint)
        )
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            if out.finished:
                last[out.request_id] = now
                lens[out.request_id] = len(out.outputs[0].token_ids)
                cached += out.num_cached_tokens
    elapsed = time.perf_counter() - start
    return BenchResult(
        mode="offline",
        workload=workload.name,
        num_requests=len(workload.requests),
        num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=sum(lens.values()),
        elapsed_s=elapsed,
        ttft_s=[t - start for t in first.values()],
        tpot_s=[(last[r] - first[r]) / (lens[r] - 1) for r in last if lens[r] > 1],
        settings={**_plain_fields(engine.config), "torch_threads": torch.get_num_threads()},
        peak_rss_bytes=peak_rss_bytes(),
        num_cached_prompt_tokens=cached,
    )


def _plain_fields(config: EngineConfig) -> dict[str, Any]:
    """The config's JSON-ready fields (a KVStore object or a cost model is left out)."""
    values = {f.name: getattr(config, f.name) for f in fields(config)}
    return {k: v for k, v in values.items() if v is None or isinstance(v, str | int | float)}
