"""``pagekv serve`` as a drop-in for ``vllm serve`` (issue #58), over real HTTP: several served
names, a root path, CORS, a chat template and a generation config from the command line,
vLLM's extra routes (/tokenize, /detokenize, /version, /ping, /v1/models/{id}), one streamed
chunk per choice, the request, access and stats log lines."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.support import (
    REPO,
    START_TIMEOUT_S,
    ServerProcess,
    free_port,
    nothing_in_use,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.model

API_KEY = "vllm-key"
ORIGIN = "http://allowed.example"
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
DEFAULT_TEMPERATURE = 0.25  # the generation config's


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("vllm")
    template = log_dir / "template.jinja"
    template.write_text(TEMPLATE)
    (log_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.25}))
    args = (
        "--num-kv-blocks", "256", "--max-num-seqs", "16",
        "--served-model-name", "alpha", "beta",
        "--root-path", "/api",
        "--allowed-origins", json.dumps([ORIGIN]),
        "--enable-log-requests",
        "--chat-template", str(template),
        "--generation-config", str(log_dir),
    )  # fmt: skip
    proc = start_server(log_dir, *args, api_key=API_KEY)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_every_served_name_is_accepted_and_the_first_reported(server: ServerProcess) -> None:
    listed = server.get("/v1/models").json()["data"]
    assert [card["id"] for card in listed] == ["alpha", "beta"]
    card = server.get("/v1/models/beta").json()
    assert card["id"] == "beta" and card["object"] == "model" and card["max_model_len"] > 0
    missing = server.get("/v1/models/zeta")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    body = {"model": "beta", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    answer = server.post("/v1/completions", body).json()
    assert answer["model"] == "alpha"
    wrong = server.post("/v1/completions", {**body, "model": "zeta"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model"


def test_the_app_answers_under_its_root_path_too(server: ServerProcess) -> None:
    assert server.get("/api/v1/models").json()["data"][0]["id"] == "alpha"
    assert server.get("/v1/models").status_code == 200  # a proxy that strips the prefix


def test_cors_lets_the_allowed_origin_in_and_keeps_the_json_rule(server: ServerProcess) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    ok = httpx.options(server.url + "/v1/completions", headers=preflight)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        server.url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"}
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    plain = httpx.post(
        server.url + "/v1/completions",
        content=b'{"prompt": "Hi"}',
        headers={**server.headers, "Origin": ORIGIN, "Content-Type": "text/plain"},
    )
    assert plain.status_code == 415
    assert plain.headers["access-control-allow-origin"] == ORIGIN


def test_tokenize_and_detokenize(server: ServerProcess) -> None:
    text = "The capital of France is Paris."
    got = server.post("/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert got["count"] == len(got["tokens"]) == len(got["token_strs"]) > 3
    assert got["max_model_len"] == server.get("/v1/models").json()["data"][0]["max_model_len"]
    assert server.post("/detokenize", {"tokens": got["tokens"]}).json() == {"prompt": text}
    bad = server.post("/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(server.url + "/tokenize", json={"prompt": text}).status_code == 401


def test_tokenize_renders_messages_with_the_chat_template(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    templated = "<user>Hi</user>\n<assistant>Hello, I</assistant>\n<assistant>"
    want = server.post("/tokenize", {"prompt": templated}).json()["tokens"]
    assert server.post("/tokenize", {"messages": messages}).json()["tokens"] == want
    opened = {"messages": messages, "add_generation_prompt": False}
    continued = server.post("/tokenize", {**opened, "continue_final_message": True}).json()
    cut = server.post("/tokenize", {"prompt": "<user>Hi</user>\n<assistant>Hello, I"}).json()
    assert continued["tokens"] == cut["tokens"]
    both = server.post("/tokenize", {"messages": messages, "continue_final_message": True})
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"


def test_chat_continues_the_final_message(client: openai.OpenAI, server: ServerProcess) -> None:
    messages: Any = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "My favourite color is"},
    ]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    reply = client.chat.completions.create(
        model="alpha", messages=messages, max_tokens=3, temperature=0, extra_body=extra
    )
    counted = server.post("/tokenize", {"messages": messages, **extra}).json()["count"]
    assert reply.usage is not None and reply.usage.prompt_tokens == counted


def test_version_and_ping(server: ServerProcess) -> None:
    assert re.fullmatch(r"\d+\.\d+.*", httpx.get(server.url + "/version").json()["version"])
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200


def test_streamed_n_sends_one_choice_per_chunk(client: openai.OpenAI) -> None:
    kwargs: Any = {"model": "alpha", "prompt": "Once upon a time", "max_tokens": 8, "n": 2}
    whole = client.completions.create(seed=11, **kwargs)
    chunks = list(client.completions.create(seed=11, stream=True, **kwargs))
    assert all(len(chunk.choices) == 1 for chunk in chunks)
    texts = {0: "", 1: ""}
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {c.index: c.text for c in whole.choices}
    chat = client.chat.completions.create(
        model="alpha",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        n=2,
        stream=True,
    )
    chat_chunks = list(chat)
    assert all(len(chunk.choices) == 1 for chunk in chat_chunks)
    assert {chunk.choices[0].index for chunk in chat_chunks} == {0, 1}


def test_response_format_constrains_a_completion(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    res = client.completions.create(
        model="alpha",
        prompt="Is the sky blue? Answer in JSON:",
        max_tokens=20,
        temperature=0,
        extra_body={"response_format": response_format},
    )
    assert json.loads(res.choices[0].text)["answer"] in ("yes", "no")


def test_tokens_as_token_ids(client: openai.OpenAI, server: ServerProcess) -> None:
    res = client.completions.create(
        model="alpha",
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    lp = res.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    ids = [int(token.removeprefix("token_id:")) for token in lp.tokens]
    assert server.post("/detokenize", {"tokens": ids}).json()["prompt"] == res.choices[0].text
    assert all(all(name.startswith("token_id:") for name in top) for top in lp.top_logprobs)


def test_unset_sampling_fields_take_the_generation_config(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    client.completions.create(model="alpha", prompt="Defaults", max_tokens=1)
    client.completions.create(model="alpha", prompt="Greedy", max_tokens=1, temperature=0)
    lines = [line for line in server.log_tail(200_000).splitlines() if "Received request" in line]
    assert f"temperature={DEFAULT_TEMPERATURE}," in lines[-2]
    assert "temperature=0," in lines[-1] or "temperature=0.0," in lines[-1]


def test_logs_have_a_line_per_response_and_the_stats_line(server: ServerProcess) -> None:
    server.get("/v1/no-such-route")
    server.post("/v1/completions", {"prompt": "Hi", "temperature": 7})
    log = server.log_tail(200_000)
    assert re.search(r'"GET /v1/no-such-route HTTP/1.1" 404 Not Found [\d.]+ ms', log)
    assert re.search(r'"POST /v1/completions HTTP/1.1" 400 Bad Request [\d.]+ ms', log)
    assert re.search(r'"POST /v1/completions HTTP/1.1" 200 OK [\d.]+ ms', log)
    assert re.search(r"Received request cmpl-\w+-0: prompt: \d+ tokens, params: ", log)
    # the stats line comes every 10 s while there is work: make some, then wait for it
    server.post("/v1/completions", {"prompt": "Tell me a story", "max_tokens": 64})
    assert wait_until(lambda: "Avg prompt throughput" in server.log_tail(200_000), 25, 0.5)
    stats = next(
        line for line in server.log_tail(200_000).splitlines() if "Avg prompt throughput" in line
    )
    assert re.search(
        r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
        r"[\d.]+ tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, .*KV cache usage: [\d.]+%",
        stats,
    )
    assert wait_until(lambda: nothing_in_use(server), timeout_s=30)


def test_startup_lines_name_the_model_kernels_and_kv_pool(server: ServerProcess) -> None:
    log = server.log_tail(200_000)
    for said in ("loading the model", "KV cache: 256 blocks", "engine ready in", "serving alpha"):
        assert said in log
    assert "unset sampling fields default to the model's generation config" in log


def test_https_with_a_self_signed_certificate(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    tls = start_tls_server(tmp_path, cert, key)
    trusted = ssl.create_default_context(cafile=str(cert))
    try:
        res = httpx.get(tls.url + "/v1/models", verify=trusted)
        assert res.status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
            httpx.get(tls.url.replace("https://", "http://") + "/health", timeout=5)
        tls_client = openai.OpenAI(
            base_url=tls.url + "/v1",
            api_key="unused",
            http_client=openai.DefaultHttpxClient(verify=trusted),
            max_retries=0,
        )
        done = tls_client.completions.create(model=res.json()["data"][0]["id"], prompt="Hi")
        assert done.choices[0].finish_reason in ("length", "stop")
        log = tls.log_tail(100_000)
        assert "https://127.0.0.1" in log
        assert '"GET /v1/models' not in log  # --uvicorn-log-level warning: no access lines
    finally:
        tls.stop()


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with ``cryptography``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def start_tls_server(log_dir: Path, cert: Path, key: Path) -> ServerProcess:
    """A server on HTTPS (``start_server`` waits on plain HTTP): /health answered over TLS."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagekv.cli", "serve", "--port", str(port), "--num-kv-blocks"]
    cmd += ["64", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    cmd += ["--uvicorn-log-level", "warning", "--disable-log-stats"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log_path = log_dir / "tls.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    server = ServerProcess(f"https://127.0.0.1:{port}", proc, log_path)
    probe = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=2)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if probe.get(server.url + "/health").status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"the TLS server did not start:\n{server.log_tail()}")


