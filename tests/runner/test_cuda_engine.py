"""The engine on a CUDA GPU (skipped without one; ``benchmarks/gpu_check.sh`` runs it there):
greedy tokens equal transformers' in float32 on the same weights, and bf16 by the top-2 rule
of the bf16 golden tests, with chunked prefill and prefix hits through the Triton kernels."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagekv.core.invariants import check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.llm import LLM
from tests.engine.test_engine_golden import (
    GREEDY,
    PROMPTS,
    _greedy_reference,
    assert_matches_reference,
)

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_equals_transformers_on_the_gpu(hf_model: Any, dtype: str) -> None:
    config = EngineConfig(  # a bounded pool: the other dtype's engine may still hold its own
        device="cuda",
        dtype=dtype,
        num_kv_blocks=256,
        max_num_batched_tokens=64,
        check_invariants=True,
    )
    engine = LLMEngine(config)
    assert engine.runner.kv.k[0].device.type == "cuda"
    assert engine.runner.system_line.startswith("GPU: ")
    assert "decode attention Triton" in engine.runner.system_line
    llm = LLM.from_engine(engine)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    for out, prompt in zip(outs, ids, strict=True):
        ref = _greedy_reference(hf_model, prompt)
        completion = out.outputs[0]
        assert completion.logprobs is not None
        logprobs = [completion.logprobs[j][t].logprob for j, t in enumerate(completion.token_ids)]
        if dtype == "float32":
            assert_matches_reference(completion.token_ids, ref, logprobs)
        else:  # bf16: every token within the reference's top 2 until the first divergence
            for j, token in enumerate(completion.token_ids):
                assert token in ref.logprobs[j].topk(2).indices.tolist(), f"token {j}"
                if token != ref.tokens[j]:
                    break
    check_no_leak(engine.kv)
