"""The engine thread: the only code that touches the ``LLMEngine`` once the server runs.

Owns the engine, the thread, the inbox (a thread-safe queue of commands) and, for each engine
request in flight, where its outputs go (``_Tracked``). HTTP handlers never block it: they put
commands and await asyncio futures that the thread resolves with ``call_soon_threadsafe``.

Each loop turn applies every queued command (adds, aborts, queries) and then runs one
``engine.step()``; so an abort frees its blocks before the next step, and a query (stats, the
block map) waits at most one step. With nothing to do the thread sleeps on the inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pagekv.engine.llm_engine import LLMEngine
from pagekv.engine.outputs import RequestOutput
from pagekv.sampling_params import SamplingParams
from pagekv.server.errors import EngineDeadError, QueueFullError
from pagekv.server.streams import OutputStream

logger = logging.getLogger("pagekv.server")
T = TypeVar("T")


class LoopMetrics(Protocol):
    """What the engine thread reports (implemented by ``metrics.Metrics``)."""

    def first_token(self, ttft_s: float) -> None: ...
    def step_done(self, start_s: float, now_s: float, outputs: list[RequestOutput]) -> None: ...
    def finished(
        self, output: RequestOutput, arrival_s: float, first_token_s: float, now_s: float
    ) -> None: ...
    def aborted(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class EngineRequest:
    """One prompt of an HTTP request, ready for ``engine.add_request``."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    client: str | None = None  # whose (the fair policy's turns): the address it came from
    priority: int = 0  # the priority policy's (lower first)
    cache_salt: str | None = None  # its prefix-cache blocks are shared only with this salt's

    def options(self) -> dict[str, Any]:
        """``add_request``'s keyword arguments that differ from their defaults."""
        given = {"priority": self.priority or None, "cache_salt": self.cache_salt}
        return {k: v for k, v in given.items() if v is not None}


@dataclass
class TokenCounts:
    """Tokens the engine has worked through since the start (the stats line's throughputs):
    prompt tokens computed (those found in the prefix cache not counted) and tokens generated.
    The engine thread adds; others read."""

    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass
class _Tracked:
    stream: OutputStream
    loop: asyncio.AbstractEventLoop
    arrival_s: float
    first_token_s: float | None = None
    num_generated: int = 0  # tokens of all its branches counted into TokenCounts so far
    prompt_counted: bool = False


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop``; a closed loop (server shutting down) drops it."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the handler gave up waiting (client gone)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass
class _Add:
    requests: list[EngineRequest]
    stream: OutputStream
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    arrival_s: float = field(default_factory=time.monotonic)

    def apply(self, runner: EngineLoop) -> None:
        error = runner.try_add(self)
        _post(self.loop, _settle, self.future, None, error)


@dataclass
class _Abort:
    request_ids: list[str]

    def apply(self, runner: EngineLoop) -> None:
        runner.abort_now(self.request_ids)


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]

    def apply(self, runner: EngineLoop) -> None:
        try:
            result, error = self.fn(runner.engine), None
        except Exception as exc:  # reported to the caller, who maps it to a status
            result, error = None, exc
        _post(self.loop, _settle, self.future, result, error)


@dataclass
class _Stop:
    def apply(self, runner: EngineLoop) -> None:
        runner.stopping = True


_Command = _Add | _Abort | _Call | _Stop


class EngineLoop:
    """Runs ``engine.step()`` in its own thread; the async methods are for the event loop."""

    def __init__(self, engine: LLMEngine, metrics: LoopMetrics, max_waiting_requests: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.stopping = False
        self.dead = False
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self.tokens = TokenCounts()
        self._thread = threading.Thread(target=self._run, name="pagekv-engine", daemon=True)

    # ---- event loop side ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._inbox.put(_Stop())
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.dead

    async def add(self, requests: list[EngineRequest]) -> OutputStream:
        """Queue the requests; raises what ``add_request`` raised (none of them is then kept)."""
        self._check_running()
        loop = asyncio.get_running_loop()
        stream = OutputStream([r.request_id for r in requests])
        future: asyncio.Future[None] = loop.create_future()
        self._inbox.put(_Add(requests, stream, loop, future))
        try:
            await future
        except asyncio.CancelledError:
            self.abort(stream.request_ids)  # the client left while the request was queued
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort now (non-blocking); the blocks are freed before the engine's next step."""
        if request_ids:
            self._inbox.put(_Abort(list(request_ids)))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` run on the engine thread between two steps."""
        self._check_running()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._inbox.put(_Call(fn, loop, future))
        return await future

    def _check_running(self) -> None:
        """A stopped thread would never answer: fail now instead of waiting forever."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")

    # ---- engine thread --------------------------------------------------------------------------

    def try_add(self, command: _Add) -> BaseException | None:
        """Add every request of ``command`` or none of them; the error, if any."""
        if self.dead:
            return EngineDeadError("the engine stopped after an internal error")
        waiting = int(self.engine.stats()["num_waiting"])
        if waiting + len(command.requests) > self.max_waiting_requests:
            return QueueFullError(
                f"{waiting} requests are waiting (limit {self.max_waiting_requests}); retry later"
            )
        added: list[str] = []
        try:
            for r in command.requests:
                self.engine.add_request(
                    r.request_id, r.prompt, r.params, client=r.client, **r.options()
                )
                added.append(r.request_id)
        except Exception as exc:  # InvalidRequestError mostly; the handler maps it
            for rid in added:
                self.engine.abort_request(rid)
            return exc
        for rid in added:
            self._tracked[rid] = _Tracked(command.stream, command.loop, command.arrival_s)
        return None

    def abort_now(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._tracked.pop(rid, None) is not None and self.engine.abort_request(rid):
                self.metrics.aborted(rid)

    def _run(self) -> None:
        while not self.stopping:
            idle = self.dead or not self.engine.has_unfinished_requests()
            for command in self._drain(block=idle):
                command.apply(self)
            if not self.stopping and not self.dead and self.engine.has_unfinished_requests():
                self._step()
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _drain(self, block: bool) -> list[_Command]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _step(self) -> None:
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; the engine is stopped")
            self.dead = True
            self._fail_all(EngineDeadError("the engine stopped after an internal error"))
            return
        now = time.monotonic()
        self.metrics.step_done(start, now, outputs)
        for output in outputs:
            self._deliver(output, now)

    def _deliver(self, output: RequestOutput, now: float) -> None:
        tracked = self._tracked.get(output.request_id)
        if tracked is None:
            return
        if tracked.first_token_s is None and any(o.token_ids for o in output.outputs):
            tracked.first_token_s = now
            self.metrics.first_token(now - tracked.arrival_s)
        self._count_tokens(tracked, output)
        _post(tracked.loop, tracked.stream.put, output)
        if output.finished:
            del self._tracked[output.request_id]
            self.metrics.finished(output, tracked.arrival_s, tracked.first_token_s or now, now)

    def _count_tokens(self, tracked: _Tracked, output: RequestOutput) -> None:
        if not tracked.prompt_counted:
            tracked.prompt_counted = True
            computed = len(output.prompt_token_ids) - output.num_cached_tokens
            self.tokens.prompt_tokens += max(computed, 0)
        generated = sum(len(o.token_ids) for o in output.outputs)
        self.tokens.generation_tokens += max(generated - tracked.num_generated, 0)
        tracked.num_generated = max(generated, tracked.num_generated)

    def _fail_all(self, error: BaseException) -> None:
        for tracked in self._tracked.values():
            _post(tracked.loop, tracked.stream.fail, error)
        self._tracked.clear()
