"""FileStore: the default storage tier, one file per key under a directory.

Owns: the on-disk layout and atomic publication of values. A key maps to
``DIR/ab/cd/<sha256(key) hex>`` (two levels of fan-out by hash prefix, so no directory grows
large and any key is a safe file name). A value is written to a temporary file in the target's
directory, optionally fsynced, then published with ``os.link(tmp, final)``: the link fails if the
key already exists (first write wins, across threads and processes) and a reader never sees a
partly written file. Values are stored as given; corruption is detected one level up
(``pagekv.tiering.blob``). Specs: ``file:DIR``, ``file://DIR`` and the bare paths that
``registry`` hands here (``open_spec``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Sequence

from pagekv.tiering.store import StoreConfigError, StoreUnavailableError


class FileStore:
    """Keys -> files under ``root``; safe for threads and for several processes sharing ``root``."""

    name = "file"

    def __init__(self, root: str, *, fsync: bool = False) -> None:
        self.root = os.path.abspath(root)
        self.fsync = fsync
        self._closed = False
        try:
            os.makedirs(self.root, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.root, prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise StoreConfigError(f"file store directory {root!r} is not writable: {exc}") from exc

    def path(self, key: str) -> str:
        """Where ``key``'s value lives (whether or not it exists)."""
        h = hashlib.sha256(key.encode()).hexdigest()
        return os.path.join(self.root, h[:2], h[2:4], h)

    def _check(self) -> None:
        if self._closed:
            raise StoreUnavailableError(f"file store {self.root} is closed")

    def exists(self, key: str) -> bool:
        self._check()
        try:
            os.stat(self.path(key))
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreUnavailableError(f"file store: cannot stat {key!r}: {exc}") from exc
        return True

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return [self.exists(k) for k in keys]

    def get(self, key: str) -> bytes | None:
        self._check()
        try:
            with open(self.path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailableError(f"file store: cannot read {key!r}: {exc}") from exc

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put(self, key: str, value: bytes) -> bool:
        self._check()
        if self.exists(key):
            return False
        final = self.path(key)
        directory = os.path.dirname(final)
        tmp = None
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(value)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
            if self.fsync:
                dir_fd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            return True
        except OSError as exc:
            raise StoreUnavailableError(f"file store: cannot write {key!r}: {exc}") from exc
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        return [self.put(k, v) for k, v in items]

    def remove(self, key: str) -> bool:
        self._check()
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreUnavailableError(f"file store: cannot remove {key!r}: {exc}") from exc
        return True

    def close(self) -> None:
        self._closed = True


def open_spec(spec: str, timeout_s: float) -> FileStore:
    """The store of a ``file:DIR`` or ``file://DIR`` spec, or of a bare path (``timeout_s``
    does not apply: every call is a local file operation)."""
    path = spec
    if spec.startswith("file:"):
        path = spec.removeprefix("file:").removeprefix("//")  # file://rel and file:///abs too
    if not path:
        raise StoreConfigError(f"store spec {spec!r} names no directory")
    return FileStore(os.path.expanduser(path))
