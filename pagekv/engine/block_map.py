"""The device block map as plain JSON data: what ``/debug/kv`` draws and tests inspect."""

from __future__ import annotations

from typing import Any

from pagekv.core.block_table import NO_BLOCK
from pagekv.core.kv_cache_manager import KVCacheManager


def block_map(kv: KVCacheManager, block_size: int) -> dict[str, Any]:
    """Every device block's state, ref count, prefix hash and owners, as plain JSON data.

    ``blocks`` is indexed by physical block id; ``hash`` is hex (None if uncommitted);
    ``owners`` are the request ids whose block table points at the block. ``requests`` maps
    each request with a device table to it (``NO_BLOCK``, -1, for a block given back behind
    a sliding window); ``swapped`` each swapped-out request to its host block table.
    Read-only; call it from the thread that steps the engine.
    """
    pool = kv.pool
    requests = {rid: list(kv.block_table(rid)) for rid in kv.request_ids()}
    owners: dict[int, list[str]] = {}
    for rid, table in requests.items():
        for block_id in dict.fromkeys(table):
            if block_id != NO_BLOCK:
                owners.setdefault(block_id, []).append(rid)
    blocks = []
    for b in range(pool.num_blocks):
        block_hash = pool.block_hash(b)
        blocks.append(
            {
                "id": b,
                "state": pool.state(b).value,
                "ref_count": pool.ref_count(b),
                "hash": None if block_hash is None else block_hash.hex(),
                "owners": owners.get(b, []),
            }
        )
    swapped = {rid: list(kv.host_block_table(rid)) for rid in kv.swapped_request_ids()}
    return {
        "num_blocks": pool.num_blocks,
        "block_size": block_size,
        "blocks": blocks,
        "requests": requests,
        "swapped": swapped,
    }
