"""From an opened GGUF file to a ModelConfig and a stream of weights under Hugging Face names.

Owns the translation of llama.cpp's conventions to HF's: metadata keys, and undoing the row
permutation llama.cpp's converter applies to attn_q / attn_k for some architectures (it
reorders each head's rows for interleaved-pair RoPE; we use HF's half-split RoPE). Which
architectures a file may say, their tensor names and whether they are permuted are each
architecture's ``registry.Architecture``. Byte-level parsing lives in gguf_file; the tokenizer
is built in tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

from pagekv.errors import ModelLoadError
from pagekv.models.config import ModelConfig, freeze_rope_scaling
from pagekv.models.gguf_file import GGUFFile, GGUFTensorInfo
from pagekv.models.quantized import (
    FORMATS,
    QUANT_ROW_MULTIPLE,
    QuantizedWeight,
    Segment,
    drop_array_pages,
)
from pagekv.models.registry import Architecture, gguf_architecture

# The tensors that are matmul weights (llama.cpp's names; token_embd is the tied LM head).
_MATMUL_WEIGHTS = frozenset(
    (
        "token_embd",
        "output",
        "attn_qkv",  # Phi-3's fused q/k/v
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    )
)


def _require(gguf: GGUFFile, key: str) -> object:
    value = gguf.metadata.get(key)
    if value is None:
        raise ModelLoadError(f"{gguf.path}: missing GGUF metadata key {key!r}")
    return value


def _int(gguf: GGUFFile, key: str, default: int | None = None) -> int:
    value = gguf.metadata.get(key, default)
    if value is None:
        raise ModelLoadError(f"{gguf.path}: missing GGUF metadata key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{gguf.path}: metadata {key!r} should be an integer: {value!r}")
    return value


def _float(gguf: GGUFFile, key: str, default: float) -> float:
    value = gguf.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(f"{gguf.path}: metadata {key!r} should be a number: {value!r}")
    return float(value)


def architecture_name(gguf: GGUFFile) -> str:
    """The file's ``general.architecture``, a registered one (else ModelLoadError)."""
    arch = _require(gguf, "general.architecture")
    gguf_architecture(arch, gguf.path)
    assert isinstance(arch, str)  # a registered name
    return arch


def gguf_config(gguf: GGUFFile) -> ModelConfig:
    """The ModelConfig that GGUF metadata (and the tensor directory) describe."""
    arch = architecture_name(gguf)
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{gguf.path}: missing tensor 'token_embd.weight'")
    if "rope_freqs.weight" in gguf.tensors:
        raise ModelLoadError(f"{gguf.path}: per-dimension rope_freqs (Llama 3.1) is not supported")
    if "rope_factors_long.weight" in gguf.tensors:
        raise ModelLoadError(f"{gguf.path}: longrope rope_factors (Phi-3 128k) are not supported")
    hidden = _int(gguf, f"{arch}.embedding_length")
    num_heads = _int(gguf, f"{arch}.attention.head_count")
    num_kv_heads = _int(gguf, f"{arch}.attention.head_count_kv", num_heads)
    head_dim = _int(gguf, f"{arch}.attention.key_length", hidden // num_heads)
    if _int(gguf, f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(f"{gguf.path}: partial RoPE (fewer rotated dims than head_dim)")
    window_key = f"{arch}.attention.sliding_window"
    config = ModelConfig(
        model_type=arch,
        vocab_size=embed.shape[0],
        hidden_size=hidden,
        intermediate_size=_int(gguf, f"{arch}.feed_forward_length"),
        num_hidden_layers=_int(gguf, f"{arch}.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(gguf, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=_float(gguf, f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(gguf, arch),
        max_position_embeddings=_int(gguf, f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        sliding_window=_int(gguf, window_key) if window_key in gguf.metadata else None,
    )
    own_fields = gguf_architecture(arch, gguf.path).gguf_config_fields
    if own_fields is None:
        return config
    prefix = f"{arch}."
    metadata = {k.removeprefix(prefix): v for k, v in gguf.metadata.items() if k.startswith(prefix)}
    try:
        return dataclasses.replace(config, **own_fields(metadata, gguf.path))
    except ModelLoadError as exc:
        raise ModelLoadError(f"{gguf.path}: {exc}") from exc


def _rope_scaling(gguf: GGUFFile, arch: str) -> tuple[tuple[str, object], ...] | None:
    rope_type = gguf.metadata.get(f"{arch}.rope.scaling.type", "none")
    if rope_type == "none":
        return None
    factor = gguf.metadata.get(f"{arch}.rope.scaling.factor")
    try:
        return freeze_rope_scaling({"rope_type": rope_type, "factor": factor})
    except ModelLoadError as exc:
        raise ModelLoadError(f"{gguf.path}: {exc}") from exc


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permute of attn_q/attn_k rows (weight [heads*head_dim, in] or bias).

    llama.cpp stores each head's rows as interleaved (even, odd) rotary pairs; HF keeps the
    first halves, then the second halves.
    """
    head_dim = w.shape[0] // num_heads
    grouped = w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
    return grouped.swapaxes(1, 2).reshape(w.shape)


def _unshift_norm(arch: Architecture, name: str, values: np.ndarray) -> np.ndarray:
    """A norm weight as the model takes it, where the converter stored it shifted."""
    if not (arch.gguf_norm_shift and name.endswith("norm.weight")):
        return values
    shifted: np.ndarray = values - np.asarray(arch.gguf_norm_shift, dtype=values.dtype)
    return shifted


def keeps_quantized(info: GGUFTensorInfo) -> bool:
    """Whether a tensor can stay GGUF blocks: a matmul weight of a type in ``FORMATS`` whose
    rows fill whole stripes of every kernel target."""
    kind = info.name.split(".")[-2] if info.name.startswith("blk.") else info.name
    return (
        kind.removesuffix(".weight") in _MATMUL_WEIGHTS
        and info.name.endswith(".weight")
        and len(info.shape) == 2
        and info.qtype in FORMATS
        and info.shape[0] % QUANT_ROW_MULTIPLE == 0
    )


def gguf_weights(
    gguf: GGUFFile, config: ModelConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, weight) for every tensor of the file: a float32 tensor dequantized one at a
    time, or with ``keep_quantized`` the blocks themselves where ``keeps_quantized``."""
    arch = gguf_architecture(config.model_type, gguf.path)
    names = arch.gguf
    assert names is not None  # gguf_architecture refuses architectures without GGUF names
    heads_of = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for name, info in gguf.tensors.items():
        target = names.hf_name(name)
        if target is None:
            raise ModelLoadError(f"{gguf.path}: unexpected tensor {name!r}")
        kind = name.split(".")[-2]
        permuted = arch.gguf_rope_permuted and kind in heads_of
        if keep_quantized and keeps_quantized(info):
            blocks = gguf.blocks(name)
            if permuted:  # whole rows move: a block never spans two
                source, blocks = blocks, unpermute_rope_rows(blocks, heads_of[kind])
                drop_array_pages(source)  # a copy holds them now: the file's pages can go
            segment = Segment(info.qtype, blocks)
            yield target, QuantizedWeight((info.shape[0], info.shape[1]), (segment,))
            continue
        values = gguf.read_tensor(name)
        if permuted:
            values = unpermute_rope_rows(values, heads_of[kind])
        values = _unshift_norm(arch, name, values)
        if not values.flags.writeable:  # a view of the read-only map; torch wants writable
            values = values.copy()
        yield target, torch.from_numpy(values)
