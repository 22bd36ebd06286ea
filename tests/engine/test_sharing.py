"""Branches on shared blocks: parallel sampling, best_of, beam search, and the KV sanitizer.

The seed note's two sharper points: branches share one prompt's K/V through reference counts,
and copy-on-write is the correctness boundary. Sharing must change no token, and a missing
copy-on-write must be caught by the sanitizer, not discovered as odd text.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagekv import BeamSearchParams, SamplingParams
from pagekv.core.invariants import check_no_leak
from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.errors import InvalidRequestError, InvariantError, PromptTooLongError
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel
from pagekv.runner.model_runner import ModelRunner

pytestmark = pytest.mark.model

PROMPT = "Once upon a time, in a small village by the sea, there lived a"


def make_llm(loaded: LoadedModel, **kwargs: Any) -> LLM:
    kwargs = {"num_kv_blocks": 512, "check_invariants": True, "kv_sanitizer": True, **kwargs}
    return LLM.from_engine(LLMEngine(EngineConfig(**kwargs), loaded))


def test_parallel_branches_equal_independent_seeded_requests(loaded: LoadedModel) -> None:
    llm = make_llm(loaded, block_size=16)
    params = SamplingParams(n=4, seed=11, temperature=1.0, top_p=0.95, max_tokens=12)
    group = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.index for c in group.outputs] == [0, 1, 2, 3]
    assert llm.stats()["cow_copies"] >= 3  # the shared partial prompt block was copied
    for i, branch in enumerate(group.outputs):
        single = SamplingParams(seed=11 + i, temperature=1.0, top_p=0.95, max_tokens=12)
        alone = llm.generate(PROMPT, single, use_tqdm=False)[0].outputs[0]
        assert branch.token_ids == alone.token_ids, f"branch {i} differs from seed {11 + i}"
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1
    check_no_leak(llm.engine.kv)


def test_branches_share_the_prompt_blocks(loaded: LoadedModel) -> None:
    llm = make_llm(loaded, block_size=4)
    engine = llm.engine
    engine.add_request("g", PROMPT, SamplingParams(n=3, seed=1, temperature=1.0, max_tokens=8))
    while not any(engine.kv.has_table(f"g#{i}") for i in (1, 2)):
        engine.step()
    tables = [engine.kv.block_table(f"g#{i}") for i in range(3)]
    num_prompt = len(engine.tokenizer.encode(PROMPT))
    full = (num_prompt - 1) // 4
    assert tables[0][:full] == tables[1][:full] == tables[2][:full]
    assert all(engine.kv.pool.ref_count(b) == 3 for b in tables[0][:full])
    while engine.has_unfinished_requests():
        engine.step()
    check_no_leak(engine.kv)


def test_best_of_returns_the_n_most_likely_branches(loaded: LoadedModel) -> None:
    llm = make_llm(loaded)
    params = SamplingParams(n=2, best_of=4, seed=5, temperature=1.0, max_tokens=8)
    best = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
    assert [c.index for c in best] == [0, 1]
    assert all(c.logprobs is None for c in best)  # computed for ranking, not asked for
    singles = []
    for i in range(4):
        p = SamplingParams(seed=5 + i, temperature=1.0, max_tokens=8, logprobs=0)
        singles.append(llm.generate(PROMPT, p, use_tqdm=False)[0].outputs[0])
    singles.sort(key=lambda c: -(c.cumulative_logprob or 0.0))
    assert [c.token_ids for c in best] == [c.token_ids for c in singles[:2]]
    check_no_leak(llm.engine.kv)


BEAM_PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "The best way to learn a new language is",
    "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.parametrize(
    ("length_penalty", "early_stopping"), [(1.0, True), (1.0, False), (0.5, "never")]
)
def test_beam_search_matches_transformers(
    loaded: LoadedModel, hf_model: Any, length_penalty: float, early_stopping: bool | str
) -> None:
    """transformers' generate(num_beams=4, do_sample=False) with the same length_penalty,
    early_stopping and eos ids computes the same best sequence."""
    llm = make_llm(loaded, num_kv_blocks=1024)
    params = BeamSearchParams(
        beam_width=4, max_tokens=20, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outs = llm.beam_search(BEAM_PROMPTS, params, use_tqdm=False)
    eos = list(loaded.tokenizer.eos_token_ids)
    for prompt, out in zip(BEAM_PROMPTS, outs, strict=True):
        ids = loaded.tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                num_beams=4,
                do_sample=False,
                max_new_tokens=20,
                length_penalty=length_penalty,
                early_stopping=early_stopping,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )[0, len(ids) :].tolist()
        best = out.sequences[0].token_ids
        assert ref[: len(best)] == best, f"{prompt!r}: ours {best} vs transformers {ref}"
        assert all(t == eos[0] for t in ref[len(best) :])  # only padding after our end
        assert [s.score for s in out.sequences] == sorted(
            (s.score for s in out.sequences), reverse=True
        )
    check_no_leak(llm.engine.kv)


def test_beam_search_runs_beside_ordinary_requests(loaded: LoadedModel) -> None:
    llm = make_llm(loaded)
    engine = llm.engine
    engine.add_request("plain", "Hello there,", SamplingParams(temperature=0, max_tokens=16))
    engine.add_beam_search_request("beams", "The capital of France is", BeamSearchParams(4, 10))
    plain = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            plain = out
    beams = engine.pop_beam_search_output("beams")
    assert beams is not None and beams.sequences
    assert plain is not None and plain.finished and len(plain.outputs[0].token_ids) == 16
    alone = llm.beam_search("The capital of France is", BeamSearchParams(4, 10), use_tqdm=False)
    assert alone[0].sequences[0].token_ids == beams.sequences[0].token_ids
    check_no_leak(engine.kv)


def test_sanitizer_catches_a_skipped_copy_on_write(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted bug: one copy-on-write is skipped, so a branch writes into the shared block."""
    original = KVCacheManager._copy_on_write
    skipped: list[int] = []

    def skip_first(self: KVCacheManager, blocks: list[int], index: int) -> None:
        if not skipped:
            skipped.append(blocks[index])
            return
        original(self, blocks, index)

    monkeypatch.setattr(KVCacheManager, "_copy_on_write", skip_first)
    # A block size that leaves the last prompt token in a partial, shared block.
    num_prompt = len(loaded.tokenizer.encode(PROMPT))
    block_size = next(b for b in (16, 8, 5, 3) if (num_prompt - 1) % b)
    # The sanitizer alone must catch it: the invariant checker is off.
    llm = make_llm(loaded, check_invariants=False, block_size=block_size)
    engine = llm.engine
    engine.add_request("g", PROMPT, SamplingParams(n=2, seed=1, temperature=1.0, max_tokens=4))
    while not engine.kv.has_table("g#1"):
        engine.step()
    # The sibling sits this step out (as when the budget or a preemption leaves it behind),
    # so the parent's write is the only one: nobody else moves off the shared block.
    sibling = next(r for r in engine.scheduler.running if r.request_id == "g#1")
    engine.scheduler.running.remove(sibling)
    fork_step = engine.scheduler.step
    with pytest.raises(InvariantError, match="KV sanitizer") as info:
        engine.step()
    assert skipped, "the planted bug never ran"
    assert f"step {fork_step + 1}:" in str(info.value)
    assert f"block {skipped[0]}, shared by ['g#0', 'g#1']" in str(info.value)


