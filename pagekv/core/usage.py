"""Usage figures of the KV cache: a frozen snapshot for stats, metrics and benchmarks.

Owns nothing; reads a ``UsageSource`` (the KV cache manager is one; this module does not import
it). Must not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagekv.core.block_pool import BlockPool
from pagekv.core.block_table import NO_BLOCK


class UsageSource(Protocol):
    """What a snapshot reads: the device pool, the block tables and the manager's counters."""

    pool: BlockPool
    block_size: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_cow_copies: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int

    def table_fills(self) -> Iterable[tuple[Sequence[int], int]]:
        """Each device table's blocks and its request's computed tokens."""
        ...


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of the device pool, for stats and metrics."""

    num_blocks: int
    num_free_blocks: int  # FREE only
    num_used_blocks: int
    num_evictable_blocks: int
    num_logical_blocks: int  # table entries: the blocks the same tables would need unshared
    num_slots_allocated: int  # used blocks x block size
    num_tokens_stored: int  # computed tokens in used blocks, shared blocks counted once
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_cow_copies: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_evictions: int

    @property
    def sharing_saving(self) -> float:
        """Share of table entries that sharing (forks, beams, prefix hits) did not allocate."""
        if self.num_logical_blocks == 0:
            return 0.0
        return max(0.0, 1.0 - self.num_used_blocks / self.num_logical_blocks)

    @property
    def internal_fragmentation(self) -> float:
        """Share of allocated slots that hold no token (the tails of last blocks)."""
        if self.num_slots_allocated == 0:
            return 0.0
        return 1.0 - self.num_tokens_stored / self.num_slots_allocated

    @classmethod
    def of(cls, manager: UsageSource) -> KVUsage:
        fill: dict[int, int] = {}
        num_logical = 0
        for blocks, computed in manager.table_fills():
            for i, block_id in enumerate(blocks):
                if block_id == NO_BLOCK:  # given back under a sliding window
                    continue
                num_logical += 1
                tokens = min(manager.block_size, max(0, computed - i * manager.block_size))
                fill[block_id] = max(fill.get(block_id, 0), tokens)
        pool = manager.pool
        return cls(
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks - pool.num_evictable_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_evictable_blocks=pool.num_evictable_blocks,
            num_logical_blocks=num_logical,
            num_slots_allocated=pool.num_used_blocks * manager.block_size,
            num_tokens_stored=sum(fill.values()),
            prefix_query_tokens=manager.prefix_query_tokens,
            prefix_hit_tokens=manager.prefix_hit_tokens,
            num_cow_copies=manager.num_cow_copies,
            num_swapped_out_blocks=manager.num_swapped_out_blocks,
            num_swapped_in_blocks=manager.num_swapped_in_blocks,
            num_evictions=pool.num_evictions,
        )
