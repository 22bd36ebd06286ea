"""The OpenAI-compatible server over real HTTP, with the official ``openai`` client.

One ``pagekv serve`` process per module (small KV pool, an API key). Greedy texts must equal
the offline ``LLM`` on the same weights and the same engine settings.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.llm import LLM
from pagekv.sampling_params import SamplingParams
from tests.server.support import ServerProcess, nothing_in_use, start_server, wait_until

pytestmark = pytest.mark.model

NUM_BLOCKS = 256
API_KEY = "test-key"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("server")
    args = ("--num-kv-blocks", str(NUM_BLOCKS), "--max-num-seqs", "32")
    proc = start_server(log_dir, *args, api_key=API_KEY)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The server's engine offline: the default model with the same (default) settings."""
    return LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=NUM_BLOCKS)))


def offline(llm: LLM, prompt: str | list[int], **kwargs: object) -> str:
    params = SamplingParams(temperature=0, **kwargs)  # type: ignore[arg-type]
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def test_models_lists_the_one_model(client: openai.OpenAI, model: str) -> None:
    assert [m.id for m in client.models.list().data] == [model]
    assert model.startswith("SmolLM2")


def test_greedy_completions_equal_offline(client: openai.OpenAI, model: str, llm: LLM) -> None:
    res = client.completions.create(model=model, prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert [c.text for c in res.choices] == [offline(llm, p, max_tokens=16) for p in PROMPTS]
    assert all(c.finish_reason == "length" for c in res.choices)
    assert res.usage is not None and res.usage.completion_tokens == 48
    tokenizer = llm.get_tokenizer()
    assert res.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)


def test_streamed_completion_concatenates_to_the_whole(client: openai.OpenAI, model: str) -> None:
    kwargs = {"model": model, "prompt": PROMPTS[2], "max_tokens": 20, "temperature": 0}
    whole = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)  # type: ignore[call-overload]
    )
    assert len(chunks) > 3  # really streamed, not one blob
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_equals_offline_chat_streamed_or_not(
    client: openai.OpenAI, model: str, llm: LLM
) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    res = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=24,
        temperature=0,
    )
    assert res.object == "chat.completion"
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == expected[0].outputs[0].text
    stream = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected[0].outputs[0].text


def test_n2_greedy_and_seeded(client: openai.OpenAI, model: str, llm: LLM) -> None:
    res = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, n=2
    )
    assert [c.index for c in res.choices] == [0, 1]
    assert [c.text for c in res.choices] == [offline(llm, PROMPTS[0], max_tokens=8)] * 2
    kwargs = {"model": model, "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 1.0}
    a = client.completions.create(n=2, seed=1234, **kwargs)  # type: ignore[call-overload]
    b = client.completions.create(n=2, seed=1234, **kwargs)  # type: ignore[call-overload]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    chat = [
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=10,
            temperature=1.0,
            seed=99,
            n=2,
        )
        for _ in range(2)
    ]
    assert [len(r.choices) for r in chat] == [2, 2]
    assert [c.message.content for c in chat[0].choices] == [
        c.message.content for c in chat[1].choices
    ]


def test_completion_logprobs(client: openai.OpenAI, model: str, llm: LLM) -> None:
    res = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3
    )
    lp = res.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == res.choices[0].text
    ref = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert ref.logprobs is not None
    for got, token_id, entry in zip(lp.token_logprobs, ref.token_ids, ref.logprobs, strict=True):
        assert got == pytest.approx(entry[token_id].logprob, abs=1e-3)
    for tops, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert 3 <= len(tops) <= 4 and max(tops.values()) == pytest.approx(chosen)  # greedy


def test_chat_top_logprobs(client: openai.OpenAI, model: str) -> None:
    res = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = res.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == res.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the top token
        assert entry.bytes == list(entry.token.encode())


def test_stop_strings_streamed_or_not(client: openai.OpenAI, model: str, llm: LLM) -> None:
    full = offline(llm, PROMPTS[1], max_tokens=32)
    stop = full.strip().split()[2]  # a word the greedy text reaches
    expected = offline(llm, PROMPTS[1], max_tokens=32, stop=(stop,))
    assert len(expected) < len(full) and stop not in expected
    kwargs = {"model": model, "prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0}
    res = client.completions.create(stop=[stop], **kwargs)  # type: ignore[call-overload]
    assert res.choices[0].text == expected
    assert res.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stop=stop, stream=True, **kwargs))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_prompt_forms_and_cached_tokens(client: openai.OpenAI, model: str, llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    by_text = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    by_lists = client.completions.create(
        model=model, prompt=[ids, ids], max_tokens=6, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.text for c in by_lists.choices] == [by_text.choices[0].text] * 2
    long_prompt = "pagekv maps every request's tokens to fixed-size blocks. " * 8  # > 2 blocks
    first = client.completions.create(model=model, prompt=long_prompt, max_tokens=2)
    again = client.completions.create(model=model, prompt=long_prompt, max_tokens=2)
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= 16 and details.cached_tokens % 16 == 0


def test_vllm_extra_body_parameters(client: openai.OpenAI, model: str, llm: LLM) -> None:
    kwargs = {"model": model, "prompt": PROMPTS[0], "max_tokens": 24}
    res = client.completions.create(temperature=0, extra_body={"ignore_eos": True}, **kwargs)  # type: ignore[call-overload]
    assert res.usage.completion_tokens == 24
    ref = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    stop_id = ref[0].outputs[0].token_ids[2]
    res = client.completions.create(
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
        **kwargs,  # type: ignore[arg-type]
    )
    assert res.choices[0].finish_reason == "stop"
    assert res.usage is not None and res.usage.completion_tokens <= 3
    top1 = client.completions.create(temperature=1.0, extra_body={"top_k": 1}, **kwargs)  # type: ignore[call-overload]
    assert top1.choices[0].text == offline(llm, PROMPTS[0], max_tokens=24)
    min_p = client.completions.create(temperature=1.0, extra_body={"min_p": 0.99}, **kwargs)  # type: ignore[call-overload]
    assert min_p.choices[0].text == top1.choices[0].text  # min_p near 1 keeps only the top


def test_penalties_equal_offline(client: openai.OpenAI, model: str, llm: LLM) -> None:
    prompt = "1, 2, 3, 4, 5,"
    plain = offline(llm, prompt, max_tokens=24)
    res = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        frequency_penalty=0.8,
        presence_penalty=0.5,
        extra_body={"repetition_penalty": 1.2},
    )
    expected = offline(
        llm,
        prompt,
        max_tokens=24,
        frequency_penalty=0.8,
        presence_penalty=0.5,
        repetition_penalty=1.2,
    )
    assert res.choices[0].text == expected != plain
    messages = [{"role": "user", "content": "Count from 1 to 20."}]
    chat = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=24,
        temperature=0,
        presence_penalty=1.0,
    )
    params = SamplingParams(temperature=0, max_tokens=24, presence_penalty=1.0)
    expected_chat = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    assert chat.choices[0].message.content == expected_chat


def test_no_block_is_left_in_use(server: ServerProcess) -> None:
    assert wait_until(lambda: nothing_in_use(server), timeout_s=5)


def test_kv_map_cli_writes_a_png(server: ServerProcess, tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "map.png"
    cmd = [sys.executable, "-m", "pagekv.cli", "kv-map", "--url", server.url, "--out", str(out)]
    if server.api_key:  # the block map needs the key, as every debug page
        cmd += ["--api-key", server.api_key]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"{NUM_BLOCKS} blocks" in result.stdout
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
