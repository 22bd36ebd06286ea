"""Abuse benchmark of ``pagekv serve``: one client misbehaves, another asks for 16 tokens.

    python benchmarks/bench_abuse.py            # starts its own server (default flags)
    python benchmarks/bench_abuse.py --record   # and save the table

The victim (from 127.0.0.2, another client to the server) sends a 16-token greedy completion
three times while each abusive client (from 127.0.0.1) runs:

    long_prompts   64 streaming requests of 8,000-token prompts at once
    wide_n         8 requests of n=128, max_tokens 8,000
    stop_strings   requests with 80,000 stop strings and n=16, back to back
    big_id_lists   two threads posting 1 MiB token-id prompts, back to back
    slowloris      600 connections that send a byte of headers now and then
    never_read     4 streams of 4,000 tokens whose responses nobody reads

Each row: what the abuser's requests got (status counts), the victim's median latency against
its latency on an idle server, and the bound it must meet: 3x idle plus one step, the step
being the longest the server took while the victim's requests ran (its step-time histogram,
to 25%; at least an idle step of ``shared_prefill_tokens`` prompt tokens). KV blocks in use
after each scenario must be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from bench_serve import start_server

ABUSER, VICTIM = "127.0.0.1", "127.0.0.2"
VICTIM_BODY = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
VICTIM_BODY["ignore_eos"] = True
SHARED_PREFILL_TOKENS = 256  # the scheduler's default: a step's prefill with two clients in
VOCAB = 49152


class Abuser:
    """Threads that run ``attack`` until stopped; each outcome (a status, or an error's name)
    is counted."""

    def __init__(self, url: str, attack: Callable[[Abuser], None], threads: int) -> None:
        self.url = url
        self.stop = threading.Event()
        self.outcomes: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.clients: list[httpx.Client] = []  # closed on exit: their requests end with them
        self._threads = [
            threading.Thread(target=attack, args=(self,), daemon=True) for _ in range(threads)
        ]

    def count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1

    def post(self, body: dict[str, Any], stream: bool = False) -> None:
        transport = httpx.HTTPTransport(local_address=ABUSER)
        try:
            with httpx.Client(transport=transport, timeout=600) as client:
                with self.lock:
                    self.clients.append(client)
                if not stream:
                    self.count(
                        str(client.post(self.url + "/v1/completions", json=body).status_code)
                    )
                    return
                with client.stream("POST", self.url + "/v1/completions", json=body) as res:
                    self.count(str(res.status_code))
                    for _ in res.iter_bytes():
                        if self.stop.is_set():
                            return
        except httpx.HTTPError as exc:
            self.count(type(exc).__name__)

    def __enter__(self) -> Abuser:
        for t in self._threads:
            t.start()
        return self

    def wait_until_in(self, timeout_s: float) -> None:
        """Until every thread's first request has an answer (a stream: its headers), which
        for the engine means queued; at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while sum(self.outcomes.values()) < len(self._threads) and time.monotonic() < deadline:
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for sock in self.sockets:
            sock.close()
        with self.lock:
            for client in self.clients:
                client.close()  # from here: a thread blocked on a read fails and ends
        deadline = time.monotonic() + 30
        for t in self._threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.1))


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def once(body: dict[str, Any], stream: bool = False) -> Callable[[Abuser], None]:
    def attack(a: Abuser) -> None:
        a.post(body, stream)

    return attack


def again(make: Callable[[], dict[str, Any]]) -> Callable[[Abuser], None]:
    def attack(a: Abuser) -> None:
        while not a.stop.is_set():
            a.post(make())

    return attack


def long_prompt(a: Abuser) -> None:
    """A streaming request of its own 8,000-token prompt (no prefix shared with another), on a
    socket held until the scenario ends (closing it aborts the request)."""
    body = json.dumps({"prompt": ids(8000, threading.get_ident()), "max_tokens": 16})
    raw_post(a, body.replace("}", ', "stream": true}'), rcvbuf=1 << 20)


def raw_post(a: Abuser, body: str, rcvbuf: int) -> None:
    host, port = a.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((ABUSER, 0))
    sock.connect((host, int(port)))
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
    with a.lock:
        a.sockets.append(sock)
    status = sock.recv(12).decode(errors="replace")[9:12]  # "HTTP/1.1 200"
    a.count(status or "closed")


def slowloris(count: int) -> Callable[[Abuser], None]:
    def attack(a: Abuser) -> None:
        host, port = a.url.removeprefix("http://").split(":")
        for _ in range(count):
            try:
                sock = socket.create_connection((host, int(port)), source_address=(ABUSER, 0))
                sock.send(b"POST /v1/completions HTTP/1.1\r\n")
                a.sockets.append(sock)
            except OSError as exc:
                a.count(type(exc).__name__)
        a.count(f"{len(a.sockets)} connections held")
        while not a.stop.wait(1.0):
            for sock in a.sockets:
                try:
                    sock.send(b"X")
                except OSError:
                    a.count("closed by the server")
                    a.sockets.remove(sock)
                    break

    return attack


def never_read(a: Abuser) -> None:
    body = '{"prompt": "Never read", "max_tokens": 4000, "ignore_eos": true, "stream": true}'
    raw_post(a, body, rcvbuf=4096)


