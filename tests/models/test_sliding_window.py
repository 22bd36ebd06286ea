"""Sliding-window attention and soft-capped attention scores, end to end, past the window.

Four families, tiny and random (test_families' recipe), each through the paged KV cache against
transformers' float32 forward on the same weights, recomputed from scratch every token (no KV
cache of its own to trust):

- Mistral: every layer slides, so the blocks wholly before a request's window are given back
  as it moves on (``KVCacheManager.release_outside_window``), and a request far longer than
  the pool runs in it;
- Qwen2 with ``max_window_layers``: the first layer sees everything, the second slides;
- Gemma 2: every other layer slides, and attention scores and logits are soft-capped;
- Gemma 3: local layers slide (with their own RoPE base), global ones see everything.

Block sizes 1, 4 and 16 (a window of 8 is shorter than a block, one block, and several), with
and without prefix caching, with prefix hits, preemption and swapping; the invariant checks
(given-back entries included) run after every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pagekv import SamplingParams
from pagekv.core.block_table import NO_BLOCK
from pagekv.core.invariants import check_no_leak
from pagekv.models import load_model
from pagekv.models.hf_loader import hf_config
from tests.engine.test_engine_golden import Reference, assert_matches_reference, make_llm
from tests.models.test_families import TINY, _reference_model, _save

transformers = pytest.importorskip("transformers")

WINDOW = 8
NEW_TOKENS = 16
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    "qwen2": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "sliding_window": WINDOW,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            # small caps, so that capping changes the numbers of these random weights
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 4.0,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
        },
    ),
}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@dataclass
class Family:
    name: str
    directory: Path
    prompts: list[list[int]]  # the first two share a 20-token prefix
    references: list[Reference]


def _full_forward_reference(model: Any, ids: list[int], steps: int) -> Reference:
    """Greedy tokens of transformers' forward over the whole sequence at every step."""
    tokens: list[int] = []
    step_logits = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids + tokens]), use_cache=False).logits
            step_logits.append(logits[0, -1].float())
            tokens.append(int(step_logits[-1].argmax()))
    logits = torch.stack(step_logits)
    top2 = logits.topk(2, dim=-1).values
    return Reference(tokens, torch.log_softmax(logits, dim=-1), (top2[:, 0] - top2[:, 1]).tolist())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name = request.param
    config_class, extra = FAMILIES[name]
    reference = _reference_model(config_class, **extra)
    directory = _save(reference, tmp_path_factory.mktemp(name))
    generator = torch.Generator().manual_seed(2)

    def ids(n: int) -> list[int]:
        return torch.randint(3, TINY["vocab_size"], (n,), generator=generator).tolist()

    shared = ids(20)
    prompts = [[*shared, *ids(9)], [*shared, *ids(3)], ids(3), ids(WINDOW), ids(37)]
    references = [_full_forward_reference(reference, p, NEW_TOKENS) for p in prompts]
    return Family(name, directory, prompts, references)


def _generate_and_check(family: Family, repeat: int = 1, **engine: object) -> dict[str, Any]:
    llm = make_llm(load_model(str(family.directory)), **engine)
    prompts, references = family.prompts * repeat, family.references * repeat
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for out, ref in zip(outs, references, strict=True):
        completion = out.outputs[0]
        assert completion.logprobs is not None
        logprobs = [completion.logprobs[j][t].logprob for j, t in enumerate(completion.token_ids)]
        assert_matches_reference(completion.token_ids, ref, logprobs)
    check_no_leak(llm.engine.kv)
    return llm.engine.stats()


