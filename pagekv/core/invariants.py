"""Invariant checks over the memory manager: pure functions that raise ``InvariantError``.

Owns nothing. Reads the internals of the pools, the manager, its block tables and its pending
transfers (that is its job) and never changes them. Tests run these after every step; the
engine runs them when ``check_invariants`` is on; benchmarks leave them off. Must not import torch.

Checked:
- every block is exactly one of FREE (in the free list), IN USE (ref > 0) or EVICTABLE
  (ref 0 with a hash, in the LRU); no duplicates in either queue; the three add up to the pool
- every block's ref count == the table entries pointing at it + its transfer pins
- every hash-index entry points at a block carrying that hash, and every hashed block is indexed
- every device table covers its request's computed tokens (and, for a plan, scheduled tokens)
- a table's given-back entries (``NO_BLOCK``) lead it, only under a sliding window, and only
  before the window of the request's next query; a plan reads and writes none of them
- no token is written into a block with ref count > 1 (copy-on-write happened first)
- twins (device/host copies known identical) are mutual and both alive
- only a caching host pool holds hashes; a host block being filled is pinned and carries its
  hash (the bytes side, checksums against the store, is tiering/manager.py's ``check``)
- once every request has ended, nothing is in use: no leak
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pagekv.core.block_pool import BlockPool
from pagekv.core.block_table import NO_BLOCK, Table
from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.plan import Plan
from pagekv.errors import InvariantError


def _dump(
    pool: BlockPool, blocks: Iterable[int], owners: dict[int, list[str]] | None = None
) -> str:
    lines = []
    for b in sorted(set(blocks)):
        block_hash = pool._hash[b]
        lines.append(
            f"  block {b}: ref={pool._ref[b]} hash={block_hash.hex()[:12] if block_hash else None}"
            f" in_free={b in pool._free} in_evictable={b in pool._evictable}"
            + (f" owners={owners.get(b, [])}" if owners is not None else "")
        )
    return "\n".join(lines)


def _fail(
    what: str, pool: BlockPool, blocks: Iterable[int], owners: dict[int, list[str]] | None = None
) -> None:
    raise InvariantError(f"{what}\n{_dump(pool, blocks, owners)}")


def check_pool(pool: BlockPool) -> None:
    """The pool's own bookkeeping: states, queues, counts and the hash index agree."""
    free = list(pool._free)
    if len(free) != len(set(free)):
        _fail("free list holds a block twice", pool, [b for b, n in Counter(free).items() if n > 1])
    free_set, evictable = set(free), set(pool._evictable)
    strays = [b for b in free_set | evictable if not 0 <= b < pool.num_blocks]
    if strays:
        named = ", ".join(f"block {b}" for b in sorted(strays))
        raise InvariantError(f"free list or LRU holds ids outside the pool: {named}")
    if free_set & evictable:
        _fail("block both free and evictable", pool, free_set & evictable)
    bad = [b for b in range(pool.num_blocks) if not _state_ok(pool, b, free_set, evictable)]
    if bad:
        _fail("block state disagrees with its queue", pool, bad)
    num_used = sum(1 for r in pool._ref if r > 0)
    if num_used + len(free_set) + len(evictable) != pool.num_blocks:
        _fail("free + used + evictable != total", pool, [])
    for block_hash, b in pool._index.items():
        if pool._hash[b] != block_hash:
            _fail(
                f"hash index entry {block_hash.hex()[:12]} points at a block without it", pool, [b]
            )
    unindexed = [b for b, h in enumerate(pool._hash) if h is not None and pool._index.get(h) != b]
    if unindexed:
        _fail("hashed block missing from the hash index", pool, unindexed)


def _state_ok(pool: BlockPool, b: int, free: set[int], evictable: set[int]) -> bool:
    ref = pool._ref[b]
    if ref < 0:
        return False
    if ref > 0:
        return b not in free and b not in evictable
    if pool._hash[b] is None:
        return b in free and b not in evictable
    return b in evictable and b not in free


def _owners(tables: Iterable[tuple[str, list[int]]]) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for rid, blocks in tables:
        for b in blocks:
            owners.setdefault(b, []).append(rid)
    return owners


def _check_refs(
    pool: BlockPool, owners: dict[int, list[str]], pins: Counter[int], where: str
) -> None:
    wrong = [b for b in range(pool.num_blocks) if pool._ref[b] != len(owners.get(b, ())) + pins[b]]
    if wrong:
        _fail(f"{where}: ref count != table entries + pins", pool, wrong, owners)


