"""Rotary position embedding: the cos/sin table and its application to q and k.

Owns the RoPE math only: inverse frequencies (with "linear" and "llama3" scaling as Hugging Face
computes them), a float32 cos/sin table built once for every position up to
max_position_embeddings, and the rotation in HF's rotate_half convention (the head dim is split
in two halves, not interleaved pairs). Imports nothing from the rest of pagekv but the config.
"""

from __future__ import annotations

import math

import torch

from pagekv.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 [head_dim // 2]: the rotation speed of each pair of dims, scaling applied."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling_dict()
    if scaling is None:
        return inv_freq
    factor = _number(scaling, "factor")
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    return _llama3_frequencies(inv_freq, scaling, factor)


def _number(scaling: dict[str, object], key: str) -> float:
    value = scaling[key]
    assert isinstance(value, int | float)  # freeze_rope_scaling checked it
    return float(value)


def _llama3_frequencies(
    inv_freq: torch.Tensor, scaling: dict[str, object], factor: float
) -> torch.Tensor:
    """Llama 3.1's scheme: slow (long-wavelength) dims are divided by factor, fast ones kept,
    and the band between is interpolated smoothly."""
    low_freq_factor = _number(scaling, "low_freq_factor")
    high_freq_factor = _number(scaling, "high_freq_factor")
    old_context = _number(scaling, "original_max_position_embeddings")
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin tables, each [max_position_embeddings, head_dim // 2]."""
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = torch.outer(positions, inverse_frequencies(config))
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by per-token cos/sin [T, head_dim // 2] (float32).

    Same numbers as HF's `x * cos + rotate_half(x) * sin` with cos = cat(c, c), computed on
    halves so the table is half the size. The math runs in float32; the result has x's dtype.
    """
    x32 = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, half], broadcast over heads
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return rotated.to(x.dtype)