SCENARIOS: dict[str, Callable[[str], Abuser]] = {
    "long_prompts": lambda url: Abuser(url, long_prompt, 64),
    "wide_n": lambda url: Abuser(url, once({"prompt": "Hi", "n": 128, "max_tokens": 8000}), 8),
    "stop_strings": lambda url: Abuser(
        url,
        again(lambda: {"prompt": "Hi", "n": 16, "stop": [f"s{i}" for i in range(80000)]}),
        1,
    ),
    "big_id_lists": lambda url: Abuser(
        url, again(lambda: {"prompt": ids(200_000, 2), "max_tokens": 4}), 2
    ),
    "slowloris": lambda url: Abuser(url, slowloris(600), 1),
    "never_read": lambda url: Abuser(url, never_read, 4),
}


def victim_latency(url: str, runs: int = 3) -> float:
    """The victim's median end-to-end latency (s) over ``runs`` requests."""
    transport = httpx.HTTPTransport(local_address=VICTIM)
    times = []
    with httpx.Client(transport=transport, timeout=600) as client:
        for _ in range(runs):
            start = time.monotonic()
            res = client.post(url + "/v1/completions", json=VICTIM_BODY)
            res.raise_for_status()
            assert res.json()["usage"]["completion_tokens"] == 16
            times.append(time.monotonic() - start)
    return statistics.median(times)


def step_time(url: str) -> float:
    """An idle step of ``SHARED_PREFILL_TOKENS`` prompt tokens (median of 3)."""
    body = {"prompt": ids(SHARED_PREFILL_TOKENS, 3), "max_tokens": 1}
    times = []
    for _ in range(3):
        start = time.monotonic()
        httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
        times.append(time.monotonic() - start)
    return statistics.median(times)


def step_buckets(url: str) -> dict[float, float]:
    """The server's step-time histogram: cumulative count per bucket's upper bound (s)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line.startswith("pagekv_step_seconds_bucket{"):
            bound = line.split('le="')[1].split('"')[0]
            if bound != "+Inf":
                out[float(bound)] = float(line.rsplit(" ", 1)[1])
    return out


def longest_step(before: dict[float, float], after: dict[float, float]) -> float:
    """The upper bound of the highest bucket that gained steps between two readings."""
    gained = [b for b in sorted(after) if after[b] - before.get(b, 0.0) > 0]
    if not gained:
        return 0.0
    # cumulative buckets: the longest step is in the lowest bucket holding all new steps
    total = after[max(after)] - before.get(max(after), 0.0)
    return min(b for b in gained if after[b] - before.get(b, 0.0) >= total)


def blocks_in_use(url: str) -> int:
    kv = httpx.get(url + "/debug/kv.json", timeout=60).json()
    return sum(b["state"] == "in_use" for b in kv["blocks"])


def settle(url: str, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while (used := blocks_in_use(url)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return used


COLUMNS = ["abusive client", "its requests got", "victim p50 (s)", "vs idle"]
COLUMNS += ["longest step (s)", "bound (s)", "met"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument(
        "--warmup-s", type=float, default=60.0, help="at most this long for the abuse to start"
    )
    p.add_argument("--serve-args", default="", help="extra `pagekv serve` flags")
    record.add_argument(p)
    args = p.parse_args()
    proc, url = start_server(args.serve_args.split())
    rows: list[list[record.Cell]] = []
    try:
        victim_latency(url, 1)  # warm up
        idle = victim_latency(url)
        step = step_time(url)
        bound = 3 * idle + step
        print(f"idle victim {idle:.3f} s, one step {step:.3f} s: bound {bound:.3f} s", flush=True)
        rows.append(["(none: idle)", "", round(idle, 3), "1.00x", round(step, 3), round(bound, 3)])
        rows[-1].append("")
        for name in args.scenarios.split(","):
            with SCENARIOS[name](url) as abuser:
                abuser.wait_until_in(args.warmup_s)
                time.sleep(1.0)
                before = step_buckets(url)
                loaded = victim_latency(url)
                step_under_abuse = longest_step(before, step_buckets(url))
            left = settle(url)
            got = ", ".join(f"{k}: {v}" for k, v in sorted(abuser.outcomes.items()))
            limit = 3 * idle + max(step, step_under_abuse)
            met = "yes" if loaded <= limit and left == 0 else "no"
            note = f"{got}; {left} blocks in use after" if left else got
            print(
                f"{name:14s} victim {loaded:7.3f} s ({loaded / idle:5.2f}x) bound {limit:.3f} "
                f"{met}  [{note}]",
                flush=True,
            )
            rows.append([name, note, round(loaded, 3), f"{loaded / idle:.2f}x"])
            rows[-1] += [round(step_under_abuse, 3), round(limit, 3), met]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    if args.record is not None:
        record.save(
            args.record or "abuse",
            "A victim's 16-token request while another client abuses the server",
            COLUMNS,
            rows,
            "`pagekv serve` with default flags"
            + (f" and {args.serve_args}" if args.serve_args else "")
            + "; the victim from another address (another client), 3 requests, median; bound: "
            "3x its idle latency plus the longest step while it ran (the server's step "
            "histogram, to 25%; at least an idle 256-token prefill).",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
