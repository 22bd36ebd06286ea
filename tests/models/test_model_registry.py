"""The model registry: an architecture name picks its model class and weight names from one
table, an unknown one is refused naming the supported ones, and one table entry is all a new
architecture needs to load from an HF directory and from a GGUF file.

Tiny random weights written at test time; no real model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models as tokenizer_models

from pagekv.errors import ModelLoadError
from pagekv.models import LlamaForCausalLM, ModelConfig, load_model, registry
from pagekv.models.gguf_tokenizer import byte_alphabet
from pagekv.models.llama import _slice
from pagekv.models.llama_family import GGUF_NAMES
from pagekv.models.registry import ARCHITECTURES, Architecture, GGUFNames

SHAPES = {
    "vocab_size": 259,  # the GGUF tokenizer below: 256 bytes, one merge, two control tokens
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
# every registered architecture, in the registry's order (the order messages list them)
SUPPORTED = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma3")
GGUF_SUPPORTED = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma3")


class ToyForCausalLM(LlamaForCausalLM):
    """A test-local model class: the Llama decoder under a name of its own."""


# Always q/k/v bias (as Qwen2), its GGUF rows not permuted: both differ from Llama's.
TOY = Architecture(ToyForCausalLM, GGUF_NAMES, hf_attention_bias=True)
ODD = Architecture(lambda config, dtype: {})  # builds something the runner cannot drive


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one registration line of a new architecture, for this test only."""
    monkeypatch.setitem(ARCHITECTURES, "toy", (__name__, "TOY"))


def _config(model_type: str = "toy", **changes: object) -> ModelConfig:
    fields: dict[str, Any] = {
        "model_type": model_type,
        **SHAPES,
        "head_dim": 16,
        "rms_norm_eps": 2.0**-16,  # exact in the float32 of GGUF metadata
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": True,
        **changes,
    }
    return ModelConfig(**fields)


def _random_model(config: ModelConfig) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config, torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model


def _hf_named(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {
        name: _slice(module, param, part, model.config).clone()
        for name, (module, param, part) in model._targets().items()
    }


def _logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1)

    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), attention)
        return model.compute_logits(hidden)


def test_every_registered_name_is_an_architecture_of_a_llama_class() -> None:
    assert registry.architecture_names() == SUPPORTED
    for name in registry.architecture_names():
        arch = registry.architecture(name, "test")
        assert isinstance(arch, Architecture)
        assert isinstance(arch.model_class, type) and issubclass(arch.model_class, LlamaForCausalLM)
    assert registry.gguf_architecture_names() == GGUF_SUPPORTED
    assert registry.architecture("llama", "t").gguf_rope_permuted
    assert registry.architecture("qwen2", "t").hf_attention_bias


@pytest.mark.parametrize("name", ["bert", None, 7])
def test_unknown_architecture_is_refused_naming_the_supported_ones(name: object) -> None:
    with pytest.raises(ModelLoadError) as info:
        registry.architecture(name, "somewhere")
    assert str(info.value) == (
        f"somewhere: unsupported architecture {name!r}; supported: {SUPPORTED}"
    )
    with pytest.raises(ModelLoadError, match=re.escape(f"known: {SUPPORTED}")):
        _config(model_type=str(name))


def test_a_gguf_file_of_an_unknown_architecture_is_refused(tmp_path: Path) -> None:
    for name in ("bert", "mistral"):  # mistral: registered, but no GGUF files of its own
        path = _write_gguf(tmp_path / f"{name}.gguf", _random_model(_config("llama")), name)
        with pytest.raises(ModelLoadError) as info:
            load_model(str(path))
        assert str(info.value) == (
            f"{path}: unsupported GGUF architecture {name!r}; supported: {GGUF_SUPPORTED}"
        )


def test_one_table_entry_makes_a_new_architecture_load_from_an_hf_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _random_model(_config("llama"))
    directory = _write_hf_directory(tmp_path / "toy", source, "toy")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'toy'"):
        load_model(str(directory))
    monkeypatch.setitem(ARCHITECTURES, "toy", (__name__, "TOY"))
    loaded = load_model(str(directory))
    assert type(loaded.model) is ToyForCausalLM
    assert loaded.config.model_type == "toy"
    assert loaded.config.attention_bias  # config.json does not say so: TOY does
    ids = [5, 9, 2, 40, 7]
    torch.testing.assert_close(_logits(loaded.model, ids), _logits(source, ids), atol=0, rtol=0)


@pytest.mark.usefixtures("toy_registered")
def test_one_table_entry_makes_a_new_architecture_load_from_a_gguf_file(tmp_path: Path) -> None:
    source = _random_model(_config("toy"))
    loaded = load_model(str(_write_gguf(tmp_path / "toy.gguf", source, "toy")))
    assert type(loaded.model) is ToyForCausalLM
    assert loaded.config == source.config
    ids = [5, 9, 2, 40, 7]  # rows as written: TOY says its attn_q/attn_k are not permuted
    torch.testing.assert_close(_logits(loaded.model, ids), _logits(source, ids), atol=0, rtol=0)


