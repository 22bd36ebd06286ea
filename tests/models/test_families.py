"""Model families beyond Llama: Qwen3 (per-head q/k norms, head_dim of its own) and Phi-3 (fused
qkv and gate_up checkpoint tensors); sliding windows are test_sliding_window's.

Tiny random models built from each family's transformers config, saved as HF directories (and
GGUF files) at test time; pagekv's greedy tokens through the paged KV cache equal transformers'
float32 ones on the same weights: block sizes 1 and 16, with and without prefix hits and
preemption, on every kernel target this CPU runs; and for head sizes 128 and 256, requests of
one prompt decoding together through cascade attention over their shared prefix.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models as tokenizer_models

from pagekv import SamplingParams
from pagekv.core.invariants import check_no_leak
from pagekv.errors import ModelLoadError
from pagekv.kernels import build
from pagekv.kernels.prefill import PrefillKernel
from pagekv.models import LoadedModel, load_model
from pagekv.models.hf_loader import hf_config
from pagekv.models.registry import architecture
from pagekv.runner import fast_attention
from tests.engine.test_engine_golden import (
    Reference,
    _greedy_reference,
    assert_matches_reference,
    make_llm,
)
from tests.engine.test_engine_golden_bf16 import MIN_COMPARED_FRACTION, agreeing_prefix
from tests.models.test_model_registry import _write_gguf
from tests.models_fixtures import full_logits

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12
TINY = {
    "vocab_size": 259,  # test_model_registry's GGUF tokenizer
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 2.0**-16,  # exact in the float32 of GGUF metadata
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
WIDE = {"hidden_size": 96, "num_key_value_heads": 2}  # 96: whole heads of 12 and of 8
FAMILIES = {  # name: model_type, or model_type-variant
    # head_dim not hidden / heads, as in real Qwen3 checkpoints
    "qwen3": ("Qwen3Config", {"head_dim": 24}),
    "phi3": ("Phi3Config", {}),
    # the head sizes and GQA groups of the models people run: 128 with 6 query heads a KV head
    # (Qwen2.5-1.5B's 12 on 2), 256 with 4 (Gemma 3's 4 on 1)
    "llama-hd128": (
        "LlamaConfig",
        {**WIDE, "head_dim": 128, "num_attention_heads": 12},
    ),
    "llama-hd256": (
        "LlamaConfig",
        {**WIDE, "head_dim": 256, "num_attention_heads": 8},
    ),
}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@dataclass
class Family:
    directory: Path  # the HF directory
    gguf: Path
    prompts: list[list[int]]  # two sharing a long prefix
    references: list[Reference]


def _reference_model(config_class: str, **extra: Any) -> Any:
    """transformers' model of a tiny config, its weights spread so that greedy tokens are
    decisive and the norms (q/k norms included) are not all ones."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_class)(**{**TINY, **extra})
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.3) if "norm" in name else param.normal_(0.0, 0.15)
    return model


def _save(model: Any, directory: Path) -> Path:
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    BackendTokenizer(tokenizer_models.WordLevel(vocab, unk_token="t0")).save(
        str(directory / "tokenizer.json")
    )
    return directory


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name = request.param
    model_type = name.split("-")[0]
    config_class, extra = FAMILIES[name]
    reference = _reference_model(config_class, **extra)
    directory = _save(reference, tmp_path_factory.mktemp(name))
    loaded = load_model(str(directory))
    assert loaded.config.model_type == model_type
    arch = architecture(model_type, "test")
    assert arch.gguf is not None
    gguf_path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
    gguf = _write_gguf(gguf_path, loaded.model, model_type, arch.gguf, arch.gguf_rope_permuted)
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(3, TINY["vocab_size"], (40,), generator=generator).tolist()
    prompts = [
        [*shared, 7, 8, 9],
        [*shared, 10, 11],
        torch.randint(3, TINY["vocab_size"], (23,), generator=generator).tolist(),
        [5],
    ]
    references = [_greedy_reference(reference, ids, NEW_TOKENS) for ids in prompts]
    return Family(directory, gguf, prompts, references)


