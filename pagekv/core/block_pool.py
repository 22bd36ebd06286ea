"""The physical block pool: reference counts, the free list, the evictable LRU, the hash index.

Owns: every physical block's reference count and prefix hash, and the two queues of
unreferenced blocks. Nothing else in pagekv changes these. Must not import torch.

A block is always in exactly one state, derived from (ref count, hash)::

    ref > 0                  IN USE      owned by >= 1 block-table entry (or a pin)
    ref == 0, hash is None   FREE        in ``_free`` (FIFO: freed last, reused last)
    ref == 0, hash set       EVICTABLE   in ``_evictable`` (LRU first); still a prefix-cache
                                         hit until it is reused for something else

Allocation takes FREE blocks first, then evicts the least recently used EVICTABLE block, so
cached K/V survives as long as there is any block without history to hand out. Both queues are
O(1) at both ends (``deque`` and ``OrderedDict``); nothing scans a list.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from enum import Enum

from pagekv.errors import DoubleFreeError, InvalidRequestError, NoFreeBlocksError, UnknownBlockError

BlockHash = bytes


class BlockState(Enum):
    FREE = "free"
    IN_USE = "in_use"
    EVICTABLE = "evictable"


class BlockPool:
    """A fixed set of ``num_blocks`` blocks of ``block_size`` token slots each.

    Owner of: ``_ref`` (reference counts), ``_hash`` (committed prefix hash per block),
    ``_free`` and ``_evictable`` (the unreferenced blocks) and ``_index`` (hash -> block).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidRequestError(f"num_blocks must be >= 1, got {num_blocks!r}", "num_blocks")
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {block_size!r}", "block_size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._index: dict[BlockHash, int] = {}
        self.num_evictions = 0
        # Told (block, hash) just before an EVICTABLE block is reused, while its K/V is intact:
        # the tier manager's chance to write it back to a lower tier (kv_cache_manager.py).
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        # Told (hash, True) when a hash enters the index, (hash, False) when it leaves it: the
        # KV event log's view of what this pool caches (kv_events.py).
        self.on_hash_change: Callable[[BlockHash, bool], None] | None = None

    # ---- queries (pure) -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: FREE plus EVICTABLE."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free) + len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        self._check_id(block_id)
        return self._hash[block_id]

    def state(self, block_id: int) -> BlockState:
        self._check_id(block_id)
        if self._ref[block_id] > 0:
            return BlockState.IN_USE
        return BlockState.FREE if self._hash[block_id] is None else BlockState.EVICTABLE

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding K/V for ``block_hash``, if cached (in use or evictable)."""
        return self._index.get(block_hash)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def free_order(self) -> list[int]:
        """Blocks in the order ``allocate`` would hand them out (FREE, then EVICTABLE LRU)."""
        return [*self._free, *self._evictable]

    def iter_free(self) -> Iterator[int]:
        return iter(self._free)

    def iter_evictable(self) -> Iterator[int]:
        return iter(self._evictable)

    def index_items(self) -> list[tuple[BlockHash, int]]:
        return list(self._index.items())

    # ---- mutations ----------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks (ref count 1 each), or raise without changing anything."""
        if num_blocks < 0:
            raise InvalidRequestError(f"cannot allocate {num_blocks} blocks", "num_blocks")
        if num_blocks > len(self._free) + len(self._evictable):
            raise NoFreeBlocksError(
                f"need {num_blocks} blocks, {len(self._free)} free + "
                f"{len(self._evictable)} evictable"
            )
        return [self._take_one() for _ in range(num_blocks)]

    def allocate_one(self) -> int:
        """The hot path of decode growth: one block, ref count 1."""
        if not self._free and not self._evictable:
            raise NoFreeBlocksError("no free or evictable block left")
        return self._take_one()

    def _take_one(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            if self.on_evict is not None:
                block_hash = self._hash[block_id]
                assert block_hash is not None  # EVICTABLE means hashed
                self.on_evict(block_id, block_hash)
            self._forget_hash(block_id)
            self.num_evictions += 1
        self._ref[block_id] = 1
        return block_id

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block: a prefix-cache hit or a fork.

        An EVICTABLE block leaves the LRU (it is in use again). A FREE block has no content
        anyone could want, so touching it is a bug in the caller: ``UnknownBlockError``.
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref[block_id] == 0 and self._hash[block_id] is None:
                raise UnknownBlockError(
                    f"block {block_id} is free; only cached or used blocks can be shared"
                )
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._evictable[block_id]
            self._ref[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block (a block may appear several times).

        Validates everything first, so a bad call changes nothing. A block reaching ref count
        0 becomes EVICTABLE (most recently used end) if it carries a hash, else FREE (tail).
        Callers free a table's blocks last-to-first so a chain's tail is evicted before its head.
        """
        self._check_free(block_ids)
        ref = self._ref
        for block_id in block_ids:
            count = ref[block_id] - 1
            ref[block_id] = count
            if count == 0:
                if self._hash[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None

    def _check_free(self, block_ids: Sequence[int]) -> None:
        ref, num_blocks = self._ref, self.num_blocks
        for block_id in block_ids:
            if not 0 <= block_id < num_blocks:
                raise UnknownBlockError(f"block {block_id!r} is not in a pool of {num_blocks}")
        if len(block_ids) == 1:
            if ref[block_ids[0]] == 0:
                raise DoubleFreeError(f"block {block_ids[0]} freed but its ref count is 0")
            return
        for block_id, times in Counter(block_ids).items():
            if ref[block_id] < times:
                raise DoubleFreeError(
                    f"block {block_id} freed {times} times but its ref count is {ref[block_id]}"
                )

    def commit(self, block_id: int, block_hash: BlockHash) -> bool:
        """Mark a full, computed block as holding ``block_hash``; False if already cached.

        The first block to commit a hash is the cached copy; a later identical block (computed
        twice by two requests at once) stays unhashed and goes to the free list when released.
        """
        self._check_id(block_id)
        if self._ref[block_id] == 0:
            raise UnknownBlockError(f"block {block_id} is not in use; only written blocks commit")
        if self._hash[block_id] is not None or block_hash in self._index:
            return False
        self._hash[block_id] = block_hash
        self._index[block_hash] = block_id
        if self.on_hash_change is not None:
            self.on_hash_change(block_hash, True)
        return True

    def discard(self, block_id: int) -> None:
        """Drop an EVICTABLE block's content (it failed verification): it becomes FREE."""
        if block_id not in self._evictable:
            raise UnknownBlockError(f"block {block_id} is not evictable; only those can be dropped")
        del self._evictable[block_id]
        self._forget_hash(block_id)
        self._free.append(block_id)

    def evict_all(self) -> int:
        """Drop every EVICTABLE block's hash (reset the prefix cache); returns how many."""
        num = len(self._evictable)
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget_hash(block_id)
            self._free.append(block_id)
        return num

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._hash[block_id]
        if block_hash is not None:
            self._hash[block_id] = None
            if self._index.get(block_hash) == block_id:
                del self._index[block_hash]
                if self.on_hash_change is not None:
                    self.on_hash_change(block_hash, False)

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise UnknownBlockError(f"block {block_id!r} is not in a pool of {self.num_blocks}")
