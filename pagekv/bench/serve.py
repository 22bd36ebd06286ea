"""``pagekv bench serve``: the same workloads against an OpenAI-compatible HTTP server.

Owns one timed pass of streamed ``/v1/completions`` requests, one thread per in-flight request
(standard library only, so it also measures vLLM's or any other server). Prompts go as token
ids with ``ignore_eos`` and ``max_tokens`` = the request's output length; TTFT is the first
streamed chunk that carries text, TPOT the rest of the stream over the remaining tokens.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pagekv.bench.report import BenchResult
from pagekv.bench.workloads import BenchRequest, Workload


@dataclass(frozen=True)
class ServeSettings:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None  # the served model name; None: the server's first model
    max_concurrency: int = 64
    api_key: str | None = None
    timeout_s: float = 600.0


@dataclass(frozen=True)
class _Timing:
    start: float
    first: float
    end: float
    num_output_tokens: int


def _served_model(settings: ServeSettings) -> str:
    if settings.model is not None:
        return settings.model
    with urllib.request.urlopen(_http(settings, "/v1/models"), timeout=settings.timeout_s) as r:
        return str(json.load(r)["data"][0]["id"])


def _http(settings: ServeSettings, path: str, body: bytes | None = None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json"}
    if settings.api_key:
        headers["Authorization"] = f"Bearer {settings.api_key}"
    return urllib.request.Request(settings.url.rstrip("/") + path, data=body, headers=headers)


def _one(settings: ServeSettings, model: str, request: BenchRequest) -> _Timing:
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = 0.0
    num_tokens = request.output_len
    http = _http(settings, "/v1/completions", json.dumps(body).encode())
    with urllib.request.urlopen(http, timeout=settings.timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            if chunk.get("usage"):
                num_tokens = int(chunk["usage"]["completion_tokens"])
            if not first and any(c.get("text") for c in chunk.get("choices", [])):
                first = time.perf_counter()
    end = time.perf_counter()
    return _Timing(start, first or end, end, num_tokens)


def run_serve(workload: Workload, settings: ServeSettings) -> BenchResult:
    """All requests submitted at once, at most ``max_concurrency`` in flight."""
    model = _served_model(settings)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=settings.max_concurrency) as pool:
        timings = list(pool.map(lambda r: _one(settings, model, r), workload.requests))
    elapsed = time.perf_counter() - start
    return BenchResult(
        mode="serve",
        workload=workload.name,
        num_requests=len(workload.requests),
        num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=sum(t.num_output_tokens for t in timings),
        elapsed_s=elapsed,
        ttft_s=[t.first - t.start for t in timings],
        tpot_s=[
            (t.end - t.first) / (t.num_output_tokens - 1)
            for t in timings
            if t.num_output_tokens > 1
        ],
        settings={"url": settings.url, "model": model, "max_concurrency": settings.max_concurrency},
    )
