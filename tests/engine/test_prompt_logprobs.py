"""Prompt logprobs (vLLM's ``prompt_logprobs``) and ``max_tokens=0``: every prompt token's
log-probability given those before it equals transformers' float32 log-softmax on the same
weights, whole or in chunks, with a prefix in the cache, after preemptions; the ranks and the
decoded tokens are vLLM's.

The exact path (``gguf_activations="dtype"``: the file's blocks dequantized in registers to the
reference's float32 weights), as the golden tests run it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagekv import Logprob, SamplingParams
from pagekv.core.invariants import check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel
from tests.engine.test_engine_golden import PROMPTS

pytestmark = pytest.mark.model

LOGPROB_TOL = 1e-4
NUM_TOP = 5
CHUNK_TOKENS = 64  # max_num_batched_tokens: the long prompt takes several chunks


def make_llm(loaded: LoadedModel, **kwargs: Any) -> LLM:
    config = EngineConfig(check_invariants=True, block_size=16, gguf_activations="dtype", **kwargs)
    return LLM.from_engine(LLMEngine(config, loaded))


@pytest.fixture(scope="module")
def prompt_ids(loaded_gguf: LoadedModel) -> list[list[int]]:
    chosen = [PROMPTS[0], PROMPTS[3], PROMPTS[4], PROMPTS[-1]]  # short, count, chat, long
    ids = [loaded_gguf.tokenizer.encode(p) for p in chosen]
    assert len(ids[-1]) > 4 * CHUNK_TOKENS, "one prompt must take several chunks"
    return ids


@pytest.fixture(scope="module")
def reference(prompt_ids: list[list[int]], hf_model: Any) -> list[torch.Tensor]:
    """transformers' float32 log-softmax at every prompt position: [P, vocab] per prompt."""
    with torch.inference_mode():
        return [
            torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
            for ids in prompt_ids
        ]


def assert_prompt_logprobs(
    got: list[dict[int, Logprob] | None] | None, ids: list[int], ref: torch.Tensor, k: int
) -> None:
    """vLLM's shape: None, then per token i >= 1 an entry with the prompt token first and the
    top k ranked 1..k (the token among them if it is one); every value within LOGPROB_TOL of
    the reference's, the alternatives the reference's top k and the token's rank its place in
    the reference's order (up to ties within the tolerance)."""
    assert got is not None and len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry, row, token = got[i], ref[i - 1], ids[i]
        assert entry is not None and next(iter(entry)) == token, f"position {i}"
        for t, lp in entry.items():
            assert abs(lp.logprob - float(row[t])) < LOGPROB_TOL, f"position {i}, token {t}"
        rank = entry[token].rank
        above = int((row > row[token] + LOGPROB_TOL).sum())
        at_least = int((row >= row[token] - LOGPROB_TOL).sum())
        assert rank is not None and above + 1 <= rank <= at_least, f"position {i}: rank {rank}"
        alternatives = (
            dict(entry) if len(entry) == k else {t: lp for t, lp in entry.items() if t != token}
        )
        assert len(alternatives) == k, f"position {i}"
        assert sorted(lp.rank for lp in alternatives.values()) == list(range(1, k + 1))  # type: ignore[type-var]
        if k:
            kth = float(row.topk(k).values[-1])
            assert all(float(row[t]) >= kth - LOGPROB_TOL for t in alternatives)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prompt_logprobs_equal_transformers(
    loaded_gguf: LoadedModel,
    prompt_ids: list[list[int]],
    reference: list[torch.Tensor],
    prefix_caching: bool,
) -> None:
    """All prompts batched, the long one chunked (its chunks beside the others' decodes)."""
    llm = make_llm(
        loaded_gguf,
        num_kv_blocks=256,
        max_num_batched_tokens=CHUNK_TOKENS,
        enable_prefix_caching=prefix_caching,
    )
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=NUM_TOP, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    for out, ids, ref in zip(outs, prompt_ids, reference, strict=True):
        assert_prompt_logprobs(out.prompt_logprobs, ids, ref, NUM_TOP)
        # the last prompt position's distribution is the first output token's, not a prompt's
        first = out.outputs[0].logprobs
        assert first is not None
        token = out.outputs[0].token_ids[0]
        assert abs(first[0][token].logprob - float(ref[-1, token])) < LOGPROB_TOL
    check_no_leak(llm.engine.kv)