def test_responses_answer_as_chat_does(client: openai.OpenAI) -> None:
    kwargs: Any = {"model": "alpha", "temperature": 0}
    res = client.responses.create(
        input="Name a fruit.", instructions="Be brief.", max_output_tokens=6, **kwargs
    )
    chat = client.chat.completions.create(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a fruit."},
        ],
        max_tokens=6,
        **kwargs,
    )
    assert res.output_text == chat.choices[0].message.content
    assert res.usage is not None and chat.usage is not None
    assert res.usage.input_tokens == chat.usage.prompt_tokens
    assert res.usage.output_tokens == chat.usage.completion_tokens == 6
    assert res.status == "incomplete" and res.incomplete_details is not None
    assert res.incomplete_details.reason == "max_output_tokens"
    assert res.model == "alpha" and res.id.startswith("resp_")
    parts = client.responses.create(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}],
        instructions="Be brief.",
        max_output_tokens=6,
        **kwargs,
    )
    assert parts.output_text == res.output_text


def test_responses_stream_openais_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model="alpha", input="Count to five.", max_output_tokens=10, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response  # type: ignore[union-attr]
    assert deltas == done.output_text and len(deltas) > 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0]"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "Hi", "store": True}, "store"),
        ({"input": "Hi", "text": {"format": {"type": "bogus"}}}, "text.format"),
    ],
)
def test_responses_refuse_what_is_not_text(
    server: ServerProcess, body: dict[str, Any], param: str
) -> None:
    res = server.post("/v1/responses", {"model": "alpha", **body})
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "use_beam_search", True),
        ("/v1/completions", "spaces_between_special_tokens", False),
        ("/v1/completions", "truncate_prompt_tokens", 4),
        ("/v1/completions", "priority", 5),  # this server schedules fairly, not by priority
        ("/v1/chat/completions", "echo", True),
        ("/v1/chat/completions", "chat_template_kwargs", {"enable_thinking": False}),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ],
)
def test_vllm_fields_not_honoured_are_refused_by_name(
    server: ServerProcess, path: str, field: str, value: Any
) -> None:
    body: dict[str, Any] = {"model": "alpha", "max_tokens": 2}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    refused = server.post(path, {**body, field: value})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    neutral = {"use_beam_search": False, "priority": 0, "modalities": ["text"]}.get(field)
    assert server.post(path, {**body, field: neutral}).status_code == 200


