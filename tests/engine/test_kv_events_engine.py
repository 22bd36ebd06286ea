"""KV events from a real engine over real ZMQ sockets (engine/kv_events.py): vLLM's config, the
wire format a subscriber decodes, sequence numbers from 0 with ``AllBlocksCleared`` first,
replay from the buffer, and a snapshot for a subscriber that connects late."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pytest
import zmq

from pagekv import KVEventsConfig, SamplingParams
from pagekv.engine.config import EngineConfig
from pagekv.errors import InvalidRequestError
from pagekv.llm import LLM
from tests.core.test_kv_events import names

pytestmark = pytest.mark.model

EVENTS = {
    "enable_kv_cache_events": True,
    "endpoint": "tcp://127.0.0.1:0",
    "replay_endpoint": "tcp://127.0.0.1:0",
    "topic": "kv",
}
PROMPT = list(range(300, 345))  # 45 token ids: two full blocks of 16


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(kv_events_config=EVENTS, num_kv_blocks=64)
    yield engine
    engine.engine.close()


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"enable_kv_cache_events": True, "endpont": "tcp://*:1"}, "kv_events_config.endpont"),
        ({"enable_kv_cache_events": "yes"}, "kv_events_config.enable_kv_cache_events"),
        ({"publisher": "kafka"}, "kv_events_config.publisher"),
        ({"buffer_steps": 0}, "kv_events_config.buffer_steps"),
        ({"endpoint": "localhost:5557"}, "kv_events_config.endpoint"),
        ("{not json", "kv_events_config"),
        ([1, 2], "kv_events_config"),
    ],
)
def test_a_bad_config_is_refused_by_field_before_anything_loads(value, field) -> None:
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(kv_events_config=value)
    assert info.value.param == field


def test_vllms_config_as_json_or_object() -> None:
    config = EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "topic": "t"}')
    assert config.kv_events_config == KVEventsConfig(enable_kv_cache_events=True, topic="t")
    assert KVEventsConfig(enable_kv_cache_events=True).publishes
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishes
    assert not KVEventsConfig().publishes


def _batches(socket: zmq.Socket, timeout_ms: int = 2000) -> list[tuple[int, list]]:
    out = []
    while socket.poll(timeout_ms):
        topic, seq, payload = socket.recv_multipart()
        assert topic == b"kv"
        ts, events = msgpack.unpackb(payload)
        assert isinstance(ts, float)
        out.append((int.from_bytes(seq, "big"), events))
        timeout_ms = 300
    return out


def test_a_late_subscriber_gets_the_state_then_replays_the_history(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate({"prompt_token_ids": PROMPT}, params)
    source = llm.engine.kv_event_sources()["0"]
    assert source["publisher"] == "zmq" and source["encoding"] == "msgpack"
    assert source["endpoint"].startswith("tcp://127.0.0.1:") and source["topic"] == "kv"
    context = zmq.Context()
    sub, dealer = context.socket(zmq.SUB), context.socket(zmq.DEALER)
    try:
        sub.connect(source["endpoint"])
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        ((seq, snapshot),) = _batches(sub)  # the state now, as one batch
        assert snapshot[0] == {"type": "AllBlocksCleared"}
        assert snapshot[1] == {
            "type": "BlockStored",
            "block_hashes": names(PROMPT, 16),
            "parent_block_hash": None,
            "token_ids": PROMPT[:32],
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        dealer.connect(source["replay_endpoint"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while dealer.poll(2000):
            empty, topic, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if seq_bytes == (-1).to_bytes(8, "big", signed=True):
                assert topic == payload == b""
                break
            replayed.append((int.from_bytes(seq_bytes, "big"), msgpack.unpackb(payload)[1]))
        assert [s for s, _ in replayed] == list(range(seq + 1))  # every batch, in order
        assert replayed[0][1] == [{"type": "AllBlocksCleared"}]  # a new process held nothing
        stored = [h for _, evs in replayed[1:-1] for e in evs for h in e.get("block_hashes", [])]
        assert stored == names(PROMPT, 16)  # committed as the prompt was computed
        assert replayed[-1] == (seq, snapshot)
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        context.term()


def test_a_flush_is_published_as_removals(llm: LLM) -> None:
    llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=1))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.connect(llm.engine.kv_event_sources()["0"]["endpoint"])
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        _batches(sub)  # the snapshot
        llm.engine.reset_prefix_cache()
        removed = {h for _, evs in _batches(sub) for e in evs for h in e["block_hashes"]}
        assert set(names(PROMPT, 16)) <= removed
    finally:
        sub.close(linger=0)
        context.term()
