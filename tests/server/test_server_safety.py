"""A server on a network: connection deadlines (raw sockets), streams nobody reads, the debug
pages behind the key, JSON-only bodies, per-client limits, and one-line 499s."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from pagekv.core.trace import block_hashes_hex
from tests.server.support import (
    ServerProcess,
    block_states,
    nothing_in_use,
    send_without_reading,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.model

KEY = "s3cret"
TIMEOUT_S = 1.0  # header, body and keep-alive deadlines of the server below
STALL_S = 2.0
SLACK_S = 1.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--num-kv-blocks", "512", "--metrics-require-key"]
    args += ["--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S)]
    args += ["--keep-alive-timeout", str(TIMEOUT_S), "--stream-stall-timeout", str(STALL_S)]
    args += ["--client-max-requests", "2", "--client-max-output-tokens", "5000"]
    proc = start_server(tmp_path_factory.mktemp("server"), *args, api_key=KEY)
    yield proc
    proc.stop()


def connect(server: ServerProcess, source: str = "127.0.0.1") -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0))
    return sock


def closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes ``sock`` (reading and dropping whatever it sends)."""
    start = time.monotonic()
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    return time.monotonic() - start


def head(path: str, length: int, content_type: str = "application/json") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_idle_and_slow_connections_are_closed_by_their_deadlines(server: ServerProcess) -> None:
    idle = connect(server)
    assert closed_after(idle) < TIMEOUT_S + SLACK_S

    slow = connect(server)  # a header line a byte at a time, never finished
    start = time.monotonic()
    with pytest.raises(OSError):
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: yes\r\n" * 4:
            slow.send(bytes([byte]))
            time.sleep(0.1)
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S

    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    short = connect(server)  # Content-Length 10 bytes past the body
    short.sendall(head("/v1/completions", len(body) + 10) + body)
    start = time.monotonic()
    answer = short.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    assert closed_after(short) < TIMEOUT_S + SLACK_S

    kept = connect(server)  # a full request, then idle: closed after the keep-alive deadline
    kept.sendall(head("/v1/completions", len(body)) + body)
    assert kept.recv(65536).startswith(b"HTTP/1.1 200 ")
    assert closed_after(kept) < TIMEOUT_S + SLACK_S
    assert server.get("/health").status_code == 200


