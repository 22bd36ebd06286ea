"""KVCacheManager scenarios through the public API: exact block ids, ref counts, free-list order.

Block size is 4 unless a test says otherwise. ``prefill`` (tests/core_helpers.py) admits a
request as the scheduler does: allocate, mark the tokens computed, commit full blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from pagekv.core import BlockTransfers, KVCacheManager, Request
from pagekv.core.invariants import check_manager, check_no_leak
from pagekv.errors import InvalidRequestError, PromptTooLongError, UnknownRequestError
from tests.core.helpers import (
    SimulatedKV,
    expected_history,
    make_request,
    manager_state,
    prefill,
)


def refs(mgr: KVCacheManager, blocks: range | list[int]) -> list[int]:
    return [mgr.pool.ref_count(b) for b in blocks]


def fork_of(parent: Request, request_id: str) -> Request:
    child = make_request(request_id, parent.prompt_token_ids, salt=parent.cache_salt)
    child.all_token_ids = list(parent.all_token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    return child


def free_all(mgr: KVCacheManager) -> None:
    for rid in [*mgr.request_ids(), *mgr.swapped_request_ids()]:
        mgr.free(rid)
    mgr.take_transfers()
    check_no_leak(mgr)


# ---- prefix hits ---------------------------------------------------------------------------


def test_partial_prefix_hit_shares_only_the_matching_blocks() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", range(10))
    assert prefill(mgr, a) == 0
    assert mgr.block_table("a") == [0, 1, 2]
    assert mgr.pool.block_hash(0) == a.block_hashes[0]
    assert mgr.pool.block_hash(1) == a.block_hashes[1]
    assert mgr.pool.block_hash(2) is None  # partial: never cached

    b = make_request("b", [0, 1, 2, 3, 100, 101, 102, 103, 104, 105])
    assert mgr.num_cached_tokens(b) == 4
    assert mgr.allocate(b, 6) == 4
    assert mgr.block_table("b") == [0, 3, 4]
    assert refs(mgr, range(5)) == [2, 1, 1, 1, 1]
    assert mgr.pool.free_order() == [5, 6, 7, 8, 9]
    assert (mgr.prefix_query_tokens, mgr.prefix_hit_tokens) == (20, 4)
    check_manager(mgr)


def test_shared_prefix_finishes_into_lru_tails_first_then_a_third_request_hits() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(1, 9))  # two full shared blocks
    a = make_request("a", [*prompt, 10, 11, 12, 13, 14])
    b = make_request("b", [*prompt, 20, 21, 22, 23, 24])
    prefill(mgr, a)
    assert mgr.block_table("a") == [0, 1, 2, 3]
    assert prefill(mgr, b) == 8
    assert mgr.block_table("b") == [0, 1, 4, 5]
    assert refs(mgr, range(8)) == [2, 2, 1, 1, 1, 1, 0, 0]
    assert mgr.pool.free_order() == [6, 7]

    mgr.free("a")  # released last-to-first: 3 (partial) -> free, 2 (cached) -> evictable
    assert refs(mgr, range(8)) == [1, 1, 0, 0, 1, 1, 0, 0]
    assert mgr.pool.free_order() == [6, 7, 3, 2]
    mgr.free("b")
    assert list(mgr.pool.iter_free()) == [6, 7, 3, 5]
    assert list(mgr.pool.iter_evictable()) == [2, 4, 1, 0]  # chain tails evicted first
    check_manager(mgr)

    c = make_request("c", [*prompt, 30])
    assert mgr.num_cached_tokens(c) == 8
    assert mgr.allocate(c, 1) == 8
    assert mgr.block_table("c") == [0, 1, 6]
    assert refs(mgr, [0, 1, 6]) == [1, 1, 1]
    assert mgr.pool.free_order() == [7, 3, 5, 2, 4]

    d = make_request("d", range(100, 120))  # 5 blocks: 3 free, then evict 2 and 4
    assert mgr.allocate(d, 20) == 0
    assert mgr.block_table("d") == [7, 3, 5, 2, 4]
    assert mgr.pool.num_evictions == 2
    assert mgr.pool.lookup(a.block_hashes[2]) is None
    assert mgr.pool.lookup(b.block_hashes[2]) is None
    assert mgr.pool.lookup(c.block_hashes[0]) == 0 and mgr.pool.lookup(c.block_hashes[1]) == 1
    assert mgr.pool.free_order() == []
    check_manager(mgr)
    free_all(mgr)


def test_last_prompt_token_is_always_recomputed() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(8))  # exactly two blocks, both cached after prefill
    prefill(mgr, a)
    assert mgr.block_table("a") == [0, 1]
    assert mgr.pool.block_hash(1) is not None
    mgr.free("a")
    assert list(mgr.pool.iter_evictable()) == [1, 0]

    b = make_request("b", range(8))
    assert mgr.num_cached_tokens(b) == 4  # all but the last block
    assert mgr.allocate(b, 4) == 4
    assert mgr.block_table("b") == [0, 2]
    assert mgr.pool.ref_count(1) == 0 and mgr.pool.is_evictable(1)
    assert mgr.pool.free_order() == [3, 4, 5, 6, 7, 1]

    c = make_request("c", range(9))  # one more token: both blocks hit
    assert mgr.num_cached_tokens(c) == 8
    check_manager(mgr)


def test_one_token_prompt_never_hits() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=1)
    prefill(mgr, make_request("a", [5]))
    assert mgr.pool.block_hash(0) is not None
    b = make_request("b", [5])
    assert mgr.num_cached_tokens(b) == 0
    assert mgr.allocate(b, 1) == 0
    assert mgr.block_table("b") == [1]


def test_cache_salt_isolates_tenants() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(9))
    a = make_request("a", tokens, salt="t1")
    prefill(mgr, a)
    assert mgr.block_table("a") == [0, 1, 2]

    other = make_request("b", tokens, salt="t2")
    assert mgr.num_cached_tokens(other) == 0
    assert prefill(mgr, other) == 0
    assert mgr.block_table("b") == [3, 4, 5]
    assert other.block_hashes[0] != a.block_hashes[0]

    same = make_request("c", tokens, salt="t1")
    assert prefill(mgr, same) == 8
    assert mgr.block_table("c") == [0, 1, 6]
    assert refs(mgr, [0, 1, 3, 4]) == [2, 2, 1, 1]

    unsalted = make_request("d", tokens)
    assert prefill(mgr, unsalted) == 0
    assert mgr.block_table("d") == [7, 8, 9]
    empty_salt = make_request("e", tokens, salt="")  # "" is a salt, distinct from none
    assert mgr.num_cached_tokens(empty_salt) == 0
    assert mgr.num_cached_tokens(make_request("f", tokens, salt="t2")) == 8
    check_manager(mgr)


def test_prefix_caching_disabled_never_hits_and_frees_to_the_free_list() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    prefill(mgr, make_request("a", range(9)))
    assert mgr.block_table("a") == [0, 1, 2]
    assert [mgr.pool.block_hash(b) for b in range(3)] == [None, None, None]
    assert mgr.pool.index_items() == []
    b = make_request("b", range(9))
    assert mgr.num_cached_tokens(b) == 0
    assert mgr.allocate(b, 9) == 0
    assert mgr.block_table("b") == [3, 4, 5]
    mgr.free("a")
    assert mgr.pool.free_order() == [6, 7, 2, 1, 0]
    assert mgr.pool.num_evictable_blocks == 0
    assert (mgr.prefix_query_tokens, mgr.prefix_hit_tokens) == (0, 0)
    check_manager(mgr)


# ---- eviction under pressure never takes the hits being allocated ------------------------------


def _pool_where_only_hits_are_evictable() -> tuple[KVCacheManager, Request]:
    """Block size 2, 6 blocks: 0, 1 cached and evictable (the hits), 2 and 5 free, 3, 4 used."""
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    prefill(mgr, a)
    assert mgr.block_table("a") == [0, 1, 2]
    mgr.free("a")
    prefill(mgr, make_request("filler", [9, 9, 8, 8]))
    assert mgr.block_table("filler") == [3, 4]
    assert list(mgr.pool.iter_free()) == [5, 2]
    assert list(mgr.pool.iter_evictable()) == [1, 0]
    return mgr, a


def test_allocation_that_would_need_to_evict_its_own_hits_fails_cleanly() -> None:
    mgr, a = _pool_where_only_hits_are_evictable()
    c = make_request("c", [1, 2, 3, 4, 7, 7, 7, 7, 7])  # hits 0, 1; needs 3 more blocks
    assert mgr.num_cached_tokens(c) == 4
    assert mgr.pool.can_allocate(3)  # the trap: 2 free + 2 evictable looks like enough
    assert not mgr.can_allocate(c, 5)
    before = manager_state(mgr)
    assert mgr.allocate(c, 5) is None
    assert manager_state(mgr) == before
    assert mgr.pool.lookup(a.block_hashes[0]) == 0 and mgr.pool.lookup(a.block_hashes[1]) == 1
    check_manager(mgr)


def test_allocation_that_fits_beside_its_hits_evicts_nothing() -> None:
    mgr, a = _pool_where_only_hits_are_evictable()
    c = make_request("c", [1, 2, 3, 4, 7, 7, 7])  # hits 0, 1; needs exactly the 2 free blocks
    assert mgr.can_allocate(c, 3)
    assert mgr.allocate(c, 3) == 4
    assert mgr.block_table("c") == [0, 1, 5, 2]
    assert mgr.pool.num_evictions == 0
    assert mgr.pool.block_hash(0) == a.block_hashes[0]
    assert mgr.pool.block_hash(1) == a.block_hashes[1]
    assert refs(mgr, range(6)) == [1, 1, 1, 1, 1, 1]
    assert mgr.pool.free_order() == []
    check_manager(mgr)


def test_can_allocate_keeps_the_reserve() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    r = make_request("r", range(8))
    assert mgr.can_allocate(r, 8, reserve_blocks=2)
    assert not mgr.can_allocate(r, 8, reserve_blocks=3)


# ---- fork and copy-on-write --------------------------------------------------------------------


def _forked_pair() -> tuple[KVCacheManager, Request, Request, SimulatedKV]:
    """A (6 tokens computed, 1 sampled) and its fork B, sharing blocks [0, 1]; 1 is partial."""
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    kv = SimulatedKV(8, 0, 4)
    a = make_request("a", range(1, 7))
    prefill(mgr, a)
    kv.write(mgr.block_table("a"), a, 0, 6)
    a.append_token(7)
    b = fork_of(a, "b")
    b.all_token_ids[-1] = 8  # the branch sampled its own token
    mgr.fork(a, b)
    assert mgr.block_table("b") == [0, 1]
    assert refs(mgr, range(3)) == [2, 2, 0]
    return mgr, a, b, kv


def _write(mgr: KVCacheManager, kv: SimulatedKV, request: Request, num: int) -> None:
    kv.write(mgr.block_table(request.request_id), request, request.num_computed_tokens, num)
    request.num_computed_tokens += num
    mgr.commit(request)


def test_fork_then_divergent_writes_copy_on_write_before_writing() -> None:
    mgr, a, b, kv = _forked_pair()
    assert mgr.append_slots(a, 1)
    assert mgr.block_table("a") == [0, 2]
    assert mgr.block_table("b") == [0, 1]
    assert mgr.pins() == Counter({1: 1})
    assert refs(mgr, range(3)) == [2, 2, 1]  # block 1: B's entry + the pin
    assert mgr.usage().num_cow_copies == 1
    assert mgr.pool.free_order() == [3, 4, 5, 6, 7]
    check_manager(mgr)

    transfers = mgr.take_transfers()
    assert transfers == BlockTransfers(copies=((1, 2),))
    assert mgr.pins() == Counter()
    assert refs(mgr, range(3)) == [2, 1, 1]  # the pin is gone with the copy
    kv.apply(transfers)
    _write(mgr, kv, a, 1)

    assert mgr.append_slots(b, 1)  # B is now the only owner of block 1: no copy
    assert mgr.block_table("b") == [0, 1]
    assert mgr.take_transfers().copies == ()
    _write(mgr, kv, b, 1)

    for r in (a, b):
        assert kv.read(mgr.block_table(r.request_id), 7) == expected_history(r)
    check_manager(mgr)
    free_all(mgr)


def test_both_forks_writing_in_one_step_each_get_a_copy_and_the_source_is_released() -> None:
    mgr, a, b, kv = _forked_pair()
    assert mgr.append_slots(a, 1)
    assert mgr.append_slots(b, 1)  # block 1 is still pinned for A's copy: shared
    assert (mgr.block_table("a"), mgr.block_table("b")) == ([0, 2], [0, 3])
    assert mgr.pins() == Counter({1: 2})
    assert mgr.pool.ref_count(1) == 2
    transfers = mgr.take_transfers()
    assert transfers.copies == ((1, 2), (1, 3))
    assert mgr.pool.ref_count(1) == 0
    assert mgr.pool.free_order() == [4, 5, 6, 7, 1]
    kv.apply(transfers)
    _write(mgr, kv, a, 1)
    _write(mgr, kv, b, 1)
    for r in (a, b):
        assert kv.read(mgr.block_table(r.request_id), 7) == expected_history(r)
    check_manager(mgr)
    free_all(mgr)


def test_copy_source_outlives_its_last_table_until_the_copy_is_taken() -> None:
    mgr, a, _, _ = _forked_pair()
    assert mgr.append_slots(a, 1)
    mgr.free("b")
    assert mgr.pool.ref_count(1) == 1  # only the pin holds it
    assert 1 not in mgr.pool.free_order()
    check_manager(mgr)
    assert mgr.take_transfers().copies == ((1, 2),)
    assert mgr.pool.ref_count(1) == 0
    assert mgr.pool.free_order() == [3, 4, 5, 6, 7, 1]
    free_all(mgr)


def test_append_slots_grows_by_one_block_at_each_boundary() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    r = make_request("r", [1, 2])
    prefill(mgr, r)
    assert mgr.block_table("r") == [0]
    grown = [[0, 1], [0, 1], [0, 1, 2], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3]]
    for step, expected in enumerate(grown):
        r.append_token(step)
        assert mgr.append_slots(r, 1)
        assert mgr.block_table("r") == expected
        r.num_computed_tokens += 1
    r.append_token(9)
    before = manager_state(mgr)
    assert not mgr.append_slots(r, 1)  # pool exhausted: normal flow, nothing changed
    assert manager_state(mgr) == before
    check_manager(mgr)


# ---- swapping ------------------------------------------------------------------------------


def test_swap_out_and_in_of_two_requests_sharing_blocks_moves_each_block_once() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=8)
    kv = SimulatedKV(8, 8, 4)
    a = make_request("a", range(1, 7))
    prefill(mgr, a)
    kv.write(mgr.block_table("a"), a, 0, 6)
    b = fork_of(a, "b")
    mgr.fork(a, b)

    assert mgr.swap_out("a")
    assert mgr.host_block_table("a") == [0, 1]
    assert refs(mgr, [0, 1]) == [1, 1]
    assert mgr.swap_out("b")
    assert mgr.host_block_table("b") == [0, 1]
    assert [mgr.host_pool.ref_count(h) for h in (0, 1)] == [2, 2]  # type: ignore[union-attr]
    assert list(mgr.pool.iter_free()) == [2, 3, 4, 5, 6, 7, 1]
    assert list(mgr.pool.iter_evictable()) == [0]  # cached: still a prefix hit
    out = mgr.take_transfers()
    assert out == BlockTransfers(swap_out=((0, 0), (1, 1)))
    assert mgr.usage().num_swapped_out_blocks == 2
    kv.apply(out)
    check_manager(mgr)

    assert mgr.swap_in("a")
    assert mgr.swap_in("b")
    assert mgr.block_table("a") == [2, 3] and mgr.block_table("b") == [2, 3]
    assert refs(mgr, [2, 3]) == [2, 2]
    assert mgr.host_pins() == Counter({0: 1, 1: 1})  # sources alive until taken
    check_manager(mgr)
    back = mgr.take_transfers()
    assert back == BlockTransfers(swap_in=((0, 2), (1, 3)))
    assert mgr.usage().num_swapped_in_blocks == 2
    # Host pins are released last-first, like a table on the device: the tail is reused first.
    assert mgr.host_pool.free_order() == [2, 3, 4, 5, 6, 7, 1, 0]  # type: ignore[union-attr]
    assert mgr.pool.free_order() == [4, 5, 6, 7, 1, 0]
    kv.apply(back)
    for r in (a, b):
        assert kv.read(mgr.block_table(r.request_id), 6) == expected_history(r)
    check_manager(mgr)
    free_all(mgr)


def test_swap_out_without_host_room_returns_false_and_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=2)
    prefill(mgr, make_request("a", range(9)))  # 3 blocks, the host has 2
    before = manager_state(mgr)
    assert mgr.swap_out("a") is False
    assert manager_state(mgr) == before
    assert mgr.has_table("a") and not mgr.is_swapped("a")
    check_manager(mgr)


def test_swap_out_without_a_host_pool_returns_false() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    prefill(mgr, make_request("a", range(3)))
    before = manager_state(mgr)
    assert mgr.swap_out("a") is False
    assert manager_state(mgr) == before


def test_swap_in_without_device_room_returns_false_and_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=4)
    prefill(mgr, make_request("a", range(9)))
    assert mgr.swap_out("a")
    mgr.take_transfers()
    prefill(mgr, make_request("b", range(100, 113)))  # takes all 4 device blocks
    before = manager_state(mgr)
    assert mgr.swap_in("a") is False
    assert manager_state(mgr) == before
    assert mgr.is_swapped("a")
    check_manager(mgr)


# ---- a pending copy-on-write and a release in the same step -----------------------------------
# The plan applies swap_out, swap_in, then copies. A request that got a copy-on-write block in
# this step may still be preempted (freed or swapped out) before the plan is taken. Its pending
# copy must then not land on a block handed to someone else, and a swap-out of its table must
# carry the copied contents.


def test_pending_copy_does_not_overwrite_a_block_reused_by_swap_in() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2, num_host_blocks=4)
    kv = SimulatedKV(4, 4, 2)
    c = make_request("c", [7, 7, 7])
    prefill(mgr, c)
    kv.write(mgr.block_table("c"), c, 0, 3)
    assert mgr.swap_out("c")
    kv.apply(mgr.take_transfers())

    a = make_request("a", [1, 2, 3])
    prefill(mgr, a)
    assert mgr.block_table("a") == [2, 3]
    kv.write(mgr.block_table("a"), a, 0, 3)
    a.append_token(4)
    mgr.fork(a, fork_of(a, "b"))
    assert mgr.append_slots(a, 1)  # copy-on-write 3 -> 1, pending
    assert mgr.block_table("a") == [2, 1]
    mgr.free("a")  # preempted (recompute) in the same step: block 1 is free again
    assert mgr.swap_in("c")
    assert 1 in mgr.block_table("c")
    kv.apply(mgr.take_transfers())
    assert kv.read(mgr.block_table("c"), 3) == expected_history(c)
    check_manager(mgr)


def test_swap_out_after_a_pending_copy_carries_the_copied_contents() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2, num_host_blocks=8)
    kv = SimulatedKV(8, 8, 2)
    a = make_request("a", [1, 2, 3])
    prefill(mgr, a)
    kv.write(mgr.block_table("a"), a, 0, 3)
    a.append_token(4)
    mgr.fork(a, fork_of(a, "b"))
    assert mgr.append_slots(a, 1)  # copy-on-write 1 -> 2, pending
    assert mgr.swap_out("a")  # preempted (swap) in the same step, before it wrote
    kv.apply(mgr.take_transfers())
    assert kv.read(mgr.host_block_table("a"), 3, host=True) == expected_history(a)
    check_manager(mgr)


# ---- bad input: typed error, nothing changed ---------------------------------------------------


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (-1, 4), (8, 0), (8, -2)], ids=str)
def test_bad_manager_sizes_are_rejected(num_blocks: int, block_size: int) -> None:
    with pytest.raises(InvalidRequestError):
        KVCacheManager(num_blocks, block_size)


def test_negative_host_pool_size_is_rejected() -> None:
    with pytest.raises(InvalidRequestError):
        KVCacheManager(8, 4, num_host_blocks=-1)


def _busy_manager() -> tuple[KVCacheManager, Request, Request]:
    """A (6 tokens) forked into B (shared partial block 1), C swapped out, a cached block."""
    mgr = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=4)
    a = make_request("a", range(1, 7))
    prefill(mgr, a)
    b = fork_of(a, "b")
    mgr.fork(a, b)
    prefill(mgr, make_request("c", range(20, 25)))
    assert mgr.swap_out("c")
    mgr.take_transfers()
    return mgr, a, b


def _expect_unchanged(mgr: KVCacheManager, call: Callable[[], object], error: type) -> None:
    before = manager_state(mgr)
    with pytest.raises(error):
        call()
    assert manager_state(mgr) == before
    check_manager(mgr)


def test_prompt_larger_than_the_whole_pool_is_rejected() -> None:
    mgr, _, _ = _busy_manager()
    too_long = make_request("x", range(33))  # 9 blocks of 4; the pool has 8
    _expect_unchanged(mgr, lambda: mgr.allocate(too_long, 33), PromptTooLongError)
    assert issubclass(PromptTooLongError, InvalidRequestError)
    assert not mgr.has_table("x")
    whole_pool = make_request("y", range(32))  # 8 blocks: fits the pool, just not now
    before = manager_state(mgr)
    assert mgr.allocate(whole_pool, 32) is None
    assert manager_state(mgr) == before


@pytest.mark.parametrize("num_new_tokens", [0, -1, 7, 1.5], ids=str)
def test_allocate_rejects_bad_token_counts(num_new_tokens: int) -> None:
    mgr, _, _ = _busy_manager()
    request = make_request("x", range(6))
    _expect_unchanged(mgr, lambda: mgr.allocate(request, num_new_tokens), InvalidRequestError)


def test_allocate_twice_is_rejected() -> None:
    mgr, a, _ = _busy_manager()
    _expect_unchanged(mgr, lambda: mgr.allocate(a, 1), InvalidRequestError)
    c_again = make_request("c", range(20, 25))  # swapped out: it still holds host blocks
    _expect_unchanged(mgr, lambda: mgr.allocate(c_again, 5), InvalidRequestError)


@pytest.mark.parametrize("num_new_tokens", [0, -1], ids=str)
def test_append_slots_rejects_non_positive_token_counts(num_new_tokens: int) -> None:
    mgr, a, _ = _busy_manager()
    a.append_token(9)
    _expect_unchanged(mgr, lambda: mgr.append_slots(a, num_new_tokens), InvalidRequestError)


def test_fork_rejects_an_existing_child_and_a_mismatched_start() -> None:
    mgr, a, b = _busy_manager()
    _expect_unchanged(mgr, lambda: mgr.fork(a, b), InvalidRequestError)
    _expect_unchanged(mgr, lambda: mgr.fork(a, a), InvalidRequestError)
    late = fork_of(a, "late")
    late.num_computed_tokens = 2
    _expect_unchanged(mgr, lambda: mgr.fork(a, late), InvalidRequestError)


GHOST = make_request("ghost", [1, 2, 3])
UNKNOWN_ID_CALLS: dict[str, Callable[[KVCacheManager], object]] = {
    "free": lambda m: m.free("ghost"),
    "append_slots": lambda m: m.append_slots(GHOST, 1),
    "fork parent": lambda m: m.fork(GHOST, make_request("kid", [1, 2, 3])),
    "swap_out": lambda m: m.swap_out("ghost"),
    "swap_in": lambda m: m.swap_in("ghost"),
    "swap_in of a resident request": lambda m: m.swap_in("a"),
    "swap_out of a swapped request": lambda m: m.swap_out("c"),
    "block_table": lambda m: m.block_table("ghost"),
    "host_block_table": lambda m: m.host_block_table("a"),
    "commit": lambda m: m.commit(GHOST),
}


@pytest.mark.parametrize("call", UNKNOWN_ID_CALLS.values(), ids=UNKNOWN_ID_CALLS.keys())
def test_unknown_request_ids_raise_and_change_nothing(
    call: Callable[[KVCacheManager], object],
) -> None:
    mgr, _, _ = _busy_manager()
    _expect_unchanged(mgr, lambda: call(mgr), UnknownRequestError)


def test_freeing_a_request_twice_raises_the_second_time() -> None:
    mgr, _, _ = _busy_manager()
    mgr.free("b")
    _expect_unchanged(mgr, lambda: mgr.free("b"), UnknownRequestError)
    mgr.free("c")  # swapped requests free their host blocks
    _expect_unchanged(mgr, lambda: mgr.free("c"), UnknownRequestError)
    free_all(mgr)
