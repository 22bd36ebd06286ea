"""The offline API under hostile input (issue #57): each bad input raises a pagekv error and
leaves nothing behind; values at the edge of what float32 holds sample sensibly; a request
whose logits are not finite anyway ends with finish_reason "error", alone.

Table-driven: one row per input. ``tests/engine/test_api_fuzz.py`` throws random ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pagekv import InvalidRequestError, SamplingParams
from pagekv.core.invariants import check_manager
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.engine.outputs import FINISH_ERROR, RequestOutput
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel
from pagekv.runner.sampler import Sampler, SamplerOutput, SamplingRow
from pagekv.sampling_params import MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

pytestmark = pytest.mark.model

CONTEXT_TOKENS = 64  # small, so that max_tokens=None stays quick
PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(loaded: LoadedModel) -> LLM:
    config = EngineConfig(num_kv_blocks=64, check_invariants=True, max_model_len=CONTEXT_TOKENS)
    return LLM.from_engine(LLMEngine(config, loaded))


def assert_untouched(llm: LLM) -> None:
    """No block allocated, nothing queued or running."""
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["num_waiting"] == stats["num_running"] == stats["num_swapped"] == 0
    assert not llm.engine.has_unfinished_requests()
    check_manager(llm.engine.kv)


def assert_sane(llm: LLM, outputs: list[RequestOutput]) -> None:
    vocab = llm.engine.loaded.config.vocab_size
    for out in outputs:
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length"), c
            assert all(0 <= t < vocab for t in c.token_ids)


def generate(llm: LLM, params: SamplingParams, prompt: str = PROMPT) -> list[int]:
    outputs = llm.generate(prompt, params, use_tqdm=False)
    assert_sane(llm, outputs)
    assert_untouched(llm)
    return outputs[0].outputs[0].token_ids


# ---- bad input: a typed error naming the parameter, nothing left behind ----------------------

BAD_PARAMS: list[tuple[dict[str, Any], str]] = [
    ({"stop": 5}, "stop"),
    ({"stop": b"ab"}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop": [5]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["\ud800"]}, "stop"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": range(10**9)}, "stop_token_ids"),  # read no further than the cap
    ({"n": MAX_N + 1}, "n"),
    ({"n": 10**6}, "n"),
    ({"n": 2, "best_of": MAX_N + 1}, "best_of"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"max_tokens": 1.0}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": None}, "top_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1e-300}, "repetition_penalty"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"min_tokens": None}, "min_tokens"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_PARAMS)
def test_bad_sampling_params_raise_naming_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in str(info.value)


def test_vllm_spellings_of_off_are_accepted() -> None:
    params = SamplingParams(stop=None, stop_token_ids=None, top_k=-1, max_tokens=None)
    assert params.stop == () and params.stop_token_ids == () and params.top_k is None
    assert params.until_context
    assert SamplingParams(stop="a").stop == ("a",)
    assert SamplingParams(stop=iter(["a", "b"])).stop == ("a", "b")


def test_values_float32_cannot_hold_are_clamped_to_the_same_meaning() -> None:
    assert SamplingParams(top_p=5e-324).top_p == 2.0**-126
    assert SamplingParams(repetition_penalty=1e-300).repetition_penalty == 1e-30
    assert SamplingParams(repetition_penalty=1e300).repetition_penalty == 1e30
    assert SamplingParams(top_p=0.5, repetition_penalty=1.2) == SamplingParams(
        top_p=0.5, repetition_penalty=1.2
    )  # ordinary values stay as given


def _chat(llm: LLM, messages: object, params: object = GREEDY) -> Any:
    return llm.chat(messages, params, use_tqdm=False)  # type: ignore[arg-type]


def _gen(llm: LLM, prompts: object, params: object = GREEDY) -> Any:
    return llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]


USER = {"role": "user", "content": "Hi"}
BAD_CALLS: list[tuple[str, Callable[[LLM], object], str]] = [
    ("lone surrogate", lambda llm: _gen(llm, "\ud800"), "prompt"),
    ("surrogate in a batch", lambda llm: _gen(llm, ["fine", "a\udfffb"]), "prompt"),
    ("surrogate in a dict", lambda llm: _gen(llm, {"prompt": "\ud800"}), "prompt"),
    ("params as a dict", lambda llm: _gen(llm, ["a", "b"], {"temperature": 0}), "sampling_params"),
    ("too few params", lambda llm: _gen(llm, ["a", "b"], [GREEDY]), "sampling_params"),
    ("too many params", lambda llm: _gen(llm, "a", [GREEDY, GREEDY]), "sampling_params"),
    ("params of strings", lambda llm: _gen(llm, ["a"], ["greedy"]), "sampling_params"),
    ("params a string", lambda llm: _gen(llm, ["a"], "greedy"), "sampling_params"),
    ("prompts of floats", lambda llm: _gen(llm, [1.5, 2.5]), "prompt"),  # [1, 2, 3]: one prompt
    ("prompt an int", lambda llm: _gen(llm, 7), "prompt"),
    ("prompt None", lambda llm: _gen(llm, None), "prompt"),
    ("prompts with None", lambda llm: _gen(llm, ["a", None]), "prompt"),
    ("prompt bytes", lambda llm: _gen(llm, [b"ab"]), "prompt"),
    ("ids not a list", lambda llm: _gen(llm, {"prompt_token_ids": "12"}), "prompt"),
    ("min_tokens past the room", lambda llm: _gen(llm, PROMPT, _until(min_tokens=60)), ""),
    ("chat a string", lambda llm: _chat(llm, "hello"), "messages"),
    ("chat None", lambda llm: _chat(llm, None), "messages"),
    ("chat one dict", lambda llm: _chat(llm, USER), "messages"),
    ("chat empty", lambda llm: _chat(llm, []), "messages"),
    ("chat empty conversation", lambda llm: _chat(llm, [[]]), "messages"),
    ("chat list of strings", lambda llm: _chat(llm, ["hello"]), "messages[0]"),
    ("chat mixed", lambda llm: _chat(llm, [USER, "hello"]), "messages"),
    ("chat no content", lambda llm: _chat(llm, [{"role": "user"}]), "messages[0].content"),
    ("chat bad role", lambda llm: _chat(llm, [{"role": 5, "content": "x"}]), "messages[0].role"),
    ("chat surrogate", lambda llm: _chat(llm, [{"role": "user", "content": "\ud800"}]), "prompt"),
    ("chat params dict", lambda llm: _chat(llm, [USER], {"n": 2}), "sampling_params"),
    ("chat params length", lambda llm: _chat(llm, [[USER], [USER]], [GREEDY]), "sampling_params"),
    ("chat tools", lambda llm: llm.chat([USER], GREEDY, tools=[{"f": object()}]), "tools"),
]


def _until(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=None, **kwargs)


@pytest.mark.parametrize(("name", "call", "param"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_raise_typed_errors_and_leave_nothing(
    llm: LLM, name: str, call: Callable[[LLM], object], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        call(llm)
    assert not param or info.value.param == param, info.value
    assert_untouched(llm)


def test_the_engine_refuses_params_of_the_wrong_type(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.add_request("x", "Hello", {"temperature": 0})  # type: ignore[arg-type]
    assert info.value.param == "params"
    assert_untouched(llm)


# ---- edge values that are valid: sensible tokens, no NaN -------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"top_p": 1e-300}, {"top_p": 5e-324}, {"top_p": 5e-324, "top_k": 1}, {"top_k": 1}],
)
def test_a_tiny_top_p_samples_the_greedy_tokens(llm: LLM, kwargs: dict[str, Any]) -> None:
    greedy = generate(llm, GREEDY)
    assert generate(llm, SamplingParams(temperature=1.0, max_tokens=6, **kwargs)) == greedy


@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 5e-324])
def test_a_tiny_repetition_penalty_repeats_the_best_seen_token(llm: LLM, penalty: float) -> None:
    """Seen tokens' positive logits grow without bound: the best of them wins each step, the
    same at temperature 1 as greedily (before the fix: token 49151 or one token repeated)."""
    greedy = generate(llm, SamplingParams(temperature=0, max_tokens=6, repetition_penalty=penalty))
    finite = generate(llm, SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1e-10))
    assert greedy == finite
    sampled = SamplingParams(temperature=1.0, max_tokens=6, repetition_penalty=penalty, seed=1)
    assert generate(llm, sampled) == greedy
    assert len(set(greedy)) > 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"repetition_penalty": 1e300},
        {"temperature": 1e300},
        {"temperature": 1e-300},
        {"temperature": 1e-5, "repetition_penalty": 1e-300},
        {"min_p": 1.0, "top_p": 5e-324},
        {"presence_penalty": -2.0, "frequency_penalty": -2.0, "repetition_penalty": 1e-300},
        {"top_k": 10**9, "top_p": 1.0},
        {"n": 3, "best_of": 4, "logprobs": 20},
    ],
)
def test_edge_values_sample_valid_tokens(llm: LLM, kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**{"temperature": 1.0, "max_tokens": 4, "seed": 0, **kwargs})
    outputs = llm.generate(PROMPT, params, use_tqdm=False)
    assert_sane(llm, outputs)
    assert_untouched(llm)


def test_max_tokens_none_generates_up_to_the_context(llm: LLM) -> None:
    out = llm.generate(PROMPT, _until(ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == CONTEXT_TOKENS
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids[:6] == generate(llm, GREEDY)
    assert_untouched(llm)


def test_max_tokens_none_is_bounded_by_a_small_pool(loaded: LoadedModel) -> None:
    config = EngineConfig(num_kv_blocks=2, block_size=16, check_invariants=True)
    small = LLM.from_engine(LLMEngine(config, loaded))
    out = small.generate(PROMPT, _until(ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32
    assert_untouched(small)


# ---- logits that are not finite anyway: that request ends with "error", alone ---------------

MARK_SEED = 666  # the request whose logits the patched sampler breaks (its 2 branches)


class BreakingSampler(Sampler):
    """The real sampler, but the rows of the request with seed MARK_SEED (its branches: + 1)
    get ``bad`` logits from their ``after``-th output token on."""

    def __init__(self, bad: float, after: int) -> None:
        self.bad, self.after = bad, after

    def __call__(self, logits: torch.Tensor, rows: Any) -> SamplerOutput:
        logits = logits.clone()
        for i, row in enumerate(rows):
            marked = isinstance(row, SamplingRow) and row.params.seed in (MARK_SEED, MARK_SEED + 1)
            if marked and row.num_generated >= self.after:
                logits[i, :] = self.bad
        return super().__call__(logits, rows)


@pytest.fixture
def breaking(llm: LLM) -> Iterator[Callable[[float, int], None]]:
    runner = llm.engine.runner
    real = runner.sampler

    def install(bad: float, after: int) -> None:
        runner.sampler = BreakingSampler(bad, after)

    yield install
    runner.sampler = real


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("after", [0, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_non_finite_row_ends_its_request_with_an_error_alone(
    llm: LLM, breaking: Callable[[float, int], None], bad: float, after: int, temperature: float
) -> None:
    others = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 2
    alone = llm.generate(["Hello", "One, two,"], others, use_tqdm=False)
    breaking(bad, after)
    marked = SamplingParams(temperature=temperature, seed=MARK_SEED, max_tokens=8, n=2)
    out = llm.generate(["Hello", PROMPT, "One, two,"], [others[0], marked, others[1]], False)
    for i, completion in enumerate(out[1].outputs):
        assert completion.finish_reason == FINISH_ERROR, (i, completion)
        assert len(completion.token_ids) <= after
    assert [o.outputs[0].token_ids for o in (out[0], out[2])] == [
        o.outputs[0].token_ids for o in alone
    ]
    assert_untouched(llm)
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_a_non_finite_draft_position_ends_a_speculating_request(loaded: LoadedModel) -> None:
    config = EngineConfig(num_kv_blocks=64, check_invariants=True, num_speculative_tokens=3)
    spec = LLM.from_engine(LLMEngine(config, loaded))
    spec.engine.runner.sampler = BreakingSampler(float("nan"), after=5)
    counting = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    marked = SamplingParams(temperature=0, max_tokens=12, seed=MARK_SEED)
    out = spec.generate([counting, counting], [greedy, marked], use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"
    assert out[1].outputs[0].finish_reason == FINISH_ERROR
    kept = out[1].outputs[0].token_ids  # a step's tokens before the broken position go too
    assert len(kept) <= 5 and kept == out[0].outputs[0].token_ids[: len(kept)]
    assert spec.stats()["draft_tokens"] > 0
    assert_untouched(spec)
