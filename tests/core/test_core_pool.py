"""BlockPool through its public API: exact block ids, ref counts and free-list order.

The pool hands out FREE blocks first (FIFO: freed last, reused last), then evicts the least
recently used EVICTABLE block. Every bad call raises a typed error and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagekv.core import BlockPool, BlockState
from pagekv.core.invariants import check_pool
from pagekv.errors import (
    BlockError,
    DoubleFreeError,
    InvalidRequestError,
    NoFreeBlocksError,
    UnknownBlockError,
)
from tests.core.helpers import pool_state


def h(n: int) -> bytes:
    return n.to_bytes(16, "little")


# ---- allocation order ------------------------------------------------------------------------


def test_fresh_pool_hands_out_blocks_in_id_order() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.free_order() == list(range(8))
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate_one() == 3
    assert [pool.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert pool.free_order() == [4, 5, 6, 7]
    assert (pool.num_used_blocks, pool.num_free_blocks, pool.num_evictable_blocks) == (4, 4, 0)
    assert pool.state(0) is BlockState.IN_USE and pool.state(4) is BlockState.FREE
    check_pool(pool)


def test_freed_blocks_go_to_the_tail_fifo() -> None:
    pool = BlockPool(8, 4)
    pool.allocate(3)
    pool.free([1])
    pool.free([0])
    assert pool.free_order() == [3, 4, 5, 6, 7, 1, 0]
    assert pool.allocate(5) == [3, 4, 5, 6, 7]
    assert pool.allocate_one() == 1
    check_pool(pool)


def test_shared_block_returns_only_when_its_last_reference_is_freed() -> None:
    pool = BlockPool(4, 4)
    block = pool.allocate_one()
    pool.touch([block, block])
    assert pool.ref_count(block) == 3
    pool.free([block])
    assert pool.ref_count(block) == 2 and block not in pool.free_order()
    pool.free([block, block])  # one call may drop several references of one block
    assert pool.ref_count(block) == 0
    assert pool.free_order() == [1, 2, 3, 0]
    check_pool(pool)


def test_allocate_zero_blocks_is_a_no_op() -> None:
    pool = BlockPool(4, 4)
    assert pool.allocate(0) == []
    assert pool.free_order() == [0, 1, 2, 3]


# ---- prefix-cache state: commit, evictable LRU, eviction ------------------------------------


def test_committed_blocks_become_evictable_in_release_order_and_evict_lru_first() -> None:
    pool = BlockPool(4, 2)
    assert pool.allocate(3) == [0, 1, 2]
    for b in (0, 1, 2):
        assert pool.commit(b, h(b)) is True
    pool.free([2, 1, 0])  # a table is released last-to-first
    assert pool.free_order() == [3, 2, 1, 0]
    assert list(pool.iter_evictable()) == [2, 1, 0]
    assert [pool.state(b) for b in (0, 1, 2)] == [BlockState.EVICTABLE] * 3
    assert pool.lookup(h(1)) == 1  # still a hit while evictable
    assert (pool.num_free_blocks, pool.num_evictable_blocks) == (4, 3)

    assert pool.allocate_one() == 3  # FREE before EVICTABLE
    assert pool.num_evictions == 0
    assert pool.allocate_one() == 2  # then the least recently used cached block
    assert pool.num_evictions == 1
    assert pool.lookup(h(2)) is None and pool.block_hash(2) is None
    assert pool.ref_count(2) == 1
    assert pool.free_order() == [1, 0]
    check_pool(pool)


def test_touch_revives_an_evictable_block_and_refreshes_its_recency() -> None:
    pool = BlockPool(3, 2)
    pool.allocate(3)
    for b in (0, 1, 2):
        pool.commit(b, h(b))
    pool.free([2, 1, 0])
    pool.touch([2])  # a prefix hit on the LRU block
    assert pool.state(2) is BlockState.IN_USE and pool.ref_count(2) == 1
    assert pool.free_order() == [1, 0]
    pool.free([2])
    assert pool.free_order() == [1, 0, 2]  # most recently used end
    assert pool.allocate(2) == [1, 0]
    assert pool.num_evictions == 2
    check_pool(pool)


def test_commit_keeps_the_first_copy_of_a_hash() -> None:
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    assert pool.commit(a, h(7)) is True
    assert pool.commit(b, h(7)) is False  # computed twice at once: b stays uncached
    assert pool.commit(a, h(8)) is False  # a block carries one hash for life
    assert (pool.block_hash(a), pool.block_hash(b)) == (h(7), None)
    assert pool.lookup(h(7)) == a and pool.lookup(h(8)) is None
    pool.free([b, a])
    assert pool.free_order() == [2, 3, b, a]
    assert list(pool.iter_free()) == [2, 3, b] and list(pool.iter_evictable()) == [a]
    check_pool(pool)


def test_evict_all_moves_every_evictable_block_to_the_free_tail_in_lru_order() -> None:
    pool = BlockPool(4, 2)
    pool.allocate(4)
    for b in (0, 1, 2):
        pool.commit(b, h(b))
    pool.free([1, 3, 0])
    pool.free([2])  # still referenced cached blocks are not touched by evict_all...
    pool.touch([2])
    assert pool.evict_all() == 2
    assert pool.free_order() == [3, 1, 0]
    assert pool.index_items() == [(h(2), 2)]  # ...and stay cached
    assert pool.num_evictions == 0  # a reset is not an eviction under pressure
    check_pool(pool)


# ---- bad input: typed error, nothing changed -------------------------------------------------


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "param"),
    [(0, 4, "num_blocks"), (-3, 4, "num_blocks"), (8, 0, "block_size"), (8, -1, "block_size")],
)
def test_bad_pool_sizes_are_rejected(num_blocks: int, block_size: int, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        BlockPool(num_blocks, block_size)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)


def _pool_with_state() -> BlockPool:
    """Blocks 0, 1 in use (1 shared), 2 evictable, 3 and 4 free."""
    pool = BlockPool(5, 2)
    pool.allocate(3)
    pool.touch([1])
    pool.commit(2, h(2))
    pool.free([2])
    return pool


BAD_POOL_CALLS: list[tuple[str, Callable[[BlockPool], object], type[Exception]]] = [
    ("double free", lambda p: p.free([3]), DoubleFreeError),
    ("double free of an evictable block", lambda p: p.free([2]), DoubleFreeError),
    ("free more references than held", lambda p: p.free([0, 0]), DoubleFreeError),
    ("double free after a good id", lambda p: p.free([1, 0, 4]), DoubleFreeError),
    ("free an id past the pool", lambda p: p.free([5]), UnknownBlockError),
    ("free a negative id", lambda p: p.free([-1]), UnknownBlockError),
    ("free a bad id after good ones", lambda p: p.free([0, 1, 99]), UnknownBlockError),
    ("touch a free block", lambda p: p.touch([0, 3]), UnknownBlockError),
    ("touch an unknown block", lambda p: p.touch([1, 5]), UnknownBlockError),
    ("commit a free block", lambda p: p.commit(3, h(3)), UnknownBlockError),
    ("commit an unknown block", lambda p: p.commit(7, h(7)), UnknownBlockError),
    ("ref count of an unknown block", lambda p: p.ref_count(5), UnknownBlockError),
    ("state of an unknown block", lambda p: p.state(-1), UnknownBlockError),
    ("allocate a negative number", lambda p: p.allocate(-1), InvalidRequestError),
    ("allocate more than free + evictable", lambda p: p.allocate(4), NoFreeBlocksError),
]


@pytest.mark.parametrize(
    ("call", "error"), [c[1:] for c in BAD_POOL_CALLS], ids=[c[0] for c in BAD_POOL_CALLS]
)
def test_bad_pool_calls_raise_and_change_nothing(
    call: Callable[[BlockPool], object], error: type[Exception]
) -> None:
    pool = _pool_with_state()
    before = pool_state(pool)
    with pytest.raises(error):
        call(pool)
    assert pool_state(pool) == before
    check_pool(pool)


def test_block_errors_are_value_errors_with_a_common_base() -> None:
    assert issubclass(DoubleFreeError, BlockError) and issubclass(UnknownBlockError, BlockError)
    assert issubclass(BlockError, ValueError)


def test_allocate_one_on_an_exhausted_pool_raises_and_changes_nothing() -> None:
    pool = BlockPool(2, 2)
    pool.allocate(2)
    before = pool_state(pool)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate_one()
    assert pool_state(pool) == before


# ---- model-based: random operation sequences against a list-based model ---------------------


class PoolModel:
    """FREE as a plain list (FIFO), EVICTABLE as a plain list (LRU first)."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self.evictable: list[int] = []
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.index: dict[bytes, int] = {}

    def take(self) -> int:
        if self.free:
            b = self.free.pop(0)
        else:
            b = self.evictable.pop(0)
            if self.index.get(self.hash[b]) == b:  # type: ignore[arg-type]
                del self.index[self.hash[b]]  # type: ignore[arg-type]
            self.hash[b] = None
        self.ref[b] = 1
        return b

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            (self.free if self.hash[b] is None else self.evictable).append(b)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc_one", "free", "touch", "commit"]), st.integers(0, 9)
    ),
    max_size=60,
)


