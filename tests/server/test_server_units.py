"""Server parts without HTTP: output streams, the engine thread, errors, bodies, metrics, PNG.

The engine thread runs against a small fake engine that logs every call, so the order of
aborts and steps is checked exactly; ``block_map`` runs on the real engine.
"""

from __future__ import annotations

import asyncio
import struct
import time
import zlib
from typing import Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.engine.outputs import CompletionOutput, RequestOutput
from pagekv.errors import InvalidRequestError, PromptTooLongError
from pagekv.models.loader import LoadedModel
from pagekv.sampling_params import SamplingParams
from pagekv.server.app import stats_for_scrape
from pagekv.server.engine_loop import EngineLoop, EngineRequest
from pagekv.server.errors import (
    AuthenticationError,
    BodyTooLargeError,
    EngineDeadError,
    MethodNotAllowedError,
    ModelNotFoundError,
    QueueFullError,
    RouteNotFoundError,
    error_body,
    status_of,
)
from pagekv.server.formats import Cursor
from pagekv.server.kv_page import render_kv_page
from pagekv.server.kv_png import FREE, encode_png, render_block_map
from pagekv.server.metrics import Metrics
from pagekv.server.protocol import (
    MAX_JSON_DEPTH,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_prompts,
    parse_json,
    sampling_params,
    validate,
)
from pagekv.server.streams import OutputStream


def output(rid: str, text: str, num_tokens: int, finished: bool = False) -> RequestOutput:
    out = CompletionOutput(
        0, text, list(range(num_tokens)), finish_reason="length" if finished else None
    )
    return RequestOutput(rid, None, [1, 2, 3], [out], finished=finished)


# ---- OutputStream ---------------------------------------------------------------------------


def test_stream_keeps_only_the_latest_output_per_request() -> None:
    async def run() -> None:
        stream = OutputStream(["a", "b"])
        stream.put(output("a", "x", 1))
        stream.put(output("b", "y", 1))
        stream.put(output("a", "xx", 2))
        stream.put(output("a", "xxx", 3, finished=True))
        assert stream.num_coalesced == 2
        assert await stream.get() == (0, output("a", "xxx", 3, finished=True))
        assert stream.unfinished_request_ids == ["b"]
        stream.put(output("b", "yy", 2, finished=True))
        assert [o.outputs[0].text for o in await stream.finals()] == ["xxx", "yy"]
        assert stream.finished

    asyncio.run(run())


def test_stream_raises_its_error_once_drained() -> None:
    async def run() -> None:
        stream = OutputStream(["a"])
        stream.put(output("a", "x", 1))
        stream.fail(EngineDeadError("gone"))
        assert (await stream.get())[1].outputs[0].text == "x"
        with pytest.raises(EngineDeadError):
            await stream.get()

    asyncio.run(run())


# ---- the engine thread ----------------------------------------------------------------------


class FakeEngine:
    """Each request yields one token per step and finishes after ``max_tokens``; logs calls."""

    def __init__(self, fail_on_step: int | None = None, step_s: float = 0.0) -> None:
        self.calls: list[str] = []
        self.live: dict[str, int] = {}
        self.max_tokens: dict[str, int] = {}
        self.fail_on_step = fail_on_step
        self.steps = 0
        self.step_s = step_s

    def add_request(
        self, rid: str, prompt: Any, params: SamplingParams, client: str | None = None
    ) -> None:
        if prompt == "bad":
            raise InvalidRequestError("bad prompt", "prompt")
        self.calls.append(f"add {rid}")
        self.live[rid], self.max_tokens[rid] = 0, params.max_tokens

    def abort_request(self, rid: str) -> bool:
        self.calls.append(f"abort {rid}")
        return self.live.pop(rid, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def stats(self) -> dict[str, Any]:
        return {"num_waiting": len(self.live), "kv_usage": 0.5, "name": "fake"}

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        self.steps += 1
        self.calls.append("step")
        if self.steps == self.fail_on_step:
            raise RuntimeError("kernel exploded")
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] == self.max_tokens[rid]
            outs.append(output(rid, "t" * self.live[rid], self.live[rid], done))
            if done:
                del self.live[rid]
        return outs


