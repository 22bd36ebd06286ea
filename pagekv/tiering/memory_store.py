"""MemoryStore: a dict behind a lock, the reference backend (spec ``memory``).

Owns nothing but the in-process dict: values die with the store. Tests of the layers above use
it, and the fault wrappers (``faults``) wrap it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pagekv.tiering.store import StoreUnavailableError


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
