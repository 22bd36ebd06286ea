"""Golden test with int8 activations (``gguf_activations="int8"``): pagekv's greedy tokens on a
GGUF file whose blocks multiply activations rounded to int8 per 32 inputs, against transformers'
float32 run on the same file.

Rounding the activations (as llama.cpp does) moves every logit a little, so exact equality is
not the contract; the rule is the bf16 golden test's (``agreeing_prefix``): while the tokens
agree our logprobs stay close to the reference's, the first difference must be a near tie of
the reference, and a floor on the tokens compared before it guards against a model broken in a
way that happens to produce ties. Run on every kernel target this CPU has (block size 16; 1 on
the best target too), on the default Q4_1 file and on one written with every other format.
"""

from __future__ import annotations

from typing import Any

import pytest
from gguf.constants import GGMLQuantizationType as QT

from pagekv import SamplingParams
from pagekv.core.invariants import check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.kernels import isa
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel, load_model
from tests.engine.test_engine_golden import NUM_NEW_TOKENS, PROMPTS, Reference
from tests.engine.test_engine_golden_bf16 import agreed_tokens
from tests.engine.test_engine_golden_gguf import file_reference
from tests.gguf_requantize import requantize

pytestmark = pytest.mark.model

# The rounded activations move this model's logits (around 10-30) by up to a few tenths.
INT8_TIE_MARGIN = 0.75
INT8_LOGPROB_TOL = 0.5
INT8_MEAN_LOGPROB_TOL = 0.075
MIN_COMPARED_FRACTION = 0.35  # of all tokens, compared before the first legitimate tie


def choose(name: str, shape: tuple[int, ...]) -> QT:
    """Every format with int8 dot products: Q8_0 (the embedding), Q5_0 (attn_k), Q5_1
    (attn_v), Q4_0 (attn_q, ffn_up), the K types on ffn_down (its rows are 256 wide: Q4_K,
    Q5_K and Q6_K by turns of layers), Q4_1 (the rest, as the default file)."""
    if len(shape) == 1:
        return QT.F32
    if name == "token_embd.weight":
        return QT.Q8_0
    if ".ffn_down." in name:
        return (QT.Q4_K, QT.Q5_K, QT.Q6_K)[int(name.split(".")[1]) % 3]
    if ".attn_k." in name:
        return QT.Q5_0
    if ".attn_v." in name:
        return QT.Q5_1
    return QT.Q4_0 if ".attn_q." in name or ".ffn_up." in name else QT.Q4_1


@pytest.fixture(scope="module", params=["default", "mixed"])
def gguf_file(request: pytest.FixtureRequest, gguf_path: str, tmp_path_factory: Any) -> str:
    if request.param == "default":
        return gguf_path
    path = tmp_path_factory.mktemp("gguf") / "smollm2-int8-formats.gguf"
    requantize(gguf_path, str(path), choose)
    return str(path)


@pytest.fixture(scope="module")
def own_model(gguf_file: str) -> LoadedModel:
    """A model of this module's own: its weights get packed for int8 rows."""
    return load_model(gguf_file, keep_quantized=True)


@pytest.fixture(scope="module")
def reference_f32(gguf_file: str, own_model: LoadedModel) -> list[Reference]:
    return file_reference(gguf_file, own_model, PROMPTS)


@pytest.mark.parametrize("block_size", [1, 16])
def test_int8_greedy_near_transformers_float32(
    own_model: LoadedModel,
    reference_f32: list[Reference],
    block_size: int,
    kernel_target: str,
) -> None:
    if block_size == 1 and kernel_target != isa.best():
        pytest.skip("block size 1 on the best target only")
    config = EngineConfig(
        gguf_activations="int8",
        block_size=block_size,
        num_kv_blocks=8192 // block_size,
        check_invariants=True,
    )
    llm = LLM.from_engine(LLMEngine(config, own_model))
    ids = [own_model.tokenizer.encode(p) for p in PROMPTS]
    assert_int8_agrees(llm, ids, reference_f32)


def assert_int8_agrees(llm: LLM, ids: list[list[int]], references: list[Reference]) -> None:
    """``llm`` multiplies int8 activations, and its greedy tokens for ``ids`` agree with the
    float32 ``references`` by the bf16 rule with this module's tolerances; nothing leaks."""
    assert "int8 activations" in llm.engine.runner.kernels["weights"]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    agreed = agreed_tokens(
        outs, references, INT8_TIE_MARGIN, INT8_LOGPROB_TOL, INT8_MEAN_LOGPROB_TOL
    )
    total = NUM_NEW_TOKENS * len(ids)
    print(f"int8 golden: {agreed}/{total} tokens agree before a near tie")
    assert agreed >= MIN_COMPARED_FRACTION * total, f"only {agreed}/{total} tokens compared"
    check_no_leak(llm.engine.kv)
