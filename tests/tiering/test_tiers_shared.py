"""Several engines, one store: real ``pagekv serve`` processes over real Mooncake and Redis.

Engine A serves long prompts and writes their blocks to the store; engine B, started
afterwards with an empty device and host cache, serves the same prompts with storage hits for
every full prefix block and the same greedy outputs. (A stays up: Mooncake keeps objects in the
segments its clients mount, so a writer's data lives as long as the writer.) Then the store
servers are SIGKILLed under a running engine and restarted: requests still complete with the
right outputs, the failures are counted, and the restarted store is used again.

The Makefile runs the test suite in a private network namespace (Mooncake's clients listen on
all interfaces) and installs redis-server and libibverbs1; pyproject has the Mooncake wheel.
"""

from __future__ import annotations

import re
import time
from itertools import combinations
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel
from pagekv.sampling_params import SamplingParams
from tests.server.support import start_server
from tests.tiering.stores import ServerProcess, store_spec

pytestmark = pytest.mark.model

BLOCK = 16
PROMPTS = [
    f"Story {topic}. "
    + " ".join(f"On day {d} the {topic} moved {d * 3 + k} steps." for d in range(14))
    for k, topic in enumerate(["fox", "owl", "crab"])
]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^pagekv_{name} (\S+)$", text, re.MULTILINE)
    assert match, f"pagekv_{name} not in /metrics"
    return float(match.group(1))


def wait_for(url: str, name: str, at_least: float, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (value := metric(url, name)) < at_least:
        assert time.monotonic() < deadline, f"{name} stayed at {value} < {at_least}"
        time.sleep(0.2)
    return value


def complete_all(url: str) -> tuple[list[str], list[int]]:
    """Greedy completions of every prompt, one at a time; and each prompt's full blocks."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    texts, full_blocks = [], []
    for prompt in PROMPTS:
        res = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert res.usage is not None
        texts.append(res.choices[0].text)
        full_blocks.append((res.usage.prompt_tokens - 1) // BLOCK)  # the last token is computed
    return texts, full_blocks


def possible_hit_tokens(blocks: list[int], give_ups: int) -> set[int]:
    """Prefix hit tokens if ``give_ups`` of the prompts stopped waiting for their prefetch.

    A request waits for its prefix no longer than recomputing it would take (the cost model);
    on a loaded machine a store round trip can outlast that, and that request recomputes its
    blocks while the fetch still lands (a storage hit nobody used). Each request waits once.
    """
    return {
        BLOCK * sum(b for i, b in enumerate(blocks) if i not in gave_up)
        for gave_up in combinations(range(len(blocks)), give_ups)
    }


@pytest.mark.parametrize("backend", ["mooncake", "redis"])
def test_second_engine_serves_from_the_first_engines_store(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    server: ServerProcess = request.getfixturevalue(
        {"mooncake": "mooncake_master", "redis": "redis_server"}[backend]
    )
    spec = store_spec(backend, server, tmp_path)
    args = ("--num-kv-blocks", "128", "--kv-store", spec, "--kv-store-required")
    a = start_server(tmp_path, *args)
    b = None
    try:
        texts_a, blocks = complete_all(a.url)
        full_blocks = sum(blocks)
        assert full_blocks >= 24
        wait_for(a.url, "storage_written_blocks", full_blocks)  # A's writes are in the store
        b = start_server(tmp_path, *args)
        assert metric(b.url, "storage_hit_blocks") == 0
        texts_b, _ = complete_all(b.url)
        assert texts_b == texts_a
        assert wait_for(b.url, "storage_hit_blocks", full_blocks) == full_blocks
        assert metric(b.url, "storage_load_failures") == 0
        assert metric(b.url, "loads_arrived") + metric(b.url, "load_give_ups") == len(PROMPTS)
        give_ups = int(metric(b.url, "load_give_ups"))
        assert give_ups < len(PROMPTS)  # the store is used, not merely filled
        hit_tokens = metric(b.url, "prefix_cache_hit_tokens")
        assert hit_tokens in possible_hit_tokens(blocks, give_ups)
    finally:
        for proc in (a, b):
            if proc is not None:
                proc.stop()


def ask(llm: LLM, prompts: list[str]) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=6)
    return [llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> list[list[int]]:
    return ask(LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=128), loaded)), PROMPTS)


@pytest.mark.parametrize("backend", ["mooncake", "redis"])
def test_store_killed_mid_run_then_restarted(
    backend: str,
    request: pytest.FixtureRequest,
    loaded: LoadedModel,
    reference: list[list[int]],
    tmp_path: Path,
) -> None:
    server: ServerProcess = request.getfixturevalue(
        {"mooncake": "mooncake_master", "redis": "redis_server"}[backend]
    )
    config: dict[str, Any] = {
        "num_kv_blocks": 128,
        "kv_store": store_spec(backend, server, tmp_path),
        "kv_store_timeout_s": 2.0,
        "check_invariants": True,
    }
    engine = LLMEngine(EngineConfig(**config), loaded)
    assert engine.tiers is not None and engine.tiers.store is not None
    llm = LLM.from_engine(engine)
    try:
        assert ask(llm, PROMPTS[:1]) == reference[:1]
        hits_before = engine.stats()["storage_hit_blocks"]  # earlier tests' writes count too
        server.kill()  # SIGKILL: a crash, mid-run
        engine.kv.reset_prefix_cache()
        assert ask(llm, PROMPTS) == reference  # recomputed; the engine keeps serving
        down = engine.stats()
        assert down["storage_errors"] >= 1 and down["storage_hit_blocks"] == hits_before
        server.start()  # the same port, an empty store
        time.sleep(engine.tiers.retry_s)
        before = engine.stats()["storage_written_blocks"]
        engine.kv.reset_prefix_cache()
        assert ask(llm, PROMPTS) == reference  # written to the restarted store ...
        assert engine.tiers.flush()
        assert engine.stats()["storage_written_blocks"] > before
        engine.kv.reset_prefix_cache()
        assert ask(llm, PROMPTS) == reference  # ... and read back from it
        hits_after = engine.stats()["storage_hit_blocks"]
        assert hits_after > hits_before, "the restarted store was not used"
    finally:
        engine.close()
        if not server.proc or server.proc.poll() is not None:
            server.start()  # leave the session's server up for the tests after this one
