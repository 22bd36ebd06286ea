"""The storage tier under faults, with the real model and the real file store underneath.

Damaged records, records of another model, a store too slow to be worth waiting for, and a
store that goes away and comes back: requests always complete with the outputs a run without
any storage tier gives (recomputation), the engine keeps serving, and the counters say what
happened. Killing real Redis and Mooncake servers is in test_tiers_shared.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from pagekv.core.invariants import check_no_leak
from pagekv.core.request import Request
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel
from pagekv.sampling_params import SamplingParams
from pagekv.tiering.faults import FailingStore, SlowStore
from pagekv.tiering.file_store import FileStore

pytestmark = pytest.mark.model

PREFIX = "Background for every question. " + " ".join(
    f"Note {i}: the value of item {i} is {i * 13 % 97}." for i in range(24)
)
QUESTIONS = ["What is item 3?", "What is item 17?", "Which item is largest?"]
GREEDY = SamplingParams(temperature=0, max_tokens=5)


def ask(engine: LLMEngine, questions: list[str] = QUESTIONS) -> list[list[int]]:
    llm = LLM.from_engine(engine)
    prompts = [f"{PREFIX}\nQuestion: {q}\nAnswer:" for q in questions]
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def make(loaded: LoadedModel, store: Any, **config: Any) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            num_kv_blocks=64,
            host_cache_memory="16MiB",
            kv_store=store,
            check_invariants=True,
            **config,
        ),
        loaded,
    )


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(num_kv_blocks=64), loaded)
    return ask(engine)


def fill_store(loaded: LoadedModel, root: Path) -> list[list[int]]:
    engine = make(loaded, f"file:{root}")
    try:
        return ask(engine)
    finally:
        engine.close()


def record_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and "probe" not in p.name)


def test_damaged_records_are_rejected_and_recomputed(
    loaded: LoadedModel, reference: list[list[int]], tmp_path: Path
) -> None:
    assert fill_store(loaded, tmp_path) == reference
    files = record_files(tmp_path)
    assert len(files) >= 10
    for path in files:  # flip one byte in the middle of every record's payload
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x55
        path.write_bytes(bytes(data))
    engine = make(loaded, f"file:{tmp_path}")
    try:
        assert ask(engine) == reference
        stats = engine.stats()
        assert stats["storage_load_failures"] >= 1
        assert stats["storage_hit_blocks"] == 0  # nothing damaged was used
        assert ask(engine, ["Is the engine still serving?"])  # and it still serves
        check_no_leak(engine.kv)
    finally:
        engine.close()


def test_records_of_another_model_are_never_loaded(
    loaded: LoadedModel, reference: list[list[int]], tmp_path: Path
) -> None:
    """Records placed under exactly the keys another fingerprint reads are still rejected."""
    fill_store(loaded, tmp_path)
    engine = make(loaded, f"file:{tmp_path}")
    assert engine.tiers is not None
    files = FileStore(str(tmp_path))
    prompt = engine.tokenizer.encode(f"{PREFIX}\nQuestion: {QUESTIONS[0]}\nAnswer:")
    chain = engine.kv.prefix_chain(Request("probe", prompt, GREEDY))
    written = [files.path(engine.tiers.key(h)) for h in chain]
    # From now on this engine is "another model": its keys name the same blocks under another
    # fingerprint, and each such key holds the first model's record.
    engine.tiers.fingerprint = bytes(16) + engine.tiers.fingerprint[16:]
    moved = 0
    for block_hash, src in zip(chain, written, strict=True):
        if os.path.exists(src):
            dst = files.path(engine.tiers.key(block_hash))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.link(src, dst)
            moved += 1
    assert moved >= 10
    try:
        assert ask(engine) == reference
        stats = engine.stats()
        assert stats["storage_load_failures"] >= 1 and stats["storage_hit_blocks"] == 0
    finally:
        engine.close()


def test_slow_store_is_not_waited_for(
    loaded: LoadedModel, reference: list[list[int]], tmp_path: Path
) -> None:
    """Loading from this store would take longer than recomputing: the scheduler recomputes."""
    fill_store(loaded, tmp_path)
    slow = SlowStore(FileStore(str(tmp_path)), delay_s=0.25)
    engine = make(loaded, slow)
    try:
        assert ask(engine) == reference
        stats = engine.stats()
        # No request was held for the store at all (timing-free: the machine is shared).
        assert stats["load_skipped"] >= 1 and stats["load_waits"] == 0
        assert stats["storage_hit_blocks"] == 0
    finally:
        engine.close()


def test_store_outage_then_recovery(
    loaded: LoadedModel, reference: list[list[int]], tmp_path: Path
) -> None:
    store = FailingStore(FileStore(str(tmp_path)))
    engine = make(loaded, store, kv_store_timeout_s=0.5)
    assert engine.tiers is not None
    try:
        assert ask(engine) == reference  # writes the prefix to the store
        engine.tiers.flush()
        written = engine.stats()["storage_written_blocks"]
        assert written > 0
        store.fail()
        engine.kv.reset_prefix_cache()  # device and host forget: only storage could help now
        assert ask(engine) == reference  # recomputed
        down = engine.stats()
        assert down["storage_errors"] >= 1 and down["storage_hit_blocks"] == 0
        store.recover()
        time.sleep(engine.tiers.retry_s)
        engine.kv.reset_prefix_cache()
        assert ask(engine) == reference
        up = engine.stats()
        assert up["storage_hit_blocks"] > 0, "the store was not used again after it recovered"
        check_no_leak(engine.kv)
    finally:
        engine.close()


def test_damaged_host_blocks_are_never_used(
    loaded: LoadedModel, reference: list[list[int]]
) -> None:
    """Bytes of host-cached blocks changed behind the tier's back: caught, recomputed."""
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=64, host_cache_memory="16MiB", check_invariants=True), loaded
    )
    assert engine.tiers is not None and engine.runner.host_kv is not None
    assert ask(engine) == reference
    host = engine.kv.host_pool
    assert host is not None
    cached = [b for _, b in host.index_items()]
    assert len(cached) >= 10
    for b in cached:  # one value of one layer's K in every cached host block
        engine.runner.host_kv.k[3][b, 0, 0, 0] += 1.0
    engine.kv.pool.evict_all()  # the device forgets: the host copies are the only ones
    hits_before = engine.stats()["host_hit_blocks"]
    assert ask(engine) == reference
    stats = engine.stats()
    assert stats["host_checksum_failures"] >= 1 and stats["host_verify_failures"] >= 1, str(stats)
    assert stats["host_hit_blocks"] == hits_before  # not one damaged block was copied in
    check_no_leak(engine.kv)
