"""MooncakeStore: the storage tier on a Mooncake Store cluster (``mooncake-transfer-engine``).

Owns: the mapping of the KVStore contract onto ``mooncake.store.MooncakeDistributedStore``.

Set-up: ``setup(local_hostname, "P2PHANDSHAKE", segment_bytes, local_buffer_bytes, "tcp", "",
"HOST:PORT")`` against ``mooncake_master --rpc_address=HOST --rpc_port=PORT`` (also give it a
free ``--metrics_port``, default 9003 on 0.0.0.0); P2P-handshake mode needs no metadata server.
The client mounts ``segment_bytes`` of its memory into the cluster (objects of any client may be
placed there and die with the process) and listens on all interfaces (handshake and TCP
transport ports). Values move through host buffers registered once with ``register_buffer``:
``batch_put_from(keys, ptrs, sizes)`` and ``batch_get_into(keys, ptrs, sizes)``; a value larger
than one transfer buffer falls back to the copying ``put``/``get`` (a value must fit
``local_buffer_bytes``, else KVStoreError). Mooncake refuses empty objects (-600
INVALID_PARAMS), so every value is stored with one trailing byte, stripped on read.

What the library does, as observed with 0.3.13.post1 (codes from mooncake-store's ErrorCode):
- No overwrite: ``put``/``batch_put_from`` of an existing key returns 0 and keeps the old value.
  First-write-wins is ``batch_is_exist`` then put; two writers racing on one key may both be
  told True, but one value is kept, never a mix. One key twice in a ``batch_put_from`` keeps
  the second, and twice in a ``batch_get_into`` fills only one buffer yet reports success for
  both: batches are de-duplicated here (for puts the first occurrence wins).
- Miss vs error: ``get`` returns ``b""`` for both; ``get_size`` and ``batch_get_into`` return
  -704 (OBJECT_NOT_FOUND) for a miss, -703 (REPLICA_IS_NOT_READY) while a put is in progress
  (a miss here too) and another negative code on failure; ``batch_is_exist`` returns 1, 0 or a
  negative code. Reads here are ``get_size`` per key, then ``batch_get_into``.
- Lease: a read grants the object a lease (master flag ``--default_kv_lease_ttl``, 10 s);
  ``remove`` returns -706 (OBJECT_HAS_LEASE) until it ends, and ``remove`` here False.
- Eviction: past the cluster's high watermark objects are evicted, so a key that existed may
  later be a miss (a cache's normal life; callers must treat a miss as a miss).
- Server down: the first call returns -900 (RPC_FAIL) at once, later ones hang in the library
  until its RPC timeout (30 s unless ``MC_RPC_TIMEOUT_MS``; the first MooncakeStore sets it to
  its ``timeout_s`` unless already set). So every call runs on a small worker pool and the
  caller waits at most ``timeout_s`` (data calls release the GIL), and after a failure each call
  first probes the master's port with a TCP connect, so a dead master fails the call at once.
- ``setup`` holds the GIL and retries for a long time against an absent master: the master
  port is probed with a TCP connect first, and ``MC_STORE_CLIENT_SETUP_RETRIES`` is set to 1
  (unless already set). A master that accepts connections but hangs still blocks open for about
  ``timeout_s`` per RPC of the set-up.
- Restart: a restarted master starts empty; the client re-mounts its segment by itself within
  about 0.2 s (its ping thread), so no new ``setup`` is needed and the same object works again.
  Puts in that window return -200 (NO_AVAILABLE_HANDLE): retried for up to a second, then
  StoreUnavailableError.
- A client that dies without closing leaves its segment listed at the master for a while: a
  put whose replica the master places there fails with -800 (TRANSFER_FAIL, the segment's
  endpoint refuses); it is retried like -200, and lands on a live segment.
- ``close`` holds the GIL for 1-2 s; any call after it, or ``unregister_buffer`` before a
  successful ``setup``, crashes the process. So ``MooncakeStore.close`` refuses further calls
  and, once no call is in flight, keeps the set-up client for the next MooncakeStore with the
  same settings in this process (its segment stays mounted); ``close_idle_clients()`` really
  closes them.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from queue import SimpleQueue
from typing import Any, TypeVar

from pagekv.tiering.store import KVStoreError, StoreConfigError, StoreUnavailableError

T = TypeVar("T")
MiB = 1 << 20

REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
OBJECT_HAS_REPLICATION_TASK = -708
NO_AVAILABLE_HANDLE = -200
TRANSFER_FAIL = -800
# Put failures that a moment later may not recur: no segment mounted yet (a restarted master),
# or the replica placed on the segment of a client that died and that the master still lists.
_PUT_RETRIED = (NO_AVAILABLE_HANDLE, TRANSFER_FAIL)
_CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
_MISSING = (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY)
_ALIGN = 64
_TRAILER = b"\x01"


class _Buffer:
    """One registered host buffer; a worker holds it for the whole of one call."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.mem = (ctypes.c_char * size)()
        self.addr = ctypes.addressof(self.mem)

    def write(self, offset: int, value: bytes) -> None:
        ctypes.memmove(self.addr + offset, value, len(value))

    def read(self, offset: int, n: int) -> bytes:
        return ctypes.string_at(self.addr + offset, n)


