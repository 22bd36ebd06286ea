"""KV cache events: where this engine's prefix blocks live, in the form a KV-aware router reads.

Owns: the events not yet handed out, and the public identity of every block it has learned
(its public hash, its parent's, its tokens) with the media that hold it. The pools, the KV
cache manager and the tier manager call it (``attach``); the engine takes the events after
each step and publishes them (engine/kv_events.py). Must not import torch.

The events are vLLM's (``KVEventsConfig``), which vllm-router's ``kv_aware`` policy consumes::

    BlockStored      a run of full blocks entered a medium: their hashes, the parent of the
                     first (None: the run starts the sequence), their token ids, the medium
    BlockRemoved     blocks left a medium
    AllBlocksCleared this engine holds nothing (published first, so a restart is seen)

Media, as vLLM names them: ``GPU`` is the engine's own KV pool whatever the device (vLLM's
CPU backend says the same), ``CPU`` the host cache, ``STORAGE`` the storage tier. A block is
"in" the device or host medium while its hash is in that pool's index (in use or evictable:
a hit either way), and in storage once a write has landed or a read found it.

Public hashes. pagekv's own keys (prefix_cache.py) are salted and stay internal. A published
block is named by a SHA-256 chain over token ids only (u32, little-endian), ``public[i] =
SHA-256(public[i-1] || tokens of block i)`` with nothing before the first block, so equal
prefixes have equal names on every replica; a router hashes each block's ``token_ids`` itself.
Blocks of a request with a ``cache_salt`` are never published: a router matching tokens
alone would credit them to requests that cannot use them.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagekv.core.block_pool import BlockHash

if TYPE_CHECKING:
    from pagekv.core.kv_cache_manager import KVCacheManager

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_STORAGE = "STORAGE"


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str


@dataclass
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def public_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """A block's published name: SHA-256 of its parent's name and its token ids (u32 LE)."""
    h = hashlib.sha256(parent or b"")
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


@dataclass
class _Block:
    public: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    depth: int  # its index in the sequence (parents come first in a snapshot)
    media: set[str] = field(default_factory=set)


class KVEventLog:
    """The events since the last ``take``, and the identities they are built from.

    Blocks learned but in no medium are kept in an LRU of ``max_unplaced`` (a request's chain
    is learned before its blocks are computed); the storage medium is remembered for the
    ``max_storage`` most recent blocks, older ones published as removed (the router forgets
    them; the store may still hold them). Thread-safe: the storage writer calls it too.
    """

    def __init__(self, block_size: int, *, max_unplaced: int = 65536, max_storage: int = 65536):
        self.block_size = block_size
        self.max_unplaced = max_unplaced
        self.max_storage = max_storage
        self._lock = threading.Lock()
        self._placed: dict[BlockHash, _Block] = {}
        self._unplaced: OrderedDict[BlockHash, _Block] = OrderedDict()
        self._in_storage: OrderedDict[BlockHash, None] = OrderedDict()
        self._events: list[KVEvent] = []

    def attach(self, kv: KVCacheManager) -> None:
        """Hear the device pool, the host cache (when the host pool caches prefixes) and every
        unsalted hash chain as it grows."""
        kv.on_chain = self.learn
        kv.pool.on_hash_change = lambda h, added: self._changed(MEDIUM_DEVICE, h, added)
        if kv.tier_state.host_caching and kv.host_pool is not None:
            kv.host_pool.on_hash_change = lambda h, added: self._changed(MEDIUM_HOST, h, added)

    # ---- what the engine hears ---------------------------------------------------------------

    def learn(self, chain: Sequence[BlockHash], start: int, token_ids: Sequence[int]) -> None:
        """``chain`` (internal keys of ``token_ids``' full blocks) grew from index ``start``."""
        size = self.block_size
        with self._lock:
            parent = self._public(chain[start - 1]) if start > 0 else None
            if start > 0 and parent is None:  # forgotten: name the chain again from its start
                start = 0
            for i in range(start, len(chain)):
                tokens = tuple(token_ids[i * size : (i + 1) * size])
                known = self._find(chain[i])
                public = known.public if known else public_hash(parent, tokens)
                if known is None:
                    self._remember_unplaced(chain[i], _Block(public, parent, tokens, i))
                parent = public

    def stored(self, medium: str, block_hash: BlockHash) -> None:
        with self._lock:
            self._store(medium, block_hash)

    def removed(self, medium: str, block_hash: BlockHash) -> None:
        with self._lock:
            self._remove(medium, block_hash)

    def in_storage(self, block_hashes: Sequence[BlockHash], present: bool) -> None:
        """The store holds these blocks (a write landed, a read found them), or no longer."""
        with self._lock:
            for block_hash in block_hashes:
                if present:
                    self._store(MEDIUM_STORAGE, block_hash)
                else:
                    self._remove(MEDIUM_STORAGE, block_hash)

    def cleared(self) -> None:
        """Nothing is held anywhere (a start, or every tier emptied)."""
        with self._lock:
            for block_hash in list(self._placed):
                self._unplace(block_hash)
            self._in_storage.clear()
            self._events.append(AllBlocksCleared())

    def snapshot(self) -> list[KVEvent]:
        """Every block where it is now, as events from nothing: ``AllBlocksCleared``, then the
        blocks, parents first. Applied after the published events, or in their place, it
        leaves a subscriber with the current state; the events not yet taken then change
        nothing further (each sets a block's presence to what it is now)."""
        with self._lock:
            saved, self._events = self._events, [AllBlocksCleared()]
            held = sorted(
                ((b.depth, medium, h) for h, b in self._placed.items() for medium in b.media),
                key=lambda item: item[:2],
            )
            for _, medium, block_hash in held:
                self._placed[block_hash].media.discard(medium)
                self._store(medium, block_hash)
            snapshot, self._events = self._events, saved
        return snapshot

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first, runs of blocks merged."""
        with self._lock:
            events, self._events = self._events, []
        return events

    # ---- inside the lock ---------------------------------------------------------------------

    def _changed(self, medium: str, block_hash: BlockHash, added: bool) -> None:
        with self._lock:
            if added:
                self._store(medium, block_hash)
            else:
                self._remove(medium, block_hash)

    def _find(self, block_hash: BlockHash) -> _Block | None:
        return self._placed.get(block_hash) or self._unplaced.get(block_hash)

    def _public(self, block_hash: BlockHash) -> bytes | None:
        block = self._find(block_hash)
        return None if block is None else block.public

    def _remember_unplaced(self, block_hash: BlockHash, block: _Block) -> None:
        self._unplaced[block_hash] = block
        self._unplaced.move_to_end(block_hash)
        while len(self._unplaced) > self.max_unplaced:
            self._unplaced.popitem(last=False)

    def _store(self, medium: str, block_hash: BlockHash) -> None:
        block = self._placed.get(block_hash)
        if block is None:
            block = self._unplaced.pop(block_hash, None)
            if block is None:
                return  # salted, or never learned: not published
            self._placed[block_hash] = block
        if medium in block.media:
            return
        block.media.add(medium)
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and last.medium == medium
            and last.block_hashes[-1] == block.parent
        ):
            last.block_hashes.append(block.public)
            last.token_ids.extend(block.tokens)
        else:
            tokens = list(block.tokens)
            event = BlockStored([block.public], block.parent, tokens, self.block_size, medium)
            self._events.append(event)
        if medium == MEDIUM_STORAGE:
            self._in_storage[block_hash] = None
            if len(self._in_storage) > self.max_storage:
                oldest, _ = self._in_storage.popitem(last=False)
                self._remove(MEDIUM_STORAGE, oldest)

    def _remove(self, medium: str, block_hash: BlockHash) -> None:
        block = self._placed.get(block_hash)
        if block is None or medium not in block.media:
            return
        block.media.discard(medium)
        if medium == MEDIUM_STORAGE:
            self._in_storage.pop(block_hash, None)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block.public)
        else:
            self._events.append(BlockRemoved([block.public], medium))
        if not block.media:
            self._unplace(block_hash)

    def _unplace(self, block_hash: BlockHash) -> None:
        block = self._placed.pop(block_hash)
        block.media.clear()
        self._remember_unplaced(block_hash, block)
