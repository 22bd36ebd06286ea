"""vLLM's Grafana dashboard over a real Prometheus scraping a real ``pagekv serve``.

Debian's ``prometheus`` scrapes the server every second (both on 127.0.0.1, stopped by PID);
completions of every kind go through the server (streamed and not, n=2, chat, a 400, a stream
its client leaves); then each PromQL query of vLLM's example dashboard
(``data/vllm_grafana_queries.json``), its variables filled in as Grafana fills them, must
return at least one series with a number through Prometheus' HTTP API. Skips where the
prometheus binary is missing, unless ``PAGEKV_REQUIRE_SYSTEM_PACKAGES=1``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.support import ServerProcess, free_port, start_server
from tests.system_packages import require_binary

DASHBOARD = json.loads((Path(__file__).parent / "data" / "vllm_grafana_queries.json").read_text())
SERVED_NAME = "smol-on-grafana"
START_TIMEOUT_S = 60.0
SCRAPE_TIMEOUT_S = 30.0


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def api(self, path: str, **params: str) -> Any:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = response.json()
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        data = self.api("query", query=expr, time=f"{at:.3f}")
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)


def wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.25)


def start_prometheus(binary: str, workdir: Path, target_url: str) -> Prometheus:
    """Prometheus on a free 127.0.0.1 port scraping ``target_url``'s /metrics every second."""
    target = target_url.removeprefix("http://")
    config = workdir / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: pagekv, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    port = free_port()
    log_path = workdir / "prometheus.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    prometheus = Prometheus(f"http://127.0.0.1:{port}", proc, log_path)

    def ready() -> bool:
        assert proc.poll() is None, f"prometheus exited:\n{log_path.read_text()[-3000:]}"
        try:
            return httpx.get(prometheus.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for("prometheus ready", ready, START_TIMEOUT_S)
    except BaseException:
        prometheus.stop()
        raise
    return prometheus


@pytest.fixture
def prometheus_binary() -> str:
    """Asked for first, so that a missing package skips before the model loads."""
    return require_binary("prometheus")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server past its first request: its first steps (kernels built, caches warmed) can
    outlast a one-second scrape, which /metrics answers between two steps."""
    proc = start_server(tmp_path, "--num-kv-blocks", "128", "--served-model-name", SERVED_NAME)
    try:
        assert proc.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def prometheus(
    prometheus_binary: str, tmp_path: Path, server: ServerProcess
) -> Iterator[Prometheus]:
    """Prometheus with two scrapes of the server done: rates need a sample before the test's
    requests as well as after."""
    prom = start_prometheus(prometheus_binary, tmp_path, server.url)
    try:
        wait_for(
            "two scrapes of pagekv",
            lambda: (
                prom.query("count_over_time(vllm:num_requests_running[1m]) >= 2", time.time()) != []
            ),
            SCRAPE_TIMEOUT_S,
        )
        yield prom
    finally:
        prom.stop()


def drive(server: ServerProcess) -> None:
    """Every kind of request a dashboard should see, one after another."""
    prompt = "The capital of France is"
    for stream in (False, True):
        for max_tokens in (1, 8):
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
            assert server.post("/v1/completions", body).status_code == 200
    body = {"prompt": prompt, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 1}
    assert server.post("/v1/completions", body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True}
    assert server.post("/v1/chat/completions", chat).status_code == 200
    stop = {"prompt": prompt, "max_tokens": 16, "stop": [" "], "temperature": 0}
    assert server.post("/v1/completions", stop).status_code == 200
    assert server.post("/v1/completions", {"prompt": prompt, "max_tokens": -1}).status_code == 400
    leave = {"prompt": prompt, "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=leave, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data:"))  # then hang up
    wait_for(
        "the stream its client left aborted",
        lambda: server.metrics().get(("pagekv_request_aborted_total", ()), 0) >= 1,
        SCRAPE_TIMEOUT_S,
    )


def finished_count(server: ServerProcess) -> float:
    labels = (("engine", "0"), ("model_name", SERVED_NAME))
    return server.metrics()[("vllm:e2e_request_latency_seconds_count", labels)]


def filled_in(expr: str, model_name: str) -> str:
    """The query as Grafana sends it: ``$model_name`` and ``$__rate_interval`` replaced."""
    rate_interval = DASHBOARD["variables"]["__rate_interval"]["value"]
    return expr.replace("$__rate_interval", rate_interval).replace("$model_name", model_name)


def test_every_query_of_vllms_dashboard_returns_series(
    prometheus_binary: str, server: ServerProcess, prometheus: Prometheus
) -> None:
    drive(server)
    num_finished = finished_count(server)
    assert num_finished == 8  # the warm-up and every 200 above (not the 400, not the stream left)

    def scraped() -> bool:
        now = prometheus.query("sum(vllm:e2e_request_latency_seconds_count)", time.time())
        return bool(now) and float(now[0]["value"][1]) == num_finished

    wait_for("prometheus scraped the last request", scraped, SCRAPE_TIMEOUT_S)
    time.sleep(2.0)  # and once more: the gauges' latest samples are after the requests
    at = time.time()
    # the dashboard's $model_name: label_values(model_name), as Grafana asks for it
    assert prometheus.api("label/model_name/values") == [SERVED_NAME]

    targets = [(p, t) for p in DASHBOARD["panels"] for t in p["targets"]]
    empty = []
    for panel, target in targets:
        expr = filled_in(target["expr"], SERVED_NAME)
        result = prometheus.query(expr, at)
        values = [float(r["value"][1]) for r in result]
        moved = "rate(" in expr or "increase(" in expr  # over counters: the requests show
        if not any(v > 0 if moved else math.isfinite(v) for v in values):
            empty.append(f"{panel['title']} {target['refId']}: {expr} -> {values}")
    assert not empty, "no number (over counters, no positive one):\n" + "\n".join(empty)
    assert len(targets) == 32