def _groups(sizes: Sequence[int], capacity: int) -> list[list[tuple[int, int]]]:
    """Pack item indexes (with their buffer offsets) into runs that fit ``capacity`` bytes."""
    groups: list[list[tuple[int, int]]] = []
    run: list[tuple[int, int]] = []
    offset = 0
    for i, size in enumerate(sizes):
        span = -(-max(size, 1) // _ALIGN) * _ALIGN
        if run and offset + span > capacity:
            groups.append(run)
            run, offset = [], 0
        run.append((i, offset))
        offset += span
    if run:
        groups.append(run)
    return groups


class _Client:
    """A set-up library client and its registered transfer buffers; reused after close."""

    def __init__(self, lib: Any, buffers: list[_Buffer], key: tuple[Any, ...]) -> None:
        self.lib, self.buffers, self.key = lib, buffers, key


_IDLE: dict[tuple[Any, ...], list[_Client]] = {}
_IDLE_LOCK = threading.Lock()


def _connect(
    master: str,
    local_hostname: str,
    segment_bytes: int,
    local_buffer_bytes: int,
    buffer_bytes: int,
    workers: int,
    timeout_s: float,
) -> _Client:
    """An idle client with these settings, or a new one set up against ``master``."""
    key = (master, local_hostname, segment_bytes, local_buffer_bytes, buffer_bytes, workers)
    with _IDLE_LOCK:
        if _IDLE.get(key):
            return _IDLE[key].pop()
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise StoreConfigError(
            "the mooncake store needs `pip install mooncake-transfer-engine-non-cuda` "
            f"(pagekv's extra 'mooncake') and Debian's libibverbs1: {exc}"
        ) from exc
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(100, int(timeout_s * 1000))))
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    lib = MooncakeDistributedStore()
    try:
        rc = lib.setup(
            local_hostname, "P2PHANDSHAKE", segment_bytes, local_buffer_bytes, "tcp", "", master
        )
    except RuntimeError as exc:
        raise StoreUnavailableError(f"mooncake setup against {master} failed: {exc}") from exc
    if rc != 0:
        raise StoreUnavailableError(f"mooncake setup against {master} returned {rc}")
    buffers = [_Buffer(buffer_bytes) for _ in range(workers)]
    for buf in buffers:
        rc = lib.register_buffer(buf.addr, buf.size)
        if rc != 0:
            lib.close()
            raise StoreUnavailableError(f"mooncake register_buffer returned {rc}")
    return _Client(lib, buffers, key)


def close_idle_clients() -> int:
    """Really close the library clients kept for reuse (slow, and each holds the GIL)."""
    with _IDLE_LOCK:
        idle = [c for clients in _IDLE.values() for c in clients]
        _IDLE.clear()
    for client in idle:
        for buf in client.buffers:
            client.lib.unregister_buffer(buf.addr)
        client.lib.close()
    return len(idle)


