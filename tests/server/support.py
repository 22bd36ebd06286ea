"""Start, query and stop a real ``pagekv serve`` process for the server tests (no tests here).

The server runs as ``sys.executable -m pagekv.cli serve`` on a free port, its output in a log
file under the test's tmp dir, and is stopped by PID (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=60, **kwargs)

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=120, **kwargs)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def kv(self) -> dict[str, Any]:
        data: dict[str, Any] = self.get("/debug/kv.json").json()
        return data

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (name, sorted labels), via prometheus' parser."""
        text = self.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def send_without_reading(
    server: ServerProcess, path: str, body: dict[str, Any], rcvbuf_bytes: int = 4096
) -> socket.socket:
    """A raw HTTP POST whose response nobody reads (a small receive buffer fills fast)."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
    sock.connect((host, int(port)))
    raw = json.dumps(body).encode()
    auth = "".join(f"{k}: {v}\r\n" for k, v in server.headers.items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode()
    sock.sendall(head + raw)
    return sock


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(
    log_dir: Path, *args: str, api_key: str | None = None, port: int | None = None
) -> ServerProcess:
    """A running server (``/health`` answered 200); fails with the log if it does not start.
    ``port``: where (a restart's); by default a free one."""
    port = free_port() if port is None else port
    cmd = [sys.executable, "-m", "pagekv.cli", "serve", "--port", str(port), *args]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log_path = log_dir / f"server-{port}.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path, api_key)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"server did not start in {START_TIMEOUT_S} s:\n{server.log_tail()}")


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)


def block_states(kv: dict[str, Any]) -> dict[str, int]:
    counts = {"free": 0, "in_use": 0, "evictable": 0}
    for block in kv["blocks"]:
        counts[block["state"]] += 1
    return counts


def nothing_in_use(server: ServerProcess) -> bool:
    """Every block free or evictable and no request left in the engine."""
    kv = server.kv()
    stats = kv["stats"]
    return (
        block_states(kv)["in_use"] == 0
        and not kv["requests"]
        and not kv["swapped"]
        and stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0
    )
