"""``pagekv serve --trace FILE`` records real requests; ``pagekv sim`` replays the same counts."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from pagekv.core.trace import read_trace
from pagekv.sim.cost_model import CostModel
from pagekv.sim.simulator import SimConfig, simulate
from pagekv.sim.trace import replay_trace
from tests.server.support import start_server

pytestmark = pytest.mark.model

SYSTEM = "You answer in one word. " * 6  # 36 tokens: two full shared 16-token blocks


def test_a_served_trace_replays_with_the_same_requests_and_tokens(tmp_path: Path) -> None:
    trace_path = tmp_path / "trace.jsonl"
    server = start_server(tmp_path, "--num-kv-blocks", "128", "--trace", str(trace_path))
    prompt_tokens = completion_tokens = 0
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        for i, max_tokens in enumerate([3, 7, 5, 9]):
            res = client.completions.create(
                model=model,
                prompt=f"{SYSTEM}Question {i}: name a color.",
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert res.usage is not None
            prompt_tokens += res.usage.prompt_tokens
            completion_tokens += res.usage.completion_tokens
    finally:
        server.stop()  # closes the trace
    trace = read_trace(trace_path, strict=True)
    assert trace.problems == [] and len(trace.records) == 4
    assert sum(r.prompt_len for r in trace.records) == prompt_tokens
    assert sum(r.output_len for r in trace.records) == completion_tokens == 24
    shared = set.intersection(*(set(r.block_hashes) for r in trace.records))
    assert len(shared) == 2  # the system prompt's full blocks, the same for every request
    replayed = replay_trace(trace.records)
    cost = CostModel(fixed_s=0.01, per_token_s=1e-4, per_padded_context_s=1e-6)
    result = simulate(replayed, SimConfig(block_size=16), cost)
    assert result.num_requests == 4
    assert result.num_prompt_tokens == prompt_tokens
    assert result.num_output_tokens == completion_tokens
