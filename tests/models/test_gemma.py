"""Gemma 3 text: pagekv's greedy tokens and logprobs equal transformers' on the same weights.

A tiny random Gemma3ForCausalLM (local and global layers, two RoPE bases, linear RoPE scaling
on the global ones, an attention scale that is not head_dim's, soft-capped logits, norm weights
far from zero so that the (1 + w) rule matters) is saved as an HF directory; pagekv loads the
directory, transformers (float32, eager attention) the same directory. The sliding window is
as long as the model's context, so sliding and full attention agree on every prompt here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models as tokenizer_models

from pagekv import SamplingParams
from pagekv.core.invariants import check_no_leak
from pagekv.errors import ModelLoadError
from pagekv.llm import LLM
from pagekv.models import LoadedModel, load_model
from pagekv.models.gemma import Gemma3ForCausalLM
from pagekv.models.hf_loader import hf_config
from tests.engine.test_engine_golden import (
    Reference,
    _greedy_reference,
    assert_matches_reference,
    make_llm,
)

transformers = pytest.importorskip("transformers")

CONTEXT = 256
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": CONTEXT,
    "sliding_window": CONTEXT,
    "layer_types": LAYER_TYPES,
    "query_pre_attn_scalar": 24,
    "final_logit_softcapping": 4.0,
    "initializer_range": 0.1,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
}
PROMPT_LENGTHS = [3, 17, 31, 48, 70, 101]
NUM_NEW_TOKENS = 24
LOGPROB_TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(**TINY)
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # HF initializes them to 0: (1 + w) would be 1
                param.normal_(0, 1.0)
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    BackendTokenizer(tokenizer_models.WordLevel(vocab, unk_token="t0")).save(
        str(directory / "tokenizer.json")
    )
    return directory


@pytest.fixture(scope="module")
def hf_gemma(gemma_dir: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma_dir, dtype=torch.float32, attn_implementation="eager"
    )
    assert type(model).__name__ == "Gemma3ForCausalLM"
    return model.eval()


@pytest.fixture(scope="module")
def gemma(gemma_dir: Path) -> LoadedModel:
    return load_model(str(gemma_dir))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS
    ]


@pytest.fixture(scope="module")
def references(prompts: list[list[int]], hf_gemma: Any) -> list[Reference]:
    refs = [_greedy_reference(hf_gemma, ids, NUM_NEW_TOKENS) for ids in prompts]
    # a random model may repeat one token forever, and then hardly tests anything
    assert sum(len(set(r.tokens)) for r in refs) > 5 * len(refs)
    return refs


def _assert_greedy_matches(llm: LLM, prompts: list[list[int]], refs: list[Reference]) -> None:
    """Equal tokens (either of a near tie), and every logprob close while they agree."""
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        completion = out.outputs[0]
        assert completion.logprobs is not None
        ours_lp = [completion.logprobs[j][t].logprob for j, t in enumerate(completion.token_ids)]
        assert_matches_reference(completion.token_ids, ref, ours_lp)
        for j, (ours, theirs) in enumerate(zip(completion.token_ids, ref.tokens, strict=True)):
            if ours != theirs:
                break
            assert abs(ours_lp[j] - float(ref.logprobs[j, ours])) < LOGPROB_TOL, f"logprob {j}"


def test_the_directory_loads_as_gemma3(gemma: LoadedModel) -> None:
    cfg = gemma.config
    assert type(gemma.model) is Gemma3ForCausalLM
    assert cfg.model_type == "gemma3_text" and cfg.tie_word_embeddings
    assert cfg.layer_types == tuple(LAYER_TYPES) and cfg.sliding_window == CONTEXT
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert cfg.rope_scaling == (("factor", 8.0), ("rope_type", "linear"))
    assert cfg.attention_scale == 24**-0.5 and cfg.final_logit_softcapping == 4.0


def _scaled_attention(scale: float) -> Any:
    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)

    return attention


def test_logits_match_transformers(
    gemma: LoadedModel, hf_gemma: Any, prompts: list[list[int]]
) -> None:
    ids = prompts[-1]
    with torch.inference_mode():
        model = gemma.model
        hidden = model(
            torch.tensor(ids),
            torch.arange(len(ids)),
            _scaled_attention(gemma.config.attention_scale),
        )
        ours = model.compute_logits(hidden)
        expected = hf_gemma(torch.tensor([ids])).logits[0]
    assert expected.abs().max() > 1.0  # soft-capping at 4 bends logits this large
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_equals_transformers(
    gemma: LoadedModel,
    prompts: list[list[int]],
    references: list[Reference],
    block_size: int,
    prefix_caching: bool,
) -> None:
    llm = make_llm(
        gemma,
        block_size=block_size,
        num_kv_blocks=2048 // block_size,
        enable_prefix_caching=prefix_caching,
    )
    _assert_greedy_matches(llm, prompts, references)
    check_no_leak(llm.engine.kv)


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_equals_transformers_with_prefix_hits_and_preemption(
    gemma: LoadedModel, prompts: list[list[int]], references: list[Reference], block_size: int
) -> None:
    """Few blocks: the second copy of each prompt hits the first's cached blocks, and requests
    are preempted and recomputed."""
    llm = make_llm(gemma, block_size=block_size, num_kv_blocks=320 // block_size)
    _assert_greedy_matches(llm, prompts + prompts, references + references)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["preemptions_recompute"] > 0
    check_no_leak(llm.engine.kv)


def test_greedy_equals_transformers_on_every_kernel_target(
    gemma: LoadedModel, prompts: list[list[int]], references: list[Reference], kernel_target: str
) -> None:
    llm = make_llm(gemma, block_size=16, num_kv_blocks=128)
    assert llm.engine.runner.kernels["kernel_target"] == kernel_target
    _assert_greedy_matches(llm, prompts, references)
    check_no_leak(llm.engine.kv)


def _old_style(config: dict[str, Any]) -> dict[str, Any]:
    """The same model as config.json files written before transformers 5 say it."""
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    return old | {
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 2,  # every second layer global, as LAYER_TYPES
    }


def test_older_config_spelling_reads_the_same(gemma_dir: Path, gemma: LoadedModel) -> None:
    config = json.loads((gemma_dir / "config.json").read_text())
    assert hf_config(_old_style(config), "old") == gemma.config


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"hidden_activation": "relu"}, "activation 'relu' is not supported"),
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
        ({"model_type": "gemma4"}, "unsupported architecture 'gemma4'"),
        ({"layer_types": LAYER_TYPES[:3]}, "layer_types names 3 layers, not num_hidden_layers 4"),
        ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ],
)
def test_what_pagekv_does_not_run_is_refused(
    gemma_dir: Path, change: dict[str, Any], problem: str
) -> None:
    config = json.loads((gemma_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=problem):
        hf_config(config | change, "here")


def test_kept_rows_are_those_rows_of_the_whole_pass(
    gemma: LoadedModel, prompts: list[list[int]]
) -> None:
    """Gemma's forward(keep=rows): the kept rows of the whole pass, the last layer taking the
    others no further than their K/V."""
    from tests.models_fixtures import sdpa_attention

    ids = torch.tensor(prompts[-1])
    positions = torch.arange(len(ids))
    keep = torch.tensor([0, 5, len(ids) - 1])
    with torch.inference_mode():
        whole = gemma.model(ids, positions, sdpa_attention)
        got = gemma.model(ids, positions, sdpa_attention, keep)
    assert got.shape == (3, whole.shape[1])
    torch.testing.assert_close(got, whole[keep])
