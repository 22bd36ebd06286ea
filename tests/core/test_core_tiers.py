"""The host cache and storage writes in the core, scenario by scenario, with exact block ids.

The state machine (test_core_statemachine.py) covers the same paths at random against a
simulated K/V memory; these tests pin down each write policy's timing and the one-pool
accounting of host memory.
"""

from __future__ import annotations

import pytest

from pagekv.core import KVCacheManager
from pagekv.core.invariants import check_manager
from pagekv.core.plan import StorageWrite
from pagekv.core.tier_policy import LoadCostModel, WritePolicy
from pagekv.errors import InvalidRequestError
from tests.core.helpers import make_request, prefill

BS = 4


def manager(policy: str | None, *, device: int = 8, host: int = 8, storage: bool = False):
    return KVCacheManager(device, BS, True, host, write_policy=policy, write_storage=storage)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_write_through_offloads_each_block_as_it_is_committed() -> None:
    kv = manager("write_through", storage=True)
    request = make_request("a", tokens(9))
    prefill(kv, request)  # blocks 0, 1 full and committed; block 2 partial
    t = kv.take_transfers()
    assert t.swap_out == ((0, 0), (1, 1))  # device -> host, in commit order
    assert t.saves == (
        StorageWrite(0, False, request.block_hashes[0]),
        StorageWrite(1, False, request.block_hashes[1]),
    )
    assert kv.residency(request.block_hashes[0]) == (0, 0)
    assert kv.host_pins() == {}  # taken: the host copies are now evictable cache entries
    assert kv.host_pool is not None and kv.host_pool.num_evictable_blocks == 2
    assert (
        kv.tier_state.counters.offloaded_blocks == 2 and kv.tier_state.counters.storage_writes == 2
    )
    check_manager(kv)


def test_write_back_offloads_only_on_device_eviction() -> None:
    kv = manager("write_back", device=4, storage=True)
    first = make_request("a", tokens(9))
    prefill(kv, first)
    assert not kv.take_transfers()  # committed, nothing written down yet
    kv.free("a")  # blocks 0, 1 evictable (hashed), block 2 free
    prefill(kv, make_request("b", tokens(13, 100)))  # needs 4 blocks: evicts both cached
    t = kv.take_transfers()
    assert t.swap_out == ((1, 0), (0, 1))  # LRU order: block 1 was released before block 0
    assert {kv.host_pool.block_hash(h) for _, h in t.swap_out} == set(first.block_hashes[:2])
    assert t.saves == ()  # the host has room: storage gets it when the host evicts it
    assert kv.residency(first.block_hashes[0])[0] is None  # gone from the device
    check_manager(kv)


def test_write_back_saves_to_storage_when_the_host_evicts() -> None:
    kv = manager("write_back", device=4, host=2, storage=True)
    prefill(kv, make_request("a", tokens(9)))
    kv.free("a")
    prefill(kv, make_request("b", tokens(13, 100)))  # evicts a's 2 blocks into the host's 2
    kv.take_transfers()
    kv.free("b")  # b's 3 full blocks are evictable on the device now
    prefill(kv, make_request("c", tokens(13, 200)))  # evicts b's blocks into the full host
    t = kv.take_transfers()
    assert t.saves and all(w.on_host for w in t.saves)  # a's blocks, from their host copies
    check_manager(kv)


def test_selective_writes_down_at_the_second_hit() -> None:
    kv = manager("write_through_selective")
    prompt = tokens(9)
    prefill(kv, make_request("a", prompt))
    assert not kv.take_transfers()
    prefill(kv, make_request("b", prompt))  # first hit of blocks 0, 1
    assert not kv.take_transfers().swap_out
    prefill(kv, make_request("c", prompt))  # second hit: copied to the host now
    assert len(kv.take_transfers().swap_out) == 2
    assert kv.tier_state.counters.offloaded_blocks == 2


