"""Scoring prompts over HTTP, as evaluation harnesses do (lm-evaluation-harness's
``local-completions``: ``echo: true, logprobs: 1, max_tokens: 0 or 1``, prompts as token ids):
the prompt's text and per-token logprobs in OpenAI's legacy shape, vLLM's ``prompt_logprobs``,
and ``logit_bias``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.support import ServerProcess, nothing_in_use, start_server, wait_until

pytestmark = pytest.mark.model

PROMPT = "The capital of France is Paris"
CONTEXT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("scoring"), "--num-kv-blocks", "256")
    yield proc
    proc.stop()


def complete(server: ServerProcess, **body: Any) -> dict[str, Any]:
    res = server.post("/v1/completions", {"temperature": 0, **body})
    assert res.status_code == 200, res.text
    data: dict[str, Any] = res.json()
    return data


def ids_of(server: ServerProcess, text: str) -> list[int]:
    tokens: list[int] = server.post("/tokenize", {"prompt": text}).json()["tokens"]
    return tokens


def test_echo_scores_the_prompt_as_legacy_completions_do(server: ServerProcess) -> None:
    ids = ids_of(server, PROMPT)
    choice = complete(server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == PROMPT and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert lp["text_offset"] == offsets
    for token, value, top in zip(
        lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True
    ):
        assert top[token] == value and 1 <= len(top) <= 2  # the token and the top one
        assert max(top.values()) >= value
    # the last token's score is what generating it from the context gives
    generated = complete(server, prompt=CONTEXT, max_tokens=1, logprobs=5)["choices"][0]
    assert generated["text"] == " Paris"
    assert lp["token_logprobs"][-1] == pytest.approx(
        generated["logprobs"]["token_logprobs"][0], abs=1e-3
    )
    raw = choice["prompt_logprobs"]
    assert raw[0] is None and len(raw) == len(ids)
    for token_id, entry in zip(ids[1:], raw[1:], strict=True):
        assert entry[str(token_id)]["rank"] >= 1 and "decoded_token" in entry[str(token_id)]


def test_a_batch_of_token_id_prompts_with_one_token_more(server: ServerProcess) -> None:
    """lm-evaluation-harness's request: context + continuation ids, echo, max_tokens 1."""
    long_ids, short_ids = ids_of(server, PROMPT), ids_of(server, CONTEXT)
    body = {"prompt": [long_ids, short_ids], "echo": True, "logprobs": 1, "max_tokens": 1}
    data = complete(server, **body)
    by_index = sorted(data["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in by_index] == [0, 1]
    whole = by_index[0]["logprobs"]
    assert len(whole["token_logprobs"]) == len(long_ids) + 1
    assert by_index[0]["text"].startswith(PROMPT)
    # the continuation " Paris" scored inside the long prompt = generated after the short one
    continuation = whole["token_logprobs"][len(short_ids) : -1]
    after_short = by_index[1]["logprobs"]
    assert by_index[1]["text"] == CONTEXT + " Paris"
    assert continuation == pytest.approx(after_short["token_logprobs"][-1:], abs=1e-3)
    assert after_short["text_offset"][-1] == len(CONTEXT)  # offsets run on into the completion
    assert data["usage"]["prompt_tokens"] == len(long_ids) + len(short_ids)
    assert data["usage"]["completion_tokens"] == 2


def test_echo_without_logprobs_and_prompt_logprobs_alone(server: ServerProcess) -> None:
    plain = complete(server, prompt=PROMPT, echo=True, max_tokens=0)["choices"][0]
    assert plain["text"] == PROMPT and plain["logprobs"] is None
    assert "prompt_logprobs" not in plain
    ids = ids_of(server, PROMPT)
    scored = complete(server, prompt=PROMPT, prompt_logprobs=2, max_tokens=1)["choices"][0]
    assert not scored["text"].startswith(PROMPT) and scored["logprobs"] is None
    raw = scored["prompt_logprobs"]
    assert raw[0] is None and len(raw) == len(ids)
    for token_id, entry in zip(ids[1:], raw[1:], strict=True):
        assert str(token_id) in entry and 1 <= len(entry) <= 3
        assert sorted(e["rank"] for e in entry.values())[0] == 1 or len(entry) == 1


def test_a_streamed_echo_sends_the_prompt_first(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    whole = complete(server, **body)["choices"][0]
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as res:
        for line in res.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    assert all("prompt_logprobs" not in c for c in chunks)


def test_token_ids_name_prompt_tokens_too(server: ServerProcess) -> None:
    ids = ids_of(server, PROMPT)
    body = {"echo": True, "logprobs": 0, "max_tokens": 0, "return_tokens_as_token_ids": True}
    lp = complete(server, prompt=PROMPT, **body)["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{i}" for i in ids]


def test_logit_bias_steers_the_choice(server: ServerProcess) -> None:
    paris = ids_of(server, " Paris")[0]
    free = complete(server, prompt=CONTEXT, max_tokens=1)["choices"][0]["text"]
    assert free == " Paris"
    banned = complete(server, prompt=CONTEXT, max_tokens=1, logit_bias={str(paris): -100})
    assert banned["choices"][0]["text"] != " Paris"
    forced = complete(server, prompt="Hello", max_tokens=3, logit_bias={str(paris): 100})
    assert forced["choices"][0]["text"] == " Paris Paris Paris"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        (
            {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0, "prompt_logprobs": 99},
            "prompt_logprobs",
        ),
        ({"prompt": PROMPT, "logit_bias": {"the": 1}}, "logit_bias"),
        ({"prompt": PROMPT, "logit_bias": {"999999999": 1}}, "logit_bias"),
    ],
)
def test_scoring_requests_that_cannot_be_honoured(
    server: ServerProcess, body: dict[str, Any], param: str
) -> None:
    res = server.post("/v1/completions", body)
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param
    assert wait_until(lambda: nothing_in_use(server), timeout_s=30)


def test_chat_prompt_logprobs_come_beside_the_choices(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 1}
    res = server.post("/v1/chat/completions", body).json()
    raw = res["prompt_logprobs"]
    assert raw[0] is None and len(raw) == res["usage"]["prompt_tokens"]
    assert all(len(entry) in (1, 2) for entry in raw[1:])
    assert "prompt_logprobs" not in res["choices"][0]
    streamed = server.post("/v1/chat/completions", {**body, "stream": True})
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"
