"""``pagekv serve``'s vLLM flags without a model: parsing, refusals under serve's usage, the
port taken before the model loads, and the pieces behind the flags (generation config, chat
prompt, stats line, access log) on their own."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagekv.cli import build_parser, main
from pagekv.errors import InvalidRequestError
from pagekv.server.access_log import AccessLog
from pagekv.server.chat_prompt import chat_prompt
from pagekv.server.cli_args import chat_template_text, server_config, string_list
from pagekv.server.engine_loop import TokenCounts
from pagekv.server.generation_defaults import sampling_defaults
from pagekv.server.protocol import CompletionRequest, validate, with_defaults
from pagekv.server.serve import PortInUseError, bind
from pagekv.server.stats_log import StatsLine
from tests.server.support import REPO

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def serve_args(*argv: str) -> Any:
    parser, _ = build_parser()
    return parser.parse_args(["serve", *argv])


def run_serve(*argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "pagekv.cli", "serve", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)


def test_vllm_flags_make_the_server_config(tmp_path: Path) -> None:
    args = serve_args(
        "--served-model-name", "alpha", "beta",
        "--root-path", "/api",
        "--allowed-origins", '["http://a.example", "http://b.example"]',
        "--allowed-methods", "GET",
        "--allow-credentials",
        "--enable-log-requests",
        "--disable-log-stats",
        "--uvicorn-log-level", "warning",
        "--tool-call-parser", "hermes",
        "--enable-auto-tool-choice",
        "--return-tokens-as-token-ids",
        "--seed", "7",
    )  # fmt: skip
    config = server_config(args, {"temperature": 0.5})
    assert config.served_model_names == ("alpha", "beta")
    assert config.root_path == "/api"
    assert config.cors.allowed_origins == ("http://a.example", "http://b.example")
    assert config.cors.allowed_methods == ("GET",) and config.cors.allow_credentials
    assert config.logs.log_requests and not config.logs.log_stats and config.logs.access_log
    assert config.logs.uvicorn_log_level == "warning"
    assert config.tool_call_parser == "hermes" and config.return_tokens_as_token_ids
    assert config.sampling_defaults == (("temperature", 0.5),)
    assert args.seed == 7  # an EngineConfig field: engine_config(args) takes it
    assert not server_config(serve_args("--disable-log-requests")).logs.log_requests
    assert not server_config(serve_args("--disable-uvicorn-access-log")).logs.access_log


def test_help_shows_every_default() -> None:
    _, commands = build_parser()
    text = commands["serve"].format_help()
    for shown in ("(default: 8000)", "(default: 16)", "(default: info)", "(default: 127.0.0.1)"):
        assert shown in text
    assert text.count("(default:") >= 40


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--tool-call-parser", "mistral"], "argument --tool-call-parser"),
        (["--chat-template", "/no/such/template.jinja"], "argument --chat-template"),
        (["--ssl-certfile", "/no/such/cert.pem"], "argument --ssl-certfile"),
        (["--ssl-keyfile", __file__], "--ssl-keyfile needs --ssl-certfile"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--tensor-parallel-size", "2"], "argument --tensor-parallel-size"),
        (["--kv-cache-dtype", "fp8_e5m2"], "argument --kv-cache-dtype"),
        (["--uvicorn-log-level", "loud"], "argument --uvicorn-log-level"),
        (["--root-path", "api"], "argument --root-path"),
        (["--generation-config", "/no/such/dir"], "argument --generation-config"),
    ],
)
def test_a_flag_that_cannot_be_honoured_is_refused_under_serves_usage(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken, pytest.raises(SystemExit) as exited:
        taken.bind(("127.0.0.1", 0))
        taken.listen()  # were the flag taken, serve would stop here, not load and serve
        main(["serve", *argv, "--port", str(taken.getsockname()[1])])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "usage: pagekv serve" in err and said in err
    assert "pagekv serve: error:" in err
    assert "loading the model" not in err


def test_an_unknown_flag_is_refused_by_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    done = run_serve("--max-num-seqs", "4", "--definitely-not-a-flag", "3")
    assert done.returncode == 2
    assert "usage: pagekv serve" in done.stderr
    assert "pagekv serve: error: unrecognized arguments: --definitely-not-a-flag" in done.stderr


def test_a_port_in_use_fails_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_serve("--port", str(port))
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "loading the model" not in done.stderr


def test_bind_takes_the_port_for_good() -> None:
    sock = bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with pytest.raises(PortInUseError, match=str(port)):
            bind("127.0.0.1", port)  # listening already: no second server can take it
    finally:
        sock.close()


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert chat_template_text(str(path)) == TEMPLATE
    assert chat_template_text(TEMPLATE) == TEMPLATE
    with pytest.raises(Exception, match="looks like a file path"):
        chat_template_text(str(tmp_path / "missing.jinja"))


def test_cors_lists_are_json_or_one_string() -> None:
    assert string_list('["http://a", "http://b"]') == ["http://a", "http://b"]
    assert string_list("http://a") == ["http://a"]
    assert string_list('"*"') == ["*"]
    with pytest.raises(Exception, match="JSON list of strings"):
        string_list("[1, 2]")


def test_generation_config_defaults_are_vllms(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 50,  # transformers' default: no change, as vLLM's to_diff_dict drops it
        "max_new_tokens": 100,
        "do_sample": True,
        "bos_token_id": 1,
    }
    (model / "generation_config.json").write_text(json.dumps(config))
    want = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 100}
    assert sampling_defaults("auto", str(model)) == want
    assert sampling_defaults(str(model), "/elsewhere/model.gguf") == want
    assert sampling_defaults("vllm", str(model)) == {}
    assert sampling_defaults("auto", str(model / "model.gguf")) == {}  # a file: none
    with pytest.raises(InvalidRequestError, match="generation_config"):
        sampling_defaults(str(tmp_path), str(model))


def test_defaults_fill_only_what_a_request_leaves_unset() -> None:
    defaults = (("temperature", 0.25), ("top_k", 20), ("max_tokens", 100))
    req = with_defaults(validate(CompletionRequest, {"prompt": "x", "top_k": 5}), defaults)
    assert (req.temperature, req.top_k, req.max_tokens) == (0.25, 5, 16)
    zero = with_defaults(validate(CompletionRequest, {"prompt": "x", "temperature": 0}), defaults)
    assert zero.temperature == 0


def render(messages: list[dict[str, Any]], add: bool, tools: Any) -> str:
    text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
    return text + ("<assistant>" if add else "")


def test_continue_final_message_leaves_the_last_message_open() -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    assert chat_prompt(render, messages, None) == render(messages, True, None)
    opened = chat_prompt(render, messages, None, False, True)
    assert opened == "<user>Hi</user><assistant>Hello, I"
    with pytest.raises(InvalidRequestError) as err:
        chat_prompt(render, messages, None, True, True)
    assert err.value.param == "continue_final_message"


def test_stats_line_reports_throughput_queues_and_hit_rate() -> None:
    tokens = TokenCounts()
    line = StatsLine(tokens, now_s=0.0)
    idle = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0}
    assert line.line(idle, 10.0) is None  # idle: nothing written
    tokens.prompt_tokens, tokens.generation_tokens = 500, 200
    busy = {
        "num_running": 3, "num_waiting": 1, "kv_usage": 0.125,
        "prefix_cache_query_tokens": 800, "prefix_cache_hit_tokens": 200,
        "preemptions_recompute": 2,
    }  # fmt: skip
    text = line.line(busy, 20.0)
    assert text == (
        "Engine 000: Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: "
        "20.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, Preemptions: 2, "
        "KV cache usage: 12.5%, Prefix cache hit rate: 25.0%"
    )
    after = {**busy, "num_running": 0, "num_waiting": 0}
    last = line.line(after, 30.0)  # the interval after work: one more line, at zero
    assert last is not None and "Avg prompt throughput: 0.0 tokens/s" in last
    assert line.line(after, 40.0) is None


def test_access_log_has_a_line_for_each_response_errors_included(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/boom":
            raise RuntimeError("boom")
        status = 404 if scope["path"] == "/missing" else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def call(path: str) -> None:
        scope = {"type": "http", "method": "GET", "path": path, "client": ("10.0.0.1", 5)}

        async def send(message: Any) -> None:
            pass

        await AccessLog(app)(scope, None, send)  # type: ignore[arg-type]

    caplog.set_level(logging.INFO, logger="pagekv.access")
    asyncio.run(call("/ok"))
    asyncio.run(call("/missing"))
    with pytest.raises(RuntimeError):
        asyncio.run(call("/boom"))
    lines = [r.getMessage() for r in caplog.records if r.name == "pagekv.access"]
    assert len(lines) == 3
    assert lines[0].startswith('10.0.0.1:5 - "GET /ok HTTP/1.1" 200 OK ')
    assert '"GET /missing HTTP/1.1" 404 Not Found' in lines[1]
    assert '"GET /boom HTTP/1.1" 500 Internal Server Error' in lines[2]
    assert all(line.endswith(" ms") for line in lines)


def test_engine_requests_pass_priority_and_cache_salt_only_when_given() -> None:
    from pagekv.sampling_params import SamplingParams
    from pagekv.server.engine_loop import EngineRequest

    params = SamplingParams()
    assert EngineRequest("a", [1], params).options() == {}
    given = EngineRequest("a", [1], params, "c", priority=-2, cache_salt="tenant")
    assert given.options() == {"priority": -2, "cache_salt": "tenant"}
