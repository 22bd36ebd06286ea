"""Float32 and bfloat16 matmul weights on the C kernels (``csrc/fused_ops.cpp``): packed once
at load into stripes or tiles, then multiplied.

Owns the two dense layouts and their calls: stripes [out / S, in, S] (every target; S two of
its vectors) for float32 and bf16 weights, and on targets with AVX512-BF16 or AMX the tiles
[out / 16, in / 32, 16, 32] of bf16 weights, multiplied by AMX or by vectors (``unit``). The
stripes sum each output in one order for any row count; the tiles in one order up to
``tiles_max_rows`` rows (``fused_ops`` states what that means for a sequence's numbers).
``fused_ops.FusedOps`` takes these entry points beside the quantized ones (``quant``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from pagekv.kernels.isa import TILE_UNITS
from pagekv.models import layer_ops

# Activation dtype -> the suffix of the C entry point built for it.
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def by_dtype(library: ctypes.CDLL, name: str) -> dict[torch.dtype, Any]:
    """``{float32: library.<name>_f32, bfloat16: library.<name>_bf16}``."""
    return {dtype: getattr(library, f"{name}_{suffix}") for dtype, suffix in SUFFIXES.items()}


class DenseKernels:
    """The dense matmul's entry points of one loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._tiled = library.tiles_linear_bf16
        self._tiles_pack = library.tiles_pack_bf16
        self.tiles_max_rows = int(library.tiles_linear_max_rows())  # 0: no AVX512-BF16
        self._best_unit = int(library.tiles_linear_unit())
        self.unit = self._best_unit  # which multiplies the tiles: 2 AMX, 1 vectors
        self.stripe = int(library.stripes_width())  # columns a stripe: two vectors
        self._stripes_pack = by_dtype(library, "stripes_pack")
        self._stripes = by_dtype(library, "stripes_linear")

    @property
    def matmul_unit(self) -> str | None:
        """What multiplies packed tiles: "amx", "avx512-bf16" (vectors), or None (no tiles)."""
        return TILE_UNITS.get(self.unit) if self.tiles_max_rows else None

    def use_matmul_unit(self, name: str) -> bool:
        """Multiply tiles on "amx" or "avx512-bf16" where this CPU has it. True if now in use."""
        code = next((c for c, n in TILE_UNITS.items() if n == name), 0)
        if 0 < code <= self._best_unit:
            self.unit = code
        return self.unit == code

    def pack(self, weight: torch.Tensor, allocate: layer_ops.Allocate) -> layer_ops.Packed:
        """An [out, in] weight in bf16 tiles where the target has them (sides multiples of
        32), else in stripes (out a multiple of ``stripe``), else ``layer_ops.pack``."""
        out_features, in_features = weight.shape
        dtype, stripe = weight.dtype, self.stripe
        if not weight.is_contiguous() or dtype not in self._stripes:
            return layer_ops.pack(weight)
        if self.tiles_max_rows and dtype == torch.bfloat16:
            if out_features % 32 or in_features % 32:
                return layer_ops.pack(weight)
            packed = allocate((out_features // 16, in_features // 32, 16, 32), dtype)
            self._tiles_pack(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
            return packed
        if out_features % stripe:
            return layer_ops.pack(weight)
        packed = allocate((out_features // stripe, in_features, stripe), dtype)
        self._stripes_pack[dtype](weight.data_ptr(), packed.data_ptr(), out_features, in_features)
        return packed

    def linear(
        self,
        x: torch.Tensor,
        weight: layer_ops.Weight,
        packed: layer_ops.Packed,
        bias: torch.Tensor | None,
        threads: int,
    ) -> torch.Tensor:
        """x @ weight^T (+ bias) through the stripes or tiles ``pack`` gave, where the C side
        takes the call (no bias, contiguous x of the packed dtype; tiles: bf16, up to
        ``tiles_max_rows`` rows); otherwise ``layer_ops.linear``."""
        rows, width = x.shape
        ours = isinstance(packed, torch.Tensor) and packed.dim() in (3, 4)  # not oneDNN's
        if isinstance(packed, torch.Tensor) and packed.dim() == 3:
            stripe = self.stripe
            if packed.shape != (weight.shape[0] // stripe, width, stripe) or (
                x.dtype != packed.dtype
            ):
                raise ValueError("fused linear: packed stripes do not match the weight or x")
            if bias is None and x.is_contiguous():
                out = torch.empty((rows, weight.shape[0]), dtype=x.dtype)
                args = (x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, width)
                if self._stripes[x.dtype](*args, weight.shape[0], threads) == 0:
                    return out
        if isinstance(packed, torch.Tensor) and packed.dim() == 4 and rows <= self.tiles_max_rows:
            out_features = weight.shape[0]
            if packed.shape != (out_features // 16, width // 32, 16, 32):
                raise ValueError("fused linear: packed tiles do not match the weight")
            if x.dtype == torch.bfloat16 and bias is None and x.is_contiguous():
                out = torch.empty((rows, out_features), dtype=x.dtype)
                args = (x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, width)
                if self._tiled(*args, out_features, self.unit, threads) == 0:
                    return out  # else (a shape the C side declines): torch
        return layer_ops.linear(x, weight, None if ours else packed, bias)

    def decode_layout(
        self, out_features: int, in_features: int, dtype: torch.dtype
    ) -> tuple[int, ...]:
        """The packed shape the C layer halves multiply: bf16 in tiles where the target has
        them, else (and float32 always) in stripes."""
        if self.tiles_max_rows and dtype == torch.bfloat16:
            return (out_features // 16, in_features // 32, 16, 32)
        return (out_features // self.stripe, in_features, self.stripe)