@given(num_blocks=st.integers(1, 8), ops=OPS)
def test_pool_matches_a_list_model(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    pool, model = BlockPool(num_blocks, 2), PoolModel(num_blocks)
    held: list[int] = []  # one entry per reference we own
    for op, arg in ops:
        if op == "alloc":
            n = arg % 3
            if n > len(model.free) + len(model.evictable):
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(n)
            else:
                got = pool.allocate(n)
                assert got == [model.take() for _ in range(n)]
                held += got
        elif op == "alloc_one" and (model.free or model.evictable):
            b = pool.allocate_one()
            assert b == model.take()
            held.append(b)
        elif op == "free" and held:
            b = held.pop(arg % len(held))
            pool.free([b])
            model.release(b)
        elif op == "touch":
            cached = [b for b in range(num_blocks) if model.hash[b] is not None]
            if cached:
                b = cached[arg % len(cached)]
                pool.touch([b])
                if model.ref[b] == 0:
                    model.evictable.remove(b)
                model.ref[b] += 1
                held.append(b)
        elif op == "commit" and held:
            b = held[arg % len(held)]
            key = h(arg % 4)
            fresh = model.hash[b] is None and key not in model.index
            assert pool.commit(b, key) is fresh
            if fresh:
                model.hash[b], model.index[key] = key, b
        assert pool.free_order() == model.free + model.evictable
        assert [pool.ref_count(b) for b in range(num_blocks)] == model.ref
        assert dict(pool.index_items()) == model.index
        check_pool(pool)
