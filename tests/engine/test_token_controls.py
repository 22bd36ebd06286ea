"""The engine's token controls (vLLM's ``logit_bias``, ``allowed_token_ids``, ``bad_words``),
its ``metrics``, and the typed errors of bad values, on the real default model."""

from __future__ import annotations

import time
from typing import Any

import pytest

from pagekv import InvalidRequestError, SamplingParams
from pagekv.core.invariants import check_manager, check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"
STORY = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture
def llm(loaded: LoadedModel) -> LLM:
    return LLM.from_engine(
        LLMEngine(EngineConfig(num_kv_blocks=256, check_invariants=True), loaded)
    )


def greedy(max_tokens: int = 12, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_logit_bias_forces_a_token_under_greedy(llm: LLM) -> None:
    (plain,) = llm.generate(PROMPT, greedy(logprobs=3), use_tqdm=False)
    forced = llm.engine.tokenizer.encode(" banana")[0]
    assert forced not in plain.outputs[0].token_ids
    (out,) = llm.generate(PROMPT, greedy(logit_bias={str(forced): 100}, logprobs=3), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == [forced] * 12
    # logprobs are the raw distribution's (before the bias), as vLLM reports them by default
    assert completion.logprobs is not None and plain.outputs[0].logprobs is not None
    first, raw_first = completion.logprobs[0], plain.outputs[0].logprobs[0]
    assert [t for t in first if t != forced] == list(raw_first)  # the raw top 3
    for t in raw_first:
        assert first[t].logprob == pytest.approx(raw_first[t].logprob, abs=1e-5)
    assert first[forced].logprob < -5 and first[forced].rank is not None and first[forced].rank > 3
    check_no_leak(llm.engine.kv)


def test_a_negative_bias_bans_the_greedy_token(llm: LLM) -> None:
    (plain,) = llm.generate(PROMPT, greedy(), use_tqdm=False)
    first = plain.outputs[0].token_ids[0]
    (out,) = llm.generate(PROMPT, greedy(logit_bias={first: -100}), use_tqdm=False)
    assert out.outputs[0].token_ids[0] != first
    assert first not in out.outputs[0].token_ids


def test_allowed_token_ids_restrict_sampled_output(llm: LLM) -> None:
    allowed = llm.engine.tokenizer.encode(" yes no maybe")
    params = SamplingParams(
        n=4, temperature=1.5, seed=3, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed
    )
    (out,) = llm.generate(STORY, params, use_tqdm=False)
    tokens = [t for c in out.outputs for t in c.token_ids]
    assert len(tokens) == 64 and set(tokens) <= set(allowed)
    assert len(set(tokens)) > 1  # sampled, not stuck on one
    check_no_leak(llm.engine.kv)


def test_bad_words_are_never_completed(llm: LLM) -> None:
    tokenizer = llm.engine.tokenizer
    (plain,) = llm.generate(PROMPT, greedy(24), use_tqdm=False)
    text = plain.outputs[0].text
    assert "Paris" in text
    (out,) = llm.generate(PROMPT, greedy(24, bad_words=["Paris"]), use_tqdm=False)
    assert "Paris" not in out.outputs[0].text
    # a word of several tokens, its tokens the only ones allowed: completed without the ban,
    # never with it (its last token is barred right after the rest of it)
    word = "moonlight"  # " moon" "light" (and "moon" "light" at the start of a text)
    ids = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
    assert len(ids) > 1, "the test needs a word of several tokens"
    for bad_words, completed in (([], True), ([word], False)):
        params = greedy(16, allowed_token_ids=ids, bad_words=bad_words)
        tokens = llm.generate(STORY, params, use_tqdm=False)[0].outputs[0].token_ids
        windows = {tuple(tokens[i : i + len(ids)]) for i in range(len(tokens))}
        assert (ids in windows) is completed, tokens
    check_no_leak(llm.engine.kv)


def test_metrics_are_vllms_request_state_stats(llm: LLM) -> None:
    before_wall, before = time.time(), time.monotonic()
    (out,) = llm.generate(PROMPT, greedy(8), use_tqdm=False)
    m = out.metrics
    assert m is not None
    assert before_wall <= m.arrival_time <= time.time()
    assert before <= m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts
    assert m.last_token_ts <= time.monotonic()
    assert 0 < m.first_token_latency < time.time() - before_wall + 1e-3
    assert m.num_generation_tokens == 8 and m.num_preemptions == 0 and not m.is_corrupted


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
        ({"logit_bias": {"49152": 1.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(2**16 + 1)}}, "logit_bias"),
        ({"allowed_token_ids": [49152]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1.5]}, "allowed_token_ids"),
        ({"allowed_token_ids": iter(range(2**18 + 1))}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["   "]}, "bad_words"),
        ({"bad_words": ["w"] * 65}, "bad_words"),
        ({"bad_words": [1]}, "bad_words"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "prompt_logprobs": 0, "min_tokens": 1}, "min_tokens"),
        ({"max_tokens": -1, "prompt_logprobs": 0}, "max_tokens"),
    ],
)
def test_bad_token_controls_raise_typed_errors_and_leave_nothing(
    llm: LLM, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(PROMPT, SamplingParams(**kwargs), use_tqdm=False)
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats()["kv_blocks_used"] == 0
    check_manager(llm.engine.kv)
    (out,) = llm.generate(PROMPT, greedy(2), use_tqdm=False)  # the engine goes on
    assert len(out.outputs[0].token_ids) == 2