def test_cache_salt_keeps_prefix_blocks_apart(server: ServerProcess) -> None:
    prompt = "A long shared preamble about the history of Paris and its bridges. " * 6
    body = {"model": "alpha", "prompt": prompt, "max_tokens": 1, "temperature": 0}

    def cached(**extra: Any) -> int:
        usage = server.post("/v1/completions", {**body, **extra}).json()["usage"]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    cached()
    assert cached() > 0  # the same prompt again: its full blocks are found
    assert cached(cache_salt="tenant-a") == 0  # another salt: nothing shared
    assert cached(cache_salt="tenant-a") > 0


def test_strict_tools_are_refused_where_calls_are_not_constrained(server: ServerProcess) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": True,
        },
    }
    body = {
        "model": "alpha",
        "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 24,
    }
    refused = server.post("/v1/chat/completions", {**body, "tools": [tool]})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "tools[0].function.strict"
    constrained = server.post(
        "/v1/chat/completions", {**body, "tools": [tool], "tool_choice": "required"}
    )
    assert constrained.status_code == 200


# ---- the routes a router calls on its workers (vllm-router 0.1.17's shapes) ------------------


def test_a_router_reads_load_server_and_model_info_without_a_key(server: ServerProcess) -> None:
    load = httpx.get(server.url + "/get_load", timeout=30).json()
    assert load["load"] == load["num_running"] + load["num_waiting"] + load["num_swapped"] >= 0
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["model_id"] == "alpha" and info["served_model_names"] == ["alpha", "beta"]
    assert info["kv_block_size"] == 16 and info["num_kv_blocks"] == 256
    model = httpx.get(server.url + "/get_model_info", timeout=30).json()
    assert model["is_generation"] is True and model["model_path"] == info["model_path"]
    assert model["max_model_len"] == info["max_model_len"] > 0
    for alias, same in (("/load", "/get_load"), ("/model_info", "/get_model_info")):
        assert (
            httpx.get(server.url + alias, timeout=30).json().keys()
            == {"/get_load": load, "/get_model_info": model}[same].keys()
        )
    vllm_form = httpx.get(server.url + "/server_info", timeout=30).json()["vllm_config"]
    assert vllm_form["model_config"]["model"] == "alpha"
    assert vllm_form["cache_config"]["block_size"] == 16


def test_load_counts_the_requests_in_the_engine(server: ServerProcess) -> None:
    """A long stream in flight is one request of load; when it ends, none."""
    body = {"model": "alpha", "prompt": "Count slowly:", "max_tokens": 400, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as res:
        lines = res.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it runs
        assert httpx.get(server.url + "/get_load", timeout=30).json()["load"] == 1
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/get_load", timeout=30).json()["load"] != 0:
        assert time.monotonic() < deadline, "the stream left by its client was never aborted"
        time.sleep(0.1)


def test_health_generate_runs_a_token_through_the_engine(server: ServerProcess) -> None:
    res = httpx.get(server.url + "/health_generate", timeout=60)
    assert res.status_code == 200 and res.json() == {"status": "ok", "num_tokens": 1}


def test_flush_cache_forgets_cached_blocks_and_needs_the_key(server: ServerProcess) -> None:
    prompt = "A long shared prefix for the flush test. " * 8
    server.post("/v1/completions", {"model": "alpha", "prompt": prompt, "max_tokens": 1})
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 401
    flushed = server.post("/flush_cache", {})
    assert flushed.status_code == 200 and flushed.json()["flushed_blocks"] >= 4
    assert server.post("/flush_cache", {}).json()["flushed_blocks"] == 0
