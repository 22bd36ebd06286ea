"""The core's side of the KV tiers below the device pool: what is written down, and when.

Owns: the ``WritePolicy`` and the two switches it implies (``host_caching``: the host pool also
caches prefix blocks; ``write_storage``: blocks are written to the storage tier), the pending
``StorageWrite``s and storage loads that go out with the next plan, the hit counts behind
``write_through_selective``, the host-block check (``verify_host``) and the ``TierCounters``.
The KV cache manager owns the block tables, the pins and the swap-outs (held in its
``BlockTables`` and ``PendingTransfers``); it calls this object when it commits a block or takes
a prefix hit, its pending transfers call it when a host block is released and a plan is handed
out, and it lends it the pins and the swap-out queue that an offload or a load needs
(``HostFills``). Under write_back the pools call it as they evict. What the storage tier holds
is the tier manager's record (tiering/manager.py). Must not import torch.

A prefix block lives on the device, the host, in storage, or several. The pools' hash indexes
say where in memory (``residency``); a prefix hit takes each block from the device, or else
from the host cache (``find_hits``). Blocks move down by the policy and up as prefix hits::

    policy                   device -> host cache (offload)   -> storage (save)
    write_through            when committed                   when committed
    write_through_selective  at its second hit                at its second hit
    write_back               when the device evicts it        when the host evicts it (the
                                                              device, without a host cache)

An offload is a swap-out of a hashed block into a new host-cache block; a save is a
``StorageWrite``. Up: a host hit is a swap-in into a fresh device block (the manager's), a block
prefetched from storage a load into a fresh host block (``load_host``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from pagekv.core.block_pool import BlockHash, BlockPool
from pagekv.core.plan import StorageWrite
from pagekv.core.tier_policy import TierCounters, WritePolicy

Hit = tuple[int, bool]  # (block id, on_host): one logical block of a prefix hit
Load = tuple[BlockHash, int]  # (prefix hash, host block): a block coming in from storage


class HostFills(Protocol):
    """What filling a host block needs of the manager: its host pins and its swap-out queue.

    An offload is a swap-out like a swapped request's: one queue keeps their order and lets
    releasing a destination cancel either.
    """

    def pin_fill(self, host_block: int) -> None:
        """Keep a new host block's allocation reference as a pin until the plan is taken."""

    def queue_offload(self, device_block: int, host_block: int) -> None:
        """Copy ``device_block`` into ``host_block`` with the next plan's swap-outs."""

    def swap_out_source(self, host_block: int) -> int | None:
        """The device block a pending swap-out copies into ``host_block``, if one does."""