def test_host_hit_is_a_swap_in_into_a_fresh_block_committed_after_it_lands() -> None:
    kv = manager("write_through", device=4)
    first = make_request("a", tokens(9))
    prefill(kv, first)
    kv.take_transfers()
    kv.free("a")
    prefill(kv, make_request("x", tokens(13, 100)))  # evicts a's cached device blocks
    kv.take_transfers()
    kv.free("x")
    again = make_request("a2", tokens(9))
    assert kv.num_cached_tokens(again) == 8  # both full blocks, from the host
    assert kv.allocate(again, 1) == 8
    table = kv.block_table("a2")
    t = kv.take_transfers()
    assert {dst for _, dst in t.swap_in} == set(table[:2])
    assert kv.tier_state.counters.host_hit_blocks == 2
    again.num_computed_tokens = 9
    kv.commit(again)  # after the swap-ins were taken: the device copies become cache entries
    assert [kv.pool.block_hash(b) for b in table[:2]] == again.block_hashes[:2]
    check_manager(kv)


def test_a_host_block_that_fails_verification_is_dropped_and_recomputed() -> None:
    kv = manager("write_through", device=4)
    prefill(kv, make_request("a", tokens(9)))
    kv.take_transfers()
    kv.free("a")
    prefill(kv, make_request("x", tokens(13, 100)))
    kv.take_transfers()
    kv.free("x")
    first_hash = make_request("h", tokens(9))
    kv.num_cached_tokens(first_hash)  # computes its hash chain
    damaged = kv.residency(first_hash.block_hashes[1])[1]
    kv.tier_state.verify_host = lambda block, block_hash: block != damaged
    request = make_request("a3", tokens(9))
    assert kv.allocate(request, 5) == 4  # block 0 from the host; block 1 failed: recomputed
    assert kv.tier_state.counters.host_verify_failures == 1
    assert kv.residency(first_hash.block_hashes[1]) == (None, None)  # dropped, not reused
    check_manager(kv)


def test_load_host_places_pins_and_stops_when_the_host_is_full() -> None:
    kv = manager("write_through", host=2)
    hashes = [bytes([i]) * 16 for i in range(3)]
    placed = kv.tier_state.load_host(hashes)
    assert [h for h, _ in placed] == hashes[:2]
    assert kv.tier_state.counters.host_full_skips == 1
    assert kv.host_pins() == {0: 1, 1: 1}
    assert kv.tier_state.load_host(hashes[:1]) == []  # already resident
    t = kv.take_transfers()
    assert t.loads == tuple(placed)
    assert kv.residency(hashes[0]) == (None, placed[0][1])


def test_one_host_pool_for_cache_and_swap() -> None:
    """Swapping out takes cached host blocks (LRU) when it needs them: no double counting."""
    kv = manager("write_through", device=8, host=3)
    prefill(kv, make_request("a", tokens(9)))
    kv.take_transfers()
    kv.free("a")
    assert kv.host_pool is not None and kv.host_pool.num_evictable_blocks == 2
    b = make_request("b", tokens(11, 100))
    prefill(kv, b)
    kv.take_transfers()  # b's 2 full blocks went to the host cache too: 3 host blocks in use
    assert kv.swap_out("b")  # 3 blocks: the host cache's entries are evicted to make room
    assert kv.host_pool.num_free_blocks == 0
    check_manager(kv)


def test_unknown_write_policy_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="cache_write_policy"):
        manager("write_sometimes")
    assert WritePolicy.parse("write_back") is WritePolicy.WRITE_BACK


def test_load_cost_model_never_waits_longer_than_recomputing() -> None:
    cost = LoadCostModel(load_s_fixed=0.01, load_s_per_block=0.001, recompute_s_per_token=0.003)
    assert cost.prefers_load(10, 16)  # 0.02 s to load vs 0.48 s to recompute
    assert cost.max_wait_s(10, 16) == pytest.approx(0.48)
    slow = LoadCostModel(load_s_fixed=0.3, load_s_per_block=0.3, recompute_s_per_token=0.003)
    assert not slow.prefers_load(10, 16)
    with pytest.raises(InvalidRequestError, match="timeout_s"):
        LoadCostModel(timeout_s=-1)