def test_a_cached_prefix_is_scored_again_not_skipped(
    loaded_gguf: LoadedModel, prompt_ids: list[list[int]], reference: list[torch.Tensor]
) -> None:
    """A request asking for prompt logprobs does not read the prefix cache (vLLM's rule), so
    the positions a hit would skip are scored; a plain request still hits."""
    llm = make_llm(loaded_gguf, num_kv_blocks=256, max_num_batched_tokens=CHUNK_TOKENS)
    ids, ref = prompt_ids[-1], reference[-1]
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate({"prompt_token_ids": ids}, plain, use_tqdm=False)  # fills the cache
    hits = llm.stats()["prefix_cache_hit_tokens"]
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    (out,) = llm.generate({"prompt_token_ids": ids}, scored, use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert llm.stats()["prefix_cache_hit_tokens"] == hits
    assert_prompt_logprobs(out.prompt_logprobs, ids, ref, 2)
    (again,) = llm.generate({"prompt_token_ids": ids}, plain, use_tqdm=False)
    assert again.num_cached_tokens > 0  # the cache is still read by others
    check_no_leak(llm.engine.kv)


def test_prompt_logprobs_survive_preemption(
    loaded_gguf: LoadedModel, prompt_ids: list[list[int]], reference: list[torch.Tensor]
) -> None:
    """A pool too small for all of them at once: requests are preempted and recomputed,
    chunks of a prompt scored again overwrite the same positions."""
    llm = make_llm(loaded_gguf, num_kv_blocks=40, max_num_batched_tokens=CHUNK_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, prompt_logprobs=1)
    batch = prompt_ids * 2
    outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    assert llm.stats()["preemptions_recompute"] > 0
    for out, ids, ref in zip(outs, batch, reference * 2, strict=True):
        assert_prompt_logprobs(out.prompt_logprobs, ids, ref, 1)
    check_no_leak(llm.engine.kv)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(
    loaded_gguf: LoadedModel, prompt_ids: list[list[int]], reference: list[torch.Tensor]
) -> None:
    llm = make_llm(loaded_gguf, num_kv_blocks=256, max_num_batched_tokens=CHUNK_TOKENS)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, logprobs=3)
    batch = [{"prompt_token_ids": ids} for ids in prompt_ids]
    outs = llm.generate(batch, params, use_tqdm=False)
    for out, ids, ref in zip(outs, prompt_ids, reference, strict=True):
        assert out.finished
        (completion,) = out.outputs
        assert completion.token_ids == [] and completion.text == ""
        assert completion.finish_reason == "length" and completion.logprobs == []
        assert_prompt_logprobs(out.prompt_logprobs, ids, ref, 0)
        assert all(len(e) == 1 for e in out.prompt_logprobs[1:] if e is not None)  # type: ignore[index]
    assert llm.stats()["kv_blocks_used"] == 0
    check_no_leak(llm.engine.kv)


def test_n_branches_share_one_scored_prompt(
    loaded_gguf: LoadedModel, prompt_ids: list[list[int]], reference: list[torch.Tensor]
) -> None:
    llm = make_llm(loaded_gguf, num_kv_blocks=256)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, prompt_logprobs=2)
    (out,) = llm.generate({"prompt_token_ids": prompt_ids[2]}, params, use_tqdm=False)
    assert len(out.outputs) == 3
    assert_prompt_logprobs(out.prompt_logprobs, prompt_ids[2], reference[2], 2)
    check_no_leak(llm.engine.kv)


def test_a_one_token_prompt_has_only_the_none_entry(loaded_gguf: LoadedModel) -> None:
    llm = make_llm(loaded_gguf, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    (out,) = llm.generate({"prompt_token_ids": [504]}, params, use_tqdm=False)
    assert out.prompt_logprobs == [None]
    assert len(out.outputs[0].token_ids) == 2


def test_decoded_tokens_and_ranks_are_vllms(loaded_gguf: LoadedModel) -> None:
    """decoded_token: the token's text alone, special tokens spelled out; the chosen token
    first with its rank, then the top k ranked 1..k."""
    llm = make_llm(loaded_gguf, num_kv_blocks=64)
    tokenizer = loaded_gguf.tokenizer
    prompt = "<|im_start|>user\nName a colour.<|im_end|>\n"
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=4, prompt_logprobs=4)
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    ids = out.prompt_token_ids
    assert out.prompt_logprobs is not None
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None
        for t, lp in entry.items():
            alone = tokenizer.decode([t], skip_special_tokens=False)
            if not alone.endswith("\ufffd"):  # else completed from the context, or ""
                assert lp.decoded_token == alone
        assert entry[ids[i]].decoded_token == tokenizer.decode([ids[i]], skip_special_tokens=False)
    assert any(
        e is not None and e[ids[i]].decoded_token == "<|im_end|>"
        for i, e in enumerate(out.prompt_logprobs)
    )
    completion = out.outputs[0]
    assert completion.logprobs is not None
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert next(iter(entry)) == token
        alternatives = [lp for t, lp in entry.items() if t != token]
        ranks = sorted(lp.rank for lp in entry.values() if lp.rank is not None)
        assert entry[token].rank == 1  # greedy: the chosen token is the most likely
        assert ranks == list(range(1, 5))
        values = [lp.logprob for lp in entry.values()]
        assert values == sorted(values, reverse=True)
        assert len(alternatives) == 3
