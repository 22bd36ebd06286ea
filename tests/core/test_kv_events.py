"""KV events (core/kv_events.py): what a subscriber learns of the pools, checked against the
pools themselves. A subscriber's view is rebuilt from the events alone, as vllm-router's index
would be, and must equal what each pool's hash index holds, named by public hashes computed
here independently (SHA-256 over the parent's name and the block's token ids, u32 LE)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from pagekv.core import KVCacheManager
from pagekv.core.block_pool import BlockHash
from pagekv.core.kv_events import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventLog,
)
from tests.core.helpers import make_request, prefill

BS = 4
View = set[tuple[str, bytes]]


def names(token_ids: Sequence[int], block_size: int = BS) -> list[bytes]:
    """The public name of each full block of ``token_ids``, computed from scratch (SHA-256 of
    the parent's name and the block's token ids, u32 LE)."""
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = out[-1] if out else b""
        out.append(hashlib.sha256(parent + struct.pack(f"<{block_size}I", *block)).digest())
    return out


def apply(view: View, events: list[KVEvent], anchors: set[bytes]) -> None:
    """A subscriber's index: stores need a known parent (or none), as vllm-router's does."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            view.clear()
        elif isinstance(event, BlockStored):
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            parent = event.parent_block_hash
            assert parent is None or parent in anchors, "a store whose parent was never named"
            for i, name in enumerate(event.block_hashes):
                tokens = event.token_ids[i * BS : (i + 1) * BS]
                want = hashlib.sha256((parent or b"") + struct.pack(f"<{BS}I", *tokens)).digest()
                assert name == want, "a block's name is not its parent's and its tokens' hash"
                view.add((event.medium, name))
                anchors.add(name)
                parent = name
        else:
            assert isinstance(event, BlockRemoved)
            for name in event.block_hashes:
                assert (event.medium, name) in view, "a removal of a block never stored"
                view.discard((event.medium, name))


def truth(kv: KVCacheManager, public: dict[BlockHash, bytes]) -> View:
    held = {(MEDIUM_DEVICE, public[h]) for h, _ in kv.pool.index_items() if h in public}
    if kv.host_pool is not None:
        held |= {(MEDIUM_HOST, public[h]) for h, _ in kv.host_pool.index_items() if h in public}
    return held


def manager(device: int = 6, host: int = 0, policy: str | None = None) -> KVCacheManager:
    return KVCacheManager(device, BS, True, host, write_policy=policy)


def test_committed_blocks_are_stored_as_one_chain_named_by_their_tokens() -> None:
    kv = manager()
    log = KVEventLog(BS)
    log.attach(kv)
    request = make_request("a", list(range(10)))
    prefill(kv, request)
    (event,) = log.take()
    assert event == BlockStored(names(range(10)), None, list(range(8)), BS, MEDIUM_DEVICE)


def test_salted_blocks_are_never_published() -> None:
    kv = manager()
    log = KVEventLog(BS)
    log.attach(kv)
    prefill(kv, make_request("a", list(range(10)), salt="tenant"))
    kv.free("a")
    kv.reset_prefix_cache()
    assert log.take() == []


def test_eviction_and_reset_remove_blocks_by_name() -> None:
    kv = manager(device=3)
    log = KVEventLog(BS)
    log.attach(kv)
    prefill(kv, make_request("a", list(range(8))))
    kv.free("a")
    log.take()
    prefill(kv, make_request("b", list(range(100, 108))))  # two blocks: evicts a's LRU one
    events = log.take()
    assert events[0] == BlockRemoved([names(range(8))[1]], MEDIUM_DEVICE)  # the tail first
    kv.free("b")
    kv.reset_prefix_cache()
    removed = log.take()
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(
        [names(range(8))[0], *names(range(100, 108))]
    )


def test_host_cache_fills_are_stored_on_the_cpu_medium() -> None:
    kv = manager(host=4, policy="write_through")
    log = KVEventLog(BS)
    log.attach(kv)
    prefill(kv, make_request("a", list(range(9))))
    view: View = set()
    apply(view, log.take(), set())
    want = names(range(9))
    assert view == {(m, h) for m in (MEDIUM_DEVICE, MEDIUM_HOST) for h in want}


def test_storage_is_remembered_for_the_newest_blocks_only() -> None:
    kv = manager()
    log = KVEventLog(BS, max_storage=2)
    log.attach(kv)
    request = make_request("a", list(range(12)))
    prefill(kv, request)
    log.take()
    log.in_storage(request.block_hashes, True)
    view: View = set()
    apply(view, log.take(), set(names(range(12))))
    assert {h for m, h in view if m == MEDIUM_STORAGE} == set(names(range(12))[1:])
    log.in_storage(request.block_hashes[2:], False)  # a record found bad and deleted
    apply(view, log.take(), set())
    assert {h for m, h in view if m == MEDIUM_STORAGE} == {names(range(12))[1]}


def test_a_chain_whose_parent_was_forgotten_is_named_again_from_its_start() -> None:
    kv = manager(device=8)
    log = KVEventLog(BS, max_unplaced=2)
    log.attach(kv)
    request = make_request("a", list(range(12)))
    prefill(kv, request, 5)  # block 0 committed; block 1 learned, not yet computed
    for i in range(3):  # other chains learned (admission looks them up) push block 1 out
        kv.num_cached_tokens(make_request(f"x{i}", list(range(200 * i, 200 * i + 9))))
    request.append_token(12)  # the chain grows past block 1 (it is learned again)
    kv.append_slots(request, 8)
    request.num_computed_tokens = 13
    kv.commit(request)
    view: View = set()
    apply(view, log.take(), set())
    assert view == {(MEDIUM_DEVICE, h) for h in names([*range(12), 12])}


OPS = st.lists(
    st.tuples(st.sampled_from(["add", "free", "take", "reset"]), st.integers(0, 5)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(OPS, st.sampled_from(["write_through", "write_back", None]))
def test_a_subscribers_view_is_what_the_pools_hold(ops: list[tuple[str, int]], policy) -> None:
    """At random: the view built from the events, and the snapshot, equal the pools' indexes."""
    kv = manager(device=8, host=6 if policy else 0, policy=policy)
    log = KVEventLog(BS)
    log.attach(kv)
    public: dict[BlockHash, bytes] = {}
    live: list[str] = []
    view: View = set()
    anchors: set[bytes] = set()
    for n, (op, arg) in enumerate(ops):
        if op == "add":
            shared = list(range(4 * arg))  # prompts share prefixes of 0..5 blocks
            tokens = shared + [1000 + n] * (1 + (n * 7) % 9)
            request = make_request(f"r{n}", tokens)
            if kv.can_allocate(request, request.num_tokens - kv.num_cached_tokens(request)):
                prefill(kv, request)
                live.append(request.request_id)
                public.update(zip(request.block_hashes, names(tokens), strict=False))
        elif op == "free" and live:
            kv.free(live.pop(arg % len(live)))
        elif op == "take":
            kv.take_transfers()
        elif op == "reset":
            kv.reset_prefix_cache()
        apply(view, log.take(), anchors)
        assert view == truth(kv, public)
        fresh: View = set()
        apply(fresh, log.snapshot(), set())
        assert fresh == view
