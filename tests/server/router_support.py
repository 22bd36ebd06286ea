"""A fleet for the scale-out tests and ``benchmarks/bench_router.py``: real ``pagekv serve``
replicas (KV events on, an optional shared file store) behind a real ``vllm-router`` process,
all on 127.0.0.1, each stopped by PID. No tests here.

A replica's prefix hits are read from its /metrics (vLLM's counter names), so a test can say
which replica served a request and whether its prefix was found there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.support import ServerProcess, free_port, start_server

ROUTER_START_TIMEOUT_S = 60.0
POLICIES = ("round_robin", "power_of_two", "cache_aware", "kv_aware")
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
REQUESTS = "vllm:request_success_total"


def events_config(ports: tuple[int, int] = (0, 0)) -> str:
    """KV events on 127.0.0.1: (publisher, replay) ports; 0 binds a free one (the replica's
    /kv_event_sources names it), a fixed pair lets a restarted replica keep its endpoints."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{ports[0]}",
            "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}",
        }
    )


def start_replica(
    log_dir: Path,
    *args: str,
    store: str | None = None,
    port: int | None = None,
    event_ports: tuple[int, int] = (0, 0),
) -> ServerProcess:
    """One replica on one thread; with ``store`` (a ``--kv-store`` spec), a host cache and that
    store, shared with the replicas given the same spec."""
    tiers = ("--host-cache-memory", "64MiB", "--kv-store", store) if store else ()
    events = ("--kv-events-config", events_config(event_ports))
    args = (*events, "--num-threads", "1", *tiers, *args)
    return start_server(log_dir, *args, port=port)


def counter(server: ServerProcess, name: str) -> float:
    """The sum of a counter's samples on one replica."""
    return sum(v for (n, _), v in server.metrics().items() if n == name)


@dataclass
class Router:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    metrics_url: str

    def kv_index_complaints(self) -> list[str]:
        """The router's log lines on KV event batches it could not decode or would not apply
        (the rejections are logged at debug level: ``start_router(..., debug=True)``)."""
        signs = ("kv_index decode batch", "batch rejected", "unknown parent")
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [line for line in lines if any(sign in line for sign in signs)]

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of the router's own Prometheus exporter."""
        text = httpx.get(self.metrics_url, timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)


def start_router(
    log_dir: Path,
    workers: list[ServerProcess],
    policy: str,
    port: int | None = None,
    debug: bool = False,
) -> Router:
    """vllm-router in front of ``workers``; returns once every worker is healthy behind it.

    Its worker checks run every second (the period power_of_two polls /get_load at), and its
    Prometheus exporter takes a free port (its default one may be taken)."""
    port = free_port() if port is None else port
    metrics_port = free_port()
    cmd = [
        sys.executable, "-m", "vllm_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(w.url for w in workers),
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-startup-check-interval", "1",
        "--health-check-interval-secs", "1",
        "--log-level", "debug" if debug else "info",
    ]  # fmt: skip
    log_path = log_dir / f"router-{policy}-{port}.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    router = Router(f"http://127.0.0.1:{port}", proc, log_path, metrics_url)
    deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}:\n{router.log_tail()}")
        try:
            if httpx.get(router.url + "/health", timeout=2).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    router.stop()
    raise RuntimeError(f"vllm-router did not start:\n{router.log_tail()}")
