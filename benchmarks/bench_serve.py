"""Load benchmark of ``pagekv serve``: concurrent streaming completions over HTTP.

    python benchmarks/bench_serve.py                       # starts its own server
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --num-requests 200
    python benchmarks/bench_serve.py --compare-offline     # + the same workload via LLM()
    python benchmarks/bench_serve.py --compare-offline --record   # and save the table

Each request streams ``/v1/completions`` (greedy, ``ignore_eos``, usage in the last chunk) with
a seeded random prompt of ``--prompt-words`` words and ``--max-tokens`` tokens. Per request:
TTFT = send -> first chunk with text; TPOT = (last chunk - first text chunk) / (tokens - 1).
Reports requests/s, output tokens/s, TTFT and TPOT p50/p99, errors, and the KV blocks still in
use once every request has ended (leaks: must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

REPO = Path(__file__).resolve().parents[1]
WORDS = [
    *("the", "a", "memory", "block", "cache", "page", "token", "prefix", "request", "model"),
    *("engine", "table", "hash", "free", "used", "swap", "evict", "copy", "write", "read"),
    *("kernel", "batch", "step", "scheduler", "queue", "prompt", "stream", "server"),
]


@dataclass
class Result:
    ok: bool
    error: str | None
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float
    num_tokens: int


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def workload(num: int, words: tuple[int, int], tokens: tuple[int, int], seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))),
            "max_tokens": rng.randint(*tokens),
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for _ in range(num)
    ]


async def one(client: httpx.AsyncClient, body: dict[str, Any], sem: asyncio.Semaphore) -> Result:
    async with sem:
        start = time.perf_counter()
        first: float | None = None
        tokens, done, error = 0, False, None
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    error = f"HTTP {response.status_code}: {response.text[:200]}"
                async for line in response.aiter_lines():
                    if error is not None or not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = str(chunk["error"])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                        first = time.perf_counter()
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        end = time.perf_counter()
        if error is None and not done:
            error = "stream ended without [DONE]"
        tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
        ttft = None if first is None else first - start
        return Result(error is None, error, ttft, tpot, end - start, tokens)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


async def blocks_in_use_after(url: str, headers: dict[str, str], timeout_s: float = 5.0) -> int:
    """KV blocks still in use once the engine has no request (waits up to ``timeout_s``).

    Each poll opens a fresh connection: a pooled one may have idled past the server's
    keep-alive timeout while the last streams ran, and the server may close it just as
    the poll is sent on it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0) as client:
            kv = (await client.get("/debug/kv.json")).json()
        in_use = sum(b["state"] == "in_use" for b in kv["blocks"])
        if in_use == 0 or time.monotonic() > deadline:
            return in_use
        await asyncio.sleep(0.05)


async def run(url: str, bodies: list[dict], concurrency: int, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=httpx.Timeout(600.0)
    ) as client:
        sem = asyncio.Semaphore(concurrency)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, b, sem) for b in bodies))
        wall = time.perf_counter() - start
    leaked = await blocks_in_use_after(url, headers)
    return summarize(results, wall, leaked)


def summarize(results: list[Result], wall_s: float, leaked: int) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s,
        "output_tokens_per_s": sum(r.num_tokens for r in ok) / wall_s,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "mean_latency_s": statistics.fmean(r.latency_s for r in ok) if ok else None,
        "kv_blocks_in_use_after": leaked,
    }


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "pagekv.cli", "serve", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(960):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("server did not start")


