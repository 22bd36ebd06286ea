"""The KV cache manager: block tables, prefix hits, growth, fork, copy-on-write, swap.

Owns: every request's block table (device, or host while swapped), the pins that keep transfer
sources alive, and the pending transfers. The ``BlockPool``s own reference counts. The scheduler
calls this facade; the runner only sees the ``BlockTransfers`` it hands out. Must not import torch.

Token positions map to slots through the table (block size B = 4 here)::

    position:   0 1 2 3 | 4 5 6 7 | 8 9
    logical:    block 0 | block 1 | block 2 (partial: 2 of 4 slots used)
    table:      [  8    ,   2     ,  15  ]
    slot(p) = table[p // B] * B + p % B      e.g. slot(9) = 15 * 4 + 1 = 61

Copy-on-write happens BEFORE the write: when a request is about to write into a block whose
ref count is > 1, ``append_slots`` gives it a fresh block, remaps its table, and records
(src, dst); the runner copies src -> dst before the forward pass writes the new token.

The host pool has two uses and one accounting: swapped requests' blocks (in use) and, with a
write policy, a host prefix cache (hashed blocks, evictable LRU, like the device's). A prefix
block therefore lives on the device, the host, in storage, or several: the two pools' hash
indexes say where (``residency``); the storage tier's own record is the tier manager's. Blocks
move down by ``WritePolicy`` (offloads are swap-outs of hashed blocks; storage writes are
``StorageWrite``s) and up as prefix hits: a host hit is a swap-in into a fresh device block, a
prefetched storage block a ``load`` into a fresh host block (``load_host``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagekv.core.block_pool import BlockHash, BlockPool
from pagekv.core.plan import BlockTransfers, StorageWrite
from pagekv.core.prefix_cache import extend_hash_chain
from pagekv.core.request import Request
from pagekv.core.tier_policy import TierCounters, WritePolicy
from pagekv.core.usage import KVUsage
from pagekv.errors import InvalidRequestError, PromptTooLongError, UnknownRequestError


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


Hit = tuple[int, bool]  # (block id, on_host): one logical block of a prefix hit


@dataclass
class _Table:
    """A request's block table: logical block i -> physical block ``blocks[i]``."""

    request: Request
    blocks: list[int]
    num_committed: int = 0  # blocks[:num_committed] are known to the prefix cache


