"""The KV cache manager: block tables, prefix hits, growth, fork, copy-on-write, swap.

Owns, as the facade the scheduler calls: every request's block table (device, or host while
swapped), the pins that keep transfer sources alive, and the pending swaps and copies. It
decides what changes; two helpers hold the records: the ``BlockTables`` (core/block_table.py)
and the ``PendingTransfers`` (core/transfers.py: pins, moves, copies, twins; every release goes
through it). The ``BlockPool``s own reference counts; the ``TierState`` (core/tier_state.py)
owns the tiers below the device: the write policy, the pending storage saves and loads, the
tier counters. The runner only sees the ``BlockTransfers`` this hands out. Must not import torch.

Token positions map to slots through the table (block size B = 4 here)::

    position:   0 1 2 3 | 4 5 6 7 | 8 9
    logical:    block 0 | block 1 | block 2 (partial: 2 of 4 slots used)
    table:      [  8    ,   2     ,  15  ]
    slot(p) = table[p // B] * B + p % B      e.g. slot(9) = 15 * 4 + 1 = 61

Copy-on-write happens BEFORE the write: when a request is about to write into a block whose
ref count is > 1, ``append_slots`` gives it a fresh block, remaps its table, and records
(src, dst); the runner copies src -> dst before the forward pass writes the new token.

The host pool has two uses and one accounting: swapped requests' blocks (in use) and, with a
write policy, a host prefix cache (hashed blocks, evictable LRU, like the device's). The manager
tells the tier state when it commits a block or takes a prefix hit (and the pending transfers
tell it when a host block is released); the tier state fills host-cache blocks through the
manager's host pins and swap-out queue (an offload is a swap-out of a hashed block).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from pagekv.core.block_pool import BlockHash, BlockPool
from pagekv.core.block_table import NO_BLOCK, BlockTables, cdiv
from pagekv.core.plan import BlockTransfers
from pagekv.core.prefix_cache import extend_hash_chain
from pagekv.core.request import Request
from pagekv.core.tier_policy import WritePolicy
from pagekv.core.tier_state import Hit, TierState
from pagekv.core.transfers import PendingTransfers
from pagekv.core.usage import KVUsage
from pagekv.errors import InvalidRequestError, PromptTooLongError, UnknownRequestError


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
        sliding_window: int | None = None,
    ) -> None:
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise InvalidRequestError(
                f"num_host_blocks must be >= 0, got {num_host_blocks!r}", "num_host_blocks"
            )
        self.pool = BlockPool(num_blocks, block_size)
        self.host_pool = BlockPool(num_host_blocks, block_size) if num_host_blocks > 0 else None
        if sliding_window is not None and (
            not isinstance(sliding_window, int) or sliding_window < 1
        ):
            raise InvalidRequestError(
                f"sliding_window must be >= 1 or None, got {sliding_window!r}", "sliding_window"
            )
        self.block_size = block_size
        # Every layer's attention window (None: some layer attends to all): blocks wholly
        # before it are given back as the requests move on (``release_outside_window``).
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self._tiers = TierState(self.pool, self.host_pool, write_policy, write_storage, self)
        # The records this facade keeps, read by the invariant checks and the tests:
        self.tables = BlockTables()  # device and host tables
        self.pending = PendingTransfers(self.pool, self.host_pool, self._tiers)  # pins, moves
        # Told (chain, first new index, tokens) as an unsalted hash chain grows (kv_events.py).
        self.on_chain: Callable[[list[BlockHash], int, list[int]], None] | None = None

    # ---- queries --------------------------------------------------------------------------------

    def has_table(self, request_id: str) -> bool:
        return self.tables.has_table(request_id)

    def is_swapped(self, request_id: str) -> bool:
        return self.tables.is_swapped(request_id)

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.block_table(request_id)

    def num_held_blocks(self, request_id: str) -> int:
        """The blocks a request holds (device, or host while swapped): what freeing it gives."""
        return self.tables.num_held(request_id)

    def host_block_table(self, request_id: str) -> list[int]:
        return self.tables.host_block_table(request_id)

    def request_ids(self) -> list[str]:
        return self.tables.request_ids()

    def swapped_request_ids(self) -> list[str]:
        return self.tables.swapped_request_ids()

    def pins(self) -> Counter[int]:
        return Counter(self.pending.pins)

    def host_pins(self) -> Counter[int]:
        return Counter(self.pending.host_pins)

    def block_owners(self) -> dict[int, list[str]]:
        """Device block -> the requests whose tables point at it (for checks and the block map)."""
        return self.tables.block_owners()

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def most_blocks_held(self, num_prompt: int, num_tokens: int, chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` (``num_prompt`` of them its prompt)
        holds at once when fed at most ``chunk`` tokens a step: all of them, or, under a
        sliding window, what one step's window and new tokens span (a prompt chunk's at most,
        a decode's fewer)."""
        full = self.num_blocks_for(num_tokens)
        if self.sliding_window is None:
            return full
        span = self.sliding_window - 1 + min(chunk, num_prompt)
        return min(full, self.num_blocks_for(span) + 1)

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host_pool is None else self.host_pool.num_blocks

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
        return self._hash_chain(request, max_blocks)[:max_blocks]

    def residency(self, block_hash: BlockHash) -> tuple[int | None, int | None]:
        """Where a prefix block's K/V lives in memory: (device block, host block), each or None."""
        return self._tiers.residency(block_hash)

    def _hash_chain(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's hash chain, extended to cover at least ``num_blocks`` full blocks."""
        chain = request.block_hashes
        if len(chain) < num_blocks:
            tokens, start = request.all_token_ids[: num_blocks * self.block_size], len(chain)
            extend_hash_chain(chain, tokens, self.block_size, request.cache_salt)
            if self.on_chain is not None and request.cache_salt is None:
                self.on_chain(chain, start, tokens)
        return chain

    def _find_hits(self, request: Request) -> list[Hit]:
        # Hits cover whole blocks before the last target token: that token is always computed
        # (so the request samples from fresh logits and never writes into a block it found).
        if not self.enable_prefix_caching or not request.reads_prefix_cache:
            return []
        return self._tiers.find_hits(self.prefix_chain(request))

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
        hits = self._tiers.verified(self._find_hits(request))
        num_missing = self._num_missing(request, hits, num_new_tokens)
        if num_missing > self._room(hits):
            return None
        self.pool.touch([b for b, on_host in hits if not on_host])
        for b, on_host in hits:
            if on_host:
                self.pending.pin_host(b)
        fresh = iter(self.pool.allocate(num_missing))
        blocks: list[int] = []
        num_committed = len(hits)
        for i, (b, on_host) in enumerate(hits):
            if on_host:
                # Committed once its K/V has arrived (``commit`` skips pending swap-ins).
                num_committed = min(num_committed, i)
                dst = next(fresh)
                self.pending.queue_swap_in(dst, b)
                blocks.append(dst)
            else:
                blocks.append(b)
        blocks.extend(fresh)
        self.tables.add(request, blocks, num_committed)
        num_hit_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching and request.reads_prefix_cache:
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += num_hit_tokens
        self._tiers.on_prefix_hit(hits, request.block_hashes)
        return num_hit_tokens

    def _check_new(self, request: Request, num_new_tokens: int) -> None:
        rid = request.request_id
        self.tables.check_unheld(rid)
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
        need = self.most_blocks_held(request.num_tokens, request.num_tokens, num_new_tokens)
        if need > self.pool.num_blocks:
            raise PromptTooLongError(
                f"request {rid!r} needs {need} blocks; the whole pool has {self.pool.num_blocks}",
                "prompt",
            )

    def append_slots(self, request: Request, num_new_tokens: int, reserve_blocks: int = 0) -> bool:
        """Make room to write ``num_new_tokens`` tokens after the computed ones.

        Grows the table to cover them and copies-on-write any shared block they fall into.
        Returns False, changing nothing, if the pool cannot supply the blocks now.
        """
        table = self.tables.lookup(request.request_id)
        if num_new_tokens < 1:
            raise InvalidRequestError(
                f"num_new_tokens must be >= 1, got {num_new_tokens!r}", "num_new_tokens"
            )
        # The decode hot path (256 requests a step): plain arithmetic on locals, no helpers.
        blocks, block_size, ref = table.blocks, self.block_size, self.pool._ref
        start = request.num_computed_tokens
        first, last = start // block_size, (start + num_new_tokens - 1) // block_size
        pending = self.pending
        if first == last < len(blocks) and ref[blocks[first]] == 1:
            # Writes land in one block this request alone holds: nothing to allocate or copy.
            if pending.host_twin:
                pending.break_twin(blocks[first])
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
        if pending.host_twin:
            for i in written:
                pending.break_twin(blocks[i])
        return True

    def _copy_on_write(self, blocks: list[int], index: int) -> None:
        blocks[index] = self.pending.copy(blocks[index])
        self.num_cow_copies += 1

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's whole table: every block shared, ref count + 1."""
        table = self.tables.lookup(parent.request_id)
        self.tables.check_unheld(child.request_id)
        if child.num_computed_tokens != parent.num_computed_tokens:
            raise InvalidRequestError(
                "a fork starts at the parent's computed tokens "
                f"({parent.num_computed_tokens}), child has {child.num_computed_tokens}",
                "num_computed_tokens",
            )
        self.pool.touch(table.live)
        self.tables.add(child, table.blocks, table.num_committed, table.num_dropped)
        child.block_hashes = list(parent.block_hashes)

    def free(self, request_id: str) -> None:
        """Release everything the request holds, device and host; its table is gone."""
        table = self.tables.pop(request_id)
        host_table = self.tables.pop_host(request_id)
        if table is None and host_table is None:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks")
        if table is not None:
            self.pending.release(self.pool, table.live[::-1])
        if host_table is not None and self.host_pool is not None:
            self.pending.release(self.host_pool, host_table.live[::-1])

    def release_outside_window(self, request: Request) -> None:
        """Under a sliding window, give back the blocks wholly before the window of the
        request's next query (position ``num_computed_tokens``: it sees the keys after
        position - window, and every later query fewer). Their entries become ``NO_BLOCK``;
        committed blocks stay in the prefix cache, evictable. Called after each step."""
        window = self.sliding_window
        if window is None:
            return
        table = self.tables.lookup(request.request_id)
        dead = (request.num_computed_tokens - window + 1) // self.block_size
        if self.enable_prefix_caching:  # a block is given back once the prefix cache has it
            dead = min(dead, table.num_committed)
        first = table.num_dropped
        if dead <= first:
            return
        released = table.blocks[first:dead]
        table.blocks[first:dead] = [NO_BLOCK] * (dead - first)
        table.num_dropped = dead
        self.pending.release(self.pool, released[::-1])

    def commit(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache.

        Called after the step that wrote them, never before: a block is a cache hit only once
        its K/V exists. A block newly cached is the tier state's to copy down.
        """
        table = self.tables.lookup(request.request_id)
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= table.num_committed:
            return
        chain = self._hash_chain(request, num_full)
        for i in range(max(table.num_committed, table.num_dropped), num_full):
            block_id = table.blocks[i]
            if self.pending.is_incoming(block_id):
                # Its K/V arrives with a transfer not yet applied: not a cache hit until then
                # (and a pending transfer is only ever cancelled into a block nobody caches).
                num_full = i
                break
            if self.pool.commit(block_id, chain[i]):
                self._tiers.on_commit(block_id, chain[i])
        table.num_committed = num_full

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody uses, device and host; returns how many."""
        num = self.pool.evict_all()
        if self._tiers.host_caching and self.host_pool is not None:
            num += self.host_pool.evict_all()
        return num

    # ---- swapping -------------------------------------------------------------------------------

    def swap_out(self, request_id: str) -> bool:
        """Move a request's blocks to the host pool; False (nothing changed) if it lacks room.

        A block whose host twin is still valid (shared with a request swapped earlier) is not
        moved again; the host block gains a reference instead.
        """
        table = self.tables.lookup(request_id)
        host = self.host_pool
        if host is None:
            return False
        live, dropped = table.live, [NO_BLOCK] * table.num_dropped
        num_moves = self.pending.num_moves(live, to_host=True)
        if num_moves > host.num_free_blocks:
            return False
        host_blocks = self.pending.move(live, to_host=True)
        self.tables.pop(request_id)
        self.pending.release(self.pool, live[::-1])
        self.tables.add_host(table.request, dropped + host_blocks, table.num_dropped)
        self.num_swapped_out_blocks += num_moves
        return True

    def swap_in(self, request_id: str) -> bool:
        """Bring a swapped request's blocks back to the device; False if the pool lacks room."""
        host_table = self.tables.lookup_host(request_id)
        live, num_dropped = host_table.live, host_table.num_dropped
        num_moves = self.pending.num_moves(live, to_host=False)
        if num_moves > self.pool.num_free_blocks:
            return False
        blocks = self.pending.move(live, to_host=False)
        assert self.host_pool is not None  # a host table implies a host pool
        self.tables.pop_host(request_id)
        self.pending.release(self.host_pool, live[::-1])
        self.tables.add(host_table.request, [NO_BLOCK] * num_dropped + blocks, 0, num_dropped)
        self.num_swapped_in_blocks += num_moves
        return True

    # ---- the tier state, and what it needs of the pins and swap-outs (``HostFills``) ------------

    @property
    def tier_state(self) -> TierState:
        """The write policy, the pending saves and loads, and the tier counters."""
        return self._tiers

    def pin_fill(self, host_block: int) -> None:
        self.pending.pin_fill(host_block)  # the allocation's reference, dropped when taken

    def queue_offload(self, device_block: int, host_block: int) -> None:
        self.pending.queue_offload(device_block, host_block)

    def swap_out_source(self, host_block: int) -> int | None:
        return self.pending.swap_out_source(host_block)

    # ---- hand-off to the runner, reporting ------------------------------------------------------

    def take_transfers(self) -> BlockTransfers:
        """Hand out the pending transfers (in apply order) and release their sources' pins."""
        return self.pending.take()

    def usage(self) -> KVUsage:
        """A snapshot of the device pool and the counters (see ``core/usage.py``)."""
        return KVUsage.of(self)

    def table_fills(self) -> Iterator[tuple[list[int], int]]:
        """Each device table's blocks and its request's computed tokens (for ``usage``)."""
        return self.tables.table_fills()
