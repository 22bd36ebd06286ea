"""Golden test in bfloat16: pagekv's fast path (bf16 weights and KV cache) against Hugging Face
transformers running the same weights in bf16, one prompt at a time.

Two bf16 implementations round differently (pagekv keeps RoPE and the decode softmax in
float32; transformers rounds RoPE to bf16), so exact equality is not the contract. The rule:
walk the tokens; while they agree, our logprob of each token must be close to the reference's
(each within a loose bound, and all of them close on average); at the first difference our
token's reference logit must be within ``BF16_TIE_MARGIN`` of the reference's best (a near tie,
which either implementation may break either way); after it the sequences legitimately
diverge, so stop comparing.

Near ties are common in bf16: measured on these prompts, transformers bf16 itself leaves its own
float32 greedy path after 8-61 tokens on 4 of 8 prompts, every time at a margin <= 0.25. So the
test does not demand long agreement; a floor on the compared tokens only guards against a
model broken in a way that happens to produce ties.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from pagekv import SamplingParams
from pagekv.core.invariants import check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.kernels import fused_ops, isa
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel, load_model
from pagekv.runner.model_runner import AttentionBackend
from tests.engine.test_engine_golden import NUM_NEW_TOKENS, PROMPTS, Reference, _greedy_reference

pytestmark = pytest.mark.model

# Logits of this model sit around 10-30, where one bf16 step is 0.0625-0.125; two bf16
# pipelines differ by a few steps there. A logprob is a logit less the log-sum-exp, so one token's
# logprob may differ by as much as a logit: at a low-confidence token (p near 0.2) a few in a
# thousand do, on every kernel target, while most differ by a step or less. The mean over all
# compared tokens is what a systematic error (a wrong scale, a lost rounding) moves.
BF16_TIE_MARGIN = 0.5
BF16_LOGPROB_TOL = 0.5
BF16_MEAN_LOGPROB_TOL = 0.05
MIN_COMPARED_FRACTION = 0.25  # of all tokens, compared before the first legitimate tie


@pytest.fixture(scope="module")
def loaded_bf16(gguf_path: str) -> LoadedModel:
    return load_model(gguf_path, torch.bfloat16)


@pytest.fixture(scope="module")
def hf_model_bf16(gguf_path: str) -> Any:
    import transformers
    from transformers.utils.quantization_config import GgufConfig

    # dequantize=True: dense bf16 weights and bf16 matmuls. Without it, recent transformers keep
    # GGUF weights packed and compute a "bf16" model's matmuls in float32.
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path),
        gguf_file=os.path.basename(gguf_path),
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    model.eval()
    return model


@pytest.fixture(scope="module")
def prompt_ids(loaded_bf16: LoadedModel) -> list[list[int]]:
    return [loaded_bf16.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference_bf16(prompt_ids: list[list[int]], hf_model_bf16: Any) -> list[Reference]:
    return [_greedy_reference(hf_model_bf16, ids) for ids in prompt_ids]


def agreeing_prefix(
    ours: list[int],
    ours_logprobs: list[float] | None,
    ref: Reference,
    tie_margin: float = BF16_TIE_MARGIN,
    logprob_tol: float = BF16_LOGPROB_TOL,
) -> int:
    """How many leading tokens agree (each with a logprob within ``logprob_tol``, when given);
    fails unless the first disagreement is a near tie (within ``tie_margin``)."""
    for j, (a, b) in enumerate(zip(ours, ref.tokens, strict=True)):
        if a == b and ours_logprobs is None:
            continue
        if a == b:
            ref_logprob = float(ref.logprobs[j, a])
            assert abs(ours_logprobs[j] - ref_logprob) < logprob_tol, (
                f"token {j}: logprob {ours_logprobs[j]:.3f}, reference {ref_logprob:.3f}"
            )
            continue
        # Our token must be a near-top choice of the reference: within the tie margin of its
        # best (logprob differences are logit differences). Not "one of its top 2": ties of
        # three happen (prompt 5, token 3: two tokens exactly level 0.125 below the best), and
        # topk's order among exactly equal logits means nothing.
        gap = float(ref.logprobs[j, b] - ref.logprobs[j, a])
        assert gap < tie_margin, (
            f"token {j}: ours {a} != reference {b}, {gap:.3f} below it in the reference"
        )
        return j
    return len(ours)


def agreed_tokens(
    outs: list[Any],
    refs: list[Reference],
    tie_margin: float = BF16_TIE_MARGIN,
    logprob_tol: float = BF16_LOGPROB_TOL,
    mean_logprob_tol: float = BF16_MEAN_LOGPROB_TOL,
) -> int:
    """``agreeing_prefix`` summed over the completions (each NUM_NEW_TOKENS long, with the
    logprob of every token) against their references; fails unless the compared tokens'
    logprobs are within ``mean_logprob_tol`` of the reference's on average."""
    deviations: list[float] = []
    for out, ref in zip(outs, refs, strict=True):
        completion = out.outputs[0]
        tokens = completion.token_ids
        assert len(tokens) == NUM_NEW_TOKENS and completion.logprobs is not None
        logprobs = [completion.logprobs[j][t].logprob for j, t in enumerate(tokens)]
        agreed = agreeing_prefix(tokens, logprobs, ref, tie_margin, logprob_tol)
        deviations += [abs(logprobs[j] - float(ref.logprobs[j, tokens[j]])) for j in range(agreed)]
    mean = sum(deviations) / max(len(deviations), 1)
    print(f"mean logprob deviation {mean:.4f} over {len(deviations)} tokens")
    assert mean < mean_logprob_tol, f"mean logprob deviation {mean:.4f} >= {mean_logprob_tol}"
    return len(deviations)