def run_loop(engine: FakeEngine, body: Any, max_waiting: int = 100) -> Metrics:
    metrics = Metrics()
    loop = EngineLoop(cast(LLMEngine, engine), metrics, max_waiting)
    loop.start()
    try:
        asyncio.run(body(loop))
    finally:
        loop.stop()
    return metrics


def req(rid: str, prompt: str = "p", max_tokens: int = 3) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens))


def test_loop_delivers_outputs_and_records_metrics() -> None:
    async def body(loop: EngineLoop) -> None:
        stream = await loop.add([req("a"), req("b", max_tokens=2)])
        finals = await stream.finals()
        assert [f.outputs[0].text for f in finals] == ["ttt", "tt"]
        assert (await loop.call(lambda e: e.stats()))["name"] == "fake"

    metrics = run_loop(FakeEngine(), body)
    text = metrics.exposition({}).decode()
    assert 'pagekv_request_success_total{finish_reason="length"} 2.0' in text
    assert "pagekv_time_to_first_token_seconds_count 2.0" in text


def test_abort_reaches_the_engine_within_one_step() -> None:
    engine = FakeEngine(step_s=0.02)
    requested_at: list[int] = []

    async def body(loop: EngineLoop) -> None:
        stream = await loop.add([req("a", max_tokens=100)])
        await stream.get()
        requested_at.append(engine.steps)
        loop.abort(["a"])
        await loop.call(lambda e: None)  # a turn later

    metrics = run_loop(engine, body)
    steps_before_abort = engine.calls[: engine.calls.index("abort a")].count("step")
    assert steps_before_abort <= requested_at[0] + 1  # the step running then, no more
    assert engine.steps == steps_before_abort
    assert "pagekv_request_aborted_total 1.0" in metrics.exposition({}).decode()


def test_a_scrape_during_a_long_step_shows_the_previous_engine_numbers() -> None:
    """/metrics waits for a step boundary at most METRICS_WAIT_S once it has numbers to show."""
    engine = FakeEngine(step_s=1.5)
    metrics = Metrics()
    waits: list[float] = []

    async def body(loop: EngineLoop) -> None:
        first = await stats_for_scrape(loop, metrics, wait_s=0.2)  # nothing shown yet: waits
        metrics.exposition(first)
        await loop.add([req("a", max_tokens=3)])
        await asyncio.sleep(0.1)  # the engine is inside a step now
        started = time.monotonic()
        stale = await stats_for_scrape(loop, metrics, wait_s=0.2)
        waits.append(time.monotonic() - started)
        assert stale == first and stale["num_waiting"] == 0
        fresh = await stats_for_scrape(loop, metrics, wait_s=10.0)
        assert fresh["num_waiting"] == 1

    loop = EngineLoop(cast(LLMEngine, engine), metrics, 100)
    loop.start()
    try:
        asyncio.run(body(loop))
    finally:
        loop.stop()
    assert waits[0] < 1.0  # not the 1.5 s step


def test_a_bad_prompt_adds_none_of_the_batch_and_a_full_queue_is_429() -> None:
    engine = FakeEngine()

    async def body(loop: EngineLoop) -> None:
        with pytest.raises(InvalidRequestError):
            await loop.add([req("a"), req("b", prompt="bad")])
        assert engine.live == {}
        with pytest.raises(QueueFullError):
            await loop.add([req(f"r{i}") for i in range(3)])

    run_loop(engine, body, max_waiting=2)
    assert engine.calls[:2] == ["add a", "abort a"]


def test_a_failed_step_fails_the_streams_and_marks_the_engine_dead() -> None:
    async def body(loop: EngineLoop) -> None:
        stream = await loop.add([req("a", max_tokens=10)])
        with pytest.raises(EngineDeadError):
            await stream.finals()
        assert not loop.alive
        with pytest.raises(EngineDeadError):
            await loop.add([req("b")])

    run_loop(FakeEngine(fail_on_step=2), body)


