"""The server under bad input, its /metrics and its /debug/kv page (in headless Chromium).

Every bad request gets its documented 4xx with an OpenAI error body, and the server keeps
serving. /metrics parses with prometheus' own parser and its counters move as requests run.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagekv.kernels import isa
from tests.server.support import (
    REPO,
    ServerProcess,
    block_states,
    nothing_in_use,
    send_without_reading,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.model

NUM_BLOCKS = 96
MAX_WAITING = 2
API_KEY = "sk-test"
OK = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ("--num-kv-blocks", str(NUM_BLOCKS), "--max-num-seqs", "2")
    args += ("--max-waiting-requests", str(MAX_WAITING))
    proc = start_server(tmp_path_factory.mktemp("server"), *args, api_key=API_KEY)
    yield proc
    proc.stop()


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


UNSATISFIABLE = {"allOf": [{"type": "string"}, {"type": "integer"}]}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def tool_def(parameters: dict[str, Any] | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": "f"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def named_choice(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


# (id, path, raw body, expected status, expected error param)
BAD_BODIES: list[tuple[str, str, bytes, int, str | None]] = [
    ("malformed json", CMPL, b'{"prompt": "x",', 400, None),
    ("json array", CMPL, b"[1, 2]", 400, None),
    ("invalid utf-8", CMPL, b'{"prompt": "\xff\xfe"}', 400, None),
    ("missing prompt", CMPL, _json({"max_tokens": 4}), 400, "prompt"),
    ("prompt wrong type", CMPL, _json({"prompt": 5}), 400, "prompt"),
    ("empty prompt", CMPL, _json({"prompt": ""}), 400, "prompt"),
    ("empty prompt list", CMPL, _json({"prompt": []}), 400, "prompt"),
    ("token outside vocab", CMPL, _json({"prompt": [1, 10**9]}), 400, "prompt"),
    ("max_tokens string", CMPL, _json({**OK, "max_tokens": "5"}), 400, "max_tokens"),
    ("max_tokens negative", CMPL, _json({**OK, "max_tokens": -1}), 400, "max_tokens"),
    ("max_tokens zero", CMPL, _json({**OK, "max_tokens": 0}), 400, "max_tokens"),
    ("max_tokens huge", CMPL, _json({**OK, "max_tokens": 10**9}), 400, "max_tokens"),
    ("max_tokens enormous", CMPL, _json({**OK, "max_tokens": 10**30}), 400, "max_tokens"),
    ("n zero", CMPL, _json({**OK, "n": 0}), 400, "n"),
    ("n 10000", CMPL, _json({**OK, "n": 10000}), 400, "n"),
    (
        "stop strings past the cap",
        CMPL,
        _json({**OK, "stop": [f"s{i}" for i in range(80)]}),
        400,
        "stop",
    ),
    ("stop string too long", CMPL, _json({**OK, "stop": "x" * 5000}), 400, "stop"),
    ("prompt ids past the context", CMPL, _json({**OK, "prompt": [5] * 9000}), 400, "prompt"),
    ("n bool", CMPL, _json({**OK, "n": True}), 400, "n"),
    ("top_p 2", CMPL, _json({**OK, "top_p": 2}), 400, "top_p"),
    ("temperature negative", CMPL, _json({**OK, "temperature": -1}), 400, "temperature"),
    ("temperature string", CMPL, _json({**OK, "temperature": "hot"}), 400, "temperature"),
    ("stream string", CMPL, _json({**OK, "stream": "yes"}), 400, "stream"),
    ("stop not strings", CMPL, _json({**OK, "stop": [1]}), 400, "stop"),
    ("logprobs too many", CMPL, _json({**OK, "logprobs": 100}), 400, "logprobs"),
    ("presence_penalty 3", CMPL, _json({**OK, "presence_penalty": 3}), 400, "presence_penalty"),
    ("frequency_penalty str", CMPL, _json({**OK, "frequency_penalty": "1"}), 400, None),
    ("repetition_penalty 0", CMPL, _json({**OK, "repetition_penalty": 0}), 400, None),
    ("logit_bias not token ids", CMPL, _json({**OK, "logit_bias": {"x": 5}}), 400, "logit_bias"),
    ("seed past torch's range", CMPL, _json({**OK, "seed": 2**64}), 400, "seed"),
    (
        "streamed prompt_logprobs",
        CMPL,
        _json({**OK, "prompt_logprobs": 1, "stream": True}),
        400,
        "prompt_logprobs",
    ),
    ("unknown model", CMPL, _json({**OK, "model": "gpt-9"}), 400, "model"),
    ("prompt beyond the pool", CMPL, _json({**OK, "prompt": "hello " * 2000}), 400, "prompt"),
    ("empty messages", CHAT, _json({"messages": []}), 400, "messages"),
    ("missing messages", CHAT, _json({"max_tokens": 4}), 400, "messages"),
    ("unknown role", CHAT, _json({"messages": [{"role": "wizard", "content": "x"}]}), 400, None),
    ("content int", CHAT, _json({"messages": [{"role": "user", "content": 1}]}), 400, None),
    ("top_logprobs alone", CHAT, _json({"messages": MESSAGES, "top_logprobs": 2}), 400, None),
    (
        "top_logprobs 50",
        CHAT,
        _json({"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}),
        400,
        "top_logprobs",
    ),
    (
        "response_format of no such type",
        CHAT,
        _json({"messages": MESSAGES, "response_format": {"type": "xml"}}),
        400,
        "response_format.type",
    ),
    (
        "json_schema that does not compile",
        CHAT,
        _json({"messages": MESSAGES, "response_format": schema_format({"type": "nope"})}),
        400,
        "response_format",
    ),
    (
        "unsatisfiable json_schema",
        CHAT,
        _json({"messages": MESSAGES, "response_format": schema_format(UNSATISFIABLE)}),
        400,
        "response_format",
    ),
    (
        "self-referencing guided_json",
        CMPL,
        _json({**OK, "guided_json": {"$ref": "#"}}),
        400,
        "guided_json",
    ),
    ("bad guided_regex", CMPL, _json({**OK, "guided_regex": "(("}), 400, "guided_regex"),
    ("empty guided_choice", CMPL, _json({**OK, "guided_choice": []}), 400, "guided_choice"),
    (
        "two constraints",
        CMPL,
        _json({**OK, "guided_regex": "a+", "guided_choice": ["b"]}),
        400,
        "guided_choice",
    ),
    (
        "unknown structured_outputs kind",
        CMPL,
        _json({**OK, "structured_outputs": {"xml": "<a/>"}}),
        400,
        "structured_outputs",
    ),
    (
        "tool parameters that do not compile",
        CHAT,
        _json({"messages": MESSAGES, "tools": [tool_def({"type": "bogus"})]}),
        400,
        "tools[0].function.parameters",
    ),
    (
        "tool_choice naming no tool",
        CHAT,
        _json({"messages": MESSAGES, "tools": [tool_def(None)], "tool_choice": named_choice("g")}),
        400,
        "tool_choice",
    ),
    (
        "tool_choice required without tools",
        CHAT,
        _json({"messages": MESSAGES, "tool_choice": "required"}),
        400,
        "tool_choice",
    ),
    (
        "a constrained tool call and a response_format",
        CHAT,
        _json(
            {
                "messages": MESSAGES,
                "tools": [tool_def(None)],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            }
        ),
        400,
        "response_format",
    ),
    ("chat n 10000", CHAT, _json({"messages": MESSAGES, "n": 10000}), 400, "n"),
    ("10 MB body", CMPL, b'{"prompt": "' + b"a" * (10 << 20) + b'"}', 413, None),
]


DEEP = 100_000  # far past the server's nesting limit, and past Python's recursion limit
CMPL_BASE = b'"prompt": "Hello", "max_tokens": 4'
CHAT_BASE = b'"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4'


def _raw(base: bytes, extra: bytes) -> bytes:
    """A JSON object of ``base`` and ``extra`` (raw JSON text: NaN and lone surrogates stay)."""
    return b"{" + base + b", " + extra + b"}"


def _deep_list() -> bytes:
    return b"[" * DEEP + b"]" * DEEP


def _deep_object() -> bytes:
    return b'{"a": ' * DEEP + b"1" + b"}" * DEEP


# (field, raw JSON value) refused on either endpoint, the error naming the field
BAD_NUMBERS: list[tuple[str, bytes]] = [
    ("temperature", b"Infinity"),
    ("temperature", b"-Infinity"),
    ("temperature", b"NaN"),
    ("temperature", b"1e999"),  # Python's json reads it as inf
    ("temperature", b"1e308"),
    ("temperature", b"2.5"),
    ("temperature", b"1" + b"0" * 400),  # an integer past any float
    ("top_p", b"NaN"),
    ("top_p", b"Infinity"),
    ("min_p", b"NaN"),
    ("min_p", b"-Infinity"),
    ("presence_penalty", b"NaN"),
    ("frequency_penalty", b"-Infinity"),
    ("repetition_penalty", b"Infinity"),
    ("repetition_penalty", b"NaN"),
    ("stop_token_ids", b"[1000000000000]"),
    ("stop_token_ids", b"[0, 9223372036854775808]"),
    ("stop_token_ids", b"[-1]"),
]

# (id, path, raw body, error param) that must each be a 400 naming ``param`` (None: the body
# is not JSON, so no field can be named)
HOSTILE_BODIES: list[tuple[str, str, bytes, str | None]] = [
    *[
        (
            f"{name} {value[:12].decode()}",
            path,
            _raw(base, b'"' + name.encode() + b'": ' + value),
            name,
        )
        for path, base in ((CMPL, CMPL_BASE), (CHAT, CHAT_BASE))
        for name, value in BAD_NUMBERS
    ],
    ("surrogate prompt", CMPL, b'{"prompt": "\\ud800", "max_tokens": 4}', "prompt"),
    ("low surrogate in a prompt", CMPL, b'{"prompt": ["ok", "a\\udfffb"]}', "prompt[1]"),
    ("surrogate stop", CMPL, _raw(CMPL_BASE, b'"stop": ["\\ud800"]'), "stop[0]"),
    ("surrogate model", CMPL, _raw(CMPL_BASE, b'"model": "\\udbff"'), "model"),
    ("surrogate key", CMPL, _raw(CMPL_BASE, b'"\\ud800": 1'), "body"),
    (
        "surrogate content",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "messages[0].content",
    ),
    (
        "surrogate text part",
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\ud800"}]}]}',
        "messages[0].content[0].text",
    ),
    (
        "surrogate role",
        CHAT,
        b'{"messages": [{"role": "\\ud800", "content": "hi"}]}',
        "messages[0].role",
    ),
    ("deep prompt", CMPL, b'{"prompt": ' + _deep_list() + b"}", "prompt"),
    ("deep unclosed prompt", CMPL, b'{"prompt": ' + b"[" * DEEP, "prompt"),
    ("deep user", CMPL, _raw(CMPL_BASE, b'"user": ' + _deep_object()), "user"),
    ("deep list body", CMPL, _deep_list(), "body"),
    ("deep object body", CMPL, _deep_object(), "body"),
    (
        "deep user content",
        CHAT,
        b'{"messages": [{"role": "user", "content": ' + _deep_object() + b"}]}",
        "messages",
    ),
    ("deep chat user", CHAT, _raw(CHAT_BASE, b'"user": ' + _deep_list()), "user"),
    ("deep chat body", CHAT, _deep_object(), "body"),
    ("token id past the vocab", CMPL, b'{"prompt": [1, 1000000000000]}', "prompt"),
    ("negative token id", CMPL, b'{"prompt": [-1]}', "prompt"),
    ("token id past int64", CMPL, b'{"prompt": [9223372036854775808]}', "prompt"),
    (
        "bad ids in a second prompt",
        CMPL,
        b'{"prompt": [[1, 2], [1000000000000]], "n": 2}',
        "prompt",
    ),
    ("integer of 5000 digits", CMPL, _raw(CMPL_BASE, b'"n": ' + b"1" * 5000), None),
    ("chat integer of 5000 digits", CHAT, _raw(CHAT_BASE, b'"seed": ' + b"9" * 5000), None),
]
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
GREEDY_CHAT = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}


def check_error_body(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:300]
    assert "Traceback" not in response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


@pytest.mark.parametrize(
    ("path", "raw", "status", "param"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
def test_bad_request_gets_its_4xx(
    server: ServerProcess, path: str, raw: bytes, status: int, param: str | None
) -> None:
    headers = {**server.headers, "Content-Type": "application/json"}
    response = httpx.post(server.url + path, content=raw, headers=headers, timeout=60)
    error = check_error_body(response, status)
    if param is not None:
        assert error["param"] == param
    if param == "model":
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize(
    "params",
    [
        {"top_p": 1e-300},
        {"top_p": 5e-324},
        {"top_p": 1e-300, "top_k": 1},
        {"repetition_penalty": 1e-300},
        {"repetition_penalty": 1e-40},
    ],
    ids=["top_p 1e-300", "top_p 5e-324", "top_p and top_k", "rep 1e-300", "rep 1e-40"],
)
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_parameters_that_underflow_give_sensible_text(
    server: ServerProcess, path: str, params: dict[str, float]
) -> None:
    """Values that underflow float32 once made every logit -inf and every token the last id of
    the vocabulary (greedy: "." over and over): now a top_p this small keeps the top token (the
    greedy text) and a tiny repetition penalty still samples finite rows."""
    body = {**(GREEDY if path == CMPL else GREEDY_CHAT), "temperature": 1.0, **params}
    res = server.post(path, body)
    assert res.status_code == 200, res.text
    choice = res.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    text = choice["text"] if path == CMPL else choice["message"]["content"]
    greedy = server.post(path, GREEDY if path == CMPL else GREEDY_CHAT).json()["choices"][0]
    if "top_p" in params:
        assert text == (greedy["text"] if path == CMPL else greedy["message"]["content"])
    else:  # a penalty below 1 rewards repeating the prompt, not one junk token
        assert text.strip() and set(text.strip()) != {"."} and "\ufffd" not in text


def _greedy_texts(server: ServerProcess) -> tuple[str, str]:
    cmpl, chat = server.post(CMPL, GREEDY), server.post(CHAT, GREEDY_CHAT)
    assert cmpl.status_code == chat.status_code == 200, (cmpl.text, chat.text)
    return cmpl.json()["choices"][0]["text"], chat.json()["choices"][0]["message"]["content"]


def _send_hostile(
    server: ServerProcess, case: tuple[str, str, bytes, str | None]
) -> tuple[int, list[str]]:
    """One case's status and what went wrong: its status, its error's param, the server after."""
    name, path, raw, param = case
    headers = {**server.headers, "Content-Type": "application/json"}
    response = httpx.post(server.url + path, content=raw, headers=headers, timeout=60)
    problems = []
    if response.status_code != 400:
        problems.append(f"{name}: status {response.status_code}: {response.text[:200]}")
    else:
        error = check_error_body(response, 400)
        if error["param"] != param:
            problems.append(f"{name}: param {error['param']!r}, not {param!r}: {error['message']}")
    if server.get("/health").status_code != 200:
        problems.append(f"{name}: /health is not 200 afterwards")
    if not wait_until(lambda: nothing_in_use(server), timeout_s=5):
        problems.append(f"{name}: blocks or requests left in the engine: {server.kv()['stats']}")
    return response.status_code, problems


def test_hostile_bodies_are_400s_that_leave_the_server_as_it_was(server: ServerProcess) -> None:
    """Non-finite and out-of-range numbers, token ids outside the vocabulary, lone surrogates
    and deep nesting, as raw bytes on both endpoints: each a 400 naming its field, none a 5xx,
    the server healthy with nothing allocated after each, and greedy output unchanged."""
    before = _greedy_texts(server)
    server_errors, problems = [], []
    for case in HOSTILE_BODIES:
        status, found = _send_hostile(server, case)
        problems += found
        if status >= 500:
            server_errors.append(f"{case[0]}: {status}")
    assert not server_errors, "\n".join(problems)
    assert not problems, "\n".join(problems)
    assert _greedy_texts(server) == before


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": ""}])
def test_missing_or_wrong_api_key_is_401(server: ServerProcess, headers: dict[str, str]) -> None:
    for path, body in ((CMPL, OK), (CHAT, {"messages": MESSAGES})):
        response = httpx.post(server.url + path, json=body, headers=headers, timeout=60)
        assert check_error_body(response, 401)["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401


def test_a_full_waiting_queue_is_429(server: ServerProcess) -> None:
    body = {**OK, "max_tokens": 80, "ignore_eos": True, "stream": True}

    def counts(running: int, waiting: int) -> Callable[[], bool]:
        def check() -> bool:
            stats = server.kv()["stats"]
            return bool(stats["num_running"] == running and stats["num_waiting"] == waiting)

        return check

    socks = [send_without_reading(server, CMPL, body) for _ in range(2)]  # the 2 batch slots
    try:
        assert wait_until(counts(2, 0), timeout_s=30)
        socks += [send_without_reading(server, CMPL, body) for _ in range(MAX_WAITING)]
        assert wait_until(counts(2, MAX_WAITING), timeout_s=30)
        error = check_error_body(server.post(CMPL, OK), 429)
        assert error["type"] == "rate_limit_error"
    finally:
        for sock in socks:
            sock.close()
    assert wait_until(lambda: nothing_in_use(server), timeout_s=5)
    assert server.post(CMPL, OK).status_code == 200


def test_unknown_route_and_method(server: ServerProcess) -> None:
    check_error_body(server.get("/v1/nothing"), 404)
    check_error_body(httpx.delete(server.url + "/v1/models", headers=server.headers), 405)


def test_server_still_serves_after_the_bad_input(server: ServerProcess) -> None:
    assert server.get("/health").status_code == 200
    response = server.post(CMPL, OK)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    chat = server.post(CHAT, {"messages": MESSAGES, "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
    errors = server.metrics()
    assert errors[("pagekv_http_errors_total", (("status", "400"),))] >= len(BAD_BODIES) - 1
    assert errors[("pagekv_http_errors_total", (("status", "401"),))] >= 9


def test_metrics_parse_and_counters_move(server: ServerProcess) -> None:
    before = server.metrics()
    for max_tokens in (5, 7):
        body = {**OK, "max_tokens": max_tokens, "ignore_eos": True}
        assert server.post(CMPL, body).status_code == 200
    streamed = server.post(CMPL, {**OK, "max_tokens": 6, "ignore_eos": True, "stream": True})
    assert streamed.text.rstrip().endswith("data: [DONE]")
    after = server.metrics()

    def moved(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert moved("pagekv_request_success_total", (("finish_reason", "length"),)) == 3
    assert moved("pagekv_generation_tokens_total") == 18
    assert moved("pagekv_time_to_first_token_seconds_count") == 3
    assert moved("pagekv_time_per_output_token_seconds_count") == 3
    assert moved("pagekv_e2e_request_latency_seconds_count") == 3
    assert moved("pagekv_prefix_cache_queries_total") > 0
    assert moved("pagekv_engine_steps_total") >= 7
    assert moved("pagekv_request_aborted_total") == 0
    gauge = {name: value for (name, labels), value in after.items() if not labels}
    assert gauge["pagekv_kv_blocks_total"] == NUM_BLOCKS
    assert (
        gauge["pagekv_kv_blocks_free"]
        + gauge["pagekv_kv_blocks_used"]
        + gauge["pagekv_kv_blocks_evictable"]
        == NUM_BLOCKS
    )
    assert 0.0 <= gauge["pagekv_kv_usage"] <= 1.0
    for name in ("pagekv_num_running", "pagekv_num_waiting", "pagekv_num_swapped"):
        assert name in gauge
    for mode in ("recompute", "swap"):
        assert ("pagekv_preemptions_total", (("mode", mode),)) in after
    kernels = [dict(labels) for (name, labels), v in after.items() if name == "pagekv_kernels_info"]
    assert len(kernels) == 1 and kernels[0]["kernel_target"] == (isa.selected() or "none")
    assert kernels[0]["cpu"] == isa.cpu_name()


def test_kv_json_agrees_with_metrics(server: ServerProcess) -> None:
    kv = server.kv()
    assert kv["num_blocks"] == len(kv["blocks"]) == NUM_BLOCKS
    assert [b["id"] for b in kv["blocks"]] == list(range(NUM_BLOCKS))
    states = block_states(kv)
    assert states["free"] == kv["stats"]["kv_blocks_free"]
    assert states["evictable"] == kv["stats"]["kv_blocks_evictable"]
    assert all(b["hash"] for b in kv["blocks"] if b["state"] == "evictable")


def _chromium(binary: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000"]
    return subprocess.run(
        [binary, *flags, *args], capture_output=True, text=True, timeout=timeout_s
    )


def test_debug_kv_page_draws_every_block_in_chromium(chromium: str, tmp_path: Path) -> None:
    # a browser sends no API key: a server without one (with one, the page needs it)
    server = start_server(tmp_path, "--num-kv-blocks", str(NUM_BLOCKS), "--max-num-seqs", "2")
    try:
        _draw_every_block(chromium, server, tmp_path)
    finally:
        server.stop()


def _draw_every_block(chromium: str, server: ServerProcess, tmp_path: Path) -> None:
    html = server.get("/debug/kv").text
    assert "<script src" not in html and "<link" not in html and "https://" not in html
    busy = threading.Thread(  # some blocks in use while the page is drawn
        target=server.post,
        args=(CMPL, {**OK, "prompt": "Tell me " * 40, "max_tokens": 60, "ignore_eos": True}),
    )
    busy.start()
    try:
        profile = f"--user-data-dir={tmp_path / 'profile'}"
        dom = _chromium(chromium, profile, "--dump-dom", server.url + "/debug/kv")
        artifacts = REPO / "artifacts"
        artifacts.mkdir(exist_ok=True)
        shot = artifacts / "kv_map_page.png"
        shot.unlink(missing_ok=True)
        _chromium(
            chromium,
            profile,
            "--window-size=1000,700",
            f"--screenshot={shot}",
            server.url + "/debug/kv",
        )
    finally:
        busy.join()
    assert dom.returncode == 0, dom.stderr[-2000:]
    cells = [line for line in dom.stdout.split("<div") if 'class="cell ' in line]
    assert len(cells) == NUM_BLOCKS
    assert all(
        any(f'data-state="{s}"' in c for s in ("free", "in_use", "evictable")) for c in cells
    )
    assert f"{NUM_BLOCKS} blocks x 16 tokens" in dom.stdout
    assert shot.read_bytes().startswith(b"\x89PNG")
