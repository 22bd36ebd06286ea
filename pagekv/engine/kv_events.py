"""KV cache events on the wire: vLLM's ``KVEventsConfig`` and its ZMQ publisher, as
vllm-router's ``kv_aware`` policy subscribes to them (vLLM 0.32, vllm-router 0.1.17).

The engine's ``KVEventLog`` (core/kv_events.py) says what happened; after each step that
changed something, ``KVEventPublisher.publish`` sends the step's events as one batch::

    PUB socket      [topic, seq (8 bytes, big-endian), msgpack [timestamp, [event, ...]]]
    replay socket   (ROUTER) a request [b"", start seq (8 bytes)] is answered with every
                    buffered batch from that seq on, [b"", topic, seq, payload] each, then
                    [b"", b"", seq -1, b""]: a subscriber that missed batches (or a router
                    started later) catches up from the last ``buffer_steps`` batches

Sequence numbers start at 0 in every process, so a subscriber that sees them go back knows the
engine restarted; the first batch of every process is ``AllBlocksCleared``.

A subscriber that connects late (a router started or restarted after the engine, or one that
lost more batches than the replay buffer holds) would know only what changes from then on. So
the PUB socket is an XPUB, which hears each subscription: a new subscriber, or a replay the
buffer cannot cover, is answered by publishing a snapshot batch (``AllBlocksCleared``, then
every block where it is now; ``KVEventLog.snapshot``). vllm-router applies it whatever its
replay gave, so its view is exact from the first batch it sees. Events are maps
tagged with ``type``, as vLLM's msgspec encoder writes them. Sockets always bind (the router
connects); a port of 0 or ``*`` binds a free one, and ``sources()`` (GET /kv_event_sources)
names the endpoints actually bound. The sockets live on the publisher's thread; the engine
thread only queues batches (dropped and counted past ``max_queue_size``).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack

from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.kv_events import (
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventLog,
)
from pagekv.errors import InvalidRequestError
from pagekv.tiering.manager import TierManager

logger = logging.getLogger("pagekv")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REMOTE_STORES = ("mooncake", "redis")  # pools outside the engine's machine (ownership: REMOTE)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``, field for field (``--kv-events-config`` takes its JSON)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; None: zmq when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @classmethod
    def parse(cls, value: KVEventsConfig | Mapping[str, Any] | str) -> KVEventsConfig:
        """From an instance, a dict or its JSON; an unknown field or bad value is an
        ``InvalidRequestError`` naming it."""
        if isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(
                    f"kv_events_config: not JSON ({exc})", "kv_events_config"
                ) from None
        if not isinstance(value, Mapping):
            raise InvalidRequestError(
                f"kv_events_config: a JSON object, got {value!r:.80}", "kv_events_config"
            )
        names = {f.name for f in fields(cls)}
        for key in value:
            if key not in names:
                raise InvalidRequestError(
                    f"kv_events_config.{key}: no such field (fields: {', '.join(sorted(names))})",
                    f"kv_events_config.{key}",
                )
        config = cls(**value)
        config.check()
        return config

    def check(self) -> None:
        def bad(name: str, want: str) -> InvalidRequestError:
            got = getattr(self, name)
            return InvalidRequestError(
                f"kv_events_config.{name}: {want}, got {got!r}", f"kv_events_config.{name}"
            )

        if not isinstance(self.enable_kv_cache_events, bool):
            raise bad("enable_kv_cache_events", "true or false")
        if self.publisher not in (None, "zmq", "null"):
            raise bad("publisher", "'zmq' or 'null'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            number = getattr(self, name)
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise bad(name, "an integer >= 1")
        for name in ("endpoint", "replay_endpoint"):
            where = getattr(self, name)
            if where is not None and (not isinstance(where, str) or "://" not in where):
                raise bad(name, "a ZMQ endpoint such as tcp://*:5557")
        if not isinstance(self.topic, str):
            raise bad("topic", "a string")

    @property
    def publishes(self) -> bool:
        """Events are on and go out over ZMQ (``publisher`` unset or "zmq")."""
        return self.enable_kv_cache_events and self.publisher in (None, "zmq")


def encode_event(event: KVEvent, storage_owner: str | None = None) -> dict[str, Any]:
    """One event as vLLM's msgspec writes it: a map tagged with its ``type``. ``storage_owner``:
    the pool a remote store is (Mooncake, Redis), named on its blocks with locality REMOTE, as
    vLLM's offloading tiers say it (vllm-router weighs them by ``--kv-penalty-external``)."""
    remote = {}
    if storage_owner is not None and getattr(event, "medium", None) == MEDIUM_STORAGE:
        remote = {"locality": "REMOTE", "ownership": storage_owner}
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
            **remote,
        }
    if isinstance(event, BlockRemoved):
        removed = {"type": "BlockRemoved", "block_hashes": event.block_hashes}
        return {**removed, "medium": event.medium, **remote}
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list[KVEvent], ts: float, storage_owner: str | None = None) -> bytes:
    """vLLM's ``EventBatch`` (array-like, the rank left out): ``[ts, [event, ...]]``."""
    encoded = [encode_event(e, storage_owner) for e in events]
    packed: bytes = msgpack.packb([ts, encoded], use_bin_type=True)
    return packed


