"""In-batch prefix sharing: which prefix blocks a step's prefills complete, for the scheduler.

Requests that arrive together with a common prefix (a system prompt, n samples of one prompt
sent separately) would each compute it in the same step, because a block becomes a prefix hit
only once computed. So a waiting request whose next uncached block is completed by a prefill
of this step waits one step and then hits it (SGLang does the same). Only prefills (chunks of
2+ tokens) are looked at: the decode hot path pays nothing. Must not import torch.
"""

from __future__ import annotations

from pagekv.core.block_pool import BlockHash
from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.request import Request


def blocks_completed(
    kv: KVCacheManager, request: Request, start: int, num_new: int
) -> list[BlockHash]:
    """Hashes of the shareable prefix blocks that tokens [start, start + num_new) fill."""
    if num_new < 2 or not kv.enable_prefix_caching:
        return []
    block_size = kv.block_size
    return kv.prefix_chain(request)[start // block_size : (start + num_new) // block_size]


def next_block_in(
    kv: KVCacheManager, request: Request, num_cached: int, computing: set[BlockHash]
) -> bool:
    """Whether the request's next uncached prefix block is one this step computes."""
    if not computing or not request.reads_prefix_cache:
        return False
    chain = kv.prefix_chain(request)
    index = num_cached // kv.block_size
    return index < len(chain) and chain[index] in computing