def _assert_greedy_matches(
    loaded: LoadedModel, family: Family, repeat: int = 1, **engine: object
) -> dict[str, Any]:
    llm = make_llm(loaded, **engine)
    prompts, references = family.prompts * repeat, family.references * repeat
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY, use_tqdm=False)
    for out, ref in zip(outs, references, strict=True):
        completion = out.outputs[0]
        assert completion.logprobs is not None
        ours_lp = [completion.logprobs[j][t].logprob for j, t in enumerate(completion.token_ids)]
        assert_matches_reference(completion.token_ids, ref, ours_lp)
    check_no_leak(llm.engine.kv)
    return llm.engine.stats()


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_equals_transformers(family: Family, block_size: int, prefix_caching: bool) -> None:
    _assert_greedy_matches(
        load_model(str(family.directory)),
        family,
        block_size=block_size,
        num_kv_blocks=1024 // block_size,
        enable_prefix_caching=prefix_caching,
    )


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_equals_transformers_with_prefix_hits_and_preemption(
    family: Family, block_size: int, source: str
) -> None:
    """Few blocks: the second copies hit the first ones' cached prefix, and requests are
    preempted and recomputed."""
    loaded = load_model(str(family.directory if source == "hf" else family.gguf))
    stats = _assert_greedy_matches(
        loaded, family, repeat=2, block_size=block_size, num_kv_blocks=128 // block_size
    )
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["preemptions_recompute"] > 0


def test_greedy_equals_transformers_on_every_kernel_target(
    family: Family, kernel_target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """...with prefix hits and preemption; and the attention ran where the start-up line says:
    the C kernels wherever they take the model's head size (64, 128, 256), torch's ops (SDPA,
    the torch decode) only where it says so."""
    loaded = load_model(str(family.directory))
    llm = make_llm(loaded, block_size=16, num_kv_blocks=8)
    kernels = llm.engine.runner.kernels
    assert kernels["kernel_target"] == kernel_target
    head_dim = loaded.config.head_dim
    if head_dim in (64, 128, 256) and build.find_compiler() is not None:
        assert kernels["prefill_attention"] == kernels["decode_attention"] == "C++", kernels
    calls = count_attention_paths(monkeypatch)
    stats = _assert_greedy_matches(loaded, family, repeat=2, block_size=16, num_kv_blocks=8)
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["preemptions_recompute"] > 0
    ran_prefill = {"C++"} if calls["prefill C++"] else set()
    ran_prefill |= {"SDPA"} if calls["prefill SDPA"] else set()
    assert ran_prefill == {kernels["prefill_attention"]}, calls
    assert bool(calls["decode torch"]) == (kernels["decode_attention"] == "torch"), calls


@pytest.mark.parametrize("family", ["llama-hd128", "llama-hd256"], indirect=True)
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_8_bit_blocks_agree_with_transformers_by_the_bf16_rule(
    family: Family, kv_dtype: str
) -> None:
    """8-bit KV blocks (#60) with prefix hits and preemption: tokens agree until a near tie,
    each agreeing token's logprob close (test_engine_golden_bf16's rule)."""
    llm = make_llm(
        load_model(str(family.directory)), kv_cache_dtype=kv_dtype, block_size=16, num_kv_blocks=8
    )
    prompts, references = family.prompts * 2, family.references * 2
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY, use_tqdm=False)
    agreed = 0
    for out, ref in zip(outs, references, strict=True):
        completion = out.outputs[0]
        logprobs = [completion.logprobs[j][t].logprob for j, t in enumerate(completion.token_ids)]
        agreed += agreeing_prefix(completion.token_ids, logprobs, ref)
    # e4m3 keeps 3 mantissa bits (int8 about 7 of a row's largest value): on these tiny random
    # models its first near tie comes sooner (hd128: after 20 of 96 tokens), so a lower floor
    floor = MIN_COMPARED_FRACTION if kv_dtype == "int8" else MIN_COMPARED_FRACTION / 2
    assert agreed >= floor * NEW_TOKENS * len(prompts), agreed
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["preemptions_recompute"] > 0
    check_no_leak(llm.engine.kv)


