"""The Gemma 2 and Gemma 3 text decoders (``gemma2`` and ``gemma3_text``, registered in
registry.py as ``GEMMA2`` and ``GEMMA3``): the Llama decoder's interface and fused weights,
Gemma's own math.

What differs from Llama, as transformers' Gemma3ForCausalLM computes it:

- embeddings scaled by sqrt(hidden_size), the factor rounded to the model's dtype first;
- RMSNorm scaled by (1 + weight), normalized and scaled in float32, then cast back
  (``gemma_rms_norm``), and four of them per layer: input and post-attention around
  attention, pre- and post-feedforward around the MLP, each post-norm applied to the block's
  output before it joins the residual stream;
- q and k RMS-normed per head (``q_norm``, ``k_norm``) before RoPE;
- a GeGLU MLP: gelu(gate, tanh approximation) * up;
- attention scaled by ``query_pre_attn_scalar ** -0.5`` (``ModelConfig.attention_scale``, which
  the runner hands its attention kernels);
- logits soft-capped, tanh(logits / c) * c, when ``final_logit_softcapping`` is set;
- local ("sliding_attention") and global layers, each with its own RoPE base: local layers
  ``rope_local_theta`` unscaled, global ones ``rope_theta`` with the config's scaling.

Gemma 2 is the same but for: no q/k norms, one RoPE base for every layer, and attention scores
soft-capped like the logits (``attn_logit_softcapping``). The sliding window and the scores'
cap are the runner's attention's (``ModelConfig.layer_windows``, ``attn_logit_softcapping``):
the model only hands each layer's q/k/v to it.

These elementwise ops run in torch whatever ``LayerOps`` the model is given: the fused C ops
implement Llama's norms and SiLU, not these. The matmuls still go through the ops (their packed
weights). Imports nothing from runner/ or core/.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from pagekv.errors import ModelLoadError
from pagekv.models.config import LAYER_TYPES, ModelConfig, freeze_rope_scaling
from pagekv.models.llama import (
    AttentionFn,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    _weight,
)
from pagekv.models.registry import Architecture, GGUFNames
from pagekv.models.rope import apply_rope, rope_cos_sin

SLIDING = "sliding_attention"
# HF name inside a layer -> our parameter, besides the Llama layer's (_LAYER_PARAMS).
_GEMMA_LAYER_PARAMS = {
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm",
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Gemma3RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (1 + weight), all in
    float32 (Llama scales after casting back), the result in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """One Gemma 3 block: h = x + post_norm(attn(norm(x))), then h + post_ff(mlp(pre_ff(h)))."""

    qk_norm = True  # q and k RMS-normed per head before RoPE

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__(config, layer_idx, dtype)
        hidden, head_dim = config.hidden_size, config.head_dim
        self.pre_feedforward_layernorm = _weight(hidden, dtype=dtype)
        self.post_feedforward_layernorm = _weight(hidden, dtype=dtype)
        if self.qk_norm:
            self.q_norm = _weight(head_dim, dtype=dtype)
            self.k_norm = _weight(head_dim, dtype=dtype)
        types = config.layer_types
        self.sliding = types is not None and types[layer_idx] == SLIDING

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer.forward`` (the output and the residual stream, whose sum is
        the hidden state, of the ``keep`` rows past the attention); cos/sin are this layer's
        kind's (local or global)."""
        ops, eps, cfg = self.ops, self.config.rms_norm_eps, self.config
        hidden = x if residual is None else residual + x
        h = gemma_rms_norm(hidden, self.input_layernorm, eps)
        q, k, v = self._qkv(h, cos, sin)
        out = attention(self.layer_idx, q, k, v).reshape(h.shape[0], cfg.q_size)
        if keep is not None:
            out, hidden = out[keep], hidden[keep]
        attn = ops.linear(out, *self._projection("o_proj"))
        hidden = hidden + gemma_rms_norm(attn, self.post_attention_layernorm, eps)
        h = gemma_rms_norm(hidden, self.pre_feedforward_layernorm, eps)
        gate, up = ops.linear(h, *self._projection("gate_up_proj")).chunk(2, dim=-1)
        mlp = ops.linear(F.gelu(gate, approximate="tanh") * up, *self._projection("down_proj"))
        return gemma_rms_norm(mlp, self.post_feedforward_layernorm, eps), hidden

    def _qkv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projection, q/k per-head norms, then RoPE: q [T, H, D], k and v [T, KV, D],
        each contiguous and new (what the attention function may assume)."""
        cfg, eps = self.config, self.config.rms_norm_eps
        qkv = self.ops.linear(h, *self._projection("qkv_proj", self.qkv_bias))
        q, k, v = torch.split(qkv, [cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        shape = (h.shape[0], -1, cfg.head_dim)
        q, k = q.reshape(shape), k.reshape(shape)
        if self.qk_norm:
            q, k = gemma_rms_norm(q, self.q_norm, eps), gemma_rms_norm(k, self.k_norm, eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.reshape(shape).contiguous()


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    """One Gemma 2 block: Gemma 3's without the q/k norms."""

    qk_norm = False


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The Gemma 3 text model: Llama's interface (weights, packing, ops, logits), Gemma's
    forward. Owns a second float32 RoPE table, the local layers'."""

    layer_class = Gemma3DecoderLayer
    rope_local_cos: torch.Tensor  # buffers like rope_cos/rope_sin, at rope_local_theta
    rope_local_sin: torch.Tensor

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        theta = config.rope_local_theta or config.rope_theta
        cos, sin = rope_cos_sin(dataclasses.replace(config, rope_theta=theta, rope_scaling=None))
        self.register_buffer("rope_local_cos", cos, persistent=False)
        self.register_buffer("rope_local_sin", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As Llama's: int64 [T] -> final-normed hidden states [T, hidden], or the ``keep``
        rows' (the last layer's attention caching every row)."""
        full = self.rope_cos[positions], self.rope_sin[positions]
        local = self.rope_local_cos[positions], self.rope_local_sin[positions]
        x = self._embed(input_ids)
        # HF keeps sqrt(hidden) as a float32 buffer and casts it to the weights' dtype
        x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Gemma3DecoderLayer)
            cos, sin = local if layer.sliding else full
            x, residual = layer(x, residual, cos, sin, attention, keep if i == last else None)
        if residual is None and keep is not None:  # no layers
            x = x[keep]
        hidden = x if residual is None else residual + x
        return gemma_rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """As Llama's, soft-capped (in the model's dtype, as HF does) when the config says."""
        logits = super().compute_logits(hidden, float32=False)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if float32 else logits

    def _targets(self) -> dict[str, tuple[torch.nn.Module, str, str | None]]:
        targets = super()._targets()
        for i, layer in enumerate(self.layers):
            for suffix, param_name in _GEMMA_LAYER_PARAMS.items():
                if hasattr(layer, param_name):
                    targets[f"model.layers.{i}.{suffix}"] = (layer, param_name, None)
        return targets


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """The Gemma 2 model: Gemma 3's with Gemma 2's layers (one RoPE base: the loader leaves
    ``rope_local_theta`` unset)."""

    layer_class = Gemma2DecoderLayer


def _number(raw: Mapping[str, object], key: str, source: str, default: float) -> float:
    value = raw.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(f"{source}: config.json {key!r} should be a number, got {value!r}")
    return float(value)


def _layer_types(raw: Mapping[str, object], source: str, num_layers: int) -> tuple[str, ...]:
    """HF's layer_types, or (older config.json files) every ``sliding_window_pattern``-th
    layer global, the others local, as Gemma3TextConfig derives them."""
    types = raw.get("layer_types")
    if types is None:
        pattern = int(_number(raw, "sliding_window_pattern", source, 6))
        return tuple(SLIDING if (i + 1) % pattern else "full_attention" for i in range(num_layers))
    if not isinstance(types, list) or not all(t in LAYER_TYPES for t in types):
        raise ModelLoadError(f"{source}: config.json layer_types should list {LAYER_TYPES}")
    return tuple(types)


def _rope_fields(raw: Mapping[str, object], source: str) -> dict[str, Any]:
    """rope_theta, rope_scaling (global layers) and rope_local_theta, from transformers 5's
    per-layer-type rope_parameters or the older rope_theta / rope_scaling /
    rope_local_base_freq keys."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or SLIDING in params):
        full, local = params.get("full_attention") or {}, params.get(SLIDING) or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{source}: scaled RoPE on sliding layers is not supported")
        return {
            "rope_theta": _number(full, "rope_theta", source, 1_000_000.0),
            "rope_scaling": freeze_rope_scaling(full),
            "rope_local_theta": _number(local, "rope_theta", source, 10_000.0),
        }
    scaling = raw.get("rope_scaling")
    return {
        "rope_theta": _number(raw, "rope_theta", source, 1_000_000.0),
        "rope_scaling": freeze_rope_scaling(scaling if isinstance(scaling, dict) else None),
        "rope_local_theta": _number(raw, "rope_local_base_freq", source, 10_000.0),
    }