class TierState:
    """The write policy applied to one manager's pools, and the storage traffic it queues."""

    def __init__(
        self,
        pool: BlockPool,
        host_pool: BlockPool | None,
        write_policy: WritePolicy | str | None,
        write_storage: bool,
        fills: HostFills,
    ) -> None:
        self.pool = pool
        self.host_pool = host_pool
        # None keeps the host pool for swapping only and writes nothing to storage.
        self.write_policy = None if write_policy is None else WritePolicy.parse(write_policy)
        self.host_caching = self.write_policy is not None and host_pool is not None
        self.write_storage = write_storage and self.write_policy is not None
        self.counters = TierCounters()
        # Checks a host-cache block's bytes against what was put there (the tier manager's).
        self.verify_host: Callable[[int, BlockHash], bool] | None = None
        self._fills = fills
        self._saves: dict[BlockHash, StorageWrite] = {}
        self._loads: dict[int, BlockHash] = {}  # host block <- storage (payload staged outside)
        self._hit_counts: OrderedDict[BlockHash, int] = OrderedDict()
        num_host_blocks = 0 if host_pool is None else host_pool.num_blocks
        self._max_hit_counts = 4 * (pool.num_blocks + num_host_blocks)
        if self.write_policy is WritePolicy.WRITE_BACK:
            pool.on_evict = self._on_device_evict
            if host_pool is not None:
                host_pool.on_evict = self._on_host_evict

    # ---- queries --------------------------------------------------------------------------------

    def residency(self, block_hash: BlockHash) -> tuple[int | None, int | None]:
        """Where a prefix block's K/V lives in memory: (device block, host block), each or None."""
        host_pool = self.host_pool if self.host_caching else None
        host = host_pool.lookup(block_hash) if host_pool is not None else None
        return self.pool.lookup(block_hash), host

    def find_hits(self, chain: Sequence[BlockHash]) -> list[Hit]:
        """The prefix hits along ``chain``: each block on the device, or else in the host cache;
        the first miss ends them."""
        lookup = self.pool.lookup
        host = self.host_pool if self.host_caching else None
        host_lookup = host.lookup if host is not None else None
        hits: list[Hit] = []
        for block_hash in chain:
            block_id = lookup(block_hash)
            if block_id is not None:
                hits.append((block_id, False))
                continue
            block_id = host_lookup(block_hash) if host_lookup is not None else None
            if block_id is None:
                break
            hits.append((block_id, True))
        return hits

    @property
    def pending_loads(self) -> Mapping[int, BlockHash]:
        """Host block -> the hash whose K/V a pending load from storage brings into it."""
        return self._loads

    # ---- the manager's hooks --------------------------------------------------------------------

    def verified(self, hits: list[Hit]) -> list[Hit]:
        """Cut the hits at the first host block that fails ``verify_host`` (and drop that block).

        A host block whose K/V is still on its way in (an offload or load of a plan not yet
        taken) is not checked: it will be filled straight from a verified source first.
        """
        host = self.host_pool
        if self.verify_host is None or host is None:
            return hits
        for i, (b, on_host) in enumerate(hits):
            if not on_host or self._is_filling(b):
                continue
            block_hash = host.block_hash(b)
            assert block_hash is not None  # a host hit is a hashed block
            if not self.verify_host(b, block_hash):
                self.counters.host_verify_failures += 1
                if host.is_evictable(b):
                    host.discard(b)
                return hits[:i]
        return hits

    def on_prefix_hit(self, hits: Sequence[Hit], block_hashes: Sequence[BlockHash]) -> None:
        """A request took these hits (host hits are being swapped in): count them, and under
        write_through_selective copy down the blocks hit for the second time."""
        self.counters.host_hit_blocks += sum(1 for _, on_host in hits if on_host)
        if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for (b, on_host), block_hash in zip(hits, block_hashes, strict=False):
                self._count_hit(b, on_host, block_hash)

    def on_commit(self, block_id: int, block_hash: BlockHash) -> None:
        """A device block newly entered the prefix cache: write_through copies it down now."""
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            self._write_down(block_id, block_hash)

    def on_host_release(self, host_block: int) -> None:
        """A host block nobody references: a load into it is cancelled (it may be reused now)."""
        self._loads.pop(host_block, None)

    def take(self) -> tuple[tuple[StorageWrite, ...], tuple[Load, ...]]:
        """Hand out the pending saves and loads (for the next plan) and forget them."""
        saves = tuple(self._saves.values())
        loads = tuple((h, dst) for dst, h in self._loads.items())
        self._saves.clear()
        self._loads.clear()
        return saves, loads

    # ---- up: storage -> host --------------------------------------------------------------------

    def load_host(self, hashes: Sequence[BlockHash]) -> list[Load]:
        """Place blocks prefetched from storage into new host blocks (host caching only).

        Returns (hash, host block) for each one placed; the loads go out with the next plan,
        whose applier writes the staged payloads. Hashes already in memory are skipped, and
        placing stops when every host block is in use.
        """
        host = self.host_pool
        if not self.host_caching or host is None:
            return []
        placed: list[Load] = []
        for block_hash in hashes:
            if host.lookup(block_hash) is not None or self.pool.lookup(block_hash) is not None:
                continue
            if host.num_free_blocks == 0:
                self.counters.host_full_skips += 1
                break
            dst = host.allocate_one()
            host.commit(dst, block_hash)
            self._fills.pin_fill(dst)
            self._loads[dst] = block_hash
            placed.append((block_hash, dst))
        self.counters.storage_loaded_blocks += len(placed)
        return placed

    # ---- down: device -> host -> storage --------------------------------------------------------

    def _is_filling(self, host_block: int) -> bool:
        return self._fills.swap_out_source(host_block) is not None or host_block in self._loads

    def _write_down(self, block_id: int, block_hash: BlockHash) -> None:
        """Copy a committed device block to the tiers below (write_through, or a second hit)."""
        if self.host_caching:
            self._offload(block_id, block_hash)
        if self.write_storage:
            self._save(block_id, False, block_hash)

    def _offload(self, block_id: int, block_hash: BlockHash) -> None:
        host = self.host_pool
        assert host is not None
        if host.lookup(block_hash) is not None:
            return
        if host.num_free_blocks == 0:
            self.counters.host_full_skips += 1
            return
        dst = host.allocate_one()  # may evict a host block (written back first, if so)
        host.commit(dst, block_hash)
        self._fills.pin_fill(dst)
        self._fills.queue_offload(block_id, dst)
        self.counters.offloaded_blocks += 1

    def _save(self, block_id: int, on_host: bool, block_hash: BlockHash) -> None:
        if block_hash not in self._saves:
            self._saves[block_hash] = StorageWrite(block_id, on_host, block_hash)
            self.counters.storage_writes += 1

    def _on_device_evict(self, block_id: int, block_hash: BlockHash) -> None:
        # write_back: the block's K/V is intact until the plan's transfers run (swap-outs and
        # saves read before anything writes), so it is copied down as it leaves.
        if self.host_caching:
            self._offload(block_id, block_hash)
        elif self.write_storage:
            self._save(block_id, False, block_hash)

    def _on_host_evict(self, block_id: int, block_hash: BlockHash) -> None:
        if self.write_storage and self.host_caching:
            self._save(block_id, True, block_hash)

    def _count_hit(self, block_id: int, on_host: bool, block_hash: BlockHash) -> None:
        """write_through_selective: a block is copied down at its second hit."""
        counts = self._hit_counts
        count = counts.pop(block_hash, 0) + 1
        counts[block_hash] = count
        if len(counts) > self._max_hit_counts:
            counts.popitem(last=False)  # forget the least recently hit
        if count != 2:
            return
        if not on_host:
            self._write_down(block_id, block_hash)
        elif self.write_storage and block_id not in self._loads:
            # Already in the host cache; if its offload is still pending, save from the source.
            source = self._fills.swap_out_source(block_id)
            if source is None:
                self._save(block_id, True, block_hash)
            else:
                self._save(source, False, block_hash)
