"""Shared helpers for the pagekv.core tests: requests, state snapshots, and a simulated runner.

``SimulatedKV`` stands in for the runner's KV tensors. Each slot holds the *signature* of the
K/V a real model would have written there: the request's cache salt and every token up to and
including that position (K/V depend on the whole prefix). Reading a request's history through
its block table must give back exactly its own signatures; a missing copy-on-write, a wrong
prefix hit or a transfer applied in the wrong order shows up as a mismatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pagekv.core import BlockPool, BlockTransfers, KVCacheManager, Request
from pagekv.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=1000)

Signature = tuple[str | None, tuple[int, ...]]


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def make_request(request_id: str, token_ids: Sequence[int], *, salt: str | None = None) -> Request:
    return Request(request_id, list(token_ids), PARAMS, cache_salt=salt)


def prefill(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None) -> int:
    """Admit ``request`` as a scheduler would: allocate, mark computed, commit. Returns hits."""
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - manager.num_cached_tokens(request)
    hits = manager.allocate(request, num_new_tokens)
    assert hits is not None, f"no room for {request.request_id}"
    request.num_computed_tokens = hits + num_new_tokens
    manager.commit(request)
    return hits


def pool_state(pool: BlockPool) -> dict[str, Any]:
    """Everything a pool owns, as plain values (for 'nothing changed' assertions)."""
    return {
        "free_order": pool.free_order(),
        "num_free": len(list(pool.iter_free())),
        "refs": [pool.ref_count(b) for b in range(pool.num_blocks)],
        "hashes": [pool.block_hash(b) for b in range(pool.num_blocks)],
        "index": sorted(pool.index_items()),
        "num_evictions": pool.num_evictions,
    }


def manager_state(manager: KVCacheManager) -> dict[str, Any]:
    """Everything the manager and its pools own, as plain values."""
    m = manager
    return {
        "pool": pool_state(m.pool),
        "host": None if m.host_pool is None else pool_state(m.host_pool),
        "tables": {r: (list(t.blocks), t.num_committed) for r, t in m.tables.device.items()},
        "host_tables": {r: (list(t.blocks), t.num_committed) for r, t in m.tables.host.items()},
        "pins": dict(m.pins()),
        "host_pins": dict(m.host_pins()),
        "pending": (
            list(m.pending.swap_out),
            list(m.pending.swap_in),
            list(m.pending.copies),
            list(m.tier_state._saves),
            list(m.tier_state.pending_loads),
        ),
        "twins": (dict(m.pending.host_twin), dict(m.pending.device_twin)),
        "counters": (
            m.prefix_query_tokens,
            m.prefix_hit_tokens,
            m.num_cow_copies,
            m.num_swapped_out_blocks,
            m.num_swapped_in_blocks,
        ),
        "tier": dataclasses.asdict(m.tier_state.counters),
    }


def signature(request: Request, position: int) -> Signature:
    return (request.cache_salt, tuple(request.all_token_ids[: position + 1]))


def expected_history(request: Request) -> list[Signature]:
    return [signature(request, p) for p in range(request.num_computed_tokens)]


class SimulatedKV:
    """The runner's view: device and host blocks holding per-slot signatures (None = garbage)."""

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.device: list[list[Signature | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[Signature | None]] = [
            [None] * block_size for _ in range(num_host_blocks)
        ]
        self.storage: dict[bytes, list[Signature | None]] = {}  # first write wins, like a store

    def apply(self, transfers: BlockTransfers) -> None:
        """In the documented order: saves, loads, swap_out, swap_in, copies."""
        for save in transfers.saves:
            source = self.host if save.on_host else self.device
            self.storage.setdefault(save.block_hash, list(source[save.block_id]))
        for block_hash, host_block in transfers.loads:
            self.host[host_block] = list(self.storage[block_hash])
        for device_block, host_block in transfers.swap_out:
            self.host[host_block] = list(self.device[device_block])
        for host_block, device_block in transfers.swap_in:
            self.device[device_block] = list(self.host[host_block])
        for src, dst in transfers.copies:
            self.device[dst] = list(self.device[src])

    def write(
        self,
        table: Sequence[int],
        request: Request,
        start: int,
        num_tokens: int,
        tokens: Sequence[int] | None = None,
    ) -> None:
        """Signatures of positions [start, start + num_tokens); ``tokens``: the sequence fed,
        when it runs past the request's own tokens (drafts)."""
        bs = self.block_size
        for p in range(start, start + num_tokens):
            sig = (
                signature(request, p)
                if tokens is None
                else (request.cache_salt, tuple(tokens[: p + 1]))
            )
            self.device[table[p // bs]][p % bs] = sig

    def read(self, table: Sequence[int], num_tokens: int, *, host: bool = False) -> list[Any]:
        blocks = self.host if host else self.device
        bs = self.block_size
        return [blocks[table[p // bs]][p % bs] for p in range(num_tokens)]
