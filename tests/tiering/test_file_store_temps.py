"""FileStore's temporary files: what a writer killed mid-write leaves is removed on the next open,
and what a live writer (in another process, or on another machine) is writing is never touched.

The first test kills a real writer process with SIGKILL while it writes; the others plant
temporary files named as writers name them, to pin down each rule of ``remove_stale_temps``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagekv.tiering.file_store import STALE_TEMP_S, TEMP_DIR, FileStore, node_tag

# Writes 32 MiB values forever (removing each once written, so the disk use stays bounded): at
# almost any instant a temporary file is being written.
WRITER = """
import sys
from pagekv.tiering.file_store import FileStore
store = FileStore(sys.argv[1])
value = bytes(32 << 20)
i = 0
while True:
    store.put(f"k{i}", value)
    store.remove(f"k{i}")
    i += 1
"""


def temps(root: Path) -> list[str]:
    return sorted(os.listdir(root / TEMP_DIR))


def writing(root: Path) -> bool:
    """Whether a value is being written: a temporary file with bytes in it (not the empty
    probe that opening writes)."""
    for name in temps(root):
        try:
            if (root / TEMP_DIR / name).stat().st_size > 0:
                return True
        except FileNotFoundError:  # published or removed since the listing
            continue
    return False


def kill_mid_write(root: Path) -> tuple[int, list[str]]:
    """Start a writer, SIGKILL it while a temporary file exists; (its pid, what it left)."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], cwd=repo)
    try:
        deadline = time.monotonic() + 60
        while not (root / TEMP_DIR).is_dir() or not writing(root):
            assert proc.poll() is None, "the writer process died on its own"
            assert time.monotonic() < deadline, "the writer never started a write"
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # by PID, as a crash would end it
        proc.wait(timeout=30)  # reaped: its PID is dead, not a zombie
    return proc.pid, temps(root)


def test_kill_9_mid_write_then_reopen_leaves_no_temporary_file(tmp_path: Path) -> None:
    for _ in range(5):  # the kill may land between two writes (microseconds of each cycle)
        pid, left = kill_mid_write(tmp_path)
        if left:
            break
    assert left, "no kill landed mid-write in 5 tries"
    assert all(name.startswith(f"{node_tag()}-{pid}-") for name in left), left
    store = FileStore(str(tmp_path))
    assert temps(tmp_path) == []
    assert store.num_removed_temps == len(left)
    assert store.put("after", b"x") and store.get("after") == b"x"  # and the store works


@pytest.fixture
def live_pid() -> Iterator[int]:
    """A process of this machine that stays alive for the test (another engine, say)."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def plant(root: Path, name: str, age_s: float = 0.0) -> Path:
    path = root / TEMP_DIR / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"partial")
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path


def test_a_live_writers_file_is_kept_and_removed_once_it_died(
    tmp_path: Path, live_pid: int
) -> None:
    node = node_tag()
    theirs = plant(tmp_path, f"{node}-{live_pid}-abc_123")
    mine = plant(tmp_path, f"{node}-{os.getpid()}-def456", age_s=2 * STALE_TEMP_S)
    gone = plant(tmp_path, f"{node}-{dead_pid()}-ghi789")
    store = FileStore(str(tmp_path))
    assert theirs.exists() and mine.exists() and not gone.exists()
    assert store.num_removed_temps == 1
    os.kill(live_pid, signal.SIGKILL)
    os.waitpid(live_pid, 0)
    FileStore(str(tmp_path))
    assert not theirs.exists()
    assert mine.exists()  # another FileStore of this process may still be writing it


def test_other_machines_files_go_by_age_and_other_names_stay(tmp_path: Path) -> None:
    """A PID of another machine or container means nothing here: only age removes its file."""
    other = "0123456789ab"
    assert other != node_tag()
    fresh = plant(tmp_path, f"{other}-{dead_pid()}-abc")
    stale = plant(tmp_path, f"{other}-{dead_pid()}-def", age_s=STALE_TEMP_S + 60)
    unknown = [
        plant(tmp_path, name, age_s=10 * STALE_TEMP_S)
        for name in ("notes.txt", ".tmp-abc", f"{other}-x-abc", f"{other}-1-abc.part")
    ]
    store = FileStore(str(tmp_path))
    assert fresh.exists() and not stale.exists()
    assert all(p.exists() for p in unknown)
    assert store.num_removed_temps == 1
    FileStore(str(tmp_path), stale_temp_s=0.0)  # the grace period is a parameter
    assert not fresh.exists()


def test_writes_survive_their_temporary_directory_being_removed(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path))
    os.rmdir(tmp_path / TEMP_DIR)
    assert store.put("k", b"v") and store.get("k") == b"v"
    assert temps(tmp_path) == []