def _common_fields(raw: Mapping[str, object], source: str, default_types: str) -> dict[str, Any]:
    """The fields Gemma 2 and 3 read alike; ``default_types``: how layer_types is derived
    where config.json lacks it ("pattern": Gemma 3's, "alternate": Gemma 2's)."""
    activation = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{source}: Gemma MLP activation {activation!r} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: bidirectional attention is not supported")
    num_layers = int(_number(raw, "num_hidden_layers", source, 0))
    if default_types == "alternate" and raw.get("layer_types") is None:
        types = tuple(SLIDING if (i + 1) % 2 else "full_attention" for i in range(num_layers))
    else:
        types = _layer_types(raw, source, num_layers)
    window = int(_number(raw, "sliding_window", source, 4096)) if SLIDING in types else None
    caps = {}
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        cap = raw.get(key)
        caps[key] = None if cap is None else _number(raw, key, source, 0.0)
    return {
        "head_dim": int(_number(raw, "head_dim", source, 256)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "layer_types": types,
        "sliding_window": window,
        "query_pre_attn_scalar": _number(raw, "query_pre_attn_scalar", source, 256),
        **caps,
    }


def gemma3_config_fields(raw: Mapping[str, object], source: str) -> dict[str, Any]:
    """The ModelConfig fields Gemma 3's config.json says its own way (Gemma3TextConfig's
    defaults where it is silent); ModelLoadError for what pagekv does not run."""
    fields = _common_fields(raw, source, "pattern")
    return {**_rope_fields(raw, source), **fields}


def gemma2_config_fields(raw: Mapping[str, object], source: str) -> dict[str, Any]:
    """Gemma 2's (Gemma2Config's defaults where it is silent: every other layer slides, both
    soft caps on); its RoPE is the loader's usual one."""
    fields = _common_fields(raw, source, "alternate")
    for key, default in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0)):
        if key not in raw:
            fields[key] = default
    return fields


