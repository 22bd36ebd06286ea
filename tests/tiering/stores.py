"""Fixtures for the storage-tier tests, offered to them by ``tests/tiering/conftest.py``.

Real servers, started once per session as subprocesses on free 127.0.0.1 ports and stopped by
PID: ``redis-server`` (plain and single-node cluster) and ``mooncake_master``. Where Debian's
redis-server, or the libibverbs1 that the Mooncake wheel links, is not installed (``make test``
installs both where it may), the tests using that server skip and the run's end names the
package (``tests/system_packages.py``); where it is, a server that does not start fails the test.
``store`` is one backend per parameter, opened through ``open_store``; ``key`` makes keys
unique to the test, so tests sharing a server never see each other's data.

PYTEST_DONT_REWRITE: helpers, no asserts.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagekv.tiering.mooncake_store import close_idle_clients
from pagekv.tiering.registry import open_store
from pagekv.tiering.store import KVStore
from tests.system_packages import require_binary, require_library

BACKENDS = ["memory", "file", "redis", "redis-cluster", "mooncake"]
SERVER_BACKENDS = ["redis", "redis-cluster", "mooncake"]
INSTALL_HINT = "`make install` installs it"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter of each thread of a process (R, S, D, T, ...)."""
    tasks = Path(f"/proc/{pid}/task")
    states = []
    for task in tasks.iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        states.append(stat.rpartition(")")[2].split()[0])
    return states


class ServerProcess:
    """One server subprocess on a fixed port; can be SIGKILLed and restarted on the same port."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        port: int,
        log: Path,
        ready: Callable[[ServerProcess], None] | None = None,
    ) -> None:
        self.name, self.argv, self.port, self.log = name, argv, port, log
        self._ready = ready
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def spec_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not port_open(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                self.stop()
                pytest.fail(f"{self.name} did not start on port {self.port}:\n{tail}")
            time.sleep(0.05)
        if self._ready is not None:
            self._ready(self)

    def kill(self) -> None:
        """SIGKILL by PID, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP, as a hung server; returns once every thread is stopped (the stop is
        asynchronous: a thread may still answer a request sent right after the signal)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not all(state in "Tt" for state in thread_states(self.proc.pid)):
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} (pid {self.proc.pid}) did not stop on SIGSTOP")
            time.sleep(0.01)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` not found on PATH; {INSTALL_HINT}")
    return path


def _redis_argv(port: int, workdir: Path, *extra: str) -> list[str]:
    return [
        require_binary("redis-server"),
        "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--daemonize", "no", "--dir", str(workdir), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("redis")
    port = free_port()
    server = ServerProcess("redis-server", _redis_argv(port, workdir), port, workdir / "log")
    server.start()
    yield server
    server.stop()


def _cluster_ready(server: ServerProcess) -> None:
    """Give the single node every slot (kept in nodes.conf across restarts); wait for state ok."""
    import redis

    client = redis.Redis(port=server.port, socket_timeout=5)
    try:
        info = client.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        if "cluster_slots_assigned:16384" not in text:
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 10
        while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            if time.monotonic() > deadline:
                pytest.fail("single-node redis cluster never reached cluster_state:ok")
            time.sleep(0.05)
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_cluster_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("redis-cluster")
    port, bus = free_port(), free_port()  # the default bus port, port + 10000, may not exist
    argv = _redis_argv(
        port, workdir, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
        "--cluster-port", str(bus),
    )  # fmt: skip
    server = ServerProcess("redis-server (cluster)", argv, port, workdir / "log", _cluster_ready)
    server.start()
    yield server
    server.stop()


def mooncake_master_binary() -> str:
    require_library("libibverbs1", "libibverbs.so.1")  # the wheel's master and client link it
    try:
        import mooncake
    except ImportError:
        pytest.fail(f"the mooncake package is not installed; {INSTALL_HINT}")
    bundled = Path(mooncake.__path__[0]) / "mooncake_master"
    return str(bundled) if bundled.exists() else _binary("mooncake_master")


def start_mooncake_master(workdir: Path) -> ServerProcess:
    """A mooncake_master on free loopback ports, started."""
    port, metrics = free_port(), free_port()
    argv = [
        mooncake_master_binary(),
        "--rpc_address=127.0.0.1", f"--rpc_port={port}",
        "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
        "--logtostderr",
    ]  # fmt: skip
    server = ServerProcess("mooncake_master", argv, port, workdir / "log")
    server.start()
    return server


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_mooncake_master(tmp_path_factory.mktemp("mooncake"))
    yield server
    close_idle_clients()  # while the master is up: a client's close unmounts its segment
    server.stop()


SERVER_FIXTURES = {
    "redis": "redis_server",
    "redis-cluster": "redis_cluster_server",
    "mooncake": "mooncake_master",
}


def store_spec(backend: str, server: ServerProcess | None, tmp_path: Path) -> str:
    if backend == "memory":
        return "memory"
    if backend == "file":
        return f"file:{tmp_path / 'store'}"
    assert server is not None
    if backend == "mooncake":
        return f"mooncake://{server.spec_address}?segment_mb=64&transfer_mb=16"
    return f"{backend}://{server.spec_address}"


def server_for(request: pytest.FixtureRequest, backend: str) -> ServerProcess | None:
    fixture = SERVER_FIXTURES.get(backend)
    return None if fixture is None else request.getfixturevalue(fixture)


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KVStore]:
    backend: str = request.param
    s = open_store(store_spec(backend, server_for(request, backend), tmp_path))
    yield s
    s.close()


@pytest.fixture
def key() -> Callable[[str], str]:
    """``key(name)``: a key no other test uses (like the engine's 'pagekv/<fp>/<hash>')."""
    prefix = f"pagekv-test/{uuid.uuid4().hex}/"
    return lambda name: prefix + name