class KVCacheManager:
    """Facade over the device pool (and the host pool used for swapping)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        *,
        write_policy: WritePolicy | str | None = None,
        write_storage: bool = False,
    ) -> None:
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise InvalidRequestError(
                f"num_host_blocks must be >= 0, got {num_host_blocks!r}", "num_host_blocks"
            )
        self.pool = BlockPool(num_blocks, block_size)
        self.host_pool = BlockPool(num_host_blocks, block_size) if num_host_blocks > 0 else None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, _Table] = {}
        self._host_tables: dict[str, _Table] = {}
        self._pins: Counter[int] = Counter()  # device transfer sources, until taken
        self._host_pins: Counter[int] = Counter()
        # Pending transfers, keyed by destination so releasing a destination cancels its move:
        self._swap_out: dict[int, int] = {}  # host block <- device block
        self._swap_in: dict[int, int] = {}  # device block <- host block (source pinned)
        # Pending copy-on-write copies, destination -> source, in the order they were made.
        self._copies: dict[int, int] = {}
        # Twins: a device block and a host block known to hold the same K/V, so a block shared
        # by two swapped requests moves once. Broken when either side is written or released.
        self._host_twin: dict[int, int] = {}
        self._device_twin: dict[int, int] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        # Lower tiers: None keeps the host pool for swapping only and writes nothing to storage.
        self.write_policy = None if write_policy is None else WritePolicy.parse(write_policy)
        self.host_caching = self.write_policy is not None and self.host_pool is not None
        self.write_storage = write_storage and self.write_policy is not None
        self.tier = TierCounters()
        self._saves: dict[BlockHash, StorageWrite] = {}
        self._loads: dict[int, BlockHash] = {}  # host block <- storage (payload staged outside)
        self._hit_counts: OrderedDict[BlockHash, int] = OrderedDict()  # write_through_selective
        # Checks a host-cache block's bytes against what was put there (the tier manager's).
        self.verify_host: Callable[[int, BlockHash], bool] | None = None
        if self.write_policy is WritePolicy.WRITE_BACK:
            self.pool.on_evict = self._on_device_evict
            if self.host_pool is not None:
                self.host_pool.on_evict = self._on_host_evict

    # ---- queries --------------------------------------------------------------------------------

    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._host_tables

    def block_table(self, request_id: str) -> list[int]:
        return self._table(request_id).blocks

    def host_block_table(self, request_id: str) -> list[int]:
        if request_id not in self._host_tables:
            raise UnknownRequestError(f"request {request_id!r} is not swapped out")
        return self._host_tables[request_id].blocks

    def request_ids(self) -> list[str]:
        return list(self._tables)

    def swapped_request_ids(self) -> list[str]:
        return list(self._host_tables)

    def pins(self) -> Counter[int]:
        return Counter(self._pins)

    def host_pins(self) -> Counter[int]:
        return Counter(self._host_pins)

    def block_owners(self) -> dict[int, list[str]]:
        """Device block -> the requests whose tables point at it (for checks and the block map)."""
        owners: dict[int, list[str]] = {}
        for rid, table in self._tables.items():
            for block_id in table.blocks:
                owners.setdefault(block_id, []).append(rid)
        return owners

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_cached_tokens(self, request: Request) -> int:
        """Tokens of ``request`` a new allocation would find in the prefix cache (pure)."""
        return len(self._find_hits(request)) * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, reserve_blocks: int = 0) -> bool:
        """Whether ``allocate`` would succeed, keeping ``reserve_blocks`` free afterwards."""
        hits = self._find_hits(request)
        return self._num_missing(request, hits, num_new_tokens) + reserve_blocks <= self._room(hits)

    def prefix_chain(self, request: Request) -> list[BlockHash]:
        """The hashes of the request's full blocks a prefix hit may cover (all but the last
        token's block), computing any the request does not have yet."""
        max_blocks = (request.num_target_tokens - 1) // self.block_size
        chain = request.block_hashes
        if len(chain) < max_blocks:
            tokens = request.all_token_ids[: max_blocks * self.block_size]
            extend_hash_chain(chain, tokens, self.block_size, request.cache_salt)
        return chain[:max_blocks]

    def residency(self, block_hash: BlockHash) -> tuple[int | None, int | None]:
        """Where a prefix block's K/V lives in memory: (device block, host block), each or None."""
        host_pool = self.host_pool if self.host_caching else None
        host = host_pool.lookup(block_hash) if host_pool is not None else None
        return self.pool.lookup(block_hash), host

    def _find_hits(self, request: Request) -> list[Hit]:
        # Hits cover whole blocks before the last target token: that token is always computed
        # (so the request samples from fresh logits and never writes into a block it found).
        # Each block is found on the device, or else in the host cache; the first miss ends it.
        if not self.enable_prefix_caching:
            return []
        lookup = self.pool.lookup
        host_lookup = self.host_pool.lookup if self.host_caching and self.host_pool else None
        hits: list[Hit] = []
        for block_hash in self.prefix_chain(request):
            block_id = lookup(block_hash)
            if block_id is not None:
                hits.append((block_id, False))
                continue
            block_id = host_lookup(block_hash) if host_lookup is not None else None
            if block_id is None:
                break
            hits.append((block_id, True))
        return hits

    def _num_missing(self, request: Request, hits: list[Hit], num_new_tokens: int) -> int:
        """Device blocks to allocate: for the new tokens and for every host hit."""
        num_device_hits = sum(1 for _, on_host in hits if not on_host)
        return cdiv(len(hits) * self.block_size + num_new_tokens, self.block_size) - (
            num_device_hits
        )

    def _room(self, hits: list[Hit]) -> int:
        # Evictable hits leave the LRU when pinned, so they are not room for new blocks.
        is_evictable = self.pool.is_evictable
        evictable_hits = sum(1 for b, on_host in hits if not on_host and is_evictable(b))
        return self.pool.num_free_blocks - evictable_hits

    # ---- allocation -----------------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int) -> int | None:
        """Give a request with no table its prefix hits plus blocks for ``num_new_tokens`` more.

        Returns the number of tokens found in the prefix cache (the caller sets them computed),
        or None if the pool cannot hold them now (nothing changed). Hits are pinned before any
        block is allocated, so the eviction that allocation may cause can never take them. A
        host hit gets a fresh device block and a swap-in; it is verified first, and one that
        fails ends the hit there (it is dropped, and what follows it is recomputed), so the
        result may be fewer tokens than ``num_cached_tokens`` promised.
        """
        self._check_new(request, num_new_tokens)
        hits = self._verified(self._find_hits(request))
        num_missing = self._num_missing(request, hits, num_new_tokens)
        if num_missing > self._room(hits):
            return None
        self.pool.touch([b for b, on_host in hits if not on_host])
        for b, on_host in hits:
            if on_host:
                self._pin_host(b)
        fresh = iter(self.pool.allocate(num_missing))
        blocks: list[int] = []
        num_committed = len(hits)
        for i, (b, on_host) in enumerate(hits):
            if on_host:
                # Committed once its K/V has arrived (``commit`` skips pending swap-ins).
                num_committed = min(num_committed, i)
                dst = next(fresh)
                self._swap_in[dst] = b
                blocks.append(dst)
                self.tier.host_hit_blocks += 1
            else:
                blocks.append(b)
        blocks.extend(fresh)
        self._tables[request.request_id] = _Table(request, blocks, num_committed)
        num_hit_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += num_hit_tokens
        if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for (b, on_host), block_hash in zip(hits, request.block_hashes, strict=False):
                self._count_hit(b, on_host, block_hash)
        return num_hit_tokens

    def _verified(self, hits: list[Hit]) -> list[Hit]:
        """Cut the hits at the first host block that fails ``verify_host`` (and drop that block).

        A host block whose K/V is still on its way in (an offload or load of a plan not yet
        taken) is not checked: it will be filled straight from a verified source first.
        """
        if self.verify_host is None or self.host_pool is None:
            return hits
        for i, (b, on_host) in enumerate(hits):
            if not on_host or b in self._swap_out or b in self._loads:
                continue
            block_hash = self.host_pool.block_hash(b)
            assert block_hash is not None  # a host hit is a hashed block
            if not self.verify_host(b, block_hash):
                self.tier.host_verify_failures += 1
                if self.host_pool.is_evictable(b):
                    self.host_pool.discard(b)
                return hits[:i]
        return hits

    def _check_new(self, request: Request, num_new_tokens: int) -> None:
        rid = request.request_id
        if rid in self._tables or rid in self._host_tables:
            raise InvalidRequestError(f"request {rid!r} already holds blocks", "request_id")
        if not isinstance(num_new_tokens, int) or num_new_tokens < 1:
            raise InvalidRequestError(
                f"num_new_tokens must be >= 1, got {num_new_tokens!r}", "num_new_tokens"
            )
        if num_new_tokens > request.num_tokens:
            raise InvalidRequestError(
                f"num_new_tokens {num_new_tokens} exceeds the request"
                f"'s {request.num_tokens} tokens",
                "num_new_tokens",
            )
        if self.num_blocks_for(request.num_tokens) > self.pool.num_blocks:
            raise PromptTooLongError(
                f"request {rid!r} needs {self.num_blocks_for(request.num_tokens)} blocks; "
                f"the whole pool has {self.pool.num_blocks}",
                "prompt",
            )

    def append_slots(self, request: Request, num_new_tokens: int, reserve_blocks: int = 0) -> bool:
        """Make room to write ``num_new_tokens`` tokens after the computed ones.

        Grows the table to cover them and copies-on-write any shared block they fall into.
        Returns False, changing nothing, if the pool cannot supply the blocks now.
        """
        table = self._tables.get(request.request_id)
        if table is None:
            raise UnknownRequestError(f"request {request.request_id!r} holds no device blocks")
        if num_new_tokens < 1:
            raise InvalidRequestError(
                f"num_new_tokens must be >= 1, got {num_new_tokens!r}", "num_new_tokens"
            )
        # The decode hot path (256 requests a step): plain arithmetic on locals, no helpers.
        blocks, block_size, ref = table.blocks, self.block_size, self.pool._ref
        start = request.num_computed_tokens
        first, last = start // block_size, (start + num_new_tokens - 1) // block_size
        if first == last < len(blocks) and ref[blocks[first]] == 1:
            # Writes land in one block this request alone holds: nothing to allocate or copy.
            if self._host_twin:
                self._break_twin(blocks[first])
            return True
        if first == last == len(blocks):
            # A decode that opens a new block: one allocation, nothing shared to copy.
            if self.pool.num_free_blocks <= reserve_blocks:
                return False
            blocks.append(self.pool.allocate_one())
            return True
        num_grow = last + 1 - len(blocks)
        written = range(first, min(len(blocks), last + 1))
        shared = [i for i in written if ref[blocks[i]] > 1]
        if (num_grow > 0 or shared) and (
            max(num_grow, 0) + len(shared) + reserve_blocks > self.pool.num_free_blocks
        ):
            return False
        for i in shared:
            self._copy_on_write(blocks, i)
        for _ in range(num_grow):
            blocks.append(self.pool.allocate_one())
        if self._host_twin:
            for i in written:
                self._break_twin(blocks[i])
        return True

    def _copy_on_write(self, blocks: list[int], index: int) -> None:
        shared = blocks[index]
        # A block that is itself the destination of a pending copy holds nothing yet: copy
        # from that copy's (pinned) source, since copies of one plan apply all at once.
        src = self._copies.get(shared, shared)
        dst = self.pool.allocate_one()
        self._pins[src] += 1  # src stays alive (and unwritten) until the copy is taken
        self.pool.touch([src])
        blocks[index] = dst
        self._release(self.pool, [shared])  # the table's reference moves to dst
        self._copies[dst] = src
        self.num_cow_copies += 1

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's whole table: every block shared, ref count + 1."""
        table = self._table(parent.request_id)
        self._check_fork(parent, child)
        self.pool.touch(table.blocks)
        self._tables[child.request_id] = _Table(child, list(table.blocks), table.num_committed)
        child.block_hashes = list(parent.block_hashes)

    def _check_fork(self, parent: Request, child: Request) -> None:
        cid = child.request_id
        if cid in self._tables or cid in self._host_tables:
            raise InvalidRequestError(f"request {cid!r} already holds blocks", "request_id")
        if child.num_computed_tokens != parent.num_computed_tokens:
            raise InvalidRequestError(
                "a fork starts at the parent's computed tokens "
                f"({parent.num_computed_tokens}), child has {child.num_computed_tokens}",
                "num_computed_tokens",
            )

    def free(self, request_id: str) -> None:
        """Release everything the request holds, device and host; its table is gone."""
        table = self._tables.pop(request_id, None)
        host_table = self._host_tables.pop(request_id, None)
        if table is None and host_table is None:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks")
        if table is not None:
            self._release(self.pool, table.blocks[::-1])
        if host_table is not None and self.host_pool is not None:
            self._release(self.host_pool, host_table.blocks[::-1])

    def commit(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache.

        Called after the step that wrote them, never before: a block is a cache hit only once
        its K/V exists.
        """
        table = self._table(request.request_id)
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= table.num_committed:
            return
        chain = request.block_hashes
        if len(chain) < num_full:
            tokens = request.all_token_ids[: num_full * self.block_size]
            extend_hash_chain(chain, tokens, self.block_size, request.cache_salt)
        for i in range(table.num_committed, num_full):
            block_id = table.blocks[i]
            if block_id in self._copies or block_id in self._swap_in:
                # Its K/V arrives with a transfer not yet applied: not a cache hit until then
                # (and a pending transfer is only ever cancelled into a block nobody caches).
                num_full = i
                break
            if self.pool.commit(block_id, chain[i]) and self.write_policy is (
                WritePolicy.WRITE_THROUGH
            ):
                self._write_down(block_id, chain[i])
        table.num_committed = num_full

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody uses, device and host; returns how many."""
        num = self.pool.evict_all()
        if self.host_caching and self.host_pool is not None:
            num += self.host_pool.evict_all()
        return num

    # ---- lower tiers: host cache and storage writes ----------------------------------------------

    def load_host(self, hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, int]]:
        """Place blocks prefetched from storage into new host blocks (host caching only).

        Returns (hash, host block) for each one placed; the loads go out with the next plan,
        whose applier writes the staged payloads. Hashes already in memory are skipped, and
        placing stops when every host block is in use.
        """
        host = self.host_pool
        if not self.host_caching or host is None:
            return []
        placed: list[tuple[BlockHash, int]] = []
        for block_hash in hashes:
            if host.lookup(block_hash) is not None or self.pool.lookup(block_hash) is not None:
                continue
            if host.num_free_blocks == 0:
                self.tier.host_full_skips += 1
                break
            dst = host.allocate_one()
            host.commit(dst, block_hash)
            self._host_pins[dst] += 1  # the allocation's reference, dropped when taken
            self._loads[dst] = block_hash
            placed.append((block_hash, dst))
        self.tier.storage_loaded_blocks += len(placed)
        return placed

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
            self.tier.host_full_skips += 1
            return
        dst = host.allocate_one()  # may evict a host block (written back first, if so)
        host.commit(dst, block_hash)
        self._host_pins[dst] += 1  # the allocation's reference, dropped when taken
        self._swap_out[dst] = block_id
        self.tier.offloaded_blocks += 1

    def _save(self, block_id: int, on_host: bool, block_hash: BlockHash) -> None:
        if block_hash not in self._saves:
            self._saves[block_hash] = StorageWrite(block_id, on_host, block_hash)
            self.tier.storage_writes += 1

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
        if len(counts) > 4 * (self.pool.num_blocks + self.num_host_blocks):
            counts.popitem(last=False)  # forget the least recently hit
        if count != 2:
            return
        if not on_host:
            self._write_down(block_id, block_hash)
        elif self.write_storage and block_id not in self._loads:
            # Already in the host cache; if its offload is still pending, save from the source.
            source = self._swap_out.get(block_id)
            if source is None:
                self._save(block_id, True, block_hash)
            else:
                self._save(source, False, block_hash)

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host_pool is None else self.host_pool.num_blocks

    # ---- swapping -------------------------------------------------------------------------------

    def swap_out(self, request_id: str) -> bool:
        """Move a request's blocks to the host pool; False (nothing changed) if it lacks room.

        A block whose host twin is still valid (shared with a request swapped earlier) is not
        moved again; the host block gains a reference instead.
        """
        table = self._table(request_id)
        host = self.host_pool
        if host is None:
            return False
        num_moves = sum(1 for b in table.blocks if b not in self._host_twin)
        if num_moves > host.num_free_blocks:
            return False
        host_blocks = self._move(table.blocks, True, self._swap_out)
        del self._tables[request_id]
        self._release(self.pool, table.blocks[::-1])
        self._host_tables[request_id] = _Table(table.request, host_blocks)
        self.num_swapped_out_blocks += num_moves
        return True

    def swap_in(self, request_id: str) -> bool:
        """Bring a swapped request's blocks back to the device; False if the pool lacks room."""
        if request_id not in self._host_tables:
            raise UnknownRequestError(f"request {request_id!r} is not swapped out")
        host_table = self._host_tables[request_id]
        num_moves = sum(1 for h in host_table.blocks if h not in self._device_twin)
        if num_moves > self.pool.num_free_blocks:
            return False
        blocks = self._move(host_table.blocks, False, self._swap_in)
        assert self.host_pool is not None  # a host table implies a host pool
        del self._host_tables[request_id]
        self._release(self.host_pool, host_table.blocks[::-1])
        self._tables[request_id] = _Table(host_table.request, blocks)
        self.num_swapped_in_blocks += num_moves
        return True

    def _move(self, blocks: Sequence[int], to_host: bool, moves: dict[int, int]) -> list[int]:
        """Map each block to the other pool: its live twin, or a new block plus a move.

        A swap-in's host source is pinned until the plan is taken, so no swap-out of the same
        step can overwrite it. (A swap-out's device source needs no pin: swap-outs run first.)
        """
        dst_pool = self.host_pool if to_host else self.pool
        assert dst_pool is not None
        twin, back = (
            (self._host_twin, self._device_twin)
            if to_host
            else (self._device_twin, self._host_twin)
        )
        out: list[int] = []
        for block_id in blocks:
            target = twin.get(block_id)
            if target is None:
                target = dst_pool.allocate_one()
                twin[block_id] = target
                back[target] = block_id
                if to_host:
                    # A pending copy's destination is not written yet: move from its source.
                    moves[target] = self._copies.get(block_id, block_id)
                else:
                    moves[target] = block_id
                    self._pin_host(block_id)
            else:
                dst_pool.touch([target])
            out.append(target)
        return out

    def _release(self, pool: BlockPool, blocks: Sequence[int]) -> None:
        """Free blocks. A block reaching ref 0 loses its twin, and any pending transfer into it
        is cancelled: nobody will read it, and it may be handed out again this very step."""
        pool.free(blocks)
        if not (self._host_twin or self._copies or self._swap_in or self._swap_out or self._loads):
            return
        is_host = pool is self.host_pool
        for block_id in blocks:
            if pool._ref[block_id] != 0:
                continue
            self._break_twin(block_id, host=is_host)
            if is_host:
                self._swap_out.pop(block_id, None)
                self._loads.pop(block_id, None)
            elif block_id in self._copies:
                self._unpin(self._copies.pop(block_id))
            elif block_id in self._swap_in:
                self._unpin_host(self._swap_in.pop(block_id))

    def _unpin(self, block_id: int) -> None:
        self._pins[block_id] -= 1
        if self._pins[block_id] == 0:
            del self._pins[block_id]
        self._release(self.pool, [block_id])

    def _pin_host(self, block_id: int) -> None:
        assert self.host_pool is not None
        self._host_pins[block_id] += 1
        self.host_pool.touch([block_id])

    def _unpin_host(self, block_id: int) -> None:
        assert self.host_pool is not None
        self._host_pins[block_id] -= 1
        if self._host_pins[block_id] == 0:
            del self._host_pins[block_id]
        self._release(self.host_pool, [block_id])

    def _break_twin(self, block_id: int, host: bool = False) -> None:
        if host:
            device_block = self._device_twin.pop(block_id, None)
            if device_block is not None:
                self._host_twin.pop(device_block, None)
        else:
            host_block = self._host_twin.pop(block_id, None)
            if host_block is not None:
                self._device_twin.pop(host_block, None)

    # ---- hand-off to the runner -----------------------------------------------------------------

    def take_transfers(self) -> BlockTransfers:
        """Hand out the pending transfers (in apply order) and release their sources' pins."""
        transfers = BlockTransfers(
            saves=tuple(self._saves.values()),
            loads=tuple((h, dst) for dst, h in self._loads.items()),
            swap_out=tuple((src, dst) for dst, src in self._swap_out.items()),
            swap_in=tuple((src, dst) for dst, src in self._swap_in.items()),
            copies=tuple((src, dst) for dst, src in self._copies.items()),
        )
        self._swap_out.clear()
        self._swap_in.clear()
        self._copies.clear()
        self._saves.clear()
        self._loads.clear()
        if self._pins:
            pinned = list(self._pins.elements())
            self._pins.clear()
            self._release(self.pool, pinned)
        if self._host_pins and self.host_pool is not None:
            # Last pinned, first released: a chain's tail then leaves the host LRU before its
            # head (as ``free`` does on the device), so what stays is a usable prefix.
            pinned = list(self._host_pins.elements())[::-1]
            self._host_pins.clear()
            self._release(self.host_pool, pinned)
        return transfers

    # ---- reporting ------------------------------------------------------------------------------

    def usage(self) -> KVUsage:
        """A snapshot of the device pool and the counters (see ``core/usage.py``)."""
        return KVUsage.of(self)

    def _table(self, request_id: str) -> _Table:
        table = self._tables.get(request_id)
        if table is None:
            raise UnknownRequestError(f"request {request_id!r} holds no device blocks")
        return table