@pytest.mark.parametrize("family", ["llama-hd128", "llama-hd256"], indirect=True)
def test_shared_prefixes_decode_by_cascade_and_equal_transformers(
    family: Family, kernel_target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies of one long prompt decoding together, float32: the later copies hit the first
    one's cached blocks, so every decode step has at least CASCADE_MIN_ROWS rows sharing a
    prefix, and every layer of every decode step attends it by cascade in C (the prefill
    kernel's float32 vectors); the greedy tokens still equal transformers'."""
    if build.find_compiler() is None:
        pytest.skip("no C++ compiler: the kernels are optional")
    loaded = load_model(str(family.directory))
    one_prompt = dataclasses.replace(
        family, prompts=family.prompts[:1], references=family.references[:1]
    )
    calls = count_attention_paths(monkeypatch)
    stats = _assert_greedy_matches(
        loaded, one_prompt, repeat=fast_attention.CASCADE_MIN_ROWS + 2, block_size=16
    )
    assert stats["prefix_cache_hit_tokens"] > 0
    decode_steps = NEW_TOKENS - 1  # the first token comes with the prefill
    assert calls["cascade C++"] == decode_steps * TINY["num_hidden_layers"], calls


def count_attention_paths(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts, from here on, the calls of the prefill kernel (chunks, and cascade attention's
    ``shared_prefix``) that ran, not declining with False, and of torch's attention paths (the
    decode kernel also runs inside C layer stacks, where Python does not see it)."""
    calls: Counter[str] = Counter()

    def counted(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def counting(*args: Any, **kwargs: Any) -> Any:
            result = function(*args, **kwargs)
            if result is not False:
                calls[name] += 1
            return result

        return counting

    monkeypatch.setattr(PrefillKernel, "__call__", counted("prefill C++", PrefillKernel.__call__))
    monkeypatch.setattr(
        PrefillKernel, "shared_prefix", counted("cascade C++", PrefillKernel.shared_prefix)
    )
    for name, path in (
        ("_prefill_chunk", "prefill SDPA"),
        ("_prefill_group", "prefill SDPA"),
        ("decode_attention_torch", "decode torch"),
    ):
        monkeypatch.setattr(fast_attention, name, counted(path, getattr(fast_attention, name)))
    return calls


def test_gguf_file_loads_the_same_model(family: Family) -> None:
    from_dir, from_gguf = load_model(str(family.directory)), load_model(str(family.gguf))
    assert from_gguf.config == from_dir.config
    ids = family.prompts[0]
    torch.testing.assert_close(
        full_logits(from_gguf.model, ids), full_logits(from_dir.model, ids), atol=0, rtol=0
    )


@pytest.mark.parametrize(
    ("config_class", "extra"),
    [
        ("Qwen3Config", {"head_dim": 32, "attention_bias": True}),
        ("Qwen3Config", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
        ("Phi3Config", {"num_key_value_heads": 1}),
    ],
)
def test_logits_equal_transformers(config_class: str, extra: dict[str, Any]) -> None:
    reference = _reference_model(config_class, **extra)
    config = hf_config(reference.config.to_dict(), config_class)
    assert config.attention_bias == bool(extra.get("attention_bias"))
    model = architecture(config.model_type, "test").model_class(config, torch.float32)
    with torch.no_grad():
        model.load_weights(reference.state_dict().items())
    ids = torch.randint(0, TINY["vocab_size"], (40,)).tolist()
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(model, ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
            "unsupported rope_scaling type 'longrope'",
        ),
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not supported"),
        ({"rope_parameters": {"partial_rotary_factor": 0.5}}, "partial_rotary_factor 0.5"),
    ],
)
def test_phi3_variants_not_implemented_are_refused(
    tmp_path: Path, changes: dict[str, Any], problem: str
) -> None:
    directory = _save(_reference_model("Phi3Config"), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    del config["rope_parameters"]  # as in config.json files older than transformers 5
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ModelLoadError, match=problem):
        load_model(str(directory))