class MooncakeStore:
    """Keys -> Mooncake objects (one replica each) through a client that joins the cluster."""

    name = "mooncake"

    def __init__(
        self,
        master: str,
        *,
        timeout_s: float = 5.0,
        local_hostname: str = "127.0.0.1",
        segment_bytes: int = 128 * MiB,
        transfer_bytes: int = 32 * MiB,
        local_buffer_bytes: int = 16 * MiB,
        workers: int = 2,
    ) -> None:
        host, _, port_text = master.rpartition(":")
        if not host or not port_text.isdigit() or workers < 1:
            raise StoreConfigError(f"mooncake master must be HOST:PORT, got {master!r}")
        if min(segment_bytes, transfer_bytes // workers, local_buffer_bytes) < MiB:
            raise StoreConfigError("mooncake segment and buffer sizes must be at least 1 MiB each")
        self.master = master
        self.timeout_s = timeout_s
        self.max_value_bytes = local_buffer_bytes - 1
        self._address = (host, int(port_text))
        self._probe()  # setup would retry for long, holding the GIL: fail fast on a dead master
        self._suspect = False
        self._client = _connect(
            master,
            local_hostname,
            segment_bytes,
            local_buffer_bytes,
            transfer_bytes // workers,
            workers,
            timeout_s,
        )
        self._lib = self._client.lib
        self._buffers: SimpleQueue[_Buffer] = SimpleQueue()
        for buf in self._client.buffers:
            self._buffers.put(buf)
        self._lock = threading.Lock()
        self._closed = False
        self._inflight = 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pagekv-mooncake")

    # -- calls on the worker pool, bounded by timeout_s -------------------------------------

    def _probe(self) -> None:
        """A plain TCP connect to the master: refused at once when it is down."""
        try:
            with socket.create_connection(self._address, timeout=self.timeout_s):
                pass
        except OSError as exc:
            raise StoreUnavailableError(f"mooncake master {self.master}: {exc}") from exc

    def _call(self, what: str, fn: Callable[[_Buffer | None], T], buffer: bool = True) -> T:
        if self._suspect:  # after a failure, a dead master fails the next calls at once
            self._probe()
        with self._lock:
            if self._closed:
                raise StoreUnavailableError(f"mooncake store ({self.master}) is closed")
            self._inflight += 1
        future: Future[T] = self._pool.submit(self._task, fn, buffer)
        try:
            result = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            if future.cancel():
                self._done()
            self._suspect = True
            raise StoreUnavailableError(
                f"mooncake {self.master}: {what} timed out after {self.timeout_s} s"
            ) from None
        except StoreUnavailableError:
            self._suspect = True
            raise
        except (RuntimeError, OSError) as exc:  # what the bindings raise for C++ exceptions
            self._suspect = True
            raise StoreUnavailableError(f"mooncake {self.master}: {what} failed: {exc}") from exc
        self._suspect = False
        return result

    def _task(self, fn: Callable[[_Buffer | None], T], buffer: bool) -> T:
        buf = self._buffers.get() if buffer else None
        try:
            return fn(buf)
        finally:
            if buf is not None:
                self._buffers.put(buf)
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._inflight -= 1
            last = self._closed and self._inflight == 0
        if last:
            self._release()

    def _release(self) -> None:
        """Closed, and no call in flight: hand the library client over for reuse."""
        self._pool.shutdown(wait=False)
        with _IDLE_LOCK:
            _IDLE.setdefault(self._client.key, []).append(self._client)

    def _fail(self, what: str, code: int) -> StoreUnavailableError:
        name = _CODE_NAMES.get(code, "error")
        return StoreUnavailableError(f"mooncake {self.master}: {what} failed: {code} ({name})")

    # -- the KVStore contract ---------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        return self._call("is_exist", lambda _: self._exists(keys) if keys else [], buffer=False)

    def _exists(self, keys: list[str]) -> list[bool]:
        codes = self._lib.batch_is_exist(keys)
        if len(codes) != len(keys):
            raise self._fail("batch_is_exist", -1)
        for code in codes:
            if code < 0:
                raise self._fail("batch_is_exist", code)
        return [code == 1 for code in codes]

    def get(self, key: str) -> bytes | None:
        return self.batch_get([key])[0]

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._call("get", lambda buf: self._get(list(keys), buf))

    def _get(self, asked: list[str], buf: _Buffer | None) -> list[bytes | None]:
        assert buf is not None
        keys = list(dict.fromkeys(asked))  # a key twice in one batch_get_into fills one slot
        out: list[bytes | None] = [None] * len(keys)
        sizes = [self._lib.get_size(k) for k in keys]
        for code in sizes:
            if code < 0 and code not in _MISSING:
                raise self._fail("get_size", code)
        present = [i for i, n in enumerate(sizes) if n >= 0 and n <= buf.size]
        for i, n in enumerate(sizes):
            if n > buf.size:
                out[i] = self._get_large(keys[i], n)
        for run in _groups([sizes[i] for i in present], buf.size):
            idx = [present[j] for j, _ in run]
            got = self._lib.batch_get_into(
                [keys[i] for i in idx], [buf.addr + off for _, off in run], [sizes[i] for i in idx]
            )
            for (_, off), i, n in zip(run, idx, got, strict=True):
                if n == sizes[i] and n > 0:
                    out[i] = buf.read(off, n - 1)
                elif n not in _MISSING:
                    raise self._fail("batch_get_into", n if n < 0 else -1)
        if len(keys) == len(asked):
            return out
        found = dict(zip(keys, out, strict=True))
        return [found[k] for k in asked]

    def _get_large(self, key: str, size: int) -> bytes | None:
        value = bytes(self._lib.get(key))
        if len(value) == size and size > 0:
            return value[:-1]
        if not value and self._lib.is_exist(key) == 0:
            return None
        raise self._fail("get", -1)

    def put(self, key: str, value: bytes) -> bool:
        return self.batch_put([(key, value)])[0]

    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        return self._call("put", lambda buf: self._put(list(items), buf))

    def _put(self, items: list[tuple[str, bytes]], buf: _Buffer | None) -> list[bool]:
        assert buf is not None
        out = [False] * len(items)
        first: dict[str, int] = {}
        for i, (key, _) in enumerate(items):
            first.setdefault(key, i)
        unique = list(first.values())
        known = self._exists([items[i][0] for i in unique]) if unique else []
        todo = [i for i, there in zip(unique, known, strict=True) if not there]
        for i in todo:
            if len(items[i][1]) > self.max_value_bytes:
                raise KVStoreError(
                    f"mooncake: a value of {len(items[i][1])} bytes is larger than "
                    f"local_buffer_bytes allows ({self.max_value_bytes})"
                )
        small = [i for i in todo if len(items[i][1]) < buf.size]
        for i in todo:
            if len(items[i][1]) >= buf.size:
                out[i] = self._put_copy(items[i][0], items[i][1] + _TRAILER)
        for run in _groups([len(items[i][1]) + 1 for i in small], buf.size):
            idx = [small[j] for j, _ in run]
            for (_, off), i in zip(run, idx, strict=True):
                buf.write(off, items[i][1])
                buf.write(off + len(items[i][1]), _TRAILER)
            keys = [items[i][0] for i in idx]
            ptrs = [buf.addr + off for _, off in run]
            lens = [len(items[i][1]) + 1 for i in idx]
            for i, ok in zip(idx, self._put_from(keys, ptrs, lens), strict=True):
                out[i] = ok
        return out

    def _put_copy(self, key: str, value: bytes) -> bool:
        return self._retry_full(lambda: [self._lib.put(key, value)])[0]

    def _put_from(self, keys: list[str], ptrs: list[int], lens: list[int]) -> list[bool]:
        return self._retry_full(lambda: list(self._lib.batch_put_from(keys, ptrs, lens)))

    def _retry_full(self, op: Callable[[], list[int]]) -> list[bool]:
        """Run a put; retry the transient failures (``_PUT_RETRIED``) for up to a second."""
        deadline = time.monotonic() + min(1.0, self.timeout_s / 2)
        while True:
            codes = op()
            if not set(codes) & set(_PUT_RETRIED) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for code in codes:
            if code < 0 and code != OBJECT_ALREADY_EXISTS:
                raise self._fail("put", code)
        return [code == 0 for code in codes]

    def remove(self, key: str) -> bool:
        code = self._call("remove", lambda _: int(self._lib.remove(key)), buffer=False)
        if code in (OBJECT_NOT_FOUND, OBJECT_HAS_LEASE, OBJECT_HAS_REPLICATION_TASK):
            return False
        if code < 0:
            raise self._fail("remove", code)
        return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._inflight == 0
        if idle:
            self._release()
