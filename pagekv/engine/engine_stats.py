"""The engine's counters as one plain dict (``LLMEngine.stats``): KV usage, prefix cache,
tiers, scheduler queues and counters, the kernels in use. Reads; owns nothing.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pagekv.core.block_pool import BlockPool
from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.scheduler import Scheduler
from pagekv.runner.model_runner import ModelRunner
from pagekv.tiering.manager import TierStats


def engine_stats(
    kv: KVCacheManager,
    scheduler: Scheduler,
    tier_stats: TierStats | None,
    runner: ModelRunner,
    block_bytes: int,
) -> dict[str, Any]:
    """The numbers the server exports; ``tier_stats``: the tier manager's, if it runs."""
    usage = kv.usage()
    return {
        "kv_blocks_total": usage.num_blocks,
        "kv_blocks_free": usage.num_free_blocks,
        "kv_blocks_used": usage.num_used_blocks,
        "kv_blocks_evictable": usage.num_evictable_blocks,
        "kv_usage": usage.num_used_blocks / usage.num_blocks,
        "kv_blocks_logical": usage.num_logical_blocks,
        "kv_sharing_saving": usage.sharing_saving,
        "kv_slots_allocated": usage.num_slots_allocated,
        "kv_tokens_stored": usage.num_tokens_stored,
        "kv_internal_fragmentation": usage.internal_fragmentation,
        "kv_bytes_per_token": block_bytes / kv.block_size,  # in the KV cache's dtype
        "kv_tokens_per_gib": 2**30 * kv.block_size / block_bytes,
        "prefix_cache_query_tokens": usage.prefix_query_tokens,
        "prefix_cache_hit_tokens": usage.prefix_hit_tokens,
        "prefix_cache_evictions": usage.num_evictions,
        "cow_copies": usage.num_cow_copies,
        "swapped_out_blocks": usage.num_swapped_out_blocks,
        "swapped_in_blocks": usage.num_swapped_in_blocks,
        **asdict(scheduler.counters),
        **asdict(kv.tier_state.counters),
        **(asdict(tier_stats) if tier_stats is not None else {}),
        "host_hit_bytes": kv.tier_state.counters.host_hit_blocks * block_bytes,
        "host_blocks_total": kv.num_host_blocks,
        "host_blocks_cached": (len(kv.host_pool.index_items()) if kv.host_pool is not None else 0),
        "kernels": dict(runner.kernels),  # strings: /metrics has them as one info
        "num_waiting": len(scheduler.waiting),
        "num_running": len(scheduler.running),
        "num_swapped": len(scheduler.swapped),
        "steps": scheduler.step,
    }


def capacity_line(pool: BlockPool, block_bytes: int, max_model_len: int, kv_dtype: str) -> str:
    """The start-up line on KV capacity: blocks, tokens, bytes in the KV cache's dtype, tokens
    per GiB, concurrency at full context."""
    num_blocks, block_size = pool.num_blocks, pool.block_size
    tokens = num_blocks * block_size
    per_token = block_bytes // block_size
    concurrency = tokens / max_model_len
    return (
        f"KV cache: {num_blocks} blocks x {block_size} tokens = {tokens} tokens "
        f"({num_blocks * block_bytes / 2**30:.2f} GiB in {kv_dtype}, {per_token / 1024:.1f} KiB "
        f"per token, {2**30 // per_token} tokens per GiB); "
        f"max concurrency at {max_model_len} tokens per request: {concurrency:.2f}x"
    )