def test_a_stream_nobody_reads_is_aborted_and_its_blocks_freed(server: ServerProcess) -> None:
    body = {"prompt": "Never read me", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    sock = send_without_reading(server, "/v1/completions", {**body, "temperature": 0})
    try:
        assert wait_until(lambda: block_states(server.kv())["in_use"] > 0, timeout_s=30)
        # its output fills the socket's buffers within a few hundred tokens; then the stall
        # deadline aborts it, long before its 4,000 tokens
        assert wait_until(lambda: nothing_in_use(server), timeout_s=60), server.kv()["stats"]
        assert "stream aborted, its client read nothing" in server.log_tail()
    finally:
        sock.close()


def test_debug_pages_need_the_key_and_show_keyed_hashes(server: ServerProcess) -> None:
    for path in ("/debug/kv", "/debug/kv.json", "/metrics"):
        assert httpx.get(server.url + path, timeout=30).status_code == 401, path
        assert server.get(path).status_code == 200, path
    ids = [(7 * i) % 1000 + 10 for i in range(48)]  # three full blocks of 16
    res = server.post("/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0})
    assert res.status_code == 200
    shown = {b["hash"] for b in server.kv()["blocks"] if b["hash"] is not None}
    engine_hashes = set(block_hashes_hex(ids))
    assert len(engine_hashes) == 3 and len(shown) >= 3
    assert not shown & engine_hashes  # nobody outside can test a guessed prompt's hashes


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_json_endpoints_refuse_bodies_that_are_not_json(
    server: ServerProcess, content_type: str
) -> None:
    body = json.dumps({"prompt": "Hi", "max_tokens": 2})
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": content_type}
    for path in ("/v1/completions", "/v1/chat/completions"):
        res = httpx.post(server.url + path, content=body, headers=headers, timeout=60)
        assert res.status_code == 415, res.text
        assert res.json()["error"]["type"] == "invalid_request_error"
    headers["Content-Type"] = "application/json; charset=utf-8"
    res = httpx.post(server.url + "/v1/completions", content=body, headers=headers, timeout=60)
    assert res.status_code == 200, res.text


def test_a_client_past_its_limits_gets_429_and_others_do_not(server: ServerProcess) -> None:
    body = {"prompt": "Count", "max_tokens": 300, "ignore_eos": True, "stream": True}
    first = send_without_reading(server, "/v1/completions", body, rcvbuf_bytes=1 << 20)
    second = send_without_reading(server, "/v1/completions", body, rcvbuf_bytes=1 << 20)
    try:
        assert wait_until(lambda: len(server.kv()["requests"]) == 2, timeout_s=30)
        small = {"prompt": "Hi", "max_tokens": 2}
        refused = server.post("/v1/completions", small)
        assert refused.status_code == 429, refused.text
        assert "requests in flight" in refused.json()["error"]["message"]
        # another address is another client
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=transport, headers=server.headers, timeout=60) as other:
            assert other.post(server.url + "/v1/completions", json=small).status_code == 200
    finally:
        first.close()
        second.close()
    assert wait_until(lambda: nothing_in_use(server), timeout_s=STALL_S + 30)
    too_much = {"prompt": "Hi", "max_tokens": 2000, "n": 3}  # 6,000 tokens of output allowance
    res = server.post("/v1/completions", too_much)
    assert res.status_code == 429 and "output tokens" in res.json()["error"]["message"]
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_client_gone_mid_body_is_one_499_line(server: ServerProcess) -> None:
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    for _ in range(3):
        sock = connect(server)
        sock.sendall(head("/v1/completions", len(body)) + body[:5])
        time.sleep(0.2)
        sock.close()
    assert wait_until(lambda: server.log_tail().count("499 127.0.0.1 POST") >= 3, timeout_s=10)
    log = server.log_tail(20000)
    assert "Traceback" not in log and " 500 " not in log
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_many_held_connections_do_not_lock_out_a_client(server: ServerProcess) -> None:
    held = [connect(server) for _ in range(200)]  # slowloris: connect and say nothing
    try:
        res = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert res.status_code == 200
        start = time.monotonic()
        done = threading.Event()

        def drain() -> None:
            for sock in held:
                closed_after(sock)
            done.set()

        threading.Thread(target=drain, daemon=True).start()
        assert done.wait(TIMEOUT_S + 10), "held connections still open"
        assert time.monotonic() - start < TIMEOUT_S + 10
    finally:
        for sock in held:
            sock.close()


def test_a_stream_left_during_its_prefill_is_aborted_at_once(server: ServerProcess) -> None:
    """A client that leaves before its first token (a long prompt still in prefill) has its
    request aborted on the disconnect, not when a token would fail to send: no first token is
    ever made for it."""

    def counts() -> tuple[float, float]:
        metrics = server.metrics()
        first_tokens = metrics[("pagekv_time_to_first_token_seconds_count", ())]
        return first_tokens, metrics.get(("pagekv_request_aborted_total", ()), 0.0)

    first_tokens, aborted = counts()
    body = {"prompt": [(13 * k) % 30000 + 100 for k in range(6000)], "max_tokens": 4}
    sock = send_without_reading(server, "/v1/completions", {**body, "stream": True})
    try:
        assert wait_until(lambda: block_states(server.kv())["in_use"] > 0, timeout_s=30)
    finally:
        sock.close()
    assert wait_until(lambda: nothing_in_use(server), timeout_s=60)
    assert counts() == (first_tokens, aborted + 1)
