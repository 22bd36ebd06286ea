"""FileStore: the default storage tier, one file per key under a directory.

Owns: the on-disk layout, atomic publication of values, and the clean-up of temporary files that
dead writers left. A key maps to ``DIR/ab/cd/<sha256(key) hex>`` (two levels of fan-out by hash
prefix, so no directory grows large and any key is a safe file name). A value is written to a
temporary file in ``DIR/.tmp/``, optionally fsynced, then published with ``os.link(tmp, final)``:
the link fails if the key already exists (first write wins, across threads and processes) and a
reader never sees a partly written file. Values are stored as given; corruption is detected one
level up (``pagekv.tiering.blob``). Specs: ``file:DIR``, ``file://DIR`` and the bare paths that
``registry`` hands here (``open_spec``).

Temporary files. A writer killed mid-write (``kill -9``, a crash, a power cut) leaves its
temporary file behind; every FileStore removes such files when it opens ``DIR``. Several
engines may share ``DIR``, so a file may belong to a live writer in another process, and
deleting it mid-write would fail that writer's put. A temporary file is named
``<node>-<pid>-<random>``: ``node`` names this machine, boot and PID namespace (where a PID
names the same process), ``pid`` the writer. Opening removes a file when

- its node is this one and its PID is not alive (the writer is gone: removed at once), or
- it is older than ``stale_temp_s`` (default 10 minutes; a block is written in milliseconds):
  the rule for files of other machines or containers, whose PIDs mean nothing here, and for a
  PID reused since its writer died.

Files of this process (another FileStore on ``DIR`` may be writing them) and files not named by
this pattern are never touched. A writer whose file was removed all the same (stuck for longer
than the grace period) fails that one put (StoreUnavailableError), nothing worse. Earlier
versions wrote ``.tmp-*`` files beside their targets; those are not looked for (it would mean
listing all 65,536 fan-out directories at every open).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import socket
import tempfile
import time
from collections.abc import Sequence

from pagekv.tiering.store import StoreConfigError, StoreUnavailableError

logger = logging.getLogger("pagekv")

TEMP_DIR = ".tmp"
STALE_TEMP_S = 600.0
_TEMP_NAME = re.compile(r"([0-9a-f]{12})-([0-9]{1,10})-[A-Za-z0-9_]+")  # node-pid-random


def node_tag() -> str:
    """12 hex digits naming this machine, boot and PID namespace: where a PID is comparable."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists here (a zombie counts: its parent has not reaped it)."""
    if pid <= 0:
        return False  # os.kill(0, ...) would name our process group
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # PermissionError: another user's process
        return True
    return True


def remove_stale_temps(directory: str, node: str, stale_temp_s: float) -> int:
    """Remove the temporary files of dead writers in ``directory`` (see the module docstring);
    how many were removed."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    now, removed = time.time(), 0
    for entry in entries:
        match = _TEMP_NAME.fullmatch(entry.name)
        if match is None:
            continue
        ours, pid = match[1] == node, int(match[2])
        if ours and pid == os.getpid():
            continue  # another FileStore of this process may be writing it
        try:
            age_s = now - entry.stat(follow_symlinks=False).st_mtime
            dead = ours and not pid_alive(pid)
            if dead or age_s > stale_temp_s:
                os.unlink(entry.path)
                removed += 1
        except FileNotFoundError:  # its writer published it, or another store removed it
            continue
    return removed


class FileStore:
    """Keys -> files under ``root``; safe for threads and for several processes sharing ``root``."""

    name = "file"

    def __init__(
        self, root: str, *, fsync: bool = False, stale_temp_s: float = STALE_TEMP_S
    ) -> None:
        self.root = os.path.abspath(root)
        self.fsync = fsync
        self._closed = False
        self._tmp_dir = os.path.join(self.root, TEMP_DIR)
        self._node = node_tag()
        try:
            os.makedirs(self._tmp_dir, exist_ok=True)
            self.num_removed_temps = remove_stale_temps(self._tmp_dir, self._node, stale_temp_s)
            fd, probe = self._mkstemp()
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise StoreConfigError(f"file store directory {root!r} is not writable: {exc}") from exc
        if self.num_removed_temps:
            logger.info(
                "file store %s: removed %d temporary files of dead writers",
                self.root,
                self.num_removed_temps,
            )

    def _mkstemp(self) -> tuple[int, str]:
        """A new temporary file named for this node and process (the PID as of now: a forked
        child writes under its own); the directory comes back if someone removed it."""
        prefix = f"{self._node}-{os.getpid()}-"
        try:
            return tempfile.mkstemp(dir=self._tmp_dir, prefix=prefix)
        except FileNotFoundError:
            os.makedirs(self._tmp_dir, exist_ok=True)
            return tempfile.mkstemp(dir=self._tmp_dir, prefix=prefix)

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
            fd, tmp = self._mkstemp()
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
