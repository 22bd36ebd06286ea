"""RedisStore: the storage tier on a Redis server or a Redis Cluster (redis-py).

Owns: the mapping of the KVStore contract onto Redis commands. ``put`` is ``SET key value NX``
(first write wins, atomically on the server); the batch forms are ``MGET`` (``mget_nonatomic``
in cluster mode, where keys spread over slots) and non-transactional pipelines of ``EXISTS`` or
``SET NX``. Socket connect/read timeouts are ``timeout_s`` (half in cluster mode, which retries
a timed-out command once) and a command that lost its connection is retried once, so a dead
server fails fast and a restarted one is picked up by the same object (the connection pool
reconnects lazily). redis-py's errors surface as StoreUnavailableError (connection, timeout,
cluster, loading, read-only, out of memory) or KVStoreError (anything else); the client is
thread-safe (a connection pool behind it). Specs: ``redis://[:PASSWORD@]HOST:PORT[/DB]`` and
``redis-cluster://[:PASSWORD@]HOST:PORT`` (``open_spec``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.retry import Retry

from pagekv.tiering.store import (
    KVStoreError,
    StoreConfigError,
    StoreUnavailableError,
    split_address,
)

_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterError,
    RedisClusterException,
    TryAgainError,
    ReadOnlyError,
    OutOfMemoryError,
    OSError,
)


class RedisStore:
    """Keys -> Redis strings; ``cluster=True`` talks to a Redis Cluster through any one node."""

    name = "redis"

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        cluster: bool = False,
        password: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.address = f"{host}:{port}" + (f"/{db}" if db else "")
        self.cluster = cluster
        self._closed = False
        attempt_s = timeout_s / 2 if cluster else timeout_s  # the cluster retries timeouts once
        opts: dict[str, Any] = {
            "password": password,
            "socket_timeout": attempt_s,
            "socket_connect_timeout": attempt_s,
            "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        }
        with self._errors("connect"):
            if cluster:
                self._r: Any = RedisCluster(host=host, port=port, **opts)
            else:
                self._r = redis.Redis(host=host, port=port, db=db, **opts)
            self._r.ping()

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        if self._closed:
            raise StoreUnavailableError(f"redis store {self.address} is closed")
        try:
            yield
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"redis {self.address}: {what} failed: {exc}") from exc
        except RedisError as exc:
            raise KVStoreError(f"redis {self.address}: {what} failed: {exc}") from exc

    def exists(self, key: str) -> bool:
        with self._errors("EXISTS"):
            return bool(self._r.exists(key))

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        with self._errors("EXISTS"):
            if not keys:
                return []
            pipe = self._r.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in pipe.execute()]

    def get(self, key: str) -> bytes | None:
        with self._errors("GET"):
            value = self._r.get(key)
            return None if value is None else bytes(value)

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._errors("MGET"):
            if not keys:
                return []
            values = (self._r.mget_nonatomic if self.cluster else self._r.mget)(list(keys))
            return [None if v is None else bytes(v) for v in values]

    def put(self, key: str, value: bytes) -> bool:
        with self._errors("SET NX"):
            return bool(self._r.set(key, value, nx=True))

    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        with self._errors("SET NX"):
            if not items:
                return []
            pipe = self._r.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, nx=True)
            return [bool(ok) for ok in pipe.execute()]

    def remove(self, key: str) -> bool:
        with self._errors("DEL"):
            return bool(self._r.delete(key))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with suppress(RedisError, RedisClusterException, OSError):
                self._r.close()


def open_spec(spec: str, timeout_s: float) -> RedisStore:
    """The store of a ``redis://`` or ``redis-cluster://`` spec (a cluster has only db 0)."""
    cluster = spec.startswith("redis-cluster://")
    host, port, path, query = split_address(spec, 6379)
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