def check_manager(manager: KVCacheManager) -> None:
    """Pools, ref counts against tables, table coverage, and twins."""
    pool = manager.pool
    check_pool(pool)
    owners = _owners((rid, t.live) for rid, t in manager.tables.device.items())
    _check_refs(pool, owners, manager.pending.pins, "device")
    for rid, table in manager.tables.device.items():
        if len(table.blocks) * manager.block_size < table.request.num_computed_tokens:
            _fail(
                f"table of {rid!r} does not cover its computed tokens", pool, table.blocks, owners
            )
    for table in (*manager.tables.device.values(), *manager.tables.host.values()):
        _check_dropped(manager, table)
    host = manager.host_pool
    if host is not None:
        check_pool(host)
        host_owners = _owners((rid, t.live) for rid, t in manager.tables.host.items())
        _check_refs(host, host_owners, manager.pending.host_pins, "host")
        _check_host_cache(manager, host)
    _check_twins(manager)


def _check_host_cache(manager: KVCacheManager, host: BlockPool) -> None:
    """Only a caching host pool holds hashes; a block still being filled is pinned and hashed."""
    if not manager.tier_state.host_caching:
        cached = [b for b in range(host.num_blocks) if host._hash[b] is not None]
        if cached:
            _fail("a swap-only host pool holds prefix-cache entries", host, cached)
        return
    loads = manager.tier_state.pending_loads
    filling = [*loads, *(h for h in manager.pending.swap_out if host._hash[h] is not None)]
    bad = [h for h in filling if manager.pending.host_pins[h] < 1]
    if bad:
        _fail("a host block being filled (load or offload) is not pinned", host, bad)
    for h, block_hash in loads.items():
        if host._hash[h] != block_hash:
            _fail(f"host block {h} loads a hash it does not carry", host, [h])


def _check_dropped(manager: KVCacheManager, table: Table) -> None:
    """Given-back entries lead the table, under a window, before the next query's window."""
    n, rid = table.num_dropped, table.request.request_id
    if table.blocks[:n] != [NO_BLOCK] * n or NO_BLOCK in table.live:
        raise InvariantError(f"table of {rid!r}: NO_BLOCK entries are not exactly its first {n}")
    if n == 0:
        return
    window = manager.sliding_window
    if window is None or n * manager.block_size > table.request.num_computed_tokens - window + 1:
        raise InvariantError(
            f"table of {rid!r} gave back {n} blocks: not all before its window ({window})"
        )


def _check_twins(manager: KVCacheManager) -> None:
    pool, host = manager.pool, manager.host_pool
    for d, h in manager.pending.host_twin.items():
        if manager.pending.device_twin.get(h) != d:
            _fail(f"twin of device block {d} (host {h}) is not mutual", pool, [d])
        if pool._ref[d] == 0 or host is None or host._ref[h] == 0:
            _fail(f"twin of device block {d} (host {h}) is not alive on both sides", pool, [d])
    for h, d in manager.pending.device_twin.items():
        if manager.pending.host_twin.get(d) != h:
            _fail(f"twin of host block {h} (device {d}) is not mutual", pool, [d])


def check_plan(manager: KVCacheManager, plan: Plan) -> None:
    """Before the runner executes ``plan``: tables cover it and no write lands in a shared block."""
    pool, bs = manager.pool, manager.block_size
    for s in plan.scheduled:
        blocks = s.block_table
        end = s.start_position + s.num_tokens
        if len(blocks) * bs < end:
            _fail(
                f"table of {s.request.request_id!r} does not cover scheduled tokens", pool, blocks
            )
        written = {blocks[i] for i in range(s.start_position // bs, -(end // -bs))}
        window = manager.sliding_window
        first_read = s.start_position - (window - 1 if window is not None else s.start_position)
        if NO_BLOCK in blocks[max(0, first_read) // bs : -(end // -bs)]:
            _fail(f"step {plan.step}: {s.request.request_id!r} reads a given-back block", pool, [])
        shared = [b for b in written if pool._ref[b] > 1]
        if shared:
            owners = _owners((rid, t.live) for rid, t in manager.tables.device.items())
            _fail(
                f"step {plan.step}: {s.request.request_id!r} writes into shared blocks",
                pool,
                shared,
                owners,
            )


def check_no_leak(manager: KVCacheManager) -> None:
    """After every request has ended: no table, no pin, every block free or evictable."""
    check_manager(manager)
    leftovers = [*manager.tables.device, *manager.tables.host]
    if leftovers:
        raise InvariantError(f"requests still hold blocks after all ended: {leftovers}")
    used = [b for b in range(manager.pool.num_blocks) if manager.pool._ref[b] > 0]
    if used:
        _fail("blocks still in use after all requests ended (leak)", manager.pool, used)
    if manager.host_pool is not None:
        host_used = [
            b for b in range(manager.host_pool.num_blocks) if manager.host_pool._ref[b] > 0
        ]
        if host_used:
            _fail("host blocks still in use after all requests ended", manager.host_pool, host_used)