@pytest.mark.parametrize("block_size", [16, 32])
def test_bf16_greedy_near_transformers_bf16(
    loaded_bf16: LoadedModel,
    prompt_ids: list[list[int]],
    reference_bf16: list[Reference],
    block_size: int,
    kernel_target: str,
) -> None:
    """On every kernel target this CPU runs: its bf16 matmuls (tiles, or bf16 weights widened
    in stripes), attention and layer ops."""
    if block_size == 32 and kernel_target != isa.best():
        pytest.skip("block size 32 on the best target only")
    config = EngineConfig(
        dtype="bfloat16",
        block_size=block_size,
        num_kv_blocks=4096 // block_size * 4,
        check_invariants=True,
    )
    llm = LLM.from_engine(LLMEngine(config, loaded_bf16))
    assert llm.engine.runner.kv.dtype == torch.bfloat16
    # the fast path under test: prepacked weights, the C layer ops and decode kernel
    model = llm.engine.runner.model
    assert model.packed_head is not None or not torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    assert fused_ops.load() is None or model.ops is fused_ops.load()
    assert llm.engine.runner.attention is AttentionBackend.FAST
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    agreed = agreed_tokens(outs, reference_bf16)
    total = NUM_NEW_TOKENS * len(prompt_ids)
    print(f"bf16 golden, block {block_size}: {agreed}/{total} tokens agree before a near tie")
    assert agreed >= MIN_COMPARED_FRACTION * total, f"only {agreed}/{total} tokens compared"
    check_no_leak(llm.engine.kv)


@pytest.fixture(scope="module")
def loaded_bf16_gguf(gguf_path: str) -> LoadedModel:
    return load_model(gguf_path, torch.bfloat16, keep_quantized=True)


def test_bf16_with_gguf_weights_near_transformers_bf16(
    loaded_bf16_gguf: LoadedModel,
    prompt_ids: list[list[int]],
    reference_bf16: list[Reference],
    kernel_target: str,
) -> None:
    """bf16 activations and KV with the file's quant blocks as weights on the exact path (each
    weight exactly its float32 value, where the reference rounds it to bf16): the same rule."""
    config = EngineConfig(
        dtype="bfloat16", gguf_activations="dtype", num_kv_blocks=1024, check_invariants=True
    )
    llm = LLM.from_engine(LLMEngine(config, loaded_bf16_gguf))
    assert llm.engine.runner.kernels["weights"].startswith("GGUF")
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    agreed = agreed_tokens(outs, reference_bf16)
    total = NUM_NEW_TOKENS * len(prompt_ids)
    print(f"bf16 golden with GGUF weights: {agreed}/{total} tokens agree before a near tie")
    assert agreed >= MIN_COMPARED_FRACTION * total, f"only {agreed}/{total} tokens compared"
    check_no_leak(llm.engine.kv)


def test_bf16_drafted_greedy_near_transformers_bf16(
    loaded_bf16: LoadedModel, prompt_ids: list[list[int]], reference_bf16: list[Reference]
) -> None:
    """The same rule with n-gram speculation on: drafted tokens are checked by the model's own
    greedy choice, so the tokens stay those of bf16 greedy decoding (logprobs are not asked
    for: a request that wants them is never drafted for)."""
    config = EngineConfig(
        dtype="bfloat16", num_kv_blocks=1024, check_invariants=True, num_speculative_tokens=4
    )
    llm = LLM.from_engine(LLMEngine(config, loaded_bf16))
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    agreed = 0
    for out, ref in zip(outs, reference_bf16, strict=True):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == NUM_NEW_TOKENS
        agreed += agreeing_prefix(tokens, None, ref)
    total = NUM_NEW_TOKENS * len(prompt_ids)
    print(f"bf16 golden with drafts: {agreed}/{total} tokens agree before a near tie")
    assert agreed >= MIN_COMPARED_FRACTION * total, f"only {agreed}/{total} tokens compared"
    assert llm.stats()["accepted_draft_tokens"] > 0
    check_no_leak(llm.engine.kv)
