"""Golden tests: pagekv's greedy tokens equal Hugging Face transformers' on the same weights.

The reference is transformers loading the same GGUF file (fp32), one prompt at a time, so no
padding or batching can hide a difference. pagekv runs all prompts batched, through the paged
KV cache, at several block sizes, with prefix caching on and off, invariants checked each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pagekv import SamplingParams
from pagekv.core.invariants import check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel

pytestmark = pytest.mark.model

NUM_NEW_TOKENS = 64
TIE_MARGIN = 1e-4
LOGPROB_TOL = 1e-3

_LONG = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books quickly and cheaply. Before this, manuscripts were "
    "copied by hand, usually by monks working in scriptoria, and a single book could take "
    "months to finish. The new method spread across Europe within a few decades: by 1500, "
    "presses were operating in more than two hundred cities, and millions of volumes had been "
    "printed. Scholars could now compare identical copies of a text, which changed how "
    "knowledge was checked and shared. Religious reformers used pamphlets to reach ordinary "
    "readers, governments printed laws and proclamations, and merchants relied on printed "
    "price lists and maps. Literacy rose slowly but steadily, and vernacular languages gained "
    "prestige as more books appeared in them rather than in Latin. Historians still debate "
    "how much the press caused these changes and how much it simply accelerated trends that "
    "were already under way, but few doubt that it was one of the most important inventions "
    "of the millennium. The press also changed the economics of writing. Authors could, for "
    "the first time, reach thousands of readers they would never meet, and printers competed "
    "to publish popular titles, which encouraged new genres such as newspapers, almanacs and "
    "novels. Errors could be corrected in a later edition instead of multiplying with every "
    "hand-made copy, and standard spellings slowly emerged because printers wanted consistent "
    "type. Universities built libraries of printed books, and scientists such as Copernicus, "
    "Vesalius and Galileo spread their findings with detailed printed diagrams that every "
    "reader saw in the same form. Music, too, was printed, so that the same song could be "
    "performed in many towns. By the eighteenth century, cheap print had become part of daily "
    "life, feeding debates in coffee houses and salons. In summary, the most important "
    "consequence of the printing press was"
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4, 5,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "Translate to French: Good morning, how are you?",
    _LONG,
]


@dataclass
class Reference:
    tokens: list[int]
    logprobs: torch.Tensor  # [steps, vocab] log-softmax of the reference's logits
    margins: list[float]  # top-1 minus top-2 logit at each step


@pytest.fixture(scope="module")
def prompt_ids(loaded: LoadedModel) -> list[list[int]]:
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    assert max(len(i) for i in ids) > 300, "the golden set needs one prompt over 300 tokens"
    return ids


@pytest.fixture(scope="module")
def reference(prompt_ids: list[list[int]], hf_model: Any) -> list[Reference]:
    return [_greedy_reference(hf_model, ids) for ids in prompt_ids]


def _greedy_reference(
    model: torch.nn.Module,
    ids: list[int],
    steps: int = NUM_NEW_TOKENS,
    process: Callable[[list[int], torch.Tensor], torch.Tensor] | None = None,
) -> Reference:
    """transformers' own forward with its KV cache, argmax each step, eos not special
    (pagekv runs with ignore_eos); ``process(tokens so far, logits)`` first, if given."""
    tokens: list[int] = []
    step_logits = []
    past = None
    inputs = torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(steps):
            out = model(input_ids=inputs, past_key_values=past, use_cache=True)
            logits = out.logits[0, -1].float()  # [vocab]
            past = out.past_key_values
            if process is not None:
                logits = process(tokens, logits)
            token = int(logits.argmax())
            tokens.append(token)
            step_logits.append(logits)
            inputs = torch.tensor([[token]])
    logits = torch.stack(step_logits)  # [steps, vocab]
    top2 = logits.topk(2, dim=-1).values
    return Reference(
        tokens=tokens,
        logprobs=torch.log_softmax(logits, dim=-1),
        margins=(top2[:, 0] - top2[:, 1]).tolist(),
    )


def assert_matches_reference(
    ours: list[int], ref: Reference, ours_logprobs: list[float] | None
) -> None:
    """Equal tokens; at a near tie (top-2 within 1e-4) either token, with a close logprob."""
    assert len(ours) == len(ref.tokens)
    for j, (a, b) in enumerate(zip(ours, ref.tokens, strict=True)):
        if a == b:
            continue
        assert ref.margins[j] < TIE_MARGIN, f"token {j}: ours {a} != reference {b} (no near tie)"
        second = ref.logprobs[j].topk(2).indices.tolist()
        assert a in second, f"token {j}: ours {a} is not in the reference's top 2 {second}"
        if ours_logprobs is not None:
            assert abs(ours_logprobs[j] - float(ref.logprobs[j, a])) < LOGPROB_TOL
        return  # the sequences legitimately diverge after a near tie


def make_llm(loaded: LoadedModel, **kwargs: object) -> LLM:
    config = EngineConfig(check_invariants=True, **kwargs)  # type: ignore[arg-type]
    return LLM.from_engine(LLMEngine(config, loaded))


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_equals_transformers(
    loaded: LoadedModel,
    prompt_ids: list[list[int]],
    reference: list[Reference],
    block_size: int,
    prefix_caching: bool,
) -> None:
    llm = make_llm(
        loaded,
        block_size=block_size,
        num_kv_blocks=4096 // block_size * 4,
        enable_prefix_caching=prefix_caching,
    )
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY, use_tqdm=False)
    for out, ids, ref in zip(outs, prompt_ids, reference, strict=True):
        assert out.prompt_token_ids == ids
        completion = out.outputs[0]
        assert completion.finish_reason == "length"
        assert completion.logprobs is not None
        ours_lp = [completion.logprobs[j][t].logprob for j, t in enumerate(completion.token_ids)]
        assert_matches_reference(completion.token_ids, ref, ours_lp)
    check_no_leak(llm.engine.kv)


def _assert_greedy_matches(
    llm: LLM, prompt_ids: list[list[int]], reference: list[Reference]
) -> None:
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY, use_tqdm=False)
    for out, ref in zip(outs, reference, strict=True):
        completion = out.outputs[0]
        assert completion.logprobs is not None
        ours_lp = [completion.logprobs[j][t].logprob for j, t in enumerate(completion.token_ids)]
        assert_matches_reference(completion.token_ids, ref, ours_lp)


def test_greedy_equals_transformers_on_every_kernel_target(
    loaded: LoadedModel, prompt_ids: list[list[int]], reference: list[Reference], kernel_target: str
) -> None:
    """The same rule on each kernel target this CPU runs (its own matmul, attention and layer
    kernels)."""
    llm = make_llm(loaded, block_size=16, num_kv_blocks=1024)
    assert llm.engine.runner.kernels["kernel_target"] == kernel_target
    _assert_greedy_matches(llm, prompt_ids, reference)
    check_no_leak(llm.engine.kv)


def test_greedy_equals_transformers_with_gguf_weights_on_every_kernel_target(
    loaded_gguf: LoadedModel,
    prompt_ids: list[list[int]],
    reference: list[Reference],
    kernel_target: str,
) -> None:
    """The exact path (``gguf_activations="dtype"``): the file's quant blocks multiplied by
    the kernels, dequantized in registers to the reference's own float32 weights: the same
    tokens."""
    llm = make_llm(loaded_gguf, block_size=16, num_kv_blocks=1024, gguf_activations="dtype")
    assert llm.engine.runner.kernels["weights"].startswith("GGUF")
    _assert_greedy_matches(llm, prompt_ids, reference)
    check_no_leak(llm.engine.kv)


@pytest.mark.parametrize("block_size", [1, 32])
def test_greedy_equals_transformers_with_gguf_weights_prefix_hits_and_preemption(
    loaded_gguf: LoadedModel,
    prompt_ids: list[list[int]],
    reference: list[Reference],
    block_size: int,
) -> None:
    """Few blocks: prompts share a cached prefix, and requests are preempted and recomputed."""
    llm = make_llm(
        loaded_gguf,
        block_size=block_size,
        num_kv_blocks=800 // block_size,
        gguf_activations="dtype",
    )
    # the second copies hit the first ones' blocks
    _assert_greedy_matches(llm, prompt_ids + prompt_ids, reference + reference)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["preemptions_recompute"] > 0
    check_no_leak(llm.engine.kv)


def test_greedy_equals_transformers_with_the_c_kernels_off(
    loaded: LoadedModel,
    prompt_ids: list[list[int]],
    reference: list[Reference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAGEKV_CPU_ISA", "none")
    llm = make_llm(loaded, block_size=16, num_kv_blocks=1024)
    assert llm.engine.runner.kernels["decode_attention"] == "torch"
    _assert_greedy_matches(llm, prompt_ids, reference)


def test_cold_and_warm_outputs_identical(loaded: LoadedModel, prompt_ids: list[list[int]]) -> None:
    llm = make_llm(loaded, block_size=16, num_kv_blocks=1024)
    batch = [{"prompt_token_ids": ids} for ids in prompt_ids]
    cold = llm.generate(batch, GREEDY, use_tqdm=False)
    hits_before = llm.stats()["prefix_cache_hit_tokens"]
    warm = llm.generate(batch, GREEDY, use_tqdm=False)
    hits = llm.stats()["prefix_cache_hit_tokens"] - hits_before
    assert hits >= sum(len(i) // 16 * 16 - 16 for i in prompt_ids), "warm run must hit the cache"
    assert all(o.num_cached_tokens > 0 for o in warm if len(o.prompt_token_ids) > 16)
    for c, w in zip(cold, warm, strict=True):
        assert c.outputs[0].token_ids == w.outputs[0].token_ids
    check_no_leak(llm.engine.kv)


def test_seeded_sampling_independent_of_batch(loaded: LoadedModel) -> None:
    llm = make_llm(loaded, block_size=16, num_kv_blocks=1024)
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate("Write a short poem about the sea.", target, use_tqdm=False)[0]
    others = [
        SamplingParams(
            temperature=1.0, seed=(i if i % 2 else None), max_tokens=8 + i, ignore_eos=True
        )
        for i in range(16)
    ]
    prompts = [f"Story number {i}: once there was" for i in range(16)]
    prompts.insert(7, "Write a short poem about the sea.")
    others.insert(7, target)
    batched = llm.generate(prompts, others, use_tqdm=False)[7]
    assert alone.outputs[0].token_ids == batched.outputs[0].token_ids
    check_no_leak(llm.engine.kv)


def _penalized_reference(
    model: torch.nn.Module, ids: list[int], steps: int, params: SamplingParams
) -> Reference:
    """Greedy with penalties: transformers' logits and its own RepetitionPenaltyLogitsProcessor
    (over prompt + output), then OpenAI's frequency and presence penalties (over the output)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    repetition = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)

    def penalize(tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits = repetition(torch.tensor([ids + tokens]), logits[None])[0]
        counts = torch.zeros_like(logits)
        for t in tokens:
            counts[t] += 1
        logits = logits - params.frequency_penalty * counts
        return logits - params.presence_penalty * (counts > 0).float()

    return _greedy_reference(model, ids, steps, penalize)


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.8},  # below 1: seen tokens are favoured
        {"frequency_penalty": 0.7, "presence_penalty": 0.4},
        {"repetition_penalty": 1.2, "frequency_penalty": -0.5, "presence_penalty": 1.5},
    ],
)
def test_penalized_greedy_equals_transformers(
    loaded: LoadedModel, hf_model: Any, prompt_ids: list[list[int]], penalties: dict[str, float]
) -> None:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **penalties)
    chosen = [prompt_ids[2], prompt_ids[3], prompt_ids[4]]  # a story, a count, a chat turn
    llm = make_llm(loaded, block_size=16, num_kv_blocks=256)
    plain = llm.generate([{"prompt_token_ids": ids} for ids in chosen], GREEDY, use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in chosen], params, use_tqdm=False)
    for out, ids in zip(outs, chosen, strict=True):
        ref = _penalized_reference(hf_model, ids, 32, params)
        assert_matches_reference(out.outputs[0].token_ids, ref, None)
    pairs = zip(outs, plain, strict=True)
    changed = [o.outputs[0].token_ids != p.outputs[0].token_ids[:32] for o, p in pairs]
    assert any(changed), "the penalties changed no output: the test would not see them ignored"
    check_no_leak(llm.engine.kv)