def start_kv_events(
    config: KVEventsConfig | Mapping[str, Any] | str | None,
    kv: KVCacheManager,
    tiers: TierManager | None,
) -> KVEventPublisher | None:
    """A publisher fed by every tier of ``kv`` (and ``tiers``' store), when events are on."""
    if config is None or not (config := KVEventsConfig.parse(config)).publishes:
        return None
    log = KVEventLog(kv.block_size)
    log.attach(kv)
    owner = None
    if tiers is not None:
        tiers.events = log
        store = tiers.store
        owner = store.name if store is not None and store.name in REMOTE_STORES else None
    return KVEventPublisher(config, log, owner)


def _bindable(endpoint: str) -> str:
    """ZMQ's form of a free port: ``tcp://h:0`` binds as ``tcp://h:*``."""
    return endpoint[: -len(":0")] + ":*" if endpoint.endswith(":0") else endpoint


class KVEventPublisher:
    """Takes the event log's events after each step and publishes them on a thread of its own."""

    def __init__(
        self, config: KVEventsConfig, log: KVEventLog, storage_owner: str | None = None
    ) -> None:
        import zmq  # only an engine that publishes needs pyzmq loaded

        self.config = config
        self.log = log
        self.storage_owner = storage_owner
        self.num_dropped_batches = 0
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only the first
        self.num_snapshots = 0
        self.endpoint = self._bind(self._pub, config.endpoint)
        self._replay = None
        self.replay_endpoint = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._replay, config.replay_endpoint)
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        log.cleared()  # a new process holds nothing: the first batch says so
        self._thread = threading.Thread(target=self._run, name="pagekv-kv-events", daemon=True)
        self._thread.start()
        self.publish()
        logger.info("KV events published on %s (replay: %s)", self.endpoint, self.replay_endpoint)

    @staticmethod
    def _bind(socket: Any, endpoint: str) -> str:
        import zmq

        socket.bind(_bindable(endpoint))
        bound: str = socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        return bound

    def sources(self) -> dict[str, dict[str, Any]]:
        """GET /kv_event_sources: this engine's one source (rank 0), with bound endpoints."""
        entry = asdict(self.config)
        entry.update(
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            publisher="zmq",
            encoding="msgpack",
            schema_version=1,
        )
        return {"0": entry}

    def publish(self) -> None:
        """Queue the events since the last call as one batch (nothing when there are none)."""
        events = self.log.take()
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped_batches += 1  # a subscriber sees the gap and replays or resets

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout_s)

    # ---- the publisher thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._pub.poll(0):
                    self._hear_subscriptions()
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is None:
                    return
                self._send(*item)
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()
            self._ctx.term()

    def _send(self, ts: float, events: list[KVEvent]) -> None:
        payload = encode_batch(events, ts, self.storage_owner)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _hear_subscriptions(self) -> None:
        subscribed = False
        while self._pub.poll(0):
            message = self._pub.recv()
            subscribed |= message[:1] == b"\x01"  # 1: subscribe, 0: unsubscribe
        if subscribed:
            self._send_snapshot()

    def _send_snapshot(self) -> None:
        """Everything queued first, then the state now as one batch."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # closing: stop after the snapshot
                break
            self._send(*item)
        self._send(time.time(), self.log.snapshot())
        self.num_snapshots += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        covered = not self._buffer or self._buffer[0][0] <= first or first >= self._seq
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        if not covered:  # batches the buffer no longer holds: what they said, as it is now
            self._send_snapshot()
