"""GGUF-quantized matmul weights on the C kernels (``csrc/quant.h``, built into the fused ops'
library): a ``QuantizedWeight`` packed into stripes, multiplied, and read back.

Owns ``PackedQuant``, one weight's stripes in runs of one format each (the segments of a fused
projection; adjacent segments of one format are one run, their stripes simply following each
other), and the calls that take it. Each weight is exactly gguf's dequantized value (quant.h
says why), every output one float32 chain of FMAs, k ascending, whatever the batch: the
stripes' contract (``fused_ops``). A weight packed with ``dots`` multiplies activations rounded
to int8 per 32 inputs by integer dot products (every format: ``csrc/quant_dot.h``), llama.cpp's
numbers rather than the exact ones; a row's output still does not depend on its batch.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pagekv.kernels import abi
from pagekv.kernels.dense import by_dtype
from pagekv.models import layer_ops
from pagekv.models.quantized import (
    FORMATS,
    Decoded,
    QuantFormat,
    QuantizedWeight,
    Segment,
    decode,
)

PACK_CHUNK_ROWS = 1024  # rows decoded at a time while packing (a multiple of every stripe)


@dataclass(frozen=True)
class Run:
    """Output columns [first, first + columns) of one format, at ``offset`` bytes."""

    format: QuantFormat
    first: int
    columns: int
    offset: int


@dataclass(frozen=True)
class PackedQuant(layer_ops.OpsLayout):
    """A quantized weight [out, in] in the kernels' stripes: ``data`` holds every run."""

    data: torch.Tensor  # uint8
    shape: tuple[int, int]
    runs: tuple[Run, ...]
    dots: bool = False  # its matmuls round the activations to int8 (integer dot products)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    @functools.cached_property
    def c_runs(self) -> ctypes.Array[abi.QuantRun]:
        """The runs as kernels.h's QuantRun, for ``c_weight``."""
        rows = [abi.QuantRun(*r.format.key(), r.first, r.columns, r.offset) for r in self.runs]
        return (abi.QuantRun * len(rows))(*rows)

    @functools.cached_property
    def c_weight(self) -> abi.QuantWeight:
        """The weight as the C calls take it (kernels.h's QuantWeight); it and its runs live
        as long as this object."""
        runs = self.c_runs
        return abi.QuantWeight(ctypes.addressof(runs), len(runs), self.data.data_ptr(), self.dots)

    @property
    def address(self) -> int:
        """``c_weight``'s address, as the C calls take it."""
        return ctypes.addressof(self.c_weight)

    def describe(self) -> str:
        return "gguf stripes, int8 activations" if self.dots else "gguf stripes"


class QuantKernels:
    """The quantized matmul's entry points of one loaded library (stripes of ``stripe``)."""

    def __init__(self, library: ctypes.CDLL, stripe: int) -> None:
        self._lib = library
        self.stripe = stripe
        self._linear = by_dtype(library, "quant_linear")
        self._gated = by_dtype(library, "quant_gated")

    def pack(
        self,
        weight: QuantizedWeight,
        allocate: layer_ops.Allocate = layer_ops.torch_empty,
        dots: bool = False,
    ) -> PackedQuant | None:
        """The weight in stripes, or None where a segment's rows are not whole stripes. Each
        segment is decoded and packed PACK_CHUNK_ROWS rows at a time, so the decoded form of a
        large weight (the embedding) is never whole in memory beside its stripes. ``dots``:
        its matmuls round the activations to int8 where the format has dot products."""
        out_features, width = weight.shape
        if any(s.rows % self.stripe for s in weight.segments):
            return None
        formats = [FORMATS[s.qtype][0] for s in weight.segments]
        sizes = [
            self._lib.quant_packed_bytes(*f.key(), s.rows, width)
            for f, s in zip(formats, weight.segments, strict=True)
        ]
        if min(sizes) < 0:
            return None
        data = allocate((sum(sizes),), torch.uint8)
        runs: list[Run] = []
        first = offset = 0
        for fmt, segment, size in zip(formats, weight.segments, sizes, strict=True):
            rows = segment.rows
            for r0 in range(0, rows, PACK_CHUNK_ROWS):
                part = Segment(segment.qtype, segment.blocks[r0 : r0 + PACK_CHUNK_ROWS])
                self._pack_rows(decode(part, width), data.data_ptr() + offset + size * r0 // rows)
            if runs and runs[-1].format == fmt:  # the same format follows on: one run
                last = runs[-1]
                runs[-1] = Run(last.format, last.first, last.columns + rows, last.offset)
            else:
                runs.append(Run(fmt, first, rows, offset))
            first, offset = first + rows, offset + size
        assert first == out_features
        return PackedQuant(data, weight.shape, tuple(runs), dots)

    def _pack_rows(self, d: Decoded, address: int) -> None:
        rows, width = d.q.shape
        parts = (d.q, d.d, d.dm, d.sc, d.mk)
        addresses = [None if part is None else part.ctypes.data for part in parts]
        if self._lib.quant_pack(*d.format.key(), *addresses, address, rows, width) != 0:
            raise ValueError(f"quant_pack declined a {d.format} segment of {rows} rows")

    def linear(self, x: torch.Tensor, packed: PackedQuant, threads: int) -> torch.Tensor:
        """x [T, in] float32 or bfloat16 @ the weight^T -> [T, out] in x's dtype."""
        rows, width = x.shape
        out_features = packed.shape[0]
        fn = self._linear.get(x.dtype)
        if fn is None or width != packed.shape[1] or not x.is_contiguous():
            raise ValueError("quantized linear: x must be a contiguous float32 or bf16 [T, in]")
        out = torch.empty((rows, out_features), dtype=x.dtype)
        base, size = packed.data.data_ptr(), out.element_size()
        for run in packed.runs:
            status = fn(
                *run.format.key(),
                int(packed.dots),
                x.data_ptr(),
                base + run.offset,
                out.data_ptr() + run.first * size,
                rows,
                width,
                run.columns,
                out_features,
                threads,
            )
            if status != 0:
                raise ValueError(f"quantized linear declined {rows} x {width} @ {run}")
        return out

    def gated(self, x: torch.Tensor, packed: PackedQuant, threads: int) -> torch.Tensor | None:
        """silu(gate) * up [T, I] of x [T, in] @ a gated MLP's weight [2 * I, in]^T (gate's
        rows, then up's), the numbers ``linear`` and silu_mul give, in one pass; None where
        the kernel declines the weight (its runs differ in format, int8 dot products)."""
        rows, width = x.shape
        fn = self._gated.get(x.dtype)
        if fn is None or width != packed.shape[1] or not x.is_contiguous():
            raise ValueError("quantized gated linear: x must be a contiguous float32 or bf16")
        inter = packed.shape[0] // 2
        out = torch.empty((rows, inter), dtype=x.dtype)
        if fn(packed.address, x.data_ptr(), out.data_ptr(), rows, width, inter, threads) != 0:
            return None
        return out

    def rows(self, packed: PackedQuant, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 [n]) of the weight [out, in] as float32 [n, in], read back from
        the stripes in one call (an embedding lookup each step)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.shape[0], packed.shape[1]), dtype=torch.float32)
        args = (packed.address, ids.data_ptr(), ids.shape[0], out.data_ptr(), packed.shape[1])
        if self._lib.quant_rows(*args) != 0:
            raise IndexError(f"quantized rows: an id outside [0, {packed.shape[0]})")
        return out
