"""The ops of a Llama layer besides attention, as one swappable object: the matmuls, RMSNorm
(with the residual add fused in), RoPE on the fused qkv output, SiLU-and-multiply.

Owns their contract (``LayerOps``) and the reference implementation in torch ops (``TorchOps``),
which defines the numbers: the C versions in ``pagekv/kernels/fused_ops.py`` agree with it
exactly where the math is the same (residual add, RoPE) and within bfloat16 rounding elsewhere
(a float32 sum in another order, another exp; the packed matmuls). Why swappable: at decode
sizes each torch op costs mostly its dispatch, and a layer spends ~40 of them here, and oneDNN
streams a decode step's weights at half the memory's speed; the runner's fast path swaps in the
C ops, the model itself never chooses.

A layer calls two composites, the halves around attention (``attention_inputs``: norm, qkv,
RoPE; ``mlp_block``: output projection, norm, MLP), which the functions of the same names here
compose from the ops above; an implementation may run a half in one go (the C ops do for decode
batches, saving a call per op) as long as the numbers are
those of the composition. Imports nothing from runner/ or core/.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from pagekv.models.quantized import QuantizedWeight
from pagekv.models.rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalize in float32, cast back, then scale in the model dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


PACKED_MAX_ROWS = 256  # above: prefill-sized, where the packed LM head measured slower
PACK_ROWS_HINT = 64  # oneDNN picks its blocking for this many rows; any row count stays exact


# (shape, dtype) -> a new uninitialized tensor: where ``LayerOps.pack`` puts a copy of its own
# layout (``torch.empty`` by default; the runner's is an arena on 2 MiB pages).
Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class OpsLayout:
    """A weight's copy in a layout of some ops' own that is not one tensor (the quantized
    kernels' stripes): only the ops that made it read it."""

    def describe(self) -> str:
        """What multiplies it, for the system-info line."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """The memory it takes."""
        raise NotImplementedError


# A matmul weight [out, in]: a tensor in the model's dtype, or GGUF blocks kept quantized.
Weight = torch.Tensor | QuantizedWeight
# What an ops' ``pack`` made of a weight: a tensor (oneDNN's copy, tiles, stripes), a layout
# of its own, or None.
Packed = torch.Tensor | OpsLayout | None


def dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a tensor of ``dtype``: quantized blocks dequantized (gguf's reference,
    a new tensor on every call: the slow path where no kernel takes them)."""
    if isinstance(weight, QuantizedWeight):
        return torch.from_numpy(weight.dequantize()).to(dtype)
    return weight


def pack(weight: Weight, allocate: Allocate = torch_empty) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a bf16 or float32 [out, in] weight; None for other dtypes or
    builds. In bf16 torch's own matmul is oneDNN's, so the numbers are the same; in float32
    torch's is MKL's sgemm, which oneDNN's packed kernels beat at decode sizes on AMD Zen
    (MKL takes a slow path there), with float32 sums in another order. oneDNN
    allocates its copy itself: ``allocate`` is not used. None for quantized blocks."""
    if isinstance(weight, QuantizedWeight) or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
    except (RuntimeError, AttributeError):  # op missing from this build, or the CPU lacks bf16
        return None
    return packed


def linear(
    x: torch.Tensor, weight: Weight, packed: Packed, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` (oneDNN's prepacked copy of ``weight``)
    for decode-sized x in bf16 (the same numbers), for any x in float32 (where oneDNN beats
    MKL's sgemm at prefill sizes too, on AMD Zen).
    Quantized blocks are dequantized for the call (``dense``)."""
    if not isinstance(packed, torch.Tensor) or (
        x.shape[0] > PACKED_MAX_ROWS and x.dtype != torch.float32
    ):
        return F.linear(x, dense(weight, x.dtype), bias)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


class Linear(NamedTuple):
    """A projection as the ops take it: weight [out, in], what the ops' ``pack`` made of it
    (or None), and the bias (or None)."""

    weight: Weight
    packed: Packed = None
    bias: torch.Tensor | None = None


class StackLayer(NamedTuple):
    """One decoder layer as a layer stack takes it (``LayerOps.prepare_stack``): its norms and
    projections, in the order the layer uses them."""

    input_norm: torch.Tensor
    qkv: Linear
    post_norm: torch.Tensor
    o_proj: Linear
    gate_up: Linear
    down: Linear

    @property
    def matmuls(self) -> tuple[Linear, Linear, Linear, Linear]:
        return self.qkv, self.o_proj, self.gate_up, self.down


@dataclass(frozen=True)
class NativeAttention:
    """A step's attention as C code calls it, layer by layer: the address of a function
    ``int f(const void* context, int layer, const void* q, const void* k, const void* v,
    void* out)`` (0 on success) that does what the step's ``AttentionFn`` does for that layer,
    q/k/v as ``attention_inputs`` makes them and out [T, num_heads, head_dim] in their dtype,
    and the address of its context, valid for the step (``keep`` holds what it points into).
    ``dtype``: of q/k/v and out, the model's."""

    function: int
    context: int
    dtype: torch.dtype
    keep: object = None


class LayerOps(Protocol):
    """What a decoder layer needs besides attention. Tensors in the model dtype unless said
    otherwise; T is the number of tokens."""

    def pack(self, weight: Weight, allocate: Allocate = torch_empty) -> Packed:
        """A copy of weight [out, in] laid out for this object's ``linear`` (same numbers), or
        None where it has no faster layout for this dtype or shape. A copy in a layout of the
        object's own goes into tensors from ``allocate``."""
        ...

    def linear(
        self,
        x: torch.Tensor,
        weight: Weight,
        packed: Packed,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [T, in] @ weight [out, in]^T (+ bias) -> [T, out]; ``packed`` is what this
        object's ``pack`` made of weight, or None."""
        ...

    def packed_rows(self, packed: Packed, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows ``ids`` (int64 [T]) of the weight ``packed`` was made of, float32 [T, in],
        read back from the packed copy (the same numbers: an embedding lookup of a tied head
        without the file's blocks); None where this object's layout cannot."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, hidden] -> a new [T, hidden]: ``rms_norm`` above."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, new residual) with new residual = residual + x (rounded to the dtype) and
        normed = rms_norm(new residual). ``residual`` may be updated in place and returned:
        callers must not use the tensor they passed afterwards."""
        ...

    def split_rope(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] (rows may be strided), cos/sin
        float32 [T, head_dim // 2] -> q [T, num_heads, head_dim], k and v [T, num_kv_heads,
        head_dim], each contiguous and new; q and k rotated as ``apply_rope`` does."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 * I] (gate, then up) -> silu(gate) * up [T, I], a new tensor."""
        ...

    def gated_linear(
        self, x: torch.Tensor, weight: Weight, packed: Packed, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``silu_mul(linear(x, weight, packed, bias))``, the same numbers, for a gated MLP's
        weight [2 * I, in] (gate's rows, then up's): [T, I]."""
        ...

    def attention_inputs(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        qkv: Linear,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer up to attention, as ``attention_inputs`` below composes it: (q, k, v, the
        residual stream). ``x`` None: the first layer, whose residual is only normed."""
        ...

    def mlp_block(
        self,
        attn: torch.Tensor,
        residual: torch.Tensor,
        o_proj: Linear,
        norm: torch.Tensor,
        eps: float,
        gate_up: Linear,
        down: Linear,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer after attention, as ``mlp_block`` below composes it: (its output, the
        residual stream)."""
        ...

    def prepare_stack(self, layers: Sequence[StackLayer], final_norm: torch.Tensor) -> object:
        """What ``run_stack`` needs to run these layers and the final norm in one go, made
        once for the weights as they are now; None where these ops cannot."""
        ...

    def run_stack(
        self,
        stack: object,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float,
        num_heads: int,
        num_kv_heads: int,
        attention: NativeAttention,
    ) -> torch.Tensor | None:
        """The prepared layers (``prepare_stack``) on the embeddings x [T, hidden], attention
        by ``attention``, then the final norm: what the layers one by one give, the same
        numbers. None where it declines (nothing written, x as it was)."""
        ...


def attention_inputs(
    ops: LayerOps,
    x: torch.Tensor | None,
    residual: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    qkv: Linear,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The input norm (of residual + x, which updates the residual; of the residual alone when
    x is None), the fused q/k/v projection, the split and RoPE, through ``ops``' own ops."""
    if x is None:
        h = ops.rms_norm(residual, norm, eps)
    else:
        h, residual = ops.add_rms_norm(x, residual, norm, eps)
    q, k, v = ops.split_rope(ops.linear(h, *qkv), cos, sin, num_heads, num_kv_heads)
    return q, k, v, residual


def mlp_block(
    ops: LayerOps,
    attn: torch.Tensor,
    residual: torch.Tensor,
    o_proj: Linear,
    norm: torch.Tensor,
    eps: float,
    gate_up: Linear,
    down: Linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output projection of attn [T, q_size], the residual add and post-attention norm,
    then the SwiGLU MLP, through ``ops``' own ops."""
    h, residual = ops.add_rms_norm(ops.linear(attn, *o_proj), residual, norm, eps)
    return ops.linear(ops.gated_linear(h, *gate_up), *down), residual


class TorchOps:
    """The reference: plain torch ops, any dtype."""

    pack = staticmethod(pack)
    linear = staticmethod(linear)

    def packed_rows(self, packed: Packed, ids: torch.Tensor) -> torch.Tensor | None:
        return None  # oneDNN's copies are not read back

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def split_rope(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens, head_dim = qkv.shape[0], 2 * cos.shape[-1]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(num_tokens, num_heads, head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, num_kv_heads, head_dim), cos, sin)
        # contiguous like q and k (fresh from the rotation), so kernels may assume it
        v = v.reshape(num_tokens, num_kv_heads, head_dim).contiguous()
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gated_linear(
        self, x: torch.Tensor, weight: Weight, packed: Packed, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return self.silu_mul(self.linear(x, weight, packed, bias))

    # the compositions above, with this object as their ops
    attention_inputs = attention_inputs
    mlp_block = mlp_block

    def prepare_stack(self, layers: Sequence[StackLayer], final_norm: torch.Tensor) -> object:
        return None  # torch runs a layer op by op

    def run_stack(self, stack: object, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        return None


TORCH_OPS = TorchOps()
