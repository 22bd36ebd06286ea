"""What routing buys pagekv replicas: vllm-router's policies over N replicas, with and without a
storage tier the replicas share.

For each store setting (none; a file store shared by every replica) and each policy
(round_robin, power_of_two, cache_aware, kv_aware), fresh replicas (one thread each, KV events
on, a small host cache) start behind a fresh ``vllm-router`` 0.1.17, then two workloads run
through it as streamed chat completions:

    shared-prefix   requests each open with one of P long system prompts (chosen at random)
                    and ask a short question of their own; P is chosen so one replica's KV
                    pool holds about half the prompts and all the replicas together hold them
    multi-turn      S conversations of T turns, each opening with a long message of its own;
                    each turn the whole conversation so far (the replies as they came back)
                    plus a new question, C conversations at once

Reported per (store, policy, workload): the prefix-hit rate (hit tokens over queried tokens,
summed over the replicas' vLLM counters), the storage hits, TTFT p50/p90 and request
throughput. The fleet is the scale-out tests' (``tests/server/router_support.py``), so what is
measured is what is tested. Usage::

    python benchmarks/bench_router.py [--replicas 2] [--record]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import record  # noqa: E402

from tests.server.router_support import (  # noqa: E402
    HITS,
    POLICIES,
    QUERIES,
    counter,
    start_replica,
    start_router,
)
from tests.server.support import ServerProcess  # noqa: E402

WORDS = ("river", "stone", "cloud", "amber", "signal", "harbor", "lantern", "meadow", "copper")


@dataclass(frozen=True)
class Shape:
    replicas: int = 2
    kv_blocks: int = 448  # per replica: a little under half the shared prompts' blocks
    prompts: int = 12  # shared system prompts
    prompt_words: int = 1000  # ~1000 tokens each (one word, one token)
    requests: int = 96  # shared-prefix requests
    sessions: int = 12  # multi-turn conversations
    turns: int = 4
    concurrency: int = 4
    max_tokens: int = 16


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def ask(router: str, model: str, messages: list[dict[str, str]], max_tokens: int):
    """One streamed chat completion: (TTFT s, seconds, reply text)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    start, first, text = time.perf_counter(), 0.0, []
    with httpx.stream("POST", router + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    return (first or end) - start, end - start, "".join(text)


def shared_prefix(router: str, model: str, shape: Shape) -> list[float]:
    systems = [f"You are agent {i}. " + words(i, shape.prompt_words) for i in range(shape.prompts)]
    rng = random.Random(7)
    jobs = [
        [{"role": "system", "content": rng.choice(systems)},
         {"role": "user", "content": f"Question {n}: " + words(1000 + n, 12)}]
        for n in range(shape.requests)
    ]  # fmt: skip
    with ThreadPoolExecutor(shape.concurrency) as pool:
        return [t for t, _, _ in pool.map(lambda m: ask(router, model, m, shape.max_tokens), jobs)]


def multi_turn(router: str, model: str, shape: Shape) -> list[float]:
    def session(s: int) -> list[float]:
        opening = f"Story {s}: " + words(5000 + s, shape.prompt_words // 2)
        messages = [{"role": "user", "content": opening}]
        ttfts = []
        for turn in range(shape.turns):
            ttft, _, reply = ask(router, model, messages, shape.max_tokens)
            ttfts.append(ttft)
            question = f"Turn {turn}: " + words(s * 100 + turn, 12)
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": question},
            ]
        return ttfts

    with ThreadPoolExecutor(shape.concurrency) as pool:
        return [t for ts in pool.map(session, range(shape.sessions)) for t in ts]


def totals(replicas: list[ServerProcess]) -> tuple[float, float, float]:
    return (
        sum(counter(r, HITS) for r in replicas),
        sum(counter(r, QUERIES) for r in replicas),
        sum(counter(r, "pagekv_storage_hit_blocks") for r in replicas),
    )


def run(shape: Shape, policy: str, store: str | None, log_dir: Path) -> list[list[record.Cell]]:
    args = ("--num-kv-blocks", str(shape.kv_blocks), "--host-cache-memory", "16MiB")
    replicas = [start_replica(log_dir, *args, store=store) for _ in range(shape.replicas)]
    router = start_router(log_dir, replicas, policy)
    rows: list[list[record.Cell]] = []
    try:
        model = replicas[0].get("/v1/models").json()["data"][0]["id"]
        time.sleep(2)  # subscribers connected
        for name, workload in (("shared-prefix", shared_prefix), ("multi-turn", multi_turn)):
            before = totals(replicas)
            start = time.perf_counter()
            ttfts = workload(router.url, model, shape)
            seconds = time.perf_counter() - start
            hits, queries, stored = (a - b for a, b in zip(totals(replicas), before, strict=True))
            p50, p90 = statistics.median(ttfts), statistics.quantiles(ttfts, n=10)[-1]
            rows.append([
                "shared file store" if store else "none", policy, name,
                round(hits / max(queries, 1), 3), int(stored),
                round(p50 * 1000), round(p90 * 1000), round(len(ttfts) / seconds, 2),
            ])  # fmt: skip
            print(rows[-1], flush=True)
            for replica in replicas:  # the next workload starts from empty pools
                replica.post("/flush_cache", {})
    finally:
        router.stop()
        for replica in replicas:
            replica.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=Shape.replicas)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--stores", nargs="+", default=["none", "file"], choices=["none", "file"])
    record.add_argument(parser)
    args = parser.parse_args()
    shape = Shape(replicas=args.replicas)
    rows: list[list[record.Cell]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.stores:
            for policy in args.policies:
                store = f"file:{tmp}/store-{policy}" if kind == "file" else None
                rows += run(shape, policy, store, Path(tmp))
    columns = ["store", "policy", "workload", "prefix hit rate", "storage hit blocks",
               "TTFT p50 ms", "TTFT p90 ms", "requests/s"]  # fmt: skip
    for row in rows:
        print(" | ".join(str(c) for c in row))
    if args.record is not None:
        note = (
            f"{shape.replicas} replicas of the default model (one thread each, "
            f"{shape.kv_blocks} KV blocks of 16 tokens, a 16 MiB host cache) behind vllm-router "
            f"0.1.17 on this machine's cores. shared-prefix: {shape.requests} chat requests over "
            f"{shape.prompts} system prompts of ~{shape.prompt_words} tokens (one replica's pool "
            "holds a little under half),"
            f" {shape.concurrency} at once; multi-turn: {shape.sessions} conversations of "
            f"{shape.turns} turns, {shape.concurrency} at once; {shape.max_tokens} tokens out. "
            "Hit rate: the replicas' prefix-cache hit tokens over queried tokens."
        )
        title = (
            "Routing over pagekv replicas: vllm-router's policies, with and without a shared store"
        )
        record.save(args.record or "router", title, columns, rows, note)


if __name__ == "__main__":
    main()
