"""The storage tier's contract: the ``KVStore`` protocol, its errors, and what backends share.

Owns: what every backend promises (keys -> bytes, first write wins, thread safety, errors as
``KVStoreError`` subclasses only), the ``Opener`` a backend module provides, and the parsing of
``scheme://HOST:PORT`` addresses that the server backends share. Every backend imports this
module and nothing here imports a backend, so it stays light: the standard library only. Which
spec names which backend is ``registry``'s.

Semantics every backend keeps:
- keys are short ASCII strings (content addresses), values opaque bytes;
- ``put`` never overwrites: True if it stored the value, False if the key already existed;
- ``get`` returns None on a miss and raises ``StoreUnavailableError`` when the store cannot be
  read, never a wrong answer; the same holds after ``close()`` (every call then raises);
- a store whose server went away raises ``StoreUnavailableError`` within about ``timeout_s``
  and works again, as the same object, once the server is back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol
from urllib.parse import parse_qsl, urlsplit

from pagekv.errors import PagekvError


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


# A backend module's ``open_spec(spec, timeout_s)``: the store a whole spec names (its scheme
# already matched); StoreConfigError for a spec it cannot accept, StoreUnavailableError for a
# server it cannot reach.
Opener = Callable[[str, float], KVStore]


def split_address(spec: str, default_port: int) -> tuple[str, int, str, dict[str, str]]:
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
