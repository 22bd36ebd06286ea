"""``LayerOps`` in C++ (``csrc/fused_ops.cpp``): each of RMSNorm(+residual), RoPE+split and
SiLU*up is one call per layer instead of 3-12 torch ops, for float32 and bfloat16 models
(``row_ops``); and the matmuls, through weights packed once at load:

- stripes (every target: AVX-512, AVX2 + FMA, generic): float32 or bfloat16 weights, float32
  FMAs, every row count; bf16 weights are widened in registers, so they stream half the bytes
  of float32 and are never multiplied by emulated bf16 instructions;
- tiles (AVX512-BF16 vectors or AMX, where the target has them): bfloat16 decode steps of 1-256
  rows, which stream the weights faster than oneDNN does; larger bf16 batches go to oneDNN.

A gated MLP's quantized gate/up weight is one pass that writes only SiLU(gate) * up
(``gated_linear``): each stripe's gate and up columns stay in cache for the SiLU, the same
numbers as the matmul and ``silu_mul`` one after the other.

A decode layer's two halves around attention (``attention_inputs``, ``mlp_block``) are one C
call each on decode batches whose matmuls are all packed here (dense float32 or bf16 weights,
or GGUF blocks): the same kernels in the same order, so the same bits, without
nine Python calls and their new tensors. A whole decode step's layers and the final norm are one
call too (``prepare_stack``, ``run_stack``), the halves of every layer with the step's
attention between them called from C (``NativeAttention``: the decode kernel's
``step_attention``).

Owns the choice of layout for each weight (``pack``: the dense stripes and tiles are
``dense``'s, the quantized stripes ``quant``'s) and the ctypes calls of the layer ops. The
numbers follow ``layer_ops.TorchOps`` rounding point by rounding point (float32 math, one
rounding to the dtype wherever torch rounds); only the sum of squares (another order) and exp
(another polynomial) differ, by float32 ulps. Rows are split over ``torch.get_num_threads()``
OpenMP threads once a call has enough work; each row is computed the same way whatever the
split, so threads never change a bit. The stripes sum each output in one order (k ascending,
one FMA chain) for any row count, so a row's numbers never depend on its batch; the tile
kernels sum in one order for any row count up to 256 (the AMX one as oneDNN does up to 32
rows). So in bfloat16 with tiles a sequence's numbers depend, within a bf16 ulp per matmul,
only on whether its batch had up to 256 rows or more.

``load()`` returns None (callers keep ``TorchOps``) when there is no compiler, the build fails,
``PAGEKV_FUSED_OPS=0`` or ``PAGEKV_CPU_ISA=none``. Imports nothing from runner/ or core/.
"""

from __future__ import annotations

import copy
import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import torch

from pagekv.kernels import abi, build
from pagekv.kernels.dense import SUFFIXES, DenseKernels, by_dtype
from pagekv.kernels.layer_stack import Stack
from pagekv.kernels.quant import PackedQuant, QuantKernels
from pagekv.kernels.row_ops import RowOps, threads
from pagekv.models import layer_ops
from pagekv.models.quantized import QuantizedWeight

DISABLE_ENV = "PAGEKV_FUSED_OPS"

# The most rows a layer half goes through in one C call on stripes (a decode batch; the tiles
# have their own limit).
ONE_CALL_MAX_ROWS = 256


