"""Structured output and tool calls over HTTP with the official ``openai`` client: 200 requests
under 5 JSON schemas, each output valid (``jsonschema``); regex and choice constraints; rows
without a constraint bit-identical beside constrained ones; tool calls (required, a named
function, auto) parsed into ``tool_calls``, streamed and not; nothing left allocated."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from pagekv.kernels import isa
from tests.engine.test_structured_output import CHOICES, QUESTIONS, REGEX, SCHEMAS
from tests.server.support import ServerProcess, nothing_in_use, start_server, wait_until

pytestmark = pytest.mark.model

NUM_REQUESTS = 200
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 12}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("server"), "--max-num-seqs", "32")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def model_of(client: OpenAI) -> str:
    return client.models.list().data[0].id


def schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_200_requests_under_5_schemas_all_validate(client: OpenAI, server: ServerProcess) -> None:
    model = model_of(client)

    def ask(i: int) -> tuple[int, str, str | None]:
        schema = SCHEMAS[i % len(SCHEMAS)]
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
            response_format=schema_format(schema),
            temperature=0.7 if i % 2 else 0,
            seed=i,
            max_tokens=96,
        )
        choice = reply.choices[0]
        return i, choice.message.content or "", choice.finish_reason

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(NUM_REQUESTS)))
    for i, content, finish_reason in answers:
        assert finish_reason == "stop", (i, content)
        jsonschema.validate(json.loads(content), SCHEMAS[i % len(SCHEMAS)])
    assert wait_until(lambda: nothing_in_use(server), timeout_s=10)


def test_regex_and_choice_constraints(client: OpenAI) -> None:
    model = model_of(client)
    for question in QUESTIONS:
        text = client.completions.create(
            model=model,
            prompt=question,
            max_tokens=30,
            temperature=0,
            extra_body={"guided_regex": REGEX},
        )
        assert re.fullmatch(REGEX, text.choices[0].text), text.choices[0].text
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=10,
            temperature=0.8,
            extra_body={"structured_outputs": {"choice": list(CHOICES)}},
        )
        assert reply.choices[0].message.content in CHOICES


def test_rows_without_a_constraint_are_bit_identical_beside_constrained_ones(
    client: OpenAI,
) -> None:
    model = model_of(client)

    def plain(question: str) -> str:
        reply = client.completions.create(
            model=model, prompt=question, max_tokens=32, temperature=0, logprobs=1
        )
        lp = reply.choices[0].logprobs
        assert lp is not None
        return json.dumps([reply.choices[0].text, lp.token_logprobs])

    alone = [plain(q) for q in QUESTIONS]

    def constrained(i: int) -> None:
        client.completions.create(
            model=model,
            prompt=QUESTIONS[i % len(QUESTIONS)],
            max_tokens=48,
            temperature=0,
            extra_body={"guided_json": SCHEMAS[i % len(SCHEMAS)]},
        )

    with ThreadPoolExecutor(12) as pool:
        busy = [pool.submit(constrained, i) for i in range(8)]
        beside = list(pool.map(plain, QUESTIONS))
        for future in busy:
            future.result()
    if isa.selected() is not None:  # the kernels: a row's sums do not depend on its batch
        assert beside == alone
        return
    # kernels off (PAGEKV_CPU_ISA=none): torch's matmuls sum a row in an order that depends
    # on the batch's size, so the same greedy text with log-probabilities a rounding apart
    for here, there in zip(alone, beside, strict=True):
        (text, logprobs), (text_beside, logprobs_beside) = json.loads(here), json.loads(there)
        assert text_beside == text
        assert logprobs_beside == pytest.approx(logprobs, abs=1e-3)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_tool_calls_are_parsed(client: OpenAI, stream: bool, tool_choice: str) -> None:
    choice: Any = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "get_weather"}}
    request: dict[str, Any] = {
        "model": model_of(client),
        "messages": WEATHER,
        "tools": TOOLS,
        "tool_choice": choice,
        "temperature": 0,
        "max_tokens": 120,
    }
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in client.chat.completions.create(**request, stream=True):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            assert not delta.content
            for call in delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                assert call.function is not None
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        found = [calls[i] for i in sorted(calls)]
    else:
        reply = client.chat.completions.create(**request)
        finish = reply.choices[0].finish_reason
        assert reply.choices[0].message.content is None
        message_calls = reply.choices[0].message.tool_calls or []
        assert all(c.id.startswith("call_") and c.type == "function" for c in message_calls)
        found = [
            {"name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
            for c in message_calls
        ]
    assert finish == "tool_calls"
    assert found, "no tool call"
    if tool_choice == "named":
        assert [c["name"] for c in found] == ["get_weather"]
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in found:
        jsonschema.validate(json.loads(call["arguments"]), by_name[call["name"]])


def test_tool_choice_auto_and_none(client: OpenAI) -> None:
    """``auto``: a text answer or parsed calls, never the raw tags; ``none``: plain text."""
    model = model_of(client)
    for tool_choice in ("auto", "none"):
        reply = client.chat.completions.create(
            model=model,
            messages=WEATHER,
            tools=TOOLS,
            tool_choice=tool_choice,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=60,
        )
        message = reply.choices[0].message
        if message.tool_calls:
            assert tool_choice == "auto" and reply.choices[0].finish_reason == "tool_calls"
            assert "<tool_call>" not in (message.content or "")
        else:
            assert message.content


def test_a_conversation_with_a_tool_result(client: OpenAI) -> None:
    """The assistant's call and the tool's answer go back through the template."""
    messages: list[Any] = [
        *WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    reply = client.chat.completions.create(
        model=model_of(client), messages=messages, tools=TOOLS, temperature=0, max_tokens=30
    )
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls
