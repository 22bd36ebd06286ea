"""Matmul weights kept as GGUF quant blocks, and those blocks decoded into one exact form.

Owns which GGUF types stay quantized (``FORMATS``), the ``QuantizedWeight`` that carries a
weight's blocks from the file to the kernels, and ``decode``: one type's blocks as integers q
and, per group of ``group`` consecutive inputs of an output row, a float32 scale and offset,
with ``scale * q + offset`` equal to gguf's reference dequantization (``dequantize``) value
for value. Every type here is of that shape; what differs is q's width, the group and whether
the offset is stored or ``-zero * scale``. The kernels (``pagekv/kernels/quant.py``) pack the
decoded form into their own layout; ``csrc/quant.h`` says why one fused multiply-add per
weight rounds as the reference does.

A weight's rows come in segments of one type each: a fused q/k/v projection whose v is Q6_K
and q, k Q4_K is three segments. The blocks are views of the file's memory map where they can
be (rows in the file's order), so keeping them costs no memory of the process's own.

Numpy only; no torch.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize

# Quantized rows are kept in whole stripes of the kernels' widest target (2 AVX-512 vectors).
QUANT_ROW_MULTIPLE = 32


@dataclass(frozen=True)
class QuantFormat:
    """The decoded form of a type: ``bits``-bit q in groups of ``group`` inputs, within
    super-blocks of ``superblock`` inputs that each have an fp16 scale d (and an fp16 offset
    base dm, if ``offsets``). Where the super-block holds several groups, each group has its
    own whole-number multipliers of d (and of dm): the K types. Without offsets,
    w = scale * (q - zero)."""

    bits: int
    group: int
    superblock: int
    offsets: bool
    zero: int

    @property
    def multipliers(self) -> bool:
        """Whether each group scales the super-block's d (and dm) by a whole number of its
        own; signed (stored + 128) where the type has no offsets (Q6_K)."""
        return self.superblock > self.group

    def key(self) -> tuple[int, int, int, int, int]:
        """(bits, group, superblock, offsets, zero) as the C kernels take them."""
        return self.bits, self.group, self.superblock, int(self.offsets), self.zero


@dataclass(frozen=True)
class Decoded:
    """One segment's blocks decoded: q uint8 [rows, K]; d and dm the fp16 bits (uint16)
    [rows, K // superblock] (dm None without offsets); sc and mk uint8 [rows, K // group],
    the groups' multipliers of d and dm (None where the format has none)."""

    format: QuantFormat
    q: np.ndarray
    d: np.ndarray
    dm: np.ndarray | None
    sc: np.ndarray | None
    mk: np.ndarray | None


@dataclass(frozen=True)
class Segment:
    """Rows of one GGUF type: ``blocks`` uint8 [rows, bytes per row], as in the file."""

    qtype: QT
    blocks: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])


@dataclass(frozen=True)
class QuantizedWeight:
    """A matmul weight [out, in] as GGUF blocks: rows in segments, top to bottom."""

    shape: tuple[int, int]
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.blocks.nbytes for s in self.segments)

    def dequantize(self) -> np.ndarray:
        """float32 [out, in] by gguf's reference dequantization (the numbers the kernels
        reproduce)."""
        parts = [dequantize(s.blocks, s.qtype) for s in self.segments]
        return np.concatenate(parts).reshape(self.shape)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 [len(ids), in]: rows ``ids`` dequantized (an embedding lookup)."""
        out = np.empty((len(ids), self.shape[1]), dtype=np.float32)
        first = 0
        for segment in self.segments:
            mine = (ids >= first) & (ids < first + segment.rows)
            if mine.any():
                blocks = segment.blocks[ids[mine] - first]
                out[mine] = dequantize(blocks, segment.qtype).reshape(-1, self.shape[1])
            first += segment.rows
        return out

    @staticmethod
    def stack(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The weights' rows one after the other (a fused projection), segments kept."""
        width = parts[0].shape[1]
        if any(p.shape[1] != width for p in parts):
            raise ValueError("stacked quantized weights must have the same input width")
        segments = tuple(s for p in parts for s in p.segments)
        return QuantizedWeight((sum(p.shape[0] for p in parts), width), segments)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 bits at byte ``at`` of every block, uint16 [n, 1]."""
    return blocks[:, at : at + 2].copy().view(np.uint16)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes [n, m] holding 4-bit fields in runs of ``run`` bytes: each run's low nibbles
    first, then its high nibbles -> uint8 [n, 2m]."""
    n, m = qs.shape
    runs = qs.reshape(n, m // run, 1, run)
    return ((runs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(n, 2 * m)


def _bit_planes(qh: np.ndarray, count: int, width: int) -> np.ndarray:
    """Bytes [n, m] whose ``count`` fields of ``width`` bits (low first) each cover the same
    m values -> uint8 [n, count * m], field j's values after field j - 1's."""
    n, m = qh.shape
    shifts = (np.arange(count, dtype=np.uint8) * width).reshape(1, count, 1)
    return ((qh.reshape(n, 1, m) >> shifts) & ((1 << width) - 1)).reshape(n, count * m)


def _high_bit_of_32(qh: np.ndarray) -> np.ndarray:
    """A little-endian u32 per block [n, 4] -> value j's bit j, uint8 [n, 32]."""
    return np.unpackbits(qh, axis=1, bitorder="little")


# a decoder: blocks [n, type size] -> (q [n, block size], d, dm, sc, mk) as in Decoded
_Parts = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]


def _q8_0(b: np.ndarray) -> _Parts:
    q = b[:, 2:34] ^ np.uint8(0x80)  # int8 + 128: the signed value's bits, offset
    return q, _f16(b, 0), None, None, None


def _q4_0(b: np.ndarray) -> _Parts:
    return _nibbles(b[:, 2:18], 16), _f16(b, 0), None, None, None


def _q4_1(b: np.ndarray) -> _Parts:
    return _nibbles(b[:, 4:20], 16), _f16(b, 0), _f16(b, 2), None, None


def _q5_0(b: np.ndarray) -> _Parts:
    q = _nibbles(b[:, 6:22], 16) | (_high_bit_of_32(b[:, 2:6]) << 4)
    return q, _f16(b, 0), None, None, None


def _q5_1(b: np.ndarray) -> _Parts:
    q = _nibbles(b[:, 8:24], 16) | (_high_bit_of_32(b[:, 4:8]) << 4)
    return q, _f16(b, 0), _f16(b, 2), None, None


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins -> uint8 [n, 8] each:
    bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; scales and mins 4-7 are the nibbles
    of bytes 8-11 with their top two bits from the top bits of bytes 0-3 and 4-7."""
    first, second, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([first & 63, (rest & 15) | ((first >> 2) & 48)], axis=1)
    mins = np.concatenate([second & 63, (rest >> 4) | ((second >> 2) & 48)], axis=1)
    return scales, mins


def _k_head(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """d, dm = -dmin (the sign bit flipped: exact), and the scales and mins."""
    scales, mins = _k_scales(b[:, 4:16])
    return _f16(b, 0), _f16(b, 2) ^ np.uint16(0x8000), scales, mins


def _q4_k(b: np.ndarray) -> _Parts:
    d, dm, scales, mins = _k_head(b)
    return _nibbles(b[:, 16:144], 32), d, dm, scales, mins


def _q5_k(b: np.ndarray) -> _Parts:
    d, dm, scales, mins = _k_head(b)
    q = _nibbles(b[:, 48:176], 32) | (_bit_planes(b[:, 16:48], 8, 1) << 4)
    return q, d, dm, scales, mins


def _q6_k(b: np.ndarray) -> _Parts:
    n = b.shape[0]
    low = _nibbles(b[:, 0:128], 64)  # two halves of 128 values
    high = _bit_planes(b[:, 128:192].reshape(2 * n, 32), 4, 2).reshape(n, 256)
    scales = b[:, 192:208] ^ np.uint8(0x80)  # int8 + 128
    return low | (high << 4), _f16(b, 208), None, scales, None


# GGUF type -> (its decoded form, its decoder)
FORMATS: dict[QT, tuple[QuantFormat, Callable[[np.ndarray], _Parts]]] = {
    QT.Q8_0: (QuantFormat(8, 32, 32, False, 128), _q8_0),
    QT.Q4_0: (QuantFormat(4, 32, 32, False, 8), _q4_0),
    QT.Q4_1: (QuantFormat(4, 32, 32, True, 0), _q4_1),
    QT.Q5_0: (QuantFormat(5, 32, 32, False, 16), _q5_0),
    QT.Q5_1: (QuantFormat(5, 32, 32, True, 0), _q5_1),
    QT.Q4_K: (QuantFormat(4, 32, 256, True, 0), _q4_k),
    QT.Q5_K: (QuantFormat(5, 32, 256, True, 0), _q5_k),
    QT.Q6_K: (QuantFormat(6, 16, 256, False, 32), _q6_k),
}


def decode(segment: Segment, width: int) -> Decoded:
    """A segment's blocks (rows of ``width`` inputs) in the decoded form of its type."""
    fmt, decoder = FORMATS[segment.qtype]
    block_size, type_size = GGML_QUANT_SIZES[segment.qtype]
    rows = segment.rows
    blocks = np.ascontiguousarray(segment.blocks).reshape(rows * width // block_size, type_size)
    q, d, dm, sc, mk = decoder(blocks)

    def per_row(part: np.ndarray | None, size: int) -> np.ndarray | None:
        return None if part is None else np.ascontiguousarray(part).reshape(rows, width // size)

    return Decoded(
        fmt,
        np.ascontiguousarray(q.reshape(rows, width), dtype=np.uint8),
        np.ascontiguousarray(d).reshape(rows, width // fmt.superblock),
        per_row(dm, fmt.superblock),
        per_row(sc, fmt.group),
        per_row(mk, fmt.group),
    )


def reconstruct(decoded: Decoded) -> np.ndarray:
    """Every weight as the kernels compute it, in float32 with one rounding (the reference's
    numbers): scale = d * sc, offset = dm * mk (or -zero * scale), w = scale * q + offset."""
    fmt = decoded.format

    def wide(bits: np.ndarray) -> np.ndarray:  # fp16 bits per super-block -> float32 per group
        return np.repeat(bits.view(np.float16).astype(np.float32), fmt.superblock // fmt.group, 1)

    def whole(multipliers: np.ndarray | None, bias: int) -> np.ndarray | float:
        return 1.0 if multipliers is None else multipliers.astype(np.float32) - bias

    signed = 128 if fmt.multipliers and not fmt.offsets else 0
    scale = wide(decoded.d) * whole(decoded.sc, signed)
    if decoded.dm is not None:
        offset = wide(decoded.dm) * whole(decoded.mk, 0)
    else:
        offset = scale * np.float32(-fmt.zero)
    scale, offset = np.repeat(scale, fmt.group, 1), np.repeat(offset, fmt.group, 1)
    exact = scale.astype(np.float64) * decoded.q + offset.astype(np.float64)
    return np.asarray(exact, dtype=np.float32)


def drop_file_pages(weights: Sequence[QuantizedWeight]) -> int:
    """Drop from this process's memory the file pages (a GGUF file's mapping) that hold only
    these weights' blocks, once packed copies serve the matmuls: the pages read while packing
    stay resident otherwise. They are read back from the file (the page cache) if the blocks
    are used again (embedding rows, an unpacked model). Returns the bytes dropped."""
    return sum(drop_array_pages(s.blocks) for w in weights for s in w.segments)


def drop_array_pages(blocks: np.ndarray) -> int:
    """``drop_file_pages`` for one array: the whole pages of a file mapping it alone covers
    (none for an array of the process's own memory). Returns the bytes dropped."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    root = blocks
    while isinstance(root.base, np.ndarray):
        root = root.base
    if advice is None or not isinstance(root.base, mmap.mmap):
        return 0  # blocks of the process's own memory (a copy, a test's array)
    offset = blocks.ctypes.data - root.ctypes.data
    start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside only
    end = (offset + blocks.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return 0
    root.base.madvise(advice, start, end - start)
    return end - start