class FusedOps(RowOps):
    """``LayerOps`` through the loaded library, for the dtypes ``supports`` accepts: the row
    ops (``RowOps``), the matmuls and the layer halves.

    The C side trusts its pointers, so every call checks dtypes, shapes and layout first and
    raises ValueError on a mismatch (a caller bug, not a fallback case).
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library)
        self._attention_inputs = by_dtype(library, "attention_inputs_dense")
        self._mlp_block = by_dtype(library, "mlp_block_dense")
        self._quant_attention_inputs = by_dtype(library, "attention_inputs_quant")
        self._quant_mlp_block = by_dtype(library, "mlp_block_quant")
        self._quant_stack = by_dtype(library, "decoder_stack_quant")
        self._dense_stack = by_dtype(library, "decoder_stack_dense")
        self.dense = DenseKernels(library)
        self.quant = QuantKernels(library, self.dense.stripe)
        self.int8_activations = False  # GGUF weights packed for int8 dot products
        self._int8_variant: FusedOps | None = None

    def with_int8_activations(self) -> FusedOps:
        """The same ops packing GGUF weights for int8 activations (``QuantKernels.pack``'s
        ``dots``): one other object, so a model switched to it packs its weights again."""
        if self.int8_activations:
            return self
        if self._int8_variant is None:
            self._int8_variant = copy.copy(self)
            self._int8_variant.int8_activations = True
        return self._int8_variant

    @property
    def matmul_unit(self) -> str | None:
        """What multiplies packed tiles: "amx", "avx512-bf16" (vectors), or None (no tiles)."""
        return self.dense.matmul_unit

    def use_matmul_unit(self, name: str) -> bool:
        """Multiply tiles on "amx" or "avx512-bf16" where this CPU has it (tests compare the
        two; the packed layout is the same). True if now in use."""
        return self.dense.use_matmul_unit(name)

    @property
    def stripe_width(self) -> int:
        """Columns of a stripe: two of the target's vectors (32 on AVX-512, 16 on AVX2)."""
        return self.dense.stripe

    def pack(
        self, weight: layer_ops.Weight, allocate: layer_ops.Allocate = layer_ops.torch_empty
    ) -> layer_ops.Packed:
        """The same numbers of an [out, in] weight reordered for this object's matmuls: GGUF
        blocks in the quantized stripes (``QuantKernels.pack``; None where the rows are not
        whole stripes, so ``layer_ops.linear`` dequantizes them per call); in bf16
        where the target has tiles (AVX512-BF16, AMX; sides multiples of 32) the tiled
        kernel's tiles, a [out / 16, in / 32, 16, 32] tensor; else, float32 or bf16 with out a
        multiple of ``stripe_width`` S, stripes [out / S, in, S] of the weight's dtype;
        otherwise ``layer_ops.pack`` (oneDNN's copy, or None). Tiles and stripes go into a
        tensor from ``allocate``."""
        if isinstance(weight, QuantizedWeight):
            return self.quant.pack(weight, allocate, self.int8_activations)
        return self.dense.pack(weight, allocate)

    def linear(
        self,
        x: torch.Tensor,
        weight: layer_ops.Weight,
        packed: layer_ops.Packed,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """bf16 without bias, at up to 256 rows with tiles from ``pack`` (none on CPUs without
        AVX512-BF16): the tiled kernel (AMX, or vectors), within a bf16 ulp of torch's matmul,
        streaming a step's weights faster than oneDNN up to 32 rows (about even above).
        float32 without bias, with stripes from ``pack``: the float32 kernel at any row count.
        Quantized stripes: the quantized kernel, float32 or bf16 activations, any row count.
        Otherwise ``layer_ops.linear``."""
        if isinstance(packed, PackedQuant):
            out = self.quant.linear(x, packed, threads())
            return out if bias is None else out.add_(bias)
        return self.dense.linear(x, weight, packed, bias, threads())

    def gated_linear(
        self,
        x: torch.Tensor,
        weight: layer_ops.Weight,
        packed: layer_ops.Packed,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Quantized stripes without bias: one pass that keeps each stripe's gate and up
        columns in cache and writes only silu(gate) * up (``QuantKernels.gated``). Otherwise
        ``silu_mul`` of ``linear``."""
        if isinstance(packed, PackedQuant) and bias is None:
            out = self.quant.gated(x, packed, threads())
            if out is not None:
                return out
        return self.silu_mul(self.linear(x, weight, packed, bias))

    def packed_rows(self, packed: layer_ops.Packed, ids: torch.Tensor) -> torch.Tensor | None:
        """Quantized stripes' rows, exactly (``QuantKernels.rows``); None for other layouts."""
        return self.quant.rows(packed, ids) if isinstance(packed, PackedQuant) else None

    def attention_inputs(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        qkv: layer_ops.Linear,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``layer_ops.attention_inputs`` in one C call for decode batches whose matmul is
        float32 stripes, bf16 tiles or stripes, or GGUF weights' quantized stripes (the same
        kernels, so the same bits); op by op otherwise."""
        rows, hidden = residual.shape
        half = cos.shape[-1]
        kind = self._one_call(residual, norm, rows, (qkv,))
        if (
            kind is not None
            and (x is None or (x.shape == residual.shape and x.dtype == residual.dtype))
            and (x is None or x.is_contiguous())
            and qkv.weight.shape == ((num_heads + 2 * num_kv_heads) * 2 * half, hidden)
            and cos.dtype == sin.dtype == torch.float32
            and cos.shape == sin.shape == (rows, half)
            and cos.is_contiguous()
            and sin.is_contiguous()
        ):
            q = torch.empty((rows, num_heads, 2 * half), dtype=residual.dtype)
            k = torch.empty((rows, num_kv_heads, 2 * half), dtype=residual.dtype)
            v = torch.empty_like(k)
            inputs = (None if x is None else x.data_ptr(), residual.data_ptr(), norm.data_ptr())
            outputs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
            shape = (rows, hidden, num_heads, num_kv_heads, 2 * half)
            tables = (cos.data_ptr(), sin.data_ptr())
            if kind == "quant":
                call = self._quant_attention_inputs[residual.dtype]
                status = call(
                    *inputs, eps, _quant(qkv.packed), *tables, *outputs, *shape, threads()
                )
            else:
                weights = (_packed(qkv.packed),)
                status = self._attention_inputs[residual.dtype](
                    *inputs, eps, *weights, *tables, *outputs, *shape, self.dense.unit, threads()
                )
            if status == 0:
                return q, k, v, residual
        return layer_ops.attention_inputs(
            self, x, residual, norm, eps, qkv, cos, sin, num_heads, num_kv_heads
        )

    def mlp_block(
        self,
        attn: torch.Tensor,
        residual: torch.Tensor,
        o_proj: layer_ops.Linear,
        norm: torch.Tensor,
        eps: float,
        gate_up: layer_ops.Linear,
        down: layer_ops.Linear,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer_ops.mlp_block`` in one C call for decode batches whose matmuls are all
        float32 stripes, all bf16 tiles or stripes, or all GGUF weights' quantized stripes (the
        same kernels, so the same bits); op by op otherwise."""
        rows, hidden = residual.shape
        inter = down.weight.shape[1]
        kind = self._one_call(residual, norm, rows, (o_proj, gate_up, down))
        if (
            kind is not None
            and attn.dtype == residual.dtype
            and attn.is_contiguous()
            and attn.shape == (rows, o_proj.weight.shape[1])
            and o_proj.weight.shape[0] == hidden
            and gate_up.weight.shape == (2 * inter, hidden)
            and down.weight.shape[0] == hidden
        ):
            out = torch.empty_like(residual)
            head = (attn.data_ptr(), residual.data_ptr())
            shape = (out.data_ptr(), rows, hidden, attn.shape[1], inter)
            if kind == "quant":
                status = self._quant_mlp_block[residual.dtype](
                    *head,
                    _quant(o_proj.packed),
                    norm.data_ptr(),
                    eps,
                    _quant(gate_up.packed),
                    _quant(down.packed),
                    *shape,
                    threads(),
                )
            else:
                status = self._mlp_block[residual.dtype](
                    *head,
                    _packed(o_proj.packed),
                    norm.data_ptr(),
                    eps,
                    _packed(gate_up.packed),
                    _packed(down.packed),
                    *shape,
                    self.dense.unit,
                    threads(),
                )
            if status == 0:
                return out, residual
        return layer_ops.mlp_block(self, attn, residual, o_proj, norm, eps, gate_up, down)

    def prepare_stack(
        self, layers: Sequence[layer_ops.StackLayer], final_norm: torch.Tensor
    ) -> Stack | None:
        """The layers for ``decoder_stack_*`` (layer_stack.py), where every matmul is one the
        layer halves' one C call takes (all quantized stripes, which may have biases of the
        activations' dtype; all float32 stripes, or all bf16 tiles or stripes, without), and
        every layer has the first one's shapes; None otherwise."""
        linears = [lin for layer in layers for lin in layer.matmuls]
        dtype = final_norm.dtype
        if not all(_stack_bias_fits(lin, dtype) for lin in linears):
            return None
        if dtype in SUFFIXES and all(
            isinstance(lin.packed, PackedQuant) and lin.packed.shape == lin.weight.shape
            for lin in linears
        ):
            matmuls = [
                abi.StackMatmul(quant=_quant(lin.packed), bias=_address(lin.bias))
                for lin in linears
            ]
            function, rows, unit = self._quant_stack[dtype], ONE_CALL_MAX_ROWS, None
        elif self._fits_dense(final_norm, tuple(linears)):
            unit = self.dense.unit if dtype == torch.bfloat16 else None  # float32: no tiles
            matmuls = [
                abi.StackMatmul(packed=_packed(lin.packed), unit=unit or 0) for lin in linears
            ]
            function, rows = self._dense_stack[dtype], self._dense_rows(dtype)
        else:
            return None
        return Stack.build(function, layers, matmuls, final_norm, rows, unit)

    def run_stack(self, stack: object, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        """Every layer and the final norm in one ``decoder_stack_*`` call (``Stack.run``)."""
        assert isinstance(stack, Stack)
        return stack.run(*args, **kwargs, unit=self.dense.unit, threads=threads())

    def _one_call(
        self,
        residual: torch.Tensor,
        norm: torch.Tensor,
        rows: int,
        linears: tuple[layer_ops.Linear, ...],
    ) -> str | None:
        """Which C call a layer half of ``rows`` rows can go through: "quant" where every
        matmul has quantized stripes (float32 or bf16), "dense" where every one is bf16 that
        one ``linear`` would give the tiles or, without them, the stripes; None otherwise (a
        bias never). The residual and norm must be as the C side reads them."""
        if not (
            rows > 0
            and residual.dtype == norm.dtype
            and residual.is_contiguous()
            and norm.is_contiguous()
            and norm.shape == residual.shape[1:]
        ):
            return None
        if all(
            isinstance(packed, PackedQuant) and packed.shape == weight.shape and bias is None
            for weight, packed, bias in linears
        ):
            quant_ok = rows <= ONE_CALL_MAX_ROWS and residual.dtype in SUFFIXES
            return "quant" if quant_ok else None
        dense_ok = rows <= self._dense_rows(residual.dtype)
        return "dense" if dense_ok and self._fits_dense(residual, linears) else None

    def _dense_rows(self, dtype: torch.dtype) -> int:
        """The most rows one C call takes with dense weights: the tiles' limit for bf16 where
        the target has tiles; else (stripes) the one-call limit."""
        if dtype == torch.bfloat16 and self.dense.tiles_max_rows:
            return self.dense.tiles_max_rows
        return ONE_CALL_MAX_ROWS

    def _fits_dense(self, residual: torch.Tensor, linears: tuple[layer_ops.Linear, ...]) -> bool:
        """Whether every matmul is a dense weight of the residual's dtype (float32 or bf16),
        without bias (a dense linear adds it in torch's matmul), packed as the C halves
        multiply it (``DenseKernels.decode_layout``)."""
        dtype = residual.dtype
        if dtype not in SUFFIXES:
            return False
        for weight, packed, bias in linears:
            if not isinstance(weight, torch.Tensor) or not isinstance(packed, torch.Tensor):
                return False
            if bias is not None or weight.dtype != dtype:
                return False
            out_features, in_features = weight.shape
            if packed.shape != self.dense.decode_layout(out_features, in_features, dtype):
                return False
        return True


def _stack_bias_fits(linear: layer_ops.Linear, dtype: torch.dtype) -> bool:
    """Whether the layer stack can add the matmul's bias: none, or one contiguous row of the
    activations' dtype."""
    bias = linear.bias
    return bias is None or (
        bias.dtype == dtype and bias.is_contiguous() and bias.shape == linear.weight.shape[:1]
    )


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _quant(packed: layer_ops.Packed) -> int:
    """The address of quantized stripes' QuantWeight, as the C layer halves take it."""
    assert isinstance(packed, PackedQuant)
    return packed.address


def _packed(packed: layer_ops.Packed) -> int | None:
    """The address of packed tiles or stripes; None for no copy or oneDNN's (no storage)."""
    ours = isinstance(packed, torch.Tensor) and packed.dim() in (3, 4)
    return packed.data_ptr() if ours and isinstance(packed, torch.Tensor) else None


# No FMA contraction: g++ contracts a * b - c into one rounding even under -std=c++17, and torch
# rounds the product first.
_EXTRA_FLAGS = ("-ffp-contract=off",)


def load(target: str | None = None) -> FusedOps | None:
    """The ops built for ``target`` (default: the selected one, ``isa.selected()``); None if
    unavailable or disabled (``PAGEKV_FUSED_OPS=0``)."""
    return _wrap(build.library_for("fused_ops", target, DISABLE_ENV, _EXTRA_FLAGS))


@functools.cache
def _wrap(library: ctypes.CDLL | None) -> FusedOps | None:
    return None if library is None else FusedOps(library)
