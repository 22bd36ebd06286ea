"""The storage tier heals itself, with the real model and the real file store.

A bad record in the middle of a prompt's chain (damaged at rest, or forged by a writer who
recomputed its CRC32) is loaded as far as the hole, deleted as it is read, recomputed and
written again, so that the next engine loads the whole chain; with ``kv_store_secret`` a
forged record is refused, without one it is accepted as before. Engines with different secrets,
or none, share a directory without ever reading each other's records.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pagekv.core.block_pool import BlockHash
from pagekv.core.invariants import check_no_leak
from pagekv.core.request import Request
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel
from pagekv.sampling_params import SamplingParams
from pagekv.tiering.blob import decode, header_size
from pagekv.tiering.file_store import FileStore

pytestmark = pytest.mark.model

PROMPT = (
    "Background for the question. "
    + " ".join(f"Note {i}: the value of item {i} is {i * 13 % 97}." for i in range(20))
    + "\nQuestion: What is item 3?\nAnswer:"
)
GREEDY = SamplingParams(temperature=0, max_tokens=5)


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> list[int]:
    return answer(LLMEngine(EngineConfig(num_kv_blocks=64), loaded))


def answer(engine: LLMEngine) -> list[int]:
    out = LLM.from_engine(engine).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids)


@contextmanager
def engine_on(loaded: LoadedModel, root: Path, secret: str | None = None) -> Iterator[LLMEngine]:
    """An engine on the file store at ``root``; closing it flushes its writes."""
    engine = LLMEngine(
        EngineConfig(
            num_kv_blocks=64,
            host_cache_memory="16MiB",
            kv_store=f"file:{root}",
            kv_store_secret=secret,
            check_invariants=True,
        ),
        loaded,
    )
    assert engine.tiers is not None and engine.tiers.store is not None
    try:
        yield engine
        check_no_leak(engine.kv)
    finally:
        engine.close()


def chain_of(engine: LLMEngine) -> list[BlockHash]:
    return engine.kv.prefix_chain(Request("probe", engine.tokenizer.encode(PROMPT), GREEDY))


def record_path(engine: LLMEngine, root: Path, block_hash: BlockHash) -> Path:
    assert engine.tiers is not None
    return Path(FileStore(str(root)).path(engine.tiers.key(block_hash)))


def intact(engine: LLMEngine, root: Path, block_hash: BlockHash) -> bool:
    """Whether the store holds a record of ``block_hash`` that this engine accepts."""
    tiers = engine.tiers
    assert tiers is not None
    path = record_path(engine, root, block_hash)
    if not path.exists():
        return False
    decode(path.read_bytes(), tiers.key(block_hash), tiers.fingerprint, tiers.secret)
    return True


def forge(path: Path, keyed: bool, key: str, fingerprint: bytes) -> bytes:
    """Rewrite a record's payload and recompute its CRC32, as any writer to the store can."""
    record = bytearray(path.read_bytes())
    start = header_size(key, fingerprint, keyed=keyed)
    record[start + 64 : start + 4096] = bytes(4096 - 64)
    record[18:22] = struct.pack("<I", zlib.crc32(record[start:]))  # the header's crc field
    path.write_bytes(bytes(record))
    return bytes(record)


def test_a_corrupt_record_is_replaced_after_one_recompute_and_its_chain_loads(
    loaded: LoadedModel, reference: list[int], tmp_path: Path
) -> None:
    with engine_on(loaded, tmp_path) as first:
        assert answer(first) == reference
        chain = chain_of(first)
    assert len(chain) >= 8
    hole = len(chain) // 2
    path = record_path(first, tmp_path, chain[hole])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55  # damage at rest: the checksum catches it
    path.write_bytes(bytes(data))

    with engine_on(loaded, tmp_path) as second:
        assert answer(second) == reference
        assert second.tiers is not None and second.tiers.flush()
        stats = second.stats()
        assert stats["storage_load_failures"] == 1 and stats["storage_removed_records"] == 1
        assert stats["storage_hit_blocks"] == hole  # the chain was loaded up to the hole
        assert intact(second, tmp_path, chain[hole])  # recomputed and written again

    with engine_on(loaded, tmp_path) as third:  # a restart: the whole chain loads
        assert answer(third) == reference
        stats = third.stats()
        assert stats["storage_load_failures"] == 0
        assert stats["storage_hit_blocks"] == len(chain)
        assert stats["prefix_cache_hit_tokens"] == len(chain) * third.kv.block_size


@pytest.mark.parametrize("secret", [None, "correct horse battery staple"])
def test_a_forged_record_is_refused_only_with_a_secret(
    loaded: LoadedModel, reference: list[int], tmp_path: Path, secret: str | None
) -> None:
    with engine_on(loaded, tmp_path, secret) as first:
        assert answer(first) == reference
        chain = chain_of(first)
        assert first.tiers is not None
        key, fingerprint = first.tiers.key(chain[3]), first.tiers.fingerprint
    forged = forge(record_path(first, tmp_path, chain[3]), secret is not None, key, fingerprint)

    with engine_on(loaded, tmp_path, secret) as second:
        outputs = answer(second)
        assert second.tiers is not None and second.tiers.flush()
        stats = second.stats()
        if secret is None:  # as before: a CRC32 authenticates nothing, the forgery is used
            assert stats["storage_load_failures"] == stats["storage_refused_records"] == 0
            assert stats["storage_hit_blocks"] == len(chain)
            assert record_path(second, tmp_path, chain[3]).read_bytes() == forged
            return
        assert outputs == reference
        assert stats["storage_refused_records"] == stats["storage_load_failures"] == 1
        assert stats["storage_removed_records"] == 1
        assert stats["storage_hit_blocks"] == 3
        assert intact(second, tmp_path, chain[3])  # replaced by a record this secret made


def test_engines_with_other_secrets_or_none_never_read_each_others_records(
    loaded: LoadedModel, reference: list[int], tmp_path: Path
) -> None:
    with engine_on(loaded, tmp_path, "secret a") as keyed:
        assert answer(keyed) == reference
        chain = chain_of(keyed)
    for other in (None, "secret b"):
        with engine_on(loaded, tmp_path, other) as engine:
            assert engine.tiers is not None and keyed.tiers is not None
            assert engine.tiers.key(chain[0]) != keyed.tiers.key(chain[0])
            assert answer(engine) == reference
            stats = engine.stats()
            assert stats["storage_hit_blocks"] == stats["storage_load_failures"] == 0
    with engine_on(loaded, tmp_path, "secret a") as again:  # nobody deleted its records
        assert answer(again) == reference
        stats = again.stats()
        assert stats["storage_hit_blocks"] == len(chain)
        assert stats["storage_load_failures"] == 0
