"""The KVStore contract, run against every backend (memory, file, redis, redis cluster, mooncake).

Real servers (tests/store_fixtures.py): a dead server is SIGKILLed, a hung one SIGSTOPped, and
the same store object must report StoreUnavailableError in time and work again afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagekv.tiering.faults import CorruptingStore, FailingStore, SlowStore
from pagekv.tiering.file_store import FileStore
from pagekv.tiering.memory_store import MemoryStore
from pagekv.tiering.mooncake_store import MooncakeStore, close_idle_clients
from pagekv.tiering.registry import open_store
from pagekv.tiering.store import KVStore, KVStoreError, StoreConfigError, StoreUnavailableError
from tests.tiering.stores import (
    SERVER_BACKENDS,
    ServerProcess,
    free_port,
    server_for,
    start_mooncake_master,
    store_spec,
)

Key = Callable[[str], str]
MiB = 1 << 20


def value(n: int, seed: int = 0) -> bytes:
    """n bytes that differ by position and seed (a shifted copy would not compare equal)."""
    block = bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


def eventually(fn: Callable[[], object], timeout_s: float = 10.0) -> object:
    """fn's first result that does not raise StoreUnavailableError, within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except StoreUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# -- the contract, every backend ---------------------------------------------------------------


def test_round_trip_exact_bytes(store: KVStore, key: Key) -> None:
    sizes = [0, 1, 7, 4096, 100_000, MiB, MiB + 13]
    values = {key(f"v{n}"): value(n, seed=n) for n in sizes}
    values[key("zeros")] = bytes(1000)
    values[key("ones")] = b"\xff" * 1001
    for k, v in values.items():
        assert store.put(k, v) is True
    for k, v in values.items():
        assert store.exists(k)
        got = store.get(k)
        assert got is not None and len(got) == len(v) and got == v
    assert store.batch_get(list(values)) == list(values.values())


def test_missing_keys(store: KVStore, key: Key) -> None:
    assert store.get(key("absent")) is None
    assert store.exists(key("absent")) is False
    assert store.batch_get([key("a"), key("b")]) == [None, None]
    assert store.batch_exists([key("a"), key("b")]) == [False, False]
    assert store.batch_get([]) == [] and store.batch_exists([]) == [] and store.batch_put([]) == []


def test_first_write_wins(store: KVStore, key: Key) -> None:
    k = key("block")
    assert store.put(k, b"first" * 1000) is True
    assert store.put(k, b"second") is False
    assert store.get(k) == b"first" * 1000
    fresh = key("fresh")
    assert store.batch_put([(k, b"third"), (fresh, b"one"), (fresh, b"two")]) == [
        False,
        True,
        False,
    ]
    assert store.batch_get([k, fresh]) == [b"first" * 1000, b"one"]


def test_batch_forms_keep_order(store: KVStore, key: Key) -> None:
    stored = {key(f"k{i}"): value(50_000 + i, seed=i) for i in range(0, 12, 2)}
    assert store.batch_put(list(stored.items())) == [True] * len(stored)
    asked = [key(f"k{i}") for i in (11, 0, 3, 4, 4, 10, 1, 8, 2, 6, 7)]
    assert store.batch_get(asked) == [stored.get(k) for k in asked]
    assert store.batch_exists(asked) == [k in stored for k in asked]


def test_remove(store: KVStore, key: Key) -> None:
    k = key("gone")
    assert store.put(k, b"x" * 100) is True
    assert store.remove(k) is True
    assert store.get(k) is None and not store.exists(k)
    assert store.remove(k) is False
    assert store.remove(key("never")) is False
    assert store.put(k, b"again") is True
    assert store.get(k) == b"again"


def test_concurrent_writer_and_readers(store: KVStore, key: Key) -> None:
    keys = [key(f"c{i}") for i in range(24)]
    expected = {k: value(100_000 + 999 * i, seed=i) for i, k in enumerate(keys)}
    errors: list[str] = []
    done = threading.Event()

    def writer() -> None:
        try:
            for i in range(0, len(keys), 3):
                ok = store.batch_put([(k, expected[k]) for k in keys[i : i + 3]])
                if ok != [True] * 3:
                    errors.append(f"put {ok}")
        finally:
            done.set()

    def reader() -> None:
        while True:
            finished = done.is_set()
            for k, got in zip(keys, store.batch_get(keys), strict=True):
                if got is not None and got != expected[k]:
                    errors.append(f"read a wrong value for {k}")
            for k in keys[::5]:
                got = store.get(k)
                if got is not None and got != expected[k]:
                    errors.append(f"get: a wrong value for {k}")
            if finished:
                return

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:5]
    assert store.batch_get(keys) == [expected[k] for k in keys]


