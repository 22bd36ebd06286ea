"""The server under load and under clients that leave or stall.

- 20 streaming clients disconnect mid-stream: within a second every block is free or
  evictable, and the next request is served.
- A non-streaming client that gives up is aborted too.
- A client that never reads its stream stalls nobody else, and its blocks go when it leaves.
- 200 concurrent streaming requests (benchmarks/bench_serve.py): zero errors, zero leaks.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.support import (
    REPO,
    ServerProcess,
    block_states,
    nothing_in_use,
    send_without_reading,
    start_server,
)
from tests.server.support import wait_until as wait

pytestmark = pytest.mark.model

NUM_BLOCKS = 256
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ("--num-kv-blocks", str(NUM_BLOCKS), "--max-num-seqs", "64")
    proc = start_server(tmp_path_factory.mktemp("server"), *args)
    yield proc
    proc.stop()


def aborted(server: ServerProcess) -> float:
    return server.metrics().get(("pagekv_request_aborted_total", ()), 0.0)


async def read_then_leave(url: str, prompt: str, num_chunks: int) -> int:
    """Stream a long completion, read ``num_chunks`` chunks with text, then disconnect."""
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json={"prompt": prompt, **LONG}) as response,
    ):
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                seen += 1
                if seen == num_chunks:
                    return seen
    return seen


def test_disconnected_streams_release_their_blocks(server: ServerProcess) -> None:
    before = aborted(server)

    async def clients() -> list[int]:
        prompts = [f"Request {i}: write a long essay about memory." for i in range(20)]
        return await asyncio.gather(*(read_then_leave(server.url, p, 2) for p in prompts))

    assert asyncio.run(clients()) == [2] * 20
    left = time.monotonic()
    assert wait(lambda: nothing_in_use(server), timeout_s=1.0), server.kv()["stats"]
    assert time.monotonic() - left < 1.0
    assert aborted(server) - before == 20
    after = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert after.status_code == 200 and after.json()["choices"][0]["text"]


def test_a_non_streaming_client_that_gives_up_is_aborted(server: ServerProcess) -> None:
    before = aborted(server)
    body = {"prompt": "Write a very long story.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    assert wait(lambda: nothing_in_use(server), timeout_s=2.0), server.kv()["stats"]
    assert aborted(server) - before == 1


def test_a_client_that_never_reads_stalls_nobody(server: ServerProcess) -> None:
    body = {"prompt": "Never read me " * 4, **LONG, "max_tokens": 400}
    sock = send_without_reading(server, "/v1/completions", body)
    try:
        assert wait(lambda: block_states(server.kv())["in_use"] > 0, timeout_s=30)
        start = time.monotonic()
        for _ in range(3):
            body = {"prompt": "Hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            res = server.post("/v1/completions", body)
            assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 8
        assert time.monotonic() - start < 60
        assert server.kv()["requests"], "the silent client's request should still be running"
    finally:
        sock.close()
    assert wait(lambda: nothing_in_use(server), timeout_s=2.0), server.kv()["stats"]


@pytest.mark.slow
def test_200_concurrent_streams_no_errors_no_leaks(server: ServerProcess, tmp_path: Path) -> None:
    def successes() -> float:
        return sum(
            v for (n, _), v in server.metrics().items() if n == "pagekv_request_success_total"
        )

    before = successes()
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_serve.py"), "--url", server.url]
    cmd += ["--num-requests", "200", "--concurrency", "200", "--json", str(out)]
    cmd += ["--prompt-words", "3,40", "--max-tokens", "2,6"]  # mixed, small: < 2 min on 2 cores
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["num_ok"] == 200 and summary["num_errors"] == 0, summary["errors"]
    assert summary["kv_blocks_in_use_after"] == 0
    assert summary["ttft_p50_s"] is not None and summary["tpot_p50_s"] is not None
    assert elapsed < 120, f"200 requests took {elapsed:.0f} s"
    assert successes() - before == 200
    assert wait(lambda: nothing_in_use(server), timeout_s=2.0)
