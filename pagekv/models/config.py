"""The shape of a Llama-family model: `ModelConfig`, frozen and validated on construction.

Owns the validation of sizes and of the RoPE scaling description (the frozen form of Hugging
Face's `rope_scaling` dict). Loaders build one from config.json or GGUF metadata; the model and
the KV cache size themselves from it. Its model types are the registry's architecture names
(registry.py). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pagekv.errors import ModelLoadError
from pagekv.models.registry import architecture_names

# rope_scaling "type"/"rope_type" values we implement; "default" means no scaling at all.
ROPE_SCALING_TYPES = ("llama3", "linear")

# Kinds of attention layer (HF's layer_types values): all previous tokens, or a sliding window.
LAYER_TYPES = ("full_attention", "sliding_attention")

RopeScaling = tuple[tuple[str, object], ...]
QWEN_MAX_WINDOW_LAYERS = 28  # Qwen2Config's default: layers from this index on slide


def qwen_layer_types(raw: Mapping[str, object], source: str) -> dict[str, object]:
    """Qwen2/Qwen3's sliding layers, where the window is on: config.json's layer_types, else
    (as their configs derive it) every layer from ``max_window_layers`` on. The window the
    loader read applies to those layers only; none of them left: no window."""
    if not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
        return {}
    types = raw.get("layer_types")
    if types is None:
        first = raw.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
        count = raw.get("num_hidden_layers")
        if not isinstance(first, int) or not isinstance(count, int):
            raise ModelLoadError(f"{source}: max_window_layers should be an integer")
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(count)]
    if not isinstance(types, list) or not all(t in LAYER_TYPES for t in types):
        raise ModelLoadError(f"{source}: config.json layer_types should list {LAYER_TYPES}")
    if "sliding_attention" not in types:
        return {"sliding_window": None}
    return {"layer_types": tuple(types)}


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and hyper-parameters of a decoder-only Llama-family model."""

    model_type: str  # a registered architecture: "llama", "qwen2", "mistral", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # sorted (key, value) pairs; see freeze_rope_scaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2-style bias on q/k/v
    # The sliding window of the layers that slide (``layer_types``; all of them when that is
    # None): a query at position p sees the keys p - window < k <= p. None: no layer slides.
    sliding_window: int | None = None
    # Optional, for architectures beyond Llama's shape; the defaults are Llama's.
    layer_types: tuple[str, ...] | None = None  # per layer, one of LAYER_TYPES (None: all full)
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3), unscaled
    query_pre_attn_scalar: float | None = None  # attention scale: its ** -0.5 (else head_dim's)
    final_logit_softcapping: float | None = None  # logits become tanh(logits / c) * c
    attn_logit_softcapping: float | None = None  # attention scores likewise (Gemma 2)

    def __post_init__(self) -> None:
        known = architecture_names()
        if self.model_type not in known:
            raise ModelLoadError(f"unknown model type {self.model_type!r}; known: {known}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelLoadError(f"config {name} must be a positive integer, got {value!r}")
        window = self.sliding_window
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window <= 0
        ):
            raise ModelLoadError(
                f"config sliding_window must be a positive integer, got {window!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ModelLoadError("rms_norm_eps and rope_theta must be positive")
        if self.rope_scaling is not None:
            freeze_rope_scaling(dict(self.rope_scaling))  # validates
        self._check_optional()

    def _check_optional(self) -> None:
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ModelLoadError(f"sliding_window must be a positive integer, got {window!r}")
        for name in (
            "rope_local_theta",
            "query_pre_attn_scalar",
            "final_logit_softcapping",
            "attn_logit_softcapping",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ModelLoadError(f"config {name} must be positive or None, got {value!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ModelLoadError(
                    f"layer_types names {len(self.layer_types)} layers, "
                    f"not num_hidden_layers {self.num_hidden_layers}"
                )
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ModelLoadError(f"unknown layer_types {unknown}; known: {LAYER_TYPES}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def fused_slices(self) -> dict[str, slice]:
        """Row ranges of each projection inside the fused qkv_proj and gate_up_proj."""
        q, kv, inter = self.q_size, self.kv_size, self.intermediate_size
        return {
            "q": slice(0, q),
            "k": slice(q, q + kv),
            "v": slice(q + kv, q + 2 * kv),
            "gate": slice(0, inter),
            "up": slice(inter, 2 * inter),
        }

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: it sees every earlier position)."""
        window, types = self.sliding_window, self.layer_types
        if window is None or types is None:
            return (window,) * self.num_hidden_layers
        return tuple(window if t == "sliding_attention" else None for t in types)

    @property
    def kv_window(self) -> int | None:
        """The window every layer shares, None where some layer sees everything: blocks wholly
        before it are read by no layer again, so the KV cache may give them back."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        scale: float = float(self.query_pre_attn_scalar or self.head_dim) ** -0.5
        return scale

    def rope_scaling_dict(self) -> dict[str, object] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)


def freeze_rope_scaling(scaling: Mapping[str, object] | None) -> RopeScaling | None:
    """Validate HF's rope_scaling dict and return it as sorted pairs (None when unscaled).

    Accepts both spellings of the type key ("rope_type", older "type"). Values are kept as
    given except numbers, which must be real numbers. Unknown types raise ModelLoadError.
    """
    if scaling is None:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in ROPE_SCALING_TYPES:
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {ROPE_SCALING_TYPES}"
        )
    required: tuple[str, ...] = ("factor",)
    if rope_type == "llama3":
        required = ("factor", "low_freq_factor", "high_freq_factor")
        required += ("original_max_position_embeddings",)
    for key in required:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(f"rope_scaling {rope_type!r} needs a positive {key!r}")
    # Lists become tuples so the frozen config stays hashable.
    pairs = {
        k: tuple(v) if isinstance(v, list) else v
        for k, v in scaling.items()
        if k not in ("type", "rope_theta")
    }
    pairs["rope_type"] = rope_type
    return tuple(sorted(pairs.items()))
