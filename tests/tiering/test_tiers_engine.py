"""The KV tiers end to end with the real model: host cache and storage tier round trips.

A multi-turn workload (one long system prompt, then per-conversation documents and turns) runs
with a device pool far too small for its working set; its greedy outputs must equal those of a
run with a device pool that holds everything, for every write policy, with the KV sanitizer and
the invariants checked every step. The counters must show the host and storage hits that made
the small pool's run match. Every test runs with float blocks and with int8 and fp8 blocks
(their scales travel with them), the host pool sized in blocks alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagekv.core.invariants import check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel
from pagekv.runner.kv_cache import KVCache
from pagekv.sampling_params import SamplingParams

pytestmark = pytest.mark.model

SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: answer question {i} briefly and kindly." for i in range(16)
)
DOCS = [
    " ".join(f"Fact {j} about {topic}: it is item {j * 7 + k} of its kind." for j in range(10))
    for k, topic in enumerate(["rivers", "stars", "bread", "trains"])
]
QUESTIONS = ["What is the first fact?", "And the last one?"]
# Between the turns, an unrelated long prompt that needs nearly the whole small device pool: it
# evicts even the hot system prompt, which must then come back from a lower tier.
FILLER = " ".join(f"Unrelated line {i} says nothing of note." for i in range(30))
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def converse(engine: LLMEngine) -> list[list[int]]:
    """Two turns of four conversations, interleaved, each turn extending its conversation."""
    llm = LLM.from_engine(engine)
    history = [f"{SYSTEM}\nDocument: {doc}\n" for doc in DOCS]
    outputs = []
    for turn, question in enumerate(QUESTIONS):
        if turn > 0:
            outputs.append(llm.generate(FILLER, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        for i in range(len(DOCS)):
            history[i] += f"User: {question}\nAssistant:"
            out = llm.generate(history[i], GREEDY, use_tqdm=False)[0].outputs[0]
            history[i] += out.text + "\n"
            outputs.append(out.token_ids)
    return outputs


@pytest.fixture(scope="module", params=["auto", "int8", "fp8"])
def kv_dtype(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def host_memory(float32_mib: int, kv_dtype: str) -> int:
    """Host-pool bytes holding as many blocks as ``float32_mib`` MiB of float32 blocks do."""
    per_block = {
        d: KVCache.bytes_per_block(30, 16, 3, 64, torch.float32, d) for d in (kv_dtype, "float32")
    }
    return float32_mib * 2**20 * per_block[kv_dtype] // per_block["float32"]


def run(
    loaded: LoadedModel, kv_dtype: str, **config: Any
) -> tuple[list[list[int]], dict[str, Any]]:
    settings = EngineConfig(
        check_invariants=True, kv_sanitizer=True, kv_cache_dtype=kv_dtype, **config
    )
    engine = LLMEngine(settings, loaded)
    try:
        outputs = converse(engine)
        check_no_leak(engine.kv)
        if engine.tiers is not None:
            engine.tiers.flush()
            assert engine.tiers.check() == []
        return outputs, engine.stats()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel, kv_dtype: str) -> list[list[int]]:
    outputs, stats = run(loaded, kv_dtype, num_kv_blocks=512)
    assert stats["prefix_cache_evictions"] == 0  # it really holds everything
    return outputs


POLICIES = ["write_through", "write_through_selective", "write_back"]


def assert_same_greedy(got: list[list[int]], expected: list[list[int]], kv_dtype: str) -> None:
    """Float and int8 blocks: the same greedy tokens. fp8 blocks: a row computed in another
    batch or chunk (recomputed after a preemption, or while its block's write was in flight)
    may round to another fp8 step (an eighth of a value) and part one output's way; a block
    lost or garbled in a round trip would part many."""
    if kv_dtype != "fp8":
        assert got == expected
        return
    differ = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert len(differ) <= max(1, len(got) // 10), differ


@pytest.mark.parametrize("policy", POLICIES)
def test_host_cache_round_trip(
    loaded: LoadedModel, reference: list[list[int]], policy: str, kv_dtype: str
) -> None:
    host = host_memory(64, kv_dtype)
    outputs, stats = run(
        loaded, kv_dtype, num_kv_blocks=28, host_cache_memory=host, cache_write_policy=policy
    )
    assert stats["prefix_cache_evictions"] > 0  # the device pool was too small
    assert stats["host_hit_blocks"] > 0, stats
    assert_same_greedy(outputs, reference, kv_dtype)


@pytest.mark.parametrize("policy", POLICIES)
def test_storage_round_trip(
    loaded: LoadedModel, reference: list[list[int]], policy: str, tmp_path: Path, kv_dtype: str
) -> None:
    outputs, stats = run(
        loaded,
        kv_dtype,
        num_kv_blocks=28,
        host_cache_memory=host_memory(6, kv_dtype),  # 8 blocks: it overflows into storage
        kv_store=f"file:{tmp_path}",
        cache_write_policy=policy,
    )
    assert stats["storage_hit_blocks"] > 0, stats
    assert stats["storage_written_blocks"] > 0
    assert stats["storage_load_failures"] == stats["storage_errors"] == 0
    assert_same_greedy(outputs, reference, kv_dtype)


@pytest.mark.parametrize("policy", POLICIES)
def test_batched_under_pressure_with_swapping_in_the_same_host_pool(
    loaded: LoadedModel, policy: str, tmp_path: Path, kv_dtype: str
) -> None:
    """Many requests at once on a small device pool: preemption by swap and the host cache
    compete for one small host pool, and storage writes and prefetches run meanwhile."""
    prompts = [
        f"{SYSTEM if i % 2 else DOCS[i % 4]}\nUser {i}: {QUESTIONS[i % 2]}\nAssistant:"
        for i in range(10)
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate(**config: Any) -> tuple[list[list[int]], dict[str, Any]]:
        settings = EngineConfig(
            check_invariants=True, kv_sanitizer=True, kv_cache_dtype=kv_dtype, **config
        )
        engine = LLMEngine(settings, loaded)
        try:
            llm = LLM.from_engine(engine)
            out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            out += [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            check_no_leak(engine.kv)
            return out, engine.stats()
        finally:
            engine.close()

    expected, _ = generate(num_kv_blocks=512)
    got, stats = generate(
        num_kv_blocks=40,
        max_num_seqs=6,
        preemption_mode="swap",
        host_cache_memory=host_memory(12, kv_dtype),  # 16 blocks: swaps and cached prefixes
        kv_store=f"file:{tmp_path}",
        cache_write_policy=policy,
    )
    assert stats["preemptions_swap"] + stats["preemptions_recompute"] > 0, stats
    assert stats["storage_written_blocks"] > 0
    assert_same_greedy(got, expected, kv_dtype)