def test_racing_writers_keep_one_value(store: KVStore, key: Key) -> None:
    k = key("raced")
    candidates = [value(200_000, seed=s) for s in range(4)]
    results: list[bool] = [False] * len(candidates)
    barrier = threading.Barrier(len(candidates))

    def write(i: int) -> None:
        barrier.wait()
        results[i] = store.put(k, candidates[i])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(candidates))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = store.get(k)
    assert got in candidates
    if store.name == "mooncake":  # exists-then-put: a race may tell two writers True
        assert sum(results) >= 1
    else:
        assert results.count(True) == 1 and got == candidates[results.index(True)]


def test_closed_store_raises(store: KVStore, key: Key) -> None:
    store.put(key("a"), b"a")
    store.close()
    calls: list[Callable[[], object]] = [
        lambda: store.get(key("a")),
        lambda: store.batch_get([key("a")]),
        lambda: store.exists(key("a")),
        lambda: store.batch_exists([key("a")]),
        lambda: store.put(key("b"), b"b"),
        lambda: store.batch_put([(key("b"), b"b")]),
        lambda: store.remove(key("a")),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailableError):
            call()
    store.close()  # twice is fine


# -- servers that die or hang ------------------------------------------------------------------


@pytest.fixture(params=SERVER_BACKENDS)
def server_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[ServerProcess, KVStore]]:
    server = server_for(request, request.param)
    assert server is not None
    s = open_store(store_spec(request.param, server, tmp_path), timeout_s=1.0)
    yield server, s
    server.resume()
    s.close()


def test_dead_server_then_restart(server_store: tuple[ServerProcess, KVStore], key: Key) -> None:
    server, store = server_store
    assert store.put(key("before"), b"1" * 1000) is True
    server.kill()
    for call in (
        lambda: store.get(key("before")),
        lambda: store.batch_get([key("before"), key("x")]),
        lambda: store.exists(key("before")),
        lambda: store.put(key("during"), b"2"),
        lambda: store.batch_put([(key("during"), b"2")]),
    ):
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            call()
        assert time.monotonic() - start < 6.0  # seconds, not the 30 s of a hung client
    server.start()  # same port; a restarted server starts empty
    assert eventually(lambda: store.put(key("after"), b"3" * 5000)) is True
    assert store.get(key("after")) == b"3" * 5000
    assert store.batch_get([key("after"), key("before")]) == [b"3" * 5000, None]


def test_hung_server_times_out(server_store: tuple[ServerProcess, KVStore], key: Key) -> None:
    server, store = server_store
    assert store.put(key("k"), b"v") is True
    server.pause()
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        store.get(key("k"))
    assert time.monotonic() - start < 5.0  # timeout_s=1.0; the margin is for a loaded machine
    server.resume()
    assert eventually(lambda: store.get(key("k"))) == b"v"


def test_unreachable_server_at_open(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    for spec in (f"redis://127.0.0.1:{port}", f"mooncake://127.0.0.1:{port}"):
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            open_store(spec, timeout_s=1.0)
        assert time.monotonic() - start < 6.0  # seconds, not the 30 s of a hung client


# -- open_store ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "nosuch",
        "s3://bucket/x",
        "memory:",
        "redis://",
        "redis://127.0.0.1:notaport",
        "redis://127.0.0.1:6379/db",
        "redis://127.0.0.1:6379?x=1",
        "redis-cluster://127.0.0.1:6379/2",
        "mooncake://127.0.0.1:50051/path",
        "mooncake://127.0.0.1:50051?bogus=1",
        "mooncake://127.0.0.1:50051?segment_mb=lots",
        "file:",
    ],
)
def test_bad_specs(spec: str) -> None:
    with pytest.raises(StoreConfigError) as info:
        open_store(spec)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KVStoreError)


def test_unwritable_directory(tmp_path: Path) -> None:
    regular = tmp_path / "a-file"
    regular.write_bytes(b"")
    with pytest.raises(StoreConfigError):
        open_store(f"file:{regular}/store")
    with pytest.raises(StoreConfigError):
        open_store(str(regular))


def test_spec_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_server: ServerProcess
) -> None:
    monkeypatch.chdir(tmp_path)
    opened = [
        open_store("memory"),
        open_store(f"file:{tmp_path / 'a'}"),
        open_store(f"file://{tmp_path / 'b'}"),
        open_store(str(tmp_path / "c")),
        open_store("./d"),
        open_store(f"redis://{redis_server.spec_address}/1"),
    ]
    assert [s.name for s in opened] == ["memory", "file", "file", "file", "file", "redis"]
    assert all(os.path.isdir(tmp_path / d) for d in "abcd")
    for s in opened:
        s.close()


# -- backend specifics ---------------------------------------------------------------------------


