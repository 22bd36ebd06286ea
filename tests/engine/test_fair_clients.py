"""The fair policy on the real engine: a client's short request is not held behind another
client's long prompts, greedy text is the same whoever shares the batch, and one client alone
is served exactly as fcfs."""

from __future__ import annotations

import pytest

from pagekv import SamplingParams
from pagekv.core.invariants import check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.models.loader import LoadedModel

pytestmark = pytest.mark.model

SHORT = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def long_prompt(i: int) -> list[int]:
    return [(97 * i + 31 * k) % 40000 + 100 for k in range(1000)]


def steps_until_done(engine: LLMEngine, request_id: str) -> tuple[int, list[int]]:
    for step in range(1, 500):
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return step, out.outputs[0].token_ids
    raise AssertionError(f"{request_id} did not finish")


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_short_request_of_another_client_is_not_held_behind_long_prompts(
    loaded: LoadedModel, policy: str
) -> None:
    config = EngineConfig(
        num_kv_blocks=1024,
        max_num_batched_tokens=512,
        scheduling_policy=policy,
        check_invariants=True,
    )
    engine = LLMEngine(config, loaded)
    for i in range(6):  # 6,000 prompt tokens: a dozen full-budget steps
        engine.add_request(f"long{i}", long_prompt(i), LONG, client="10.0.0.1")
    engine.step()
    engine.add_request("short", "The capital of France is", SHORT, client="10.0.0.2")
    steps, tokens = steps_until_done(engine, "short")
    if policy == "fair":
        assert steps == SHORT.max_tokens  # its prompt in the first step, a token each step
    else:
        assert steps > SHORT.max_tokens + 8  # behind the long prompts' prefill
    alone = LLMEngine(EngineConfig(num_kv_blocks=1024), loaded)
    alone.add_request("short", "The capital of France is", SHORT)
    assert steps_until_done(alone, "short")[1] == tokens  # the same greedy text
    while engine.has_unfinished_requests():
        engine.step()
    check_no_leak(engine.kv)
