"""int8 KV blocks (``kv_cache_dtype="int8"``, issue #60) against transformers float32 on the
same weights, by the bf16 rule (test_engine_golden_bf16.py): tokens agree until a near tie,
each agreeing token's logprob close. The mean absolute logprob difference is printed beside
float32 blocks' and bf16's (model and blocks in bf16), the cost of each rounding."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagekv import SamplingParams
from pagekv.core.invariants import check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel, load_model
from tests.engine.test_engine_golden import NUM_NEW_TOKENS, PROMPTS, Reference, _greedy_reference
from tests.engine.test_engine_golden_bf16 import MIN_COMPARED_FRACTION, agreed_tokens

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def golden_ids(loaded: LoadedModel) -> list[list[int]]:
    return [loaded.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def golden_refs(golden_ids: list[list[int]], hf_model: Any) -> list[Reference]:
    return [_greedy_reference(hf_model, ids) for ids in golden_ids]


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=0)


def mean_deviation(outs: list[Any], refs: list[Reference]) -> float:
    """Mean |logprob - reference logprob| over every token up to the first disagreement."""
    deviations = []
    for out, ref in zip(outs, refs, strict=True):
        completion = out.outputs[0]
        for j, token in enumerate(completion.token_ids):
            if token != ref.tokens[j]:
                break
            ours = completion.logprobs[j][token].logprob
            deviations.append(abs(ours - float(ref.logprobs[j, token])))
    return sum(deviations) / len(deviations)


@pytest.fixture(scope="module")
def baselines(
    loaded: LoadedModel, golden_ids: list[list[int]], golden_refs: list[Reference], gguf_path: str
) -> dict[str, float]:
    """Mean |logprob - transformers float32| of float32 blocks, and of bf16 (model and blocks)."""
    prompts = [{"prompt_token_ids": ids} for ids in golden_ids]
    fp32 = LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=1024), loaded))
    bf16_model = load_model(gguf_path, torch.bfloat16)
    bf16 = LLM.from_engine(LLMEngine(EngineConfig(dtype="bfloat16"), bf16_model))
    return {
        name: mean_deviation(engine.generate(prompts, GREEDY, use_tqdm=False), golden_refs)
        for name, engine in (("float32", fp32), ("bfloat16", bf16))
    }


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_8_bit_blocks_greedy_near_transformers_float32(
    loaded: LoadedModel,
    golden_ids: list[list[int]],
    golden_refs: list[Reference],
    baselines: dict[str, float],
    kv_dtype: str,
) -> None:
    config = EngineConfig(kv_cache_dtype=kv_dtype, num_kv_blocks=1024, check_invariants=True)
    llm = LLM.from_engine(LLMEngine(config, loaded))
    kv = llm.engine.runner.kv
    assert kv.quantized and kv.k[0].itemsize == 1 and kv.k_scale[0].dtype == torch.float16
    prompts = [{"prompt_token_ids": ids} for ids in golden_ids]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    agreed = agreed_tokens(outs, golden_refs)
    total = NUM_NEW_TOKENS * len(golden_ids)
    assert agreed >= MIN_COMPARED_FRACTION * total, f"only {agreed}/{total} tokens compared"
    check_no_leak(llm.engine.kv)
    ours = mean_deviation(outs, golden_refs)
    fp32, bf16 = baselines["float32"], baselines["bfloat16"]
    print(f"mean |logprob - transformers float32|: {kv_dtype} blocks {ours:.4f}, float32 "
          f"{fp32:.4f}, bf16 model and blocks {bf16:.4f}")  # fmt: skip