def test_sanitizer_catches_a_runtime_write_into_a_shared_block(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted runner bug: after the forward, a shared block's K is scribbled on."""
    original = ModelRunner.execute
    llm = make_llm(loaded, check_invariants=False, block_size=4)  # full prompt blocks to share
    engine = llm.engine

    def scribble(self: ModelRunner, plan: Any, *args: Any) -> Any:
        result = original(self, plan, *args)
        owners = engine.kv.block_owners()
        shared = [b for b, who in owners.items() if len(who) > 1]
        if shared and plan.step >= 4:
            self.kv.k[0][shared[0]] += 1.0
        return result

    monkeypatch.setattr(ModelRunner, "execute", scribble)
    engine.add_request("g", PROMPT, SamplingParams(n=2, seed=1, temperature=1.0, max_tokens=8))
    with pytest.raises(InvariantError, match=r"KV sanitizer, step \d+: shared block \d+ changed"):
        while engine.has_unfinished_requests():
            engine.step()


def test_bad_branching_input_is_rejected_before_allocation(loaded: LoadedModel) -> None:
    llm = make_llm(loaded, num_kv_blocks=32, block_size=16)
    for kwargs, param in [({"n": 0}, "n"), ({"n": 3, "best_of": 2}, "best_of")]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.param == param
    with pytest.raises(InvalidRequestError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    for penalty in (float("nan"), float("inf"), "1.0"):
        with pytest.raises(InvalidRequestError, match="length_penalty"):
            BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=penalty)  # type: ignore[arg-type]
    with pytest.raises(PromptTooLongError) as too_wide:
        llm.beam_search("word " * 200, BeamSearchParams(beam_width=10, max_tokens=64))
    assert too_wide.value.param == "beam_width"
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.engine.has_unfinished_requests()