# ---- errors, bodies, formats ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (AuthenticationError("x"), 401),
        (BodyTooLargeError("x"), 413),
        (QueueFullError("x"), 429),
        (InvalidRequestError("x", "n"), 400),
        (PromptTooLongError("x", "prompt"), 400),
        (ModelNotFoundError("x", "model"), 400),
        (EngineDeadError("x"), 503),
        (RouteNotFoundError("x"), 404),
        (MethodNotAllowedError("x"), 405),
        (RuntimeError("secret detail"), 500),
        (KeyError("secret detail"), 500),
    ],
)
def test_one_table_maps_errors_to_statuses(exc: Exception, status: int) -> None:
    assert status_of(exc)[0] == status
    code, body = error_body(exc)
    assert code == status and set(body["error"]) == {"message", "type", "param", "code"}
    if status == 500:
        assert "secret" not in str(body)


def test_bodies_are_parsed_strictly_and_errors_name_the_parameter() -> None:
    with pytest.raises(InvalidRequestError, match="UTF-8"):
        parse_json(b'{"a": "\xff"}')
    with pytest.raises(InvalidRequestError, match="JSON"):
        parse_json(b"{")
    with pytest.raises(InvalidRequestError) as info:
        validate(ChatCompletionRequest, {"messages": [{"role": "x", "content": "y"}]})
    assert info.value.param == "messages[0].role"
    with pytest.raises(InvalidRequestError) as info:
        validate(CompletionRequest, {"prompt": "x", "max_tokens": "5"})
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as info:
        validate(CompletionRequest, {"prompt": ["a", 1]})
    assert info.value.param == "prompt"


def test_sampling_params_from_a_body() -> None:
    body = validate(CompletionRequest, {"prompt": [[1, 2], [3]], "top_k": -1, "stop": "x"})
    params = sampling_params(body, 16, None, max_n=4)
    assert params.top_k is None and params.stop == ("x",) and params.temperature == 1.0
    assert completion_prompts(body, max_choices=8) == [[1, 2], [3]]
    with pytest.raises(InvalidRequestError) as info:
        completion_prompts(body, max_choices=1)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as info:
        sampling_params(validate(CompletionRequest, {"prompt": "x", "n": 5}), 16, None, 4)
    assert info.value.param == "n"
    chat = validate(ChatCompletionRequest, {"messages": [], "logprobs": True, "top_logprobs": 3})
    assert chat_logprobs(chat) == 3


def _param_of_refused(raw: bytes) -> str | None:
    with pytest.raises(InvalidRequestError) as info:
        parse_json(raw)
    return info.value.param


def test_nesting_is_refused_from_the_raw_bytes_and_names_the_top_level_field() -> None:
    inner = MAX_JSON_DEPTH - 1  # the body object is one level
    assert parse_json(b'{"prompt": ' + b"[" * inner + b"]" * inner + b"}")["prompt"]
    deeper = inner + 1
    assert _param_of_refused(b'{"prompt": ' + b"[" * deeper + b"]" * deeper + b"}") == "prompt"
    assert (
        _param_of_refused(b'{"n": 1, "user": ' + b'{"a":' * deeper + b"1" + b"}" * deeper + b"}")
        == "user"
    )
    assert _param_of_refused(b"[" * 10**5) == "body"
    assert _param_of_refused(b'{"x": ' + b"[" * 10**5) == "body"  # no field of the API
    # Brackets in strings (escaped quotes too) are text, not nesting.
    text = '\\"[{' * 10**4
    assert parse_json(f'{{"prompt": "{text}"}}'.encode())["prompt"] == '"[{' * 10**4


def test_strings_that_are_not_unicode_are_refused_where_they_are() -> None:
    assert _param_of_refused(b'{"prompt": "\\ud800"}') == "prompt"
    assert _param_of_refused(b'{"prompt": ["a", "b\\udfff"]}') == "prompt[1]"
    chat = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'
    assert _param_of_refused(chat) == "messages[0].content[0].text"
    assert _param_of_refused(b'{"prompt": "x", "\\ud800": 1}') == "body"
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}')["prompt"] == "\U0001f600"  # a pair
    assert _param_of_refused(b'{"n": ' + b"1" * 5000 + b"}") is None  # past int()'s digits


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ],
)
@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_every_float_field_refuses_nan_and_infinity(field: str, value: bytes) -> None:
    body = parse_json(b'{"prompt": "x", "' + field.encode() + b'": ' + value + b"}")
    with pytest.raises(InvalidRequestError, match="finite") as info:
        validate(CompletionRequest, body)
    assert info.value.param == field


