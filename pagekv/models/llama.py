"""The Llama-family decoder (Llama, Mistral, Qwen2) in plain torch and its weight loading (the
architectures it is, and their GGUF names: llama_family.py).

Owns the model's parameters and the forward math: RMSNorm, RoPE, grouped-query attention
projections, SwiGLU MLP. It does NOT own attention over the KV cache: the caller passes an
`AttentionFn` that gets rotated q/k/v for a flat batch of tokens and returns the attention output,
so paging, block tables and causality live in the runner. Imports nothing from runner/ or core/.

Load-time fusion: q/k/v projections are stacked into one `qkv_proj` weight and gate/up into one
`gate_up_proj`, so each layer does two matmuls fewer; `load_weights` takes Hugging Face names and
fills the fused slices.

Prepacking (`pack_weights`): every matmul weight is reordered once at load into the layout of
the ops' own matmuls (``LayerOps.pack``): oneDNN's blocked layout with the torch ops (faster
decode-sized matmuls, bit-identical in bf16); with the fused C ops the tiles of their bf16
kernels or their stripes. The plain parameters stay: loading, the fingerprint and tests read
them, and matmuls the packed kernels decline use them.

Elementwise ops (norms, RoPE, SiLU*up) go through a ``LayerOps`` object (layer_ops.py): torch ops
by default, the C ops of pagekv/kernels/fused_ops.py when the caller sets them
(``use_layer_ops``). The residual
stream is carried between layers apart from each layer's output, as vLLM does, so that every
residual add meets the norm after it in one ``add_rms_norm``:

    h, r = norm(x), x                      first layer (r: the residual stream)
    h, r = add_norm(attn(h), r)            r + attn, then the post-attention norm of it
    x = mlp(h)                             next layer: h, r = add_norm(x, r); ...
    out = add_norm(x, r)                   after the last layer, with the final norm

The same sums in the same order as ``x + attn(norm(x))``, so the numbers do not change. A
layer hands the ops its two halves around attention (``LayerOps.attention_inputs`` up to q/k/v,
``LayerOps.mlp_block`` after), so that fast ops may run each half in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from pagekv.errors import ModelLoadError
from pagekv.models.config import ModelConfig
from pagekv.models.layer_ops import (
    TORCH_OPS,
    Allocate,
    LayerOps,
    Linear,
    NativeAttention,
    Packed,
    StackLayer,
    Weight,
    dense,
    torch_empty,
)
from pagekv.models.quantized import QuantizedWeight, drop_file_pages
from pagekv.models.rope import rope_cos_sin

# (layer_idx, q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim], v [T, num_kv_heads,
# head_dim]) -> out [T, num_heads, head_dim]; q, k, v contiguous, in the model dtype. q and k are
# already rotated; the function applies the scale (ModelConfig.attention_scale, 1/sqrt(head_dim)
# unless the architecture says otherwise) and causality itself.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# HF name inside a layer -> (our parameter, which stacked slice): slices index config.fused_slices.
_LAYER_PARAMS: dict[str, tuple[str, str | None]] = {
    "input_layernorm.weight": ("input_layernorm", None),
    "post_attention_layernorm.weight": ("post_attention_layernorm", None),
    "self_attn.q_proj.weight": ("qkv_proj", "q"),
    "self_attn.k_proj.weight": ("qkv_proj", "k"),
    "self_attn.v_proj.weight": ("qkv_proj", "v"),
    "self_attn.q_proj.bias": ("qkv_bias", "q"),
    "self_attn.k_proj.bias": ("qkv_bias", "k"),
    "self_attn.v_proj.bias": ("qkv_bias", "v"),
    "self_attn.o_proj.weight": ("o_proj", None),
    "self_attn.o_proj.bias": ("o_bias", None),
    "mlp.gate_proj.weight": ("gate_up_proj", "gate"),
    "mlp.up_proj.weight": ("gate_up_proj", "up"),
    "mlp.down_proj.weight": ("down_proj", None),
}
# Checkpoints carry these sometimes; they are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_PACKED_PARAMS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialized: every parameter is overwritten by load_weights (which checks coverage).
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    # HF name inside a layer -> (our parameter, fused slice): a subclass with other
    # checkpoint names or extra parameters gives its own table.
    hf_params: Mapping[str, tuple[str, str | None]] = _LAYER_PARAMS

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        hidden, qkv = config.hidden_size, config.q_size + 2 * config.kv_size
        self.input_layernorm = _weight(hidden, dtype=dtype)
        self.qkv_proj = _weight(qkv, hidden, dtype=dtype)  # rows: q, then k, then v
        self.qkv_bias = _weight(qkv, dtype=dtype) if config.attention_bias else None
        self.o_proj = _weight(hidden, config.q_size, dtype=dtype)
        self.o_bias: nn.Parameter | None = None  # none in these three; a subclass may add one
        self.post_attention_layernorm = _weight(hidden, dtype=dtype)
        self.gate_up_proj = _weight(2 * config.intermediate_size, hidden, dtype=dtype)
        self.down_proj = _weight(hidden, config.intermediate_size, dtype=dtype)
        self.packed: dict[str, Packed] = {}  # by parameter name; pack_weights
        self.ops: LayerOps = TORCH_OPS  # the model's use_layer_ops sets it

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden]: the previous layer's output, or the embeddings with residual None
        (first layer); cos/sin [T, head_dim // 2] float32 for each token's position.

        Returns (this layer's output, the residual stream), both [T, hidden]; their sum is the
        hidden state. ``residual`` may be updated in place (``LayerOps.add_rms_norm``).
        ``keep`` (int64 rows): past the attention (of every row), only these rows go on.
        """
        ops, eps, cfg = self.ops, self.config.rms_norm_eps, self.config
        # the first layer: the embeddings are the residual stream, and nothing is added to it
        added, residual = (None, x) if residual is None else (x, residual)
        q, k, v, residual = self.attention_inputs(added, residual, cos, sin)
        out = attention(self.layer_idx, q, k, v).reshape(q.shape[0], cfg.q_size)
        if keep is not None:
            out, residual = out[keep], residual[keep]
        return ops.mlp_block(
            out,
            residual,
            self._projection("o_proj", self.o_bias),
            self.post_attention_layernorm,
            eps,
            self._projection("gate_up_proj"),
            self._projection("down_proj"),
        )

    def attention_inputs(
        self, x: torch.Tensor | None, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v, residual stream) as ``LayerOps.attention_inputs`` makes them: a subclass
        that changes q/k between projection and RoPE overrides this (and so leaves the fused
        one-call path, which would skip its change)."""
        cfg = self.config
        return self.ops.attention_inputs(
            x,
            residual,
            self.input_layernorm,
            cfg.rms_norm_eps,
            self._projection("qkv_proj", self.qkv_bias),
            cos,
            sin,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        )

    def stack_layer(self) -> StackLayer | None:
        """This layer as a layer stack runs it (q/k/v and o biases included), or None where it
        is not the plain layer (a subclass that changes either half)."""
        plain = LlamaDecoderLayer
        if (
            type(self).forward is not plain.forward
            or type(self).attention_inputs is not plain.attention_inputs
        ):
            return None
        return StackLayer(
            self.input_layernorm,
            self._projection("qkv_proj", self.qkv_bias),
            self.post_attention_layernorm,
            self._projection("o_proj", self.o_bias),
            self._projection("gate_up_proj"),
            self._projection("down_proj"),
        )

    def _projection(self, name: str, bias: torch.Tensor | None = None) -> Linear:
        return Linear(getattr(self, name), self.packed.get(name), bias)

    def pack_weights(self, allocate: Allocate) -> None:
        self.packed = {
            name: self.ops.pack(_data(getattr(self, name)), allocate) for name in _PACKED_PARAMS
        }


class LlamaForCausalLM(nn.Module):
    """The whole decoder. Owns its weights (frozen, eval mode) and the float32 RoPE table.

    `forward` maps a flat batch of tokens from any number of sequences to final-normed hidden
    states; `compute_logits` turns the rows the caller wants sampled into logits.
    """

    rope_cos: torch.Tensor  # buffers: [max_position_embeddings, head_dim // 2] float32
    rope_sin: torch.Tensor
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer  # a family's own layer

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            self.layer_class(config, i, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = _weight(config.hidden_size, dtype=dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _weight(config.vocab_size, config.hidden_size, dtype=dtype)
        )
        self.packed_head: Packed = None  # pack_weights
        self.ops: LayerOps = TORCH_OPS  # use_layer_ops
        self._prepared_stack: object = _UNPREPARED  # _stack, for the packed weights
        cos, sin = rope_cos_sin(config)  # [max_position_embeddings, head_dim // 2] each
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.eval()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> final-normed hidden states [T, hidden], or only
        the ``keep`` rows' (int64): the last layer caches every row's K/V, then goes on with those.

        When ``attention`` also offers itself to C code (a ``native`` attribute, a
        ``NativeAttention``) and the ops can run this model's layers in one go, they do
        (``LayerOps.run_stack``: the same numbers, without a Python call per op)."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self._embed(input_ids)
        native: NativeAttention | None = getattr(attention, "native", None)
        if native is not None and (stack := self._stack()) is not None:
            cfg = self.config
            heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
            eps = cfg.rms_norm_eps
            out = self.ops.run_stack(stack, x, cos, sin, eps, heads, kv_heads, native)
            if out is not None:
                return out if keep is None else out[keep]
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, attention, keep if i == last else None)
        eps = self.config.rms_norm_eps
        if residual is None:  # no layers
            return self.ops.rms_norm(x if keep is None else x[keep], self.norm, eps)
        return self.ops.add_rms_norm(x, residual, self.norm, eps)[0]

    def _stack(self) -> object:
        """The ops' prepared stack of these layers (``LayerOps.prepare_stack``), made at first
        use after packing; None where a layer is not plain or the ops cannot."""
        if self._prepared_stack is _UNPREPARED:
            layers = [_as_layer(layer).stack_layer() for layer in self.layers]
            plain = [layer for layer in layers if layer is not None]
            ready = len(plain) == len(layers) > 0 and self.packed_head is not None
            self._prepared_stack = self.ops.prepare_stack(plain, self.norm) if ready else None
        return self._prepared_stack

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab], float32 or (``float32=False``) in the
        model's dtype, for a caller that widens only what it needs."""
        logits = self.ops.linear(hidden, self._head(), self.packed_head, None)
        return logits.float() if float32 else logits

    def _head(self) -> Weight:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens
        if isinstance(table, QuantizedWeight):  # the rows dequantized, exactly: from a tied
            tied = self.lm_head is None  # head's packed copy where the ops read it back
            rows = self.ops.packed_rows(self.packed_head, input_ids) if tied else None
            rows = torch.from_numpy(table.rows(input_ids.numpy())) if rows is None else rows
            return rows.to(self.norm.dtype)
        return F.embedding(input_ids, table)

    def quantized_weights(self) -> Iterator[tuple[str, QuantizedWeight]]:
        """(name, weight) of every matmul weight kept as GGUF blocks (none but for a GGUF
        loaded with ``keep_quantized``)."""
        for name in ("embed_tokens", "lm_head"):
            weight = getattr(self, name)
            if isinstance(weight, QuantizedWeight):
                yield name, weight
        for i, layer in enumerate(self.layers):
            for name in _PACKED_PARAMS:
                weight = getattr(layer, name)
                if isinstance(weight, QuantizedWeight):
                    yield f"layers.{i}.{name}", weight

    def use_layer_ops(self, ops: LayerOps) -> None:
        """Run every layer's matmuls and elementwise ops (and the final norm) through ``ops``.

        Packed weights are in the layout of the ops that packed them: switching ops drops
        them (``pack_weights`` again to have the new ops' layout)."""
        if ops is not self.ops:
            self._unpack()
        self.ops = ops
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.ops = ops

    def pack_weights(self, allocate: Allocate = torch_empty) -> None:
        """Prepack every matmul weight in the layout of the current ops' ``pack`` (oneDNN's,
        or the fused ops' tiles or stripes; a no-op where there is none).

        The packed copies are taken from the parameters as they are now; ``load_weights``
        drops them, so call this after loading. Packing twice is a no-op. Copies in a layout
        of the ops' own go into tensors from ``allocate`` (``LayerOps.pack``).
        """
        if self.packed_head is not None:
            return
        for layer in self.layers:  # a layer's file pages go as soon as its copies exist
            assert isinstance(layer, LlamaDecoderLayer)
            layer.pack_weights(allocate)
            drop_file_pages(_quantized(_data(getattr(layer, n)) for n in _PACKED_PARAMS))
        self.packed_head = self.ops.pack(_data(self._head()), allocate)
        drop_file_pages(_quantized([self._head()]))
        self._prepared_stack = _UNPREPARED  # made again for these copies

    def packed_weight_named(self, name: str) -> Packed:
        """The packed copy of a weight named as ``quantized_weights`` names it."""
        if (name == "embed_tokens" and self.lm_head is None) or name == "lm_head":
            return self.packed_head
        if name.startswith("layers."):
            _, layer, param = name.split(".")
            return self.packed_weight(int(layer), param)
        return None

    def packed_weight(self, layer: int, name: str) -> Packed:
        """Layer ``layer``'s packed copy of ``name`` (e.g. "qkv_proj"); None if none."""
        decoder = self.layers[layer] if layer < len(self.layers) else None
        return decoder.packed.get(name) if isinstance(decoder, LlamaDecoderLayer) else None

    def _unpack(self) -> None:
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.packed = {}
        self.packed_head = None
        self._prepared_stack = _UNPREPARED

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Copy tensors named as in a HF checkpoint into the (fused) parameters.

        Casts to the model dtype on copy. A ``QuantizedWeight`` replaces its parameter where
        every slice of that parameter comes quantized (the fused weight's segments in slice
        order); otherwise it is dequantized into its slice. Raises ModelLoadError on an
        unexpected name, a shape mismatch, or when some parameter slice was never written.
        """
        self._unpack()  # packed copies of the old values would be stale
        targets = self._targets()
        written: set[str] = set()
        quantized: dict[tuple[nn.Module, str], dict[str | None, QuantizedWeight]] = {}
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (
                name == "lm_head.weight" and self.lm_head is None
            ):
                continue  # tied checkpoints sometimes store the head as well
            target = targets.get(name)
            if target is None:
                raise ModelLoadError(f"unexpected tensor {name!r} for {self.config.model_type}")
            module, param_name, part = target
            view = _slice(module, param_name, part, self.config)
            if tuple(view.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}"
                )
            if isinstance(tensor, QuantizedWeight):
                quantized.setdefault((module, param_name), {})[part] = tensor
            else:
                view.copy_(tensor)
            written.add(name)
        missing = sorted(set(targets) - written)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"missing {len(missing)} tensors: {shown}")
        for (module, param_name), parts in quantized.items():
            self._keep_quantized(module, param_name, parts)

    def _keep_quantized(
        self, module: nn.Module, param_name: str, parts: dict[str | None, QuantizedWeight]
    ) -> None:
        """``parts`` (slice -> weight) become the parameter if they are all of it, in the
        fused order; else each is dequantized into its slice."""
        slices = self.config.fused_slices
        order = sorted(parts, key=lambda part: -1 if part is None else slices[part].start)
        whole = _slice(module, param_name, None, self.config)
        if sum(parts[p].shape[0] for p in order) == whole.shape[0]:
            stacked = QuantizedWeight.stack([parts[p] for p in order])
            delattr(module, param_name)  # the parameter goes: its memory was never written
            setattr(module, param_name, stacked)
            return
        for part, weight in parts.items():
            _slice(module, param_name, part, self.config).copy_(dense(weight, whole.dtype))

    def _targets(self) -> dict[str, tuple[nn.Module, str, str | None]]:
        """HF tensor name -> (module, parameter name, fused slice or None) it fills."""
        targets: dict[str, tuple[nn.Module, str, str | None]] = {
            "model.embed_tokens.weight": (self, "embed_tokens", None),
            "model.norm.weight": (self, "norm", None),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = (self, "lm_head", None)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            for suffix, (param_name, part) in layer.hf_params.items():
                if getattr(layer, param_name) is None:
                    continue  # no q/k/v (or o) bias in this architecture
                targets[f"model.layers.{i}.{suffix}"] = (layer, param_name, part)
        return targets


_UNPREPARED = object()  # LlamaForCausalLM._stack not made yet


def _as_layer(module: nn.Module) -> LlamaDecoderLayer:
    assert isinstance(module, LlamaDecoderLayer)
    return module


def _quantized(weights: Iterable[object]) -> list[QuantizedWeight]:
    return [w for w in weights if isinstance(w, QuantizedWeight)]


def _data(weight: Weight) -> Weight:
    """A parameter's tensor (not the Parameter), or quantized blocks as they are."""
    return weight.data if isinstance(weight, torch.Tensor) else weight


def _slice(
    module: nn.Module, param_name: str, part: str | None, config: ModelConfig
) -> torch.Tensor:
    """The view of ``module``'s parameter that slice ``part`` of a fused weight fills."""
    param = getattr(module, param_name)
    if not isinstance(param, torch.Tensor):
        raise ModelLoadError(f"{param_name} was loaded twice")
    return param.data if part is None else param.data[config.fused_slices[part]]