def test_an_architecture_must_build_a_llama_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _write_hf_directory(tmp_path / "odd", _random_model(_config("llama")), "odd")
    monkeypatch.setitem(ARCHITECTURES, "odd", (__name__, "ODD"))
    with pytest.raises(ModelLoadError, match="built a dict, not a LlamaForCausalLM"):
        load_model(str(directory))


def _write_hf_directory(directory: Path, model: LlamaForCausalLM, model_type: str) -> Path:
    directory.mkdir()
    cfg = model.config
    config = {**SHAPES, "model_type": model_type, "head_dim": cfg.head_dim}
    config |= {"rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    save_file(_hf_named(model), str(directory / "model.safetensors"))
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    backend = BackendTokenizer(tokenizer_models.WordLevel(vocab, unk_token="t0"))
    backend.save(str(directory / "tokenizer.json"))
    return directory


def _permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permute of q/k rows, which ``unpermute_rope_rows`` undoes."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(
    path: Path,
    model: LlamaForCausalLM,
    arch: str,
    names: GGUFNames = GGUF_NAMES,
    rope_permuted: bool = False,
    norm_shift: float = 0.0,
    metadata: dict[str, float] | None = None,
) -> Path:
    """The model's tensors under ``names`` (those it has), float32, with a byte-level BPE
    tokenizer of 259 tokens; with ``rope_permuted``, q and k rows interleaved per rotary pair as
    llama.cpp writes a Llama's; norm weights plus ``norm_shift`` (Gemma's); ``metadata``: more
    keys after the architecture's prefix (uint32 for an int, else float32)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    for key, value in (metadata or {}).items():
        add = writer.add_uint32 if isinstance(value, int) else writer.add_float32
        add(f"{arch}.{key}", value)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_array("tokenizer.ggml.tokens", [*byte_alphabet().values(), "ab", "<s>", "</s>"])
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.add_array("tokenizer.ggml.token_type", [1] * 257 + [3, 3])
    hf_names = _hf_named(model)
    for gguf_name in _gguf_tensor_names(cfg, names):
        hf_name = names.hf_name(gguf_name)
        assert hf_name is not None
        if hf_name not in hf_names:
            continue  # e.g. no q/k/v bias in this model
        tensor = hf_names[hf_name].numpy().astype(np.float32)
        if rope_permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            tensor = _permute_rope_rows(tensor, heads)
        if gguf_name.endswith("norm.weight"):
            tensor = tensor + np.float32(norm_shift)
        writer.add_tensor(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensor_names(cfg: ModelConfig, names: GGUFNames) -> list[str]:
    found = list(names.model)
    for i in range(cfg.num_hidden_layers):
        found += [f"blk.{i}.{suffix}" for suffix in names.layer]
    return found


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_gguf_file_loads_the_same_model(arch: str, tmp_path: Path) -> None:
    """llama.cpp's spelling of a Gemma: its norms stored plus one, its layer pattern, local RoPE
    base and attention scale left to the model (Gemma 2: every other layer slides, scores and
    logits soft-capped as the file says; Gemma 3: five sliding layers to one global)."""
    window, layers, head_dim = 8, 6, 16
    sliding = "sliding_attention"
    if arch == "gemma2":
        types = tuple(sliding if i % 2 == 0 else "full_attention" for i in range(layers))
        extra: dict[str, Any] = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    else:
        types = tuple(sliding if i % 6 < 5 else "full_attention" for i in range(layers))
        extra = {"rope_local_theta": 10000.0, "rope_theta": 1_000_000.0}
    config = _config(
        arch,
        num_hidden_layers=layers,
        head_dim=head_dim,
        attention_bias=False,
        tie_word_embeddings=True,
        sliding_window=window,
        layer_types=types,
        query_pre_attn_scalar=float(head_dim),
        **extra,
    )
    source = registry.architecture(arch, "test").model_class(config, torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in source.named_parameters():
            param.normal_(0, 0.2)
            if "norm" in name:  # exact through the file's + 1 and the loader's - 1
                param.copy_((param * 1024).round() / 1024)
    caps = {k: v for k, v in extra.items() if k.endswith("softcapping")}
    path = _write_gguf(
        tmp_path / f"{arch}.gguf",
        source,
        arch,
        registry.architecture(arch, "test").gguf,
        norm_shift=1.0,
        metadata={"attention.sliding_window": window, **caps},
    )
    loaded = load_model(str(path))
    assert loaded.config == config
    ids = [3, 200, 17, 99, 5, 41, 8, 250, 13, 77, 2, 160]  # longer than the window
    windows = config.layer_windows

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * config.attention_scale
        if config.attn_logit_softcapping is not None:
            cap = config.attn_logit_softcapping
            scores = torch.tanh(scores / cap) * cap
        pos = torch.arange(len(ids))
        seen = pos[None, :] <= pos[:, None]
        if windows[layer] is not None:
            seen &= pos[None, :] > pos[:, None] - windows[layer]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v)

    def logits(model: LlamaForCausalLM) -> torch.Tensor:
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), attention)
            return model.compute_logits(hidden)

    torch.testing.assert_close(logits(loaded.model), logits(source), atol=0, rtol=0)
