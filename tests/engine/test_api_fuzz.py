"""Fuzzing the offline API (issue #57): whatever ``SamplingParams``, ``LLM.generate`` and
``LLM.chat`` are given, they raise only pagekv's errors, leave no block allocated and nothing
queued, and, when they accept the input, generate valid token ids (never an "error" finish,
which only non-finite logits cause, and the default model's are finite).

Bounded by the hypothesis profile (tests/conftest.py: 200 examples, no deadline); valid numbers
are kept small (n, max_tokens) so that an example costs a few decode steps.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagekv.core.invariants import check_manager
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.errors import PagekvError
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel
from pagekv.sampling_params import MAX_N, MIN_TOP_P, SamplingParams

pytestmark = pytest.mark.model

VOCAB = 49152  # the default model's; a few ids past it are drawn on purpose

GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and infinities included
    st.text(max_size=5),
    st.binary(max_size=3),
    st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=2), st.none()), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
TINY = st.sampled_from([5e-324, 1e-300, 1e-40, 1e-30, 1.1754943508222875e-38])
HUGE = st.sampled_from([1e30, 1e38, 1e300, 1.7976931348623157e308])
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc80\ud800"])
TEXT = st.one_of(st.text(min_size=0, max_size=24), SURROGATES)
TOKEN_IDS = st.lists(st.integers(min_value=-2, max_value=VOCAB + 2), max_size=6)


def _or_garbage(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly ``valid``, sometimes anything."""
    return st.one_of(valid, valid, valid, GARBAGE)


# Valid-but-weird values for each field, small where they cost decode steps (max_tokens=None
# fills the test engine's 64-token context).
VALID: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(1, 2),
    "temperature": st.floats(0, 3) | TINY | HUGE,
    "top_p": st.floats(0, 1, exclude_min=True) | TINY,
    "top_k": st.none() | st.integers(1, 5) | st.sampled_from([-1, 10**9]),
    "min_p": st.floats(0, 1) | TINY,
    "seed": st.none() | st.integers(-(2**63), 2**64 - 1),
    "max_tokens": st.one_of(*[st.integers(1, 3)] * 7, st.none()),
    "min_tokens": st.integers(0, 1),
    "stop": st.none() | TEXT | st.lists(TEXT, max_size=3),
    "stop_token_ids": st.none() | st.lists(st.integers(0, VOCAB + 2), max_size=4),
    "ignore_eos": st.booleans(),
    "logprobs": st.none() | st.integers(0, 20),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0, 1e6, exclude_min=True) | TINY | HUGE,
}
# The same, or out of range, or garbage.
WILD: dict[str, st.SearchStrategy[Any]] = {
    **{name: _or_garbage(valid) for name, valid in VALID.items()},
    "n": _or_garbage(st.integers(1, 2) | st.sampled_from([0, MAX_N + 1, 10**6])),
    "best_of": _or_garbage(st.none() | st.integers(1, 3)),
    "top_k": _or_garbage(VALID["top_k"] | st.sampled_from([0, -2])),
    "max_tokens": _or_garbage(st.integers(-1, 3)),
    "min_tokens": _or_garbage(st.integers(-1, 4)),
    "logprobs": _or_garbage(st.integers(-1, 21)),
}
KWARGS = st.one_of(
    st.fixed_dictionaries({}, optional=VALID), st.fixed_dictionaries({}, optional=WILD)
)


def _params_or_error(kwargs: dict[str, Any]) -> SamplingParams | None:
    try:
        return SamplingParams(**kwargs)
    except PagekvError:
        return None


@given(KWARGS)
def test_sampling_params_raise_only_pagekv_errors(kwargs: dict[str, Any]) -> None:
    params = _params_or_error(kwargs)
    event("refused" if params is None else "accepted")
    if params is None:
        return
    assert all(isinstance(s, str) and s for s in params.stop)
    assert all(type(t) is int and t >= 0 for t in params.stop_token_ids)
    assert MIN_TOP_P <= params.top_p <= 1 and 1 <= params.num_branches <= MAX_N
    assert math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0
    assert params.clone() == params  # and a copy of it is the same params


@pytest.fixture(scope="module")
def llm(loaded: LoadedModel) -> LLM:
    config = EngineConfig(num_kv_blocks=64, check_invariants=True, max_model_len=64)
    return LLM.from_engine(LLMEngine(config, loaded))


def _check_after(llm: LLM, outputs: object) -> None:
    """Nothing left behind; accepted input gave valid tokens and finite logprobs."""
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["num_waiting"] == stats["num_running"] == stats["num_swapped"] == 0
    assert not llm.engine.has_unfinished_requests()
    check_manager(llm.engine.kv)
    for out in outputs or []:  # type: ignore[attr-defined]
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length"), c
            assert all(0 <= t < VOCAB for t in c.token_ids)
            assert c.cumulative_logprob is None or math.isfinite(c.cumulative_logprob)
            for entry in c.logprobs or []:
                assert all(math.isfinite(v.logprob) for v in entry.values())


PROMPT = st.one_of(
    st.text(min_size=1, max_size=24),
    TEXT,
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=6)}),
    st.fixed_dictionaries({"prompt_token_ids": TOKEN_IDS | GARBAGE}),
    st.fixed_dictionaries({"prompt": TEXT | GARBAGE}),
    GARBAGE,
)
PROMPTS = st.one_of(PROMPT, st.lists(PROMPT, max_size=3))
# A SamplingParams from fuzzed fields, a list of them, or garbage.
PARAMS = st.one_of(
    st.none(),
    st.fixed_dictionaries({}, optional=VALID).map(_params_or_error),
    KWARGS.map(_params_or_error),
    st.lists(KWARGS.map(_params_or_error), max_size=3),
    GARBAGE,
)
HEALTH = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@HEALTH
@given(prompts=PROMPTS, params=PARAMS)
def test_generate_raises_only_pagekv_errors_and_leaves_nothing(
    llm: LLM, prompts: Any, params: Any
) -> None:
    outputs = None
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except PagekvError as exc:
        event(f"refused: {type(exc).__name__} {getattr(exc, 'param', '')}")
    else:
        event("generated")
    _check_after(llm, outputs)


MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=24)}),
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool"]) | GARBAGE,
            "content": TEXT | GARBAGE,
        }
    ),
    st.fixed_dictionaries({"role": st.just("user")}),
    GARBAGE,
)
CONVERSATION = st.lists(MESSAGE, max_size=3)
CHAT = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=24)}
)
MESSAGES = st.one_of(
    st.lists(CHAT, min_size=1, max_size=3),
    st.lists(st.lists(CHAT, min_size=1, max_size=2), min_size=1, max_size=2),
    CONVERSATION,
    st.lists(CONVERSATION, max_size=2),
    TEXT,
    GARBAGE,
)
VALID_PARAMS = st.fixed_dictionaries({}, optional=VALID).map(_params_or_error)


@HEALTH
@given(messages=MESSAGES, params=VALID_PARAMS | PARAMS)
def test_chat_raises_only_pagekv_errors_and_leaves_nothing(
    llm: LLM, messages: Any, params: Any
) -> None:
    outputs = None
    try:
        outputs = llm.chat(messages, params, use_tqdm=False)
    except PagekvError as exc:
        event(f"refused: {type(exc).__name__} {getattr(exc, 'param', '')}")
    else:
        event("generated")
    _check_after(llm, outputs)