@pytest.mark.parametrize("temperature", [2.0001, 1e308, 10**400])
def test_temperature_is_in_openais_range(temperature: float) -> None:
    ok = validate(CompletionRequest, {"prompt": "x", "temperature": 2})
    assert sampling_params(ok, 16, None, max_n=4).temperature == 2
    with pytest.raises(InvalidRequestError) as info:
        body = validate(CompletionRequest, {"prompt": "x", "temperature": temperature})
        sampling_params(body, 16, None, max_n=4)
    assert info.value.param == "temperature"


def test_cursor_holds_back_a_possible_stop_string() -> None:
    cursor = Cursor()
    running = CompletionOutput(0, "Hello wor", [1, 2, 3])
    assert cursor.advance(running, hold_chars=2) == ("Hello w", 0, 3)
    done = CompletionOutput(0, "Hello", [1, 2, 3, 4], finish_reason="stop")
    assert cursor.advance(done, hold_chars=2) == ("", 3, 4)  # the stop string was cut
    assert cursor.done


# ---- metrics, PNG, page ---------------------------------------------------------------------


def test_every_numeric_stat_becomes_a_gauge_and_counters_get_labels() -> None:
    stats = {"kv_usage": 0.25, "preemptions_recompute": 3, "preemptions_swap": 1, "name": "x"}
    text = Metrics().exposition(stats).decode()
    samples = {
        (s.name, tuple(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("pagekv_kv_usage", ())] == 0.25
    assert samples[("pagekv_preemptions_recompute", ())] == 3
    assert samples[("pagekv_preemptions_total", (("mode", "swap"),))] == 1
    assert not any(name.startswith("pagekv_name") for name, _ in samples)


def _png_pixels(data: bytes) -> tuple[int, int, bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat_len = struct.unpack(">I", data[33:37])[0]
    assert data[37:41] == b"IDAT"
    return width, height, zlib.decompress(data[41 : 41 + idat_len])


def test_png_encoder_and_block_map_picture() -> None:
    width, height, raw = _png_pixels(encode_png(2, 1, [bytes([1, 2, 3, 4, 5, 6])]))
    assert (width, height, raw) == (2, 1, b"\x00\x01\x02\x03\x04\x05\x06")
    blocks = [{"state": "free", "ref_count": 0}] * 10
    width, height, raw = _png_pixels(render_block_map({"blocks": blocks}, cell_px=4, gap_px=1))
    assert len(raw) == height * (1 + 3 * width)
    row = raw[1 * (1 + 3 * width) + 1 :]  # second pixel row, first cell starts at x = 1
    assert tuple(row[3:6]) == FREE


def test_kv_page_inlines_its_data_safely() -> None:
    page = render_kv_page({"blocks": [], "model": "</script><b>"})
    assert "</script><b>" not in page and "<\\/script><b>" in page


# ---- the engine's block map -----------------------------------------------------------------


@pytest.mark.model
def test_block_map_shows_shared_blocks_and_their_owners(loaded: LoadedModel) -> None:
    engine = LLMEngine(EngineConfig(num_kv_blocks=32, check_invariants=True), loaded)
    engine.add_request(
        "r",
        "One two three four five six seven eight " * 3,
        SamplingParams(n=2, seed=0, ignore_eos=True),
    )
    engine.step()
    data = engine.block_map()
    assert data["num_blocks"] == len(data["blocks"]) == 32
    assert set(data["requests"]) == {"r#0", "r#1"}
    shared = [b for b in data["blocks"] if b["ref_count"] == 2]
    assert shared and all(b["owners"] == ["r#0", "r#1"] for b in shared)
    assert all(b["state"] == "in_use" for b in shared)
    engine.abort_request("r")
    after = engine.block_map()
    assert after["requests"] == {} and {b["state"] for b in after["blocks"]} <= {
        "free",
        "evictable",
    }
    assert all(b["hash"] for b in after["blocks"] if b["state"] == "evictable")
