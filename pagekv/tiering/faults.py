"""Fault injection for the storage tier: wrappers that sit on top of a real KVStore.

Owns: nothing but test doubles. Each wrapper forwards every call to the store it wraps and
adds one kind of trouble, so the layers above can be tested against slow, failing or corrupting
storage with a real backend underneath:

- ``SlowStore(inner, delay_s)`` sleeps before each call;
- ``FailingStore(inner)`` raises StoreUnavailableError while ``failing`` is set (optionally only
  for some operations), like a server that went away;
- ``CorruptingStore(inner)`` flips one byte of every value it reads back.

Every wrapper counts calls per operation in ``calls``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence

from pagekv.tiering.store import KVStore, StoreUnavailableError

OPERATIONS = ("exists", "batch_exists", "get", "batch_get", "put", "batch_put", "remove")


class StoreWrapper:
    """Forwards to ``inner``; subclasses override ``_before`` and ``_after_get``."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _before(self, op: str) -> None:
        with self._lock:
            self.calls[op] += 1

    def _after_get(self, value: bytes | None) -> bytes | None:
        return value

    def exists(self, key: str) -> bool:
        self._before("exists")
        return self.inner.exists(key)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._before("batch_exists")
        return self.inner.batch_exists(keys)

    def get(self, key: str) -> bytes | None:
        self._before("get")
        return self._after_get(self.inner.get(key))

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        self._before("batch_get")
        return [self._after_get(v) for v in self.inner.batch_get(keys)]

    def put(self, key: str, value: bytes) -> bool:
        self._before("put")
        return self.inner.put(key, value)

    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        self._before("batch_put")
        return self.inner.batch_put(items)

    def remove(self, key: str) -> bool:
        self._before("remove")
        return self.inner.remove(key)

    def close(self) -> None:
        self.inner.close()


class SlowStore(StoreWrapper):
    """Sleeps ``delay_s`` before every call (a far or overloaded store)."""

    def __init__(self, inner: KVStore, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    def _before(self, op: str) -> None:
        super()._before(op)
        time.sleep(self.delay_s)


class FailingStore(StoreWrapper):
    """Raises StoreUnavailableError while ``failing`` is True, for ``ops`` (default: all)."""

    def __init__(
        self, inner: KVStore, *, failing: bool = False, ops: Iterable[str] = OPERATIONS
    ) -> None:
        super().__init__(inner)
        self.failing = failing
        self.ops = frozenset(ops)
        unknown = self.ops - set(OPERATIONS)
        if unknown:
            raise ValueError(f"unknown store operations {sorted(unknown)}")

    def fail(self) -> None:
        self.failing = True

    def recover(self) -> None:
        self.failing = False

    def _before(self, op: str) -> None:
        super()._before(op)
        if self.failing and op in self.ops:
            raise StoreUnavailableError(f"injected failure of {self.name} store: {op}")


class CorruptingStore(StoreWrapper):
    """Returns every value read with one byte flipped (at ``offset`` from the end)."""

    def __init__(self, inner: KVStore, *, offset: int = 1) -> None:
        super().__init__(inner)
        self.offset = offset

    def _after_get(self, value: bytes | None) -> bytes | None:
        if not value:
            return value
        damaged = bytearray(value)
        damaged[-min(self.offset, len(value))] ^= 0xFF
        return bytes(damaged)
