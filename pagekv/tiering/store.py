"""The storage tier's contract: the ``KVStore`` protocol, its errors, ``open_store``, MemoryStore.

Owns: what every backend promises (keys -> bytes, first write wins, thread safety, errors as
``KVStoreError`` subclasses only) and the spec strings that name a backend. The backends live in
sibling modules and are imported lazily, so ``redis`` or ``mooncake`` is only needed when used.

Semantics every backend keeps:
- keys are short ASCII strings (content addresses), values opaque bytes;
- ``put`` never overwrites: True if it stored the value, False if the key already existed;
- ``get`` returns None on a miss and raises ``StoreUnavailableError`` when the store cannot be
  read, never a wrong answer; the same holds after ``close()`` (every call then raises);
- a store whose server went away raises ``StoreUnavailableError`` within about ``timeout_s``
  and works again, as the same object, once the server is back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Protocol
from urllib.parse import parse_qsl, unquote, urlsplit

from pagekv.errors import PagekvError

ACCEPTED_SPECS = (
    "'memory', 'file:DIR' (or an absolute or ./relative path), 'redis://HOST:PORT[/DB]', "
    "'redis-cluster://HOST:PORT', 'mooncake://HOST:PORT'"
)


class KVStoreError(PagekvError):
    """Base of all storage-tier errors."""


class StoreUnavailableError(KVStoreError):
    """The store cannot be reached or used: server down, connection lost, timed out, closed."""


class StoreConfigError(KVStoreError, ValueError):
    """A bad store spec, an unwritable directory or an unknown scheme (raised at open time)."""


class KVStore(Protocol):
    """Keys -> bytes with first-write-wins puts; every method is safe to call from any thread."""

    name: str

    def exists(self, key: str) -> bool: ...

    def batch_exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get(self, key: str) -> bytes | None: ...

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def put(self, key: str, value: bytes) -> bool: ...

    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]: ...

    def remove(self, key: str) -> bool: ...

    def close(self) -> None: ...


class MemoryStore:
    """A dict behind a lock: the reference backend, and the one for tests of the layers above."""

    name = "memory"

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise StoreUnavailableError("memory store is closed")

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self._check()
            return [k in self._data for k in keys]

    def get(self, key: str) -> bytes | None:
        return self.batch_get([key])[0]

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            self._check()
            return [self._data.get(k) for k in keys]

    def put(self, key: str, value: bytes) -> bool:
        return self.batch_put([(key, value)])[0]

    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        with self._lock:
            self._check()
            out = []
            for key, value in items:
                new = key not in self._data
                if new:
                    self._data[key] = bytes(value)
                out.append(new)
            return out

    def remove(self, key: str) -> bool:
        with self._lock:
            self._check()
            return self._data.pop(key, None) is not None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._data.clear()


def _host_port(spec: str, default_port: int) -> tuple[str, int, str, dict[str, str]]:
    """Split 'scheme://HOST:PORT/PATH?QUERY' into host, port, path and query (StoreConfigError)."""
    try:
        parts = urlsplit(spec)
        port = parts.port if parts.port is not None else default_port
        query = dict(parse_qsl(parts.query, strict_parsing=bool(parts.query)))
    except ValueError as exc:
        raise StoreConfigError(f"bad store spec {spec!r}: {exc}") from None
    if not parts.hostname:
        raise StoreConfigError(f"bad store spec {spec!r}: no host")
    return parts.hostname, port, parts.path, query


def _open_redis(spec: str, cluster: bool, timeout_s: float) -> KVStore:
    from pagekv.tiering.redis_store import RedisStore

    host, port, path, query = _host_port(spec, 6379)
    if query:
        raise StoreConfigError(f"bad store spec {spec!r}: no query parameters are accepted")
    db_text = path.strip("/") or "0"
    if not db_text.isdigit() or (cluster and db_text != "0"):
        raise StoreConfigError(f"bad store spec {spec!r}: the database must be a number")
    parts = urlsplit(spec)
    password = unquote(parts.password) if parts.password else None
    return RedisStore(
        host, port, db=int(db_text), cluster=cluster, password=password, timeout_s=timeout_s
    )


def _open_mooncake(spec: str, timeout_s: float) -> KVStore:
    from pagekv.tiering.mooncake_store import MooncakeStore

    host, port, path, query = _host_port(spec, 50051)
    if path.strip("/"):
        raise StoreConfigError(f"bad store spec {spec!r}: no path is accepted")
    mib = 1 << 20
    known = {"segment_mb", "transfer_mb", "local_buffer_mb", "local_hostname"}
    if set(query) - known:
        raise StoreConfigError(
            f"bad store spec {spec!r}: unknown option(s) {sorted(set(query) - known)}; "
            f"accepted: {sorted(known)}"
        )
    try:
        sizes = {k: int(query[k]) * mib for k in known - {"local_hostname"} if k in query}
    except ValueError:
        raise StoreConfigError(f"bad store spec {spec!r}: sizes are whole MiB") from None
    return MooncakeStore(
        f"{host}:{port}",
        timeout_s=timeout_s,
        local_hostname=query.get("local_hostname", "127.0.0.1"),
        segment_bytes=sizes.get("segment_mb", 128 * mib),
        transfer_bytes=sizes.get("transfer_mb", 32 * mib),
        local_buffer_bytes=sizes.get("local_buffer_mb", 16 * mib),
    )


def open_store(spec: str, *, timeout_s: float = 5.0) -> KVStore:
    """Open the store that ``spec`` names; raises StoreConfigError for a spec it cannot accept.

    A server that cannot be reached at open time raises StoreUnavailableError.
    """
    if timeout_s <= 0:
        raise StoreConfigError(f"timeout_s must be positive, got {timeout_s}")
    spec = spec.strip()
    if spec == "memory":
        return MemoryStore()
    scheme, sep, _ = spec.partition("://")
    if sep:
        if scheme == "redis":
            return _open_redis(spec, cluster=False, timeout_s=timeout_s)
        if scheme == "redis-cluster":
            return _open_redis(spec, cluster=True, timeout_s=timeout_s)
        if scheme == "mooncake":
            return _open_mooncake(spec, timeout_s)
        if scheme != "file":
            raise StoreConfigError(f"unknown store scheme in {spec!r}; accepted: {ACCEPTED_SPECS}")
    if spec.startswith("file:"):
        path = spec.removeprefix("file:")
        path = path.removeprefix("//")  # file://rel and file:///abs as well as file:DIR
    elif spec.startswith(("/", "./", "../", "~")):
        path = spec
    else:
        raise StoreConfigError(f"unknown store spec {spec!r}; accepted: {ACCEPTED_SPECS}")
    if not path:
        raise StoreConfigError(f"store spec {spec!r} names no directory")
    from pagekv.tiering.file_store import FileStore

    return FileStore(os.path.expanduser(path))
