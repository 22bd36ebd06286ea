"""Scale-out (issue #59): real ``pagekv serve`` replicas behind a real ``vllm-router`` 0.1.17,
all on 127.0.0.1. Every policy passes completions, chat and streams; power_of_two polls the
replicas' /get_load; kv_aware routes by the replicas' own KV events, follows a replica's
restart and, restarted itself, catches up by replay; a shared store turns a prefix computed on
one replica into a storage hit on another, which publishes it on the STORAGE medium.

Which replica served a request, and whether it found the prefix there, is read from each
replica's /metrics (vLLM's prefix-cache and request counters)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
import openai
import pytest
import zmq

from tests.core.test_kv_events import names
from tests.server.router_support import (
    HITS,
    POLICIES,
    REQUESTS,
    Router,
    counter,
    start_replica,
    start_router,
)
from tests.server.support import ServerProcess, free_port, wait_until
from tests.tiering.stores import redis_server  # noqa: F401  (a fixture)

pytestmark = pytest.mark.model

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")
PREFIX_BLOCKS = 8  # whole blocks of each shared prefix (block size 16)
CATCH_UP_S = 3.0  # a router's subscribers connect and replay well within this


def system_prompt(i: int) -> str:
    rng = random.Random(i)
    return f"You are assistant {i}. " + " ".join(rng.choice(WORDS) for _ in range(130))


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router")


@pytest.fixture(scope="module")
def replicas(log_dir: Path) -> Iterator[list[ServerProcess]]:
    ports = [(free_port(), free_port()) for _ in range(2)]
    started = [start_replica(log_dir, "--num-kv-blocks", "512", event_ports=p) for p in ports]
    yield started
    for replica in started:
        replica.stop()


def model_of(replica: ServerProcess) -> str:
    name: str = replica.get("/v1/models").json()["data"][0]["id"]
    return name


def complete(router: Router, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def served(
    replicas: list[ServerProcess], router: Router, model: str, prompt: str
) -> tuple[int, float]:
    """Complete ``prompt`` through ``router``: which replica served it, and the prefix tokens
    it found there."""
    before = [(counter(r, REQUESTS), counter(r, HITS)) for r in replicas]
    complete(router, model, prompt)
    after = [(counter(r, REQUESTS), counter(r, HITS)) for r in replicas]
    (index,) = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a[0] > b[0]]
    return index, after[index][1] - before[index][1]


def placement_hits(router: Router) -> float:
    return sum(
        v
        for (name, labels), v in router.metrics().items()
        if name == "vllm_router_kv_placement_lookups_total" and ("result", "hit") in labels
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_passes_completions_chat_and_streams(
    policy: str, replicas: list[ServerProcess], log_dir: Path
) -> None:
    router = start_router(log_dir, replicas, policy)
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        model = model_of(replicas[0])
        text = client.completions.create(
            model=model, prompt="The sky is", max_tokens=5, temperature=0
        )
        assert text.choices[0].text and text.usage.completion_tokens == 5
        messages = [{"role": "user", "content": "Name a colour."}]
        greedy = {"model": model, "messages": messages, "max_tokens": 5, "temperature": 0}
        chat = client.chat.completions.create(**greedy)
        assert chat.choices[0].message.content
        stream = client.chat.completions.create(**greedy, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces) == chat.choices[0].message.content
        if policy == "power_of_two":  # the policy polls each replica's load
            assert wait_until(
                lambda: all("GET /get_load" in r.log_tail(20000) for r in replicas), 10
            ), replicas[0].log_tail()
    finally:
        router.stop()


def test_kv_aware_sends_a_cached_prefix_to_the_replica_that_holds_it(
    replicas: list[ServerProcess], log_dir: Path
) -> None:
    router = start_router(log_dir, replicas, "kv_aware", debug=True)
    try:
        model = model_of(replicas[0])
        prefixes = [system_prompt(100 + i) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:  # first asks, at once: spread by load
            list(pool.map(lambda p: complete(router, model, p + " First?"), prefixes))
        found = []
        for turn in range(3):
            for i, prefix in enumerate(prefixes):
                prompt = f"{prefix} Question {turn}.{i}?"
                found.append(served(replicas, router, model, prompt)[1])
        on_holder = sum(tokens >= PREFIX_BLOCKS * 16 for tokens in found)
        assert on_holder >= 0.9 * len(found), found
        assert router.kv_index_complaints() == []  # every batch decoded and applied
    finally:
        router.stop()


def test_a_restarted_router_catches_up_by_replay(
    replicas: list[ServerProcess], log_dir: Path
) -> None:
    model = model_of(replicas[0])
    prefixes = [system_prompt(200 + i) for i in range(4)]
    first = start_router(log_dir, replicas, "kv_aware")
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda p: complete(first, model, p + " First?"), prefixes))
    finally:
        first.stop()
    second = start_router(log_dir, replicas, "kv_aware", debug=True)  # nothing new since
    try:
        time.sleep(CATCH_UP_S)
        for i, prefix in enumerate(prefixes):
            _, tokens = served(replicas, second, model, f"{prefix} Again {i}?")
            assert tokens >= PREFIX_BLOCKS * 16, (i, tokens)
        assert placement_hits(second) >= len(prefixes)
        assert second.kv_index_complaints() == []
    finally:
        second.stop()


def test_a_replica_restart_clears_its_blocks_and_routing_recovers(
    replicas: list[ServerProcess], log_dir: Path
) -> None:
    model = model_of(replicas[0])
    prefix = system_prompt(300)
    router = start_router(log_dir, replicas, "kv_aware")
    try:
        holder, _ = served(replicas, router, model, prefix + " First?")
        old = replicas[holder]
        old.stop()
        port = int(old.url.rsplit(":", 1)[1])
        event_ports = _event_ports(old)
        replicas[holder] = start_replica(
            log_dir, "--num-kv-blocks", "512", port=port, event_ports=event_ports
        )
        time.sleep(CATCH_UP_S)
        hits = placement_hits(router)
        _, tokens = served(replicas, router, model, prefix + " Second?")
        assert tokens == 0  # nobody holds it now: the restart took its blocks away
        assert placement_hits(router) == hits  # and the router knew: no placement credited
        third = served(replicas, router, model, prefix + " Third?")
        assert third[1] >= PREFIX_BLOCKS * 16  # routing recovered: back to where it lives
    finally:
        router.stop()


def _event_ports(replica: ServerProcess) -> tuple[int, int]:
    for line in reversed(replica.log_tail(200000).splitlines()):
        if "KV events published on" in line:
            pub, replay = line.split(" on ", 1)[1].split(" (replay: ")
            return int(pub.rsplit(":", 1)[1]), int(replay.rstrip(")").rsplit(":", 1)[1])
    raise AssertionError("no KV events line in the replica's log")


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_a_shared_store_makes_a_prefix_from_one_replica_a_storage_hit_on_another(
    backend: str, log_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Replica A computes a prefix and writes it down; B finds it in the store and publishes it
    on the STORAGE medium (a Redis store as a remote pool: ownership, locality REMOTE); a
    kv_aware router in front of both applies every batch."""
    if backend == "redis":
        spec = f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}"
    else:
        spec = f"file:{tmp_path / 'kv'}"
    a, b = (start_replica(log_dir, "--num-kv-blocks", "256", store=spec) for _ in range(2))
    router = start_router(log_dir, [a, b], "kv_aware", debug=True)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.connect(b.get("/kv_event_sources").json()["0"]["endpoint"])
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        model, prompt = model_of(a), system_prompt(400) + " Tell me."
        ids = a.post("/tokenize", {"model": model, "prompt": prompt}).json()["tokens"]
        body = {"model": model, "prompt": ids, "max_tokens": 2}
        assert a.post("/v1/completions", body).is_success
        num_full = len(ids) // 16
        assert wait_until(lambda: counter(a, "pagekv_storage_written_blocks") >= num_full, 30)
        assert b.post("/v1/completions", body).is_success
        assert counter(b, "pagekv_storage_hit_blocks") >= num_full - 1
        stored: set[bytes] = set()
        while sub.poll(2000):
            _, _, payload = sub.recv_multipart()
            for event in msgpack.unpackb(payload)[1]:
                if event["type"] == "BlockStored" and event["medium"] == "STORAGE":
                    stored.update(event["block_hashes"])
                    remote = {"ownership": "redis", "locality": "REMOTE"}
                    assert {k: event.get(k) for k in remote} == (
                        remote if backend == "redis" else {"ownership": None, "locality": None}
                    )
        assert set(names(ids, 16)[: num_full - 1]) <= stored
        complete(router, model, prompt)  # the router renders it and places it
        assert placement_hits(router) >= 1
        assert router.kv_index_complaints() == []
    finally:
        sub.close(linger=0)
        context.term()
        router.stop()
        a.stop()
        b.stop()
