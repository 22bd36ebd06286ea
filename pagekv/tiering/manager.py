"""The tier manager: the bytes side of the host cache and the storage tier.

Owns: the store connection, the hashes this engine knows the store holds, prefetched payloads
staged until their host block's load runs, each host-cache block's checksum, the reader and
writer threads, and the tier's counters. The KV cache manager (core) decides which block holds
which hash and when blocks move; this module moves and checks the bytes. It sees K/V only as
``bytes`` through ``BlockIO`` (the runner's tensors stay the runner's) and never imports torch.

Per step, before the runner's swaps (see ``core/plan.py``)::

    saves   read each block to write (device, or a verified host block) on the engine thread,
            then encode and put it on the writer thread: the step never waits for storage
    loads   write each staged, already verified payload into its host block
    offload note the checksum of every block copied into the host cache this step

Prefetch, for a request whose prefix continues past what memory holds::

    engine thread  start_prefetch(hashes)   the scheduler holds the request (or not: the cost
    reader thread  exists -> get -> decode  model may say recomputing is faster)
    engine thread  poll()                   verified payloads go into new host blocks; the
                                            request queues again and finds them as host hits

Every payload that arrives is checked before use: a host block against the checksum noted when
it was filled and its expected hash, a stored record against its key, the model fingerprint and
its checksum, and with a secret (``--kv-store-secret``) its HMAC tag (``blob.py``). A failure is
counted, logged and becomes a miss: recomputation. After a store error the tier rests for
``retry_s`` (no prefetch, no writes) and then tries again with the same store object, so a
restarted store is used again without restarting the engine.

The store heals itself. Puts never overwrite (first write wins), so a bad record left in place
would be hit, and its block and all after it recomputed, on every restart: the rewrite would
find the key taken. So a record that fails its checks is deleted as it is read (best effort;
Mooncake keeps an object under a read lease) and the recomputed block is written again. A
record of another format version is left alone: it may be a newer pagekv's sharing the store.
The records after a bad one stay valid (a block's K/V depends only on the tokens up to it) but
are not fetched: the KV cache manager gives a request its prefix hits once, at admission, as
one unbroken run (``KVCacheManager.allocate``), so that request recomputes from the hole on
anyway; once the hole is rewritten, later requests and restarted engines load the whole chain.

Keyed stores: keys carry a tag of the secret (``blob.secret_tag``), so engines with different
secrets, or none, never read (nor delete) each other's records. A record under this engine's
keys without the right HMAC tag (forged, or unkeyed) is refused: a miss, counted in
``storage_refused_records``, logged once per engine, and deleted like a damaged one.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagekv.core.block_pool import BlockHash
from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.kv_events import KVEventLog
from pagekv.core.plan import BlockTransfers
from pagekv.tiering.blob import (
    CorruptBlockError,
    ForeignRecordError,
    ForgedRecordError,
    decode,
    encode,
    secret_tag,
)
from pagekv.tiering.store import KVStore, KVStoreError
from pagekv.tiering.store_probe import measure_store

logger = logging.getLogger("pagekv")


@dataclass(frozen=True)
class BlockIO:
    """How the tier manager reaches K/V bytes (the runner's ``KVCache`` methods)."""

    read_device: Callable[[Sequence[int]], list[bytes]]
    read_host: Callable[[Sequence[int]], list[bytes]]
    write_host: Callable[[int, bytes], None]


@dataclass
class TierStats:
    """Monotonic counters of the storage tier and of host-cache verification; flat ints."""

    storage_lookups: int = 0  # prefetches started
    storage_hit_blocks: int = 0  # verified blocks that arrived from storage
    storage_hit_bytes: int = 0
    storage_written_blocks: int = 0  # puts that stored a new record
    storage_written_bytes: int = 0
    storage_write_drops: int = 0  # writes dropped: queue full or the store unavailable
    storage_errors: int = 0  # store calls that failed (unreachable, timed out)
    storage_load_failures: int = 0  # records that failed verification (never used)
    storage_refused_records: int = 0  # ... of them refused by the secret (forged or unkeyed)
    storage_removed_records: int = 0  # failed records deleted (rewritten once recomputed)
    host_checksum_failures: int = 0  # host blocks whose bytes no longer match


@dataclass
class _Prefetch:
    request_id: str
    hashes: list[BlockHash]
    payloads: list[tuple[BlockHash, bytes]]


class TierManager:
    """Host-cache checksums always; storage I/O when a store is given."""

    def __init__(
        self,
        kv: KVCacheManager,
        io: BlockIO,
        fingerprint: bytes,
        store: KVStore | None = None,
        *,
        max_pending_writes: int = 256,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        secret: bytes | None = None,
    ) -> None:
        self.kv = kv
        self.io = io
        self.fingerprint = fingerprint
        self.secret = secret  # keys the records' HMAC tags; None: CRC32 only
        self._key_ns = "" if secret is None else f"-hmac-{secret_tag(secret)}"
        self._refusal_logged = False
        self.store = store
        self.stats = TierStats()
        self.retry_s = retry_s
        self._clock = clock
        self._down_until = 0.0
        self._host_crc: dict[int, tuple[BlockHash, int]] = {}  # host block -> (hash, crc32)
        self._known: set[BlockHash] = set()  # in the store, as far as this engine knows
        self._writing: set[BlockHash] = set()  # queued for the writer
        self._staged: dict[BlockHash, bytes] = {}  # prefetched, placed, awaiting its load
        self.events = KVEventLog(kv.block_size)  # told what the store holds (the engine's)
        self._lock = threading.Lock()  # guards _known, _writing, stats, _down_until
        self._writes: queue.Queue[tuple[BlockHash, bytes] | None] = queue.Queue(max_pending_writes)
        self._jobs: queue.Queue[_Prefetch | None] = queue.Queue()
        self._done: queue.Queue[_Prefetch] = queue.Queue()
        self._threads: list[threading.Thread] = []
        if store is not None:
            for target, name in ((self._write_loop, "writer"), (self._read_loop, "reader")):
                thread = threading.Thread(target=target, name=f"pagekv-tier-{name}", daemon=True)
                thread.start()
                self._threads.append(thread)

    # ---- keys and availability ------------------------------------------------------------------

    def key(self, block_hash: BlockHash) -> str:
        """The store key: the model/layout fingerprint (and, keyed, a tag of the secret), then
        the block's hash chain key."""
        return f"pagekv/{self.fingerprint.hex()[:32]}{self._key_ns}/{block_hash.hex()}"

    @property
    def available(self) -> bool:
        """A store is configured and not resting after an error."""
        return self.store is not None and self._clock() >= self._down_until

    def _store_failed(self, what: str, exc: Exception) -> None:
        with self._lock:
            self.stats.storage_errors += 1
            self._down_until = self._clock() + self.retry_s
        logger.warning(
            "KV store %s failed (%s); the storage tier rests for %.1f s and requests recompute",
            what,
            exc,
            self.retry_s,
        )

    # ---- the host cache's checksums ----------------------------------------------------------

    def verify_host(self, block_id: int, block_hash: BlockHash) -> bool:
        """Whether host block ``block_id`` holds the bytes noted for ``block_hash``."""
        return self._verified_host_bytes(block_id, block_hash) is not None

    def _verified_host_bytes(self, block_id: int, block_hash: BlockHash) -> bytes | None:
        record = self._host_crc.get(block_id)
        if record is not None and record[0] == block_hash:
            payload = self.io.read_host([block_id])[0]
            if zlib.crc32(payload) == record[1]:
                return payload
        self.stats.host_checksum_failures += 1
        logger.warning("host block %d failed verification; its tokens are recomputed", block_id)
        return None

    # ---- one step's transfers ----------------------------------------------------------------

    def apply(self, transfers: BlockTransfers) -> None:
        """Saves, then loads, then checksums for this step's offloads (before any swap runs)."""
        device_bytes: dict[int, bytes] = {}

        def read_device(ids: list[int]) -> None:
            missing = [b for b in dict.fromkeys(ids) if b not in device_bytes]
            device_bytes.update(zip(missing, self.io.read_device(missing), strict=True))

        if transfers.saves and self.available:
            self._save(transfers, read_device, device_bytes)
        for block_hash, host_block in transfers.loads:
            payload = self._staged.pop(block_hash)
            self.io.write_host(host_block, payload)
            self._host_crc[host_block] = (block_hash, zlib.crc32(payload))
        host_pool = self.kv.host_pool
        if host_pool is not None and transfers.swap_out:
            offloads = [(d, h) for d, h in transfers.swap_out if host_pool.block_hash(h)]
            read_device([d for d, _ in offloads])
            for d, h in offloads:
                hashed = host_pool.block_hash(h)
                assert hashed is not None
                self._host_crc[h] = (hashed, zlib.crc32(device_bytes[d]))

    def _save(
        self,
        transfers: BlockTransfers,
        read_device: Callable[[list[int]], None],
        device_bytes: dict[int, bytes],
    ) -> None:
        with self._lock:
            todo = [
                w
                for w in transfers.saves
                if w.block_hash not in self._known and w.block_hash not in self._writing
            ]
        read_device([w.block_id for w in todo if not w.on_host])
        for w in todo:
            if w.on_host:
                verified = self._verified_host_bytes(w.block_id, w.block_hash)
                if verified is None:
                    continue  # never spread damaged bytes to the store
                payload = verified
            else:
                payload = device_bytes[w.block_id]
            try:
                self._writes.put_nowait((w.block_hash, payload))
            except queue.Full:
                with self._lock:
                    self.stats.storage_write_drops += 1
                continue
            with self._lock:
                self._writing.add(w.block_hash)

    def _write_loop(self) -> None:
        store = self.store
        assert store is not None
        stop = False
        while not stop:
            item = self._writes.get()
            batch = [] if item is None else [item]
            stop = item is None
            while not stop and len(batch) < 16:  # drain what is queued into one batch put
                try:
                    nxt = self._writes.get_nowait()
                except queue.Empty:
                    break
                stop = nxt is None
                if nxt is not None:
                    batch.append(nxt)
            if batch:
                self._write_batch(store, batch)
            for _ in range(len(batch) + stop):
                self._writes.task_done()

    def _write_batch(self, store: KVStore, batch: list[tuple[BlockHash, bytes]]) -> None:
        hashes = [h for h, _ in batch]
        stored: list[bool] | None = None
        if self.available:
            keyed = [(self.key(h), p) for h, p in batch]
            records = [(k, encode(k, self.fingerprint, p, self.secret)) for k, p in keyed]
            try:
                stored = store.batch_put(records)
            except KVStoreError as exc:
                self._store_failed("write", exc)
        with self._lock:
            self._writing.difference_update(hashes)
            if stored is None:
                self.stats.storage_write_drops += len(batch)
                return
            self._known.update(hashes)  # stored now, or someone stored it first
            self.events.in_storage(hashes, True)
            for (_, payload), new in zip(batch, stored, strict=True):
                if new:
                    self.stats.storage_written_blocks += 1
                    self.stats.storage_written_bytes += len(payload)

    # ---- prefetch ------------------------------------------------------------------------------

    def start_prefetch(self, request_id: str, hashes: Sequence[BlockHash]) -> None:
        """Fetch the longest run of ``hashes`` the store holds, in the background."""
        self.stats.storage_lookups += 1
        self._jobs.put(_Prefetch(request_id, list(hashes), []))

    def _read_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self.available:
                self._fetch(job)
            self._done.put(job)

    def _fetch(self, job: _Prefetch) -> None:
        store = self.store
        assert store is not None
        keys = [self.key(h) for h in job.hashes]
        try:
            present = store.batch_exists(keys)
            num = next((i for i, p in enumerate(present) if not p), len(present))
            for start in range(0, num, 32):  # bounded memory per call
                blobs = store.batch_get(keys[start : min(num, start + 32)])
                for i, blob in enumerate(blobs, start):
                    if blob is None:
                        return  # gone since exists (evicted, or the store restarted)
                    payload = self._payload(store, job.hashes[i], keys[i], blob)
                    if payload is None:
                        return  # a bad record ends the prefix (the module docstring says why)
                    job.payloads.append((job.hashes[i], payload))
        except KVStoreError as exc:
            self._store_failed("read", exc)

    def _payload(self, store: KVStore, h: BlockHash, key: str, blob: bytes) -> bytes | None:
        """The verified payload of ``key``'s record, or None: a record that fails its checks is
        counted, logged and deleted (unless another format's), so that it is written again."""
        try:
            return decode(blob, key, self.fingerprint, self.secret)
        except CorruptBlockError as exc:
            self._rejected(h, exc)
            if not isinstance(exc, ForeignRecordError) and store.remove(key):
                with self._lock:
                    self.stats.storage_removed_records += 1
            return None

    def _rejected(self, block_hash: BlockHash, exc: CorruptBlockError) -> None:
        refused = isinstance(exc, ForgedRecordError)
        with self._lock:
            self.stats.storage_load_failures += 1
            self.stats.storage_refused_records += refused
            self._known.discard(block_hash)  # gone, or going: never skip writing it again
            self.events.in_storage([block_hash], False)
            repeated = refused and self._refusal_logged
            self._refusal_logged |= refused
        if not refused:
            logger.warning("KV store record rejected (%s); its tokens are recomputed", exc)
        elif not repeated:  # a forger (or an engine with another secret's keys) may write many
            logger.warning(
                "KV store record refused (%s): not made with this engine's --kv-store-secret; "
                "such records are recomputed, and further refusals only counted "
                "(storage_refused_records)",
                exc,
            )

    def poll(self) -> list[str]:
        """Place arrived prefetches into host blocks; the ids of requests whose fetch ended."""
        ended: list[str] = []
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                return ended
            ended.append(job.request_id)
            if not job.payloads:
                continue
            payloads = dict(job.payloads)
            placed = self.kv.tier_state.load_host([h for h, _ in job.payloads])
            for block_hash, _ in placed:
                self._staged[block_hash] = payloads[block_hash]
            with self._lock:
                self._known.update(payloads)
                self.events.in_storage(list(payloads), True)
                self.stats.storage_hit_blocks += len(job.payloads)
                self.stats.storage_hit_bytes += sum(len(p) for p in payloads.values())

    def wait(self, timeout_s: float) -> None:
        """Block until a prefetch ends or ``timeout_s`` passes (an idle engine's nap)."""
        if self._done.empty() and self._threads:
            try:
                job = self._done.get(timeout=timeout_s)
            except queue.Empty:
                return
            self._done.put(job)

    # ---- start-up and shutdown ---------------------------------------------------------------

    def measure(self, payload_bytes: int, repeats: int = 3) -> tuple[float, float]:
        """Seconds of one store round trip and of fetching one block (``store_probe.py``)."""
        assert self.store is not None
        return measure_store(self.store, self.fingerprint, self.secret, payload_bytes, repeats)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write has been tried; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush the writes, stop the threads, close the store. Idempotent."""
        if self.store is None:
            return
        self.flush(timeout_s)
        self._writes.put(None)
        self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout_s)
        with contextlib.suppress(KVStoreError):
            self.store.close()
        self.store = None
        self._threads = []

    # ---- checks --------------------------------------------------------------------------------

    def check(self) -> list[str]:
        """The residency map against the pools and the store; a list of disagreements.

        Every hashed host block (its K/V arrived) has a checksum noted for that hash, and
        every hash this engine wrote is in the store (false only after a store lost data).
        """
        problems = []
        host = self.kv.host_pool
        if self.kv.tier_state.host_caching and host is not None:
            pending = set(self.kv.pending.swap_out) | set(self.kv.tier_state.pending_loads)
            for block_hash, block_id in host.index_items():
                record = self._host_crc.get(block_id)
                if block_id not in pending and (record is None or record[0] != block_hash):
                    problems.append(f"host block {block_id} has no checksum for its hash")
        if self.store is not None and self._known:
            with self._lock:
                known = sorted(self._known)
            present = self.store.batch_exists([self.key(h) for h in known])
            for block_hash, found in zip(known, present, strict=True):
                if not found:
                    problems.append(f"{block_hash.hex()} not in the store")
        return problems
