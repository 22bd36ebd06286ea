"""pagekv.core: the KV cache as managed memory, and the scheduler that spends it. No torch here.

Glossary:
- token: one position of a sequence; its K/V (every layer, every KV head) occupies one slot.
- slot: a token-sized place in the KV pool; ``slot = block_id * block_size + offset``.
- block: ``block_size`` consecutive slots; the unit of allocation, sharing and eviction.
- block table: per request, logical block i -> physical block id (owned by the KV manager,
  held in its ``BlockTables``).
- ref count: how many table entries (plus transfer pins) point at a block; > 1 means shared,
  and a shared block is never written: copy-on-write gives the writer its own block first.
- pending transfers: the swaps, copies and offloads the next plan carries, and the pins that
  keep their sources alive until it is taken (``PendingTransfers``; saves and loads are the
  tier state's).
- prefix cache: full, computed blocks indexed by a hash chain over their tokens; unreferenced
  cached blocks are EVICTABLE and still hit until reused.
- tier: where a block's K/V lives: device pool, host pool (swap, host cache), storage. What
  is written down, and when (the write policy), is the tier state's (``TierState``).
"""

from pagekv.core.block_pool import BlockPool, BlockState
from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.plan import BlockTransfers, Plan, ScheduledRequest
from pagekv.core.request import Request, RequestStatus
from pagekv.core.usage import KVUsage

__all__ = [
    "BlockPool",
    "BlockState",
    "BlockTransfers",
    "KVCacheManager",
    "KVUsage",
    "Plan",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
]
