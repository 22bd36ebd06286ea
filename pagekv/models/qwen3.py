"""Qwen3: the Llama-family decoder with RMSNorm on each head of q and of k (``QWEN3``,
registered in registry.py).

Owns the two per-head norms (``self_attn.q_norm`` / ``k_norm``, each [head_dim], applied after
the q/k/v projection and before RoPE, as transformers' Qwen3Attention does) and the GGUF names
of them. Unlike Qwen2, q/k/v have a bias only where config.json's ``attention_bias`` says so, and
then o_proj has one too.
Everything else is llama.py's.
"""

from __future__ import annotations

import torch

from pagekv.models.config import ModelConfig, qwen_layer_types
from pagekv.models.llama import (
    _LAYER_PARAMS,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    _weight,
)
from pagekv.models.llama_family import GGUF_NAMES
from pagekv.models.registry import Architecture, GGUFNames

# llama.py's layer names and the two norms
_QWEN3_LAYER_PARAMS = {
    **_LAYER_PARAMS,
    "self_attn.q_norm.weight": ("q_norm", None),
    "self_attn.k_norm.weight": ("k_norm", None),
}


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose q and k heads are RMS-normed between projection and RoPE."""

    hf_params = _QWEN3_LAYER_PARAMS

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__(config, layer_idx, dtype)
        self.q_norm = _weight(config.head_dim, dtype=dtype)
        self.k_norm = _weight(config.head_dim, dtype=dtype)
        # attention_bias gives o_proj a bias too in Qwen3 (not in Qwen2)
        if config.attention_bias:
            self.o_bias = _weight(config.hidden_size, dtype=dtype)

    def attention_inputs(
        self, x: torch.Tensor | None, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The composition of ``layer_ops.attention_inputs`` with the head norms inserted
        before RoPE; each step through the layer ops (never their one-call fused path, which
        has no place for the norms)."""
        ops, cfg = self.ops, self.config
        eps, head_dim = cfg.rms_norm_eps, cfg.head_dim
        if x is None:
            h = ops.rms_norm(residual, self.input_layernorm, eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_layernorm, eps)
        qkv = ops.linear(h, *self._projection("qkv_proj", self.qkv_bias))
        num_tokens = qkv.shape[0]
        q, k, v = torch.split(qkv, [cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        # rows of one head each: the norms' weights are [head_dim]
        q = ops.rms_norm(q.reshape(-1, head_dim).contiguous(), self.q_norm, eps)
        k = ops.rms_norm(k.reshape(-1, head_dim).contiguous(), self.k_norm, eps)
        normed = torch.cat((q.view(num_tokens, -1), k.view(num_tokens, -1), v), dim=-1)
        q, k, v = ops.split_rope(normed, cos, sin, cfg.num_attention_heads, cfg.num_key_value_heads)
        return q, k, v, residual


class Qwen3ForCausalLM(LlamaForCausalLM):
    """The Llama decoder built of Qwen3 layers."""

    layer_class = Qwen3DecoderLayer


# llama.cpp's converter keeps Qwen's q/k rows as HF has them (no RoPE permutation).
GGUF_NAMES_QWEN3 = GGUFNames(
    model=GGUF_NAMES.model,
    layer={
        **GGUF_NAMES.layer,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
)

QWEN3 = Architecture(Qwen3ForCausalLM, GGUF_NAMES_QWEN3, hf_config_fields=qwen_layer_types)