def _gguf_as_config_json(meta: Mapping[str, object], source: str) -> dict[str, object]:
    """What a Gemma GGUF file says, spelled as config.json would say it. llama.cpp's converter
    keeps the sizes, the window, RoPE and the soft caps; the layer pattern, the local RoPE base
    and the attention scale it leaves to the model's defaults (Gemma 3: five sliding layers to
    one global, local base 10000), which the config.json readers supply where a key is absent.
    The attention scale is llama.cpp's: head_dim ** -0.5, but hidden / heads for the 27B sizes
    (62 layers in Gemma 3, 46 in Gemma 2), whose query_pre_attn_scalar says so."""
    raw: dict[str, object] = {
        "num_hidden_layers": meta.get("block_count"),
        "head_dim": meta.get("attention.key_length"),
        "sliding_window": meta.get("attention.sliding_window"),
        "rope_theta": meta.get("rope.freq_base"),
        "final_logit_softcapping": meta.get("final_logit_softcapping"),
        "attn_logit_softcapping": meta.get("attn_logit_softcapping"),
        "layer_types": None,
    }
    scaling = meta.get("rope.scaling.type", "none")
    if scaling != "none":
        raw["rope_scaling"] = {"rope_type": scaling, "factor": meta.get("rope.scaling.factor")}
    hidden, heads = meta.get("embedding_length"), meta.get("attention.head_count")
    if meta.get("block_count") in (46, 62) and isinstance(hidden, int) and isinstance(heads, int):
        raw["query_pre_attn_scalar"] = hidden // heads
    else:
        raw["query_pre_attn_scalar"] = raw["head_dim"]
    return raw


def gemma3_gguf_fields(meta: Mapping[str, object], source: str) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 3 GGUF file that the common reading lacks (tied
    embeddings it reads from the tensors)."""
    fields = gemma3_config_fields(_gguf_as_config_json(meta, source), source)
    return {k: v for k, v in fields.items() if k != "tie_word_embeddings"}


def gemma2_gguf_fields(meta: Mapping[str, object], source: str) -> dict[str, Any]:
    """Gemma 2's, its soft caps as the file says them (a file without them has none)."""
    fields = _common_fields(_gguf_as_config_json(meta, source), source, "alternate")
    return {k: v for k, v in fields.items() if k != "tie_word_embeddings"}


# llama.cpp's names for Gemma's tensors. Its converter keeps Gemma's q/k rows in HF's order
# (NEOX-style RoPE) and stores every norm weight with Gemma's 1 added.
GGUF_NAMES = GGUFNames(
    model={
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    },
    layer={
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
)
GEMMA3 = Architecture(
    Gemma3ForCausalLM,
    GGUF_NAMES,
    gguf_norm_shift=1.0,
    hf_config_fields=gemma3_config_fields,
    gguf_config_fields=gemma3_gguf_fields,
)
GEMMA2 = Architecture(
    Gemma2ForCausalLM,
    GGUF_NAMES,
    gguf_norm_shift=1.0,
    hf_config_fields=gemma2_config_fields,
    gguf_config_fields=gemma2_gguf_fields,
)
