"""Every check in pagekv.core.invariants fires on a planted corruption and names the block.

Each case builds the same clean, busy state through the public API, corrupts one piece of the
private bookkeeping, and expects ``InvariantError`` whose message names the offending block
(or request). The clean state itself must pass every check.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from pagekv.core import KVCacheManager, Plan, Request, ScheduledRequest
from pagekv.core.invariants import check_manager, check_no_leak, check_plan, check_pool
from pagekv.errors import InvariantError
from tests.core.helpers import make_request, prefill


@dataclass
class World:
    """Block size 4, 8 device blocks, 4 host blocks::

    a   [0, 1, 2]   10 tokens computed; 0 and 1 cached          (refs 2 2 2, shared with e)
    e   [0, 1, 2]   fork of a
    b   host [0, 1, 2]  fork of a, swapped out: device 0, 1, 2 twin host 0, 1, 2
    free list [6, 7, 5], evictable [4, 3] (a finished request's cached blocks)
    """

    mgr: KVCacheManager
    a: Request


def fork_of(parent: Request, request_id: str) -> Request:
    child = make_request(request_id, parent.all_token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    return child


def build_world() -> World:
    mgr = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=4)
    a = make_request("a", range(10))
    prefill(mgr, a)
    mgr.fork(a, fork_of(a, "b"))
    mgr.fork(a, fork_of(a, "e"))
    assert mgr.swap_out("b")
    mgr.take_transfers()
    prefill(mgr, make_request("c", range(100, 109)))
    mgr.free("c")
    assert mgr.block_table("a") == [0, 1, 2] == mgr.block_table("e")
    assert mgr.host_block_table("b") == [0, 1, 2]
    assert mgr.pool.free_order() == [6, 7, 5, 4, 3]
    assert dict(mgr.pending.host_twin) == {0: 0, 1: 1, 2: 2}
    return World(mgr, a)


def test_the_clean_world_passes_every_check() -> None:
    w = build_world()
    check_pool(w.mgr.pool)
    assert w.mgr.host_pool is not None
    check_pool(w.mgr.host_pool)
    check_manager(w.mgr)
    w.a.append_token(10)
    assert w.mgr.append_slots(w.a, 1)  # copy-on-write out of the shared block 2
    plan = Plan(1, (ScheduledRequest(w.a, 10, 1, w.mgr.block_table("a")),), w.mgr.take_transfers())
    check_plan(w.mgr, plan)
    for rid in ("a", "b", "e"):
        w.mgr.free(rid)
    check_no_leak(w.mgr)


# ---- one planted corruption per check --------------------------------------------------------


def _stale_index(w: World) -> None:
    w.mgr.pool._index[b"\x00" * 16] = 6


def _unindexed(w: World) -> None:
    block_hash = w.mgr.pool._hash[1]
    assert block_hash is not None
    del w.mgr.pool._index[block_hash]


def _wrong_hash_on_used_block(w: World) -> None:
    w.mgr.pool._hash[2] = b"\x01" * 16


def _non_mutual_twin(w: World) -> None:
    w.mgr.pending.device_twin[0] = 5


def _dead_twin(w: World) -> None:
    w.mgr.pending.host_twin[6] = 3
    w.mgr.pending.device_twin[3] = 6


def _one_sided_twin(w: World) -> None:
    w.mgr.pending.device_twin[3] = 7


def _uncovered_computed(w: World) -> None:
    w.a.num_computed_tokens = 13  # the table covers 12


def _pin_without_block(w: World) -> None:
    w.mgr.pending.pins[7] += 1


def _leaked_block(w: World) -> None:
    for rid in ("a", "b", "e"):
        w.mgr.free(rid)
    w.mgr.take_transfers()
    check_no_leak(w.mgr)
    assert w.mgr.pool.allocate_one() == 6  # in use, but no table entry or pin owns it


PLANTS: dict[str, tuple[Callable[[World], None], Callable[[KVCacheManager], None], str, int]] = {
    # name: (corrupt, check, message fragment, block the message must name)
    "free list holds a block twice": (
        lambda w: w.mgr.pool._free.append(7),
        check_manager,
        "free list holds a block twice",
        7,
    ),
    "block both free and evictable": (
        lambda w: w.mgr.pool._evictable.__setitem__(6, None),
        check_manager,
        "both free and evictable",
        6,
    ),
    "used block in the free list": (
        lambda w: w.mgr.pool._free.append(1),
        check_manager,
        "state disagrees",
        1,
    ),
    "free block lost from the free list": (
        lambda w: w.mgr.pool._free.remove(5),
        check_manager,
        "state disagrees",
        5,
    ),
    "negative ref count": (
        lambda w: w.mgr.pool._ref.__setitem__(7, -1),
        check_manager,
        "state disagrees",
        7,
    ),
    "unknown id in the free list": (
        lambda w: w.mgr.pool._free.append(99),
        check_manager,
        "ids outside the pool",
        99,
    ),
    "wrong device ref count": (
        lambda w: w.mgr.pool._ref.__setitem__(1, 3),
        check_manager,
        "device: ref count != table entries + pins",
        1,
    ),
    "wrong host ref count": (
        lambda w: w.mgr.host_pool._ref.__setitem__(2, 2),  # type: ignore[union-attr]
        check_manager,
        "host: ref count != table entries + pins",
        2,
    ),
    "pin on a block that holds no such reference": (
        _pin_without_block,
        check_manager,
        "ref count != table entries + pins",
        7,
    ),
    "stale hash-index entry": (_stale_index, check_manager, "hash index entry", 6),
    "hashed block missing from the index": (
        _unindexed,
        check_manager,
        "missing from the hash index",
        1,
    ),
    "hash changed under a used block": (
        _wrong_hash_on_used_block,
        check_manager,
        "missing from the hash index",
        2,
    ),
    "table does not cover computed tokens": (
        _uncovered_computed,
        check_manager,
        "does not cover its computed tokens",
        2,
    ),
    "twin not mutual": (_non_mutual_twin, check_manager, "not mutual", 0),
    "twin not alive on both sides": (_dead_twin, check_manager, "not alive on both sides", 6),
    "twin known on one side only": (_one_sided_twin, check_manager, "twin", 7),
    "leaked block": (_leaked_block, check_no_leak, "ref count", 6),
}


@pytest.mark.parametrize(
    ("corrupt", "check", "fragment", "block"), PLANTS.values(), ids=PLANTS.keys()
)
def test_planted_corruption_fires_and_names_the_block(
    corrupt: Callable[[World], None],
    check: Callable[[KVCacheManager], None],
    fragment: str,
    block: int,
) -> None:
    w = build_world()
    check_manager(w.mgr)  # clean before
    corrupt(w)
    with pytest.raises(InvariantError) as info:
        check(w.mgr)
    message = str(info.value)
    assert fragment in message
    assert re.search(rf"\bblock {block}\b", message), f"block {block} not named in:\n{message}"


# ---- check_plan: scheduled coverage and no write into a shared block ----------------------------


def test_check_plan_fires_on_a_write_into_a_shared_block() -> None:
    w = build_world()
    w.a.append_token(10)
    # Hand-built: A writes position 10 into block 2, which A shares with E (no copy-on-write).
    plan = Plan(7, (ScheduledRequest(w.a, 10, 1, w.mgr.block_table("a")),), w.mgr.take_transfers())
    with pytest.raises(InvariantError, match=r"step 7: 'a' writes into shared blocks") as info:
        check_plan(w.mgr, plan)
    assert re.search(r"\bblock 2\b", str(info.value))
    assert "owners=['a', 'e']" in str(info.value)


def test_check_plan_fires_on_a_plan_beyond_the_table() -> None:
    w = build_world()
    w.a.all_token_ids += [10, 11, 12]
    plan = Plan(1, (ScheduledRequest(w.a, 10, 3, [0, 1, 2]),), w.mgr.take_transfers())
    with pytest.raises(InvariantError, match="does not cover scheduled tokens") as info:
        check_plan(w.mgr, plan)
    assert re.search(r"\bblock 2\b", str(info.value))


def test_check_plan_accepts_reads_of_shared_blocks() -> None:
    w = build_world()
    w.a.append_token(10)
    assert w.mgr.append_slots(w.a, 1)
    assert w.mgr.block_table("a") == [0, 1, 6]
    plan = Plan(1, (ScheduledRequest(w.a, 10, 1, w.mgr.block_table("a")),), w.mgr.take_transfers())
    check_plan(w.mgr, plan)  # blocks 0 and 1 stay shared; only block 6 is written


# ---- check_no_leak ---------------------------------------------------------------------------


def test_check_no_leak_fires_while_a_request_still_holds_blocks() -> None:
    w = build_world()
    w.mgr.free("a")
    w.mgr.free("e")
    with pytest.raises(InvariantError, match=r"still hold blocks.*'b'"):
        check_no_leak(w.mgr)


def test_freeing_a_copy_destination_cancels_the_copy_and_its_pin() -> None:
    w = build_world()
    w.a.append_token(10)
    assert w.mgr.append_slots(w.a, 1)  # pins block 2 until take_transfers
    assert w.mgr.pins() == {2: 1}
    for rid in ("a", "b", "e"):
        w.mgr.free(rid)
    assert w.mgr.pins() == {}  # nobody will read the destination: the copy is cancelled
    check_no_leak(w.mgr)
    assert w.mgr.take_transfers().copies == ()


def test_check_no_leak_fires_on_a_pin_never_released() -> None:
    w = build_world()
    for rid in ("a", "b", "e"):
        w.mgr.free(rid)
    check_no_leak(w.mgr)
    pool = w.mgr.pool
    block = pool.free_order()[0]
    w.mgr.pending.pins[block] += 1  # plant: a pin that stays after every request has ended
    pool._ref[block] = 1
    pool._free.remove(block)
    with pytest.raises(InvariantError, match=r"leak") as info:
        check_no_leak(w.mgr)
    assert re.search(rf"\bblock {block}\b", str(info.value))


def test_freeing_a_swap_in_destination_cancels_the_move_and_its_host_pin() -> None:
    w = build_world()
    w.mgr.free("a")
    w.mgr.free("e")  # device copies gone: b's swap-in must move every block
    assert w.mgr.swap_in("b")  # pins host 0, 1, 2 until take_transfers
    assert w.mgr.host_pins() == {0: 1, 1: 1, 2: 1}
    w.mgr.free("b")
    assert w.mgr.host_pins() == {}
    check_no_leak(w.mgr)
    assert w.mgr.take_transfers().swap_in == ()