def test_file_store_layout_and_atomicity(tmp_path: Path, key: Key) -> None:
    root = tmp_path / "store"
    a, b = FileStore(str(root)), FileStore(str(root), fsync=True)  # two processes, one dir
    assert a.put(key("x"), b"from a") is True
    assert b.put(key("x"), b"from b") is False
    assert b.get(key("x")) == b"from a"
    assert b.put(key("y"), value(10_000)) is True and a.get(key("y")) == value(10_000)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) == 2 and not any(p.name.startswith(".") for p in files)
    assert all(p.relative_to(root).parts[:2] == (p.name[:2], p.name[2:4]) for p in files)


def test_redis_database_is_separate(redis_server: ServerProcess, key: Key) -> None:
    db0 = open_store(f"redis://{redis_server.spec_address}/0")
    db1 = open_store(f"redis://{redis_server.spec_address}/1")
    assert db0.put(key("k"), b"0") and db1.put(key("k"), b"1")
    assert (db0.get(key("k")), db1.get(key("k"))) == (b"0", b"1")
    db0.close()
    db1.close()


def test_mooncake_lease_blocks_remove(
    mooncake_master: ServerProcess, tmp_path: Path, key: Key
) -> None:
    store = open_store(store_spec("mooncake", mooncake_master, tmp_path))
    try:
        assert store.put(key("k"), b"leased") is True
        assert store.get(key("k")) == b"leased"  # the read grants a ~10 s lease
        assert store.remove(key("k")) is False
        assert store.get(key("k")) == b"leased"
    finally:
        store.close()


def test_mooncake_values_larger_than_a_transfer_buffer(
    mooncake_master: ServerProcess, tmp_path: Path, key: Key
) -> None:
    store = open_store(store_spec("mooncake", mooncake_master, tmp_path))
    assert isinstance(store, MooncakeStore)  # 16 MiB for 2 workers: 8 MiB buffers
    try:
        big, small = value(9 * MiB, seed=1), value(MiB // 2, seed=2)  # big: the copying path
        assert store.batch_put([(key("big"), big), (key("small"), small)]) == [True, True]
        assert store.batch_get([key("small"), key("big"), key("none")]) == [small, big, None]
        many = [(key(f"m{i}"), value(MiB, seed=i)) for i in range(12)]  # 12 MiB: 2 runs
        assert store.batch_put(many) == [True] * 12
        assert store.batch_get([k for k, _ in many]) == [v for _, v in many]
    finally:
        store.close()


# -- fault wrappers ------------------------------------------------------------------------------


def test_fault_wrappers(key: Key) -> None:
    failing = FailingStore(MemoryStore(), ops=["get", "batch_get"])
    assert failing.put(key("k"), b"abc") is True
    failing.fail()
    with pytest.raises(StoreUnavailableError):
        failing.get(key("k"))
    assert failing.exists(key("k"))  # only reads fail
    failing.recover()
    assert failing.get(key("k")) == b"abc"
    assert failing.calls["get"] == 2 and failing.calls["put"] == 1
    with pytest.raises(ValueError):
        FailingStore(MemoryStore(), ops=["frobnicate"])

    slow = SlowStore(MemoryStore(), delay_s=0.05)
    start = time.monotonic()
    slow.put(key("k"), b"x")
    slow.get(key("k"))
    assert time.monotonic() - start >= 0.1

    corrupt = CorruptingStore(MemoryStore())
    corrupt.put(key("k"), b"abc")
    assert corrupt.get(key("k")) == b"ab\x9c"
    assert corrupt.batch_get([key("k"), key("none")]) == [b"ab\x9c", None]


def test_mooncake_puts_survive_a_dead_clients_segment(tmp_path: Path, key: Key) -> None:
    """A client killed with its segment mounted stays listed at the master for a while, and
    a put whose replica lands there fails (TRANSFER_FAIL): the store retries it onto a live
    segment, so every put succeeds."""
    master = start_mooncake_master(tmp_path)  # its own: the dead segment must not outlive it
    spec = store_spec("mooncake", master, tmp_path)
    code = (
        "import sys, time; from pagekv.tiering.registry import open_store; "
        f"store = open_store({spec!r}); print('mounted', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    store = None
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "mounted"
        child.kill()
        child.wait()
        store = open_store(spec)
        items = [(key(f"after-death-{i}"), value(1000, seed=i)) for i in range(24)]
        assert [store.put(k, v) for k, v in items] == [True] * len(items)
        assert store.batch_get([k for k, _ in items]) == [v for _, v in items]
    finally:
        child.kill()
        if store is not None:
            store.close()
        close_idle_clients()  # the kept client's segment is on this master: unmount it now
        master.stop()