def offline(bodies: list[dict], num_kv_blocks: int, max_num_seqs: int) -> dict:
    """The same workload through the in-process ``LLM`` (no HTTP): the engine's own ceiling."""
    sys.path.insert(0, str(REPO))
    from pagekv.llm import LLM
    from pagekv.sampling_params import SamplingParams

    llm = LLM(num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs)
    params = [
        SamplingParams(temperature=0, ignore_eos=True, max_tokens=b["max_tokens"]) for b in bodies
    ]
    start = time.perf_counter()
    outs = llm.generate([b["prompt"] for b in bodies], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": wall,
        "requests_per_s": len(outs) / wall,
        "output_tokens_per_s": tokens / wall,
    }


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def report(summary: dict, args: argparse.Namespace) -> str:
    return "\n".join(
        [
            f"{summary['num_requests']} streaming requests, concurrency {args.concurrency}, "
            f"prompt {args.prompt_words} words, max_tokens {args.max_tokens}",
            "| measure | result |",
            "| --- | --- |",
            f"| requests/s | {summary['requests_per_s']:.2f} |",
            f"| output tokens/s | {summary['output_tokens_per_s']:.1f} |",
            f"| TTFT p50 / p99 | {ms(summary['ttft_p50_s'])} / {ms(summary['ttft_p99_s'])} |",
            f"| TPOT p50 / p99 | {ms(summary['tpot_p50_s'])} / {ms(summary['tpot_p99_s'])} |",
            f"| errors | {summary['num_errors']} |",
            f"| KV blocks in use after | {summary['kv_blocks_in_use_after']} |",
            f"| wall time | {summary['wall_s']:.1f} s |",
            *(
                [
                    f"| offline LLM, same workload | {off['requests_per_s']:.2f} requests/s, "
                    f"{off['wall_s']:.1f} s |"
                ]
                if (off := summary.get("offline"))
                else []
            ),
        ]
    )


RECORD_COLUMNS = ["concurrency", "requests/s", "output tok/s", "TTFT p50 / p99"]
RECORD_COLUMNS += ["TPOT p50 / p99", "errors", "KV blocks in use after", "offline LLM requests/s"]


def save_record(name: str, summary: dict[str, Any], args: argparse.Namespace) -> None:
    offline = summary.get("offline")
    row: list[record.Cell] = [
        args.concurrency,
        round(summary["requests_per_s"], 2),
        round(summary["output_tokens_per_s"], 1),
        f"{ms(summary['ttft_p50_s'])} / {ms(summary['ttft_p99_s'])}",
        f"{ms(summary['tpot_p50_s'])} / {ms(summary['tpot_p99_s'])}",
        summary["num_errors"],
        summary["kv_blocks_in_use_after"],
        round(offline["requests_per_s"], 2) if offline else None,
    ]
    server = f"pagekv serve --num-kv-blocks {args.num_kv_blocks} --max-num-seqs {args.max_num_seqs}"
    server = "a running server" if args.url else f"`{server}`"
    record.save(
        name,
        "HTTP server under load: concurrent streaming completions",
        RECORD_COLUMNS,
        [row],
        f"{server}; {summary['num_requests']} streaming requests, prompts of {args.prompt_words} "
        f"words, max_tokens {args.max_tokens}. KV blocks in use after: "
        "leaks, must be 0; the offline LLM runs the same workload in process (the baseline).",
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--num-kv-blocks", type=int, default=256, help="for the started server")
    p.add_argument("--max-num-seqs", type=int, default=64, help="for the started server")
    p.add_argument("--compare-offline", action="store_true", help="also run it in-process")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--prompt-words", default="3,60", help="min,max words per prompt")
    p.add_argument("--max-tokens", default="2,8", help="min,max output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the summary here")
    record.add_argument(p)
    args = p.parse_args()
    bodies = workload(
        args.num_requests, _range(args.prompt_words), _range(args.max_tokens), args.seed
    )
    serve_args = [
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    proc, url = (None, args.url) if args.url else start_server(serve_args)
    try:
        summary = asyncio.run(run(url, bodies, args.concurrency, args.api_key))
    finally:
        if proc is not None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    if args.compare_offline:
        summary["offline"] = offline(bodies, args.num_kv_blocks, args.max_num_seqs)
    print(report(summary, args))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if args.record is not None:
        save_record(args.record or "serve", summary, args)
    return 0 if summary["num_errors"] == 0 and summary["kv_blocks_in_use_after"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