def test_the_layers_windows_are_the_configs(family: Family) -> None:
    config = load_model(str(family.directory)).config
    expected = {
        "mistral": (WINDOW, WINDOW),
        "qwen2": (None, WINDOW),
        "gemma2": (WINDOW, None),
        "gemma3_text": (WINDOW, None),
    }[family.name]
    assert config.layer_windows == expected
    # only a window every layer shares lets the KV cache give blocks back
    assert config.kv_window == (WINDOW if family.name == "mistral" else None)
    assert (config.attn_logit_softcapping is not None) == (family.name == "gemma2")


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_equals_transformers_past_the_window(
    family: Family, block_size: int, prefix_caching: bool
) -> None:
    _generate_and_check(
        family,
        block_size=block_size,
        num_kv_blocks=1024 // block_size,
        enable_prefix_caching=prefix_caching,
    )


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_equals_transformers_with_prefix_hits_preemption_and_swap(
    family: Family, block_size: int
) -> None:
    """Few blocks, prompts in chunks: the second copies hit the first ones' prefix, and
    requests are swapped out and back (given-back entries stay given back on both sides)."""
    stats = _generate_and_check(
        family,
        repeat=2,
        block_size=block_size,
        # chunked prefill; a window holds fewer blocks: Mistral's pool is smaller, to preempt
        num_kv_blocks=(
            {1: 30, 4: 8, 16: 3}[block_size] if family.name == "mistral" else 64 // block_size
        ),
        max_num_batched_tokens=16,
        swap_space="16MiB",
        preemption_mode="swap",
    )
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["preemptions_swap"] > 0


def test_a_request_longer_than_the_pool_runs_in_its_window(tmp_path: Path) -> None:
    """Mistral: 120 prompt tokens and 80 new ones in a pool of 20 blocks of 4 (80 tokens): the
    blocks before the window go back to the pool as the request moves on, so it never holds
    more than a window and a chunk span, and its tokens still equal transformers'."""
    config_class, extra = FAMILIES["mistral"]
    reference = _reference_model(config_class, **extra)
    loaded = load_model(str(_save(reference, tmp_path)))
    prompt = torch.randint(3, TINY["vocab_size"], (120,)).tolist()
    steps = 80
    ref = _full_forward_reference(reference, prompt, steps)
    llm = make_llm(loaded, block_size=4, num_kv_blocks=20, max_num_batched_tokens=32)
    engine, kv = llm.engine, llm.engine.kv
    most = kv.most_blocks_held(len(prompt), len(prompt) + steps, 32)
    assert most == 11 < kv.num_blocks_for(len(prompt) + steps)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=0)
    engine.add_request("long", prompt, params)
    outputs, dropped_seen = [], 0
    for _ in range(200):  # bounded: a request that cannot fit would loop on preemption
        if not engine.has_unfinished_requests():
            break
        outputs += [o for o in engine.step() if o.finished]
        assert kv.usage().num_used_blocks <= most
        if kv.has_table("long"):
            dropped_seen = max(dropped_seen, kv.block_table("long").count(NO_BLOCK))
    assert not engine.has_unfinished_requests() and len(outputs) == 1
    assert engine.stats()["preemptions_recompute"] == 0
    assert dropped_seen >= (len(prompt) + steps - WINDOW) // 4 - 1
    completion = outputs[0].outputs[0]
    assert completion.logprobs is not None
    logprobs = [completion.logprobs[j][t].logprob for j, t in enumerate(completion.token_ids)]
    assert_matches_reference(completion.token_ids, ref, logprobs)
    check_no_leak(kv)


@pytest.mark.parametrize(
    ("raw", "window", "types"),
    [
        ({"model_type": "mistral", "sliding_window": None}, None, None),
        ({"model_type": "mistral", "sliding_window": 4096}, 4096, None),
        ({"model_type": "phi3", "sliding_window": 2047}, 2047, None),
        ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096}, None, None),
        # Qwen2Config's default max_window_layers (28) leaves these two layers full
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}, None, None),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}
            | {"max_window_layers": 0},
            64,
            ("sliding_attention",) * 2,
        ),
        (
            {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64}
            | {"layer_types": ["full_attention", "sliding_attention"]},
            64,
            ("full_attention", "sliding_attention"),
        ),
        (
            {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64}
            | {"layer_types": ["full_attention", "full_attention"]},  # no layer slides
            None,
            None,
        ),
    ],
)
def test_the_config_carries_the_window_only_where_it_is_on(
    raw: dict[str, Any], window: int | None, types: tuple[str, ...] | None
) -> None:
    shapes = {k: v for k, v in TINY.items() if not k.endswith("token_id")}
    config = hf_config({**shapes, **raw}, "test")
    assert (config.sliding_window, config.layer_types) == (window, types)
