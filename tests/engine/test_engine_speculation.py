"""N-gram speculative decoding end to end on the real model (float32): the same tokens as
decoding one at a time, for greedy requests, with stops inside accepted drafts, next to sampled
requests in the same batch, and nothing left allocated."""

from __future__ import annotations

import pytest

from pagekv import SamplingParams
from pagekv.bench.workloads import load_workload
from pagekv.core.invariants import check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel

pytestmark = pytest.mark.model


def make_llm(loaded: LoadedModel, k: int) -> LLM:
    config = EngineConfig(num_kv_blocks=256, check_invariants=True, num_speculative_tokens=k)
    return LLM.from_engine(LLMEngine(config, loaded))


PROMPTS = [
    "1, 2, 3, 4, 5,",
    "the cat sat on the mat. the cat sat on the mat. the cat",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "Write a short poem about the sea.",
]


def generate(llm: LLM, params: list[SamplingParams], prompts: list[object]) -> list[object]:
    outs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_drafted_greedy_decoding_gives_the_same_tokens(loaded: LoadedModel) -> None:
    random = load_workload("random").requests[:3]  # raw token prompts; the model loops on them
    prompts: list[object] = [*PROMPTS, *({"prompt_token_ids": r.prompt_token_ids} for r in random)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    params = [greedy] * len(prompts) + [sampled]
    prompts.append("Pick a random animal:")
    plain = generate(make_llm(loaded, 0), params, prompts)
    llm = make_llm(loaded, 4)
    assert generate(llm, params, prompts) == plain
    stats = llm.stats()
    assert stats["accepted_draft_tokens"] > 40  # the drafted path did the work
    assert stats["draft_tokens"] > stats["accepted_draft_tokens"]  # and some drafts were wrong
    assert stats["kv_blocks_used"] == 0
    check_no_leak(llm.engine.kv)


def test_drafted_decoding_with_penalties_gives_the_same_tokens(loaded: LoadedModel) -> None:
    # a drafted position's penalties count the drafts before it as output
    random = load_workload("random").requests[:2]
    prompts: list[object] = [*PROMPTS, *({"prompt_token_ids": r.prompt_token_ids} for r in random)]
    mild = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.3)
    favour = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=0.7)
    params = [mild if i % 2 else favour for i in range(len(prompts))]
    plain = generate(make_llm(loaded, 0), params, prompts)
    llm = make_llm(loaded, 4)
    assert generate(llm, params, prompts) == plain
    assert llm.stats()["accepted_draft_tokens"] > 20  # drafts were taken under the penalties
    check_no_leak(llm.engine.kv)


def test_stops_inside_accepted_drafts(loaded: LoadedModel) -> None:
    plain, drafted = make_llm(loaded, 0), make_llm(loaded, 6)
    prompt = "1, 2, 3, 4, 5,"
    cases = [
        SamplingParams(temperature=0, max_tokens=30, stop=["9"]),  # a stop string
        SamplingParams(temperature=0, max_tokens=30, stop=["9"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=13),  # max_tokens mid-draft
    ]
    base = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    stop_id = base[0].outputs[0].token_ids[12]
    cases.append(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]))
    for params in cases:
        want = generate(plain, [params], [prompt])
        got = generate(drafted, [params], [prompt])
        assert got == want, params
    chat = [{"role": "user", "content": "Count from 1 to 10."}]
    params = SamplingParams(temperature=0, max_tokens=200, min_tokens=3)
    want = plain.chat(chat, params, use_tqdm=False)[0].outputs[0]
    got = drafted.chat(chat, params, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (
        want.token_ids,
        want.text,
        want.finish_reason,
    )
    assert got.finish_reason == "stop"  # EOS, possibly inside accepted drafts
    assert drafted.stats()["accepted_draft_tokens"] > 0
    check_no_leak(drafted.engine.kv)
