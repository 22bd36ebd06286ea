"""A small C++ kernel for paged decode attention on CPU, compiled on first use, loaded by ctypes.

Owns the ctypes calls of ``csrc/decode.cpp``; the build, its flags and its cache are
``pagekv.kernels.build``'s. Why not torch ops: a decode row reads its whole history, and
gathering that history through the block table into new tensors costs a copy of every K/V byte
per layer per step; this kernel reads each cached K/V row in place, once. The same library
writes a step's new K/V rows into their slots (``DecodeKernel.write_kv``): one call instead of
two indexed copies, with the scattered destination rows requested ahead. For a layer stack that
runs a decode step's layers in C, both at once for each layer (``step_attention``: the C
function and its context, which the stack calls between the layer halves).

``load()`` returns None (and the caller falls back to torch ops) when there is no compiler, the
build fails, ``PAGEKV_CPU_KERNEL=0`` or ``PAGEKV_CPU_ISA=none``. Must not import ``pagekv.core``
or ``server``; of ``models``, only the layer ops' ``NativeAttention`` (``step_attention``'s
result).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pagekv.kernels import abi, build
from pagekv.models.layer_ops import NativeAttention

DISABLE_ENV = "PAGEKV_CPU_KERNEL"

# by (query dtype, cache dtype): float rows in the queries' dtype, or 8-bit rows (int8, or
# fp8 e4m3 bits in uint8) with fp16 scales
_ENTRIES = {
    (torch.float32, torch.float32): "decode_f32",
    (torch.bfloat16, torch.bfloat16): "decode_bf16",
    (torch.float32, torch.int8): "decode_f32_int8",
    (torch.bfloat16, torch.int8): "decode_bf16_int8",
    (torch.float32, torch.uint8): "decode_f32_fp8",
    (torch.bfloat16, torch.uint8): "decode_bf16_fp8",
}
EIGHT_BIT_FORMATS = {torch.int8: 1, torch.uint8: 2}  # kernels.h's KvFormat


@dataclass(frozen=True)
class DecodeBatch:
    """The decode sequences of a step as the kernel reads them: one query token each, or, with
    ``query_lens``, the last ``query_lens[b]`` positions of sequence b (a drafted decode), each
    seeing the history up to itself."""

    block_tables: torch.Tensor  # int32 [B, max_blocks], contiguous; padding is never read
    seq_lens: torch.Tensor  # int32 [B], history length including this step's tokens
    max_seq_len: int  # max(seq_lens), as a python int so the call needs no sync
    # Leading blocks every row has in its table (the same physical blocks: a shared prompt),
    # all before each row's own first query position; 0 when none or fewer than 2 rows.
    shared_blocks: int = 0
    query_lens: torch.Tensor | None = None  # int32 [B]; None: 1 each
    num_queries: int = 0  # sum(query_lens) (B when None): the rows of q
    max_query_len: int = 1

    def __post_init__(self) -> None:
        lens = self.query_lens
        if lens is None:
            return
        if not (
            lens.dtype == torch.int32
            and lens.is_contiguous()
            and lens.shape == self.seq_lens.shape
            and bool((lens >= 1).all())
            and bool((lens <= self.seq_lens).all())
            and int(lens.sum()) == self.num_queries
            and (lens.numel() == 0 or int(lens.max()) <= self.max_query_len)
        ):
            raise ValueError("DecodeBatch: query_lens must be int32 [B], 1 <= each <= seq_len")

    def fits(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether q [Q, H, D] and the caches [num_blocks, block_size, KVH, D] are what a C
        kernel reading this batch may trust: one dtype (or 8-bit caches), contiguous, Q rows for
        its queries, int32 tables with a row per sequence."""
        tables, seq_lens = self.block_tables, self.seq_lens
        num_seqs = seq_lens.shape[0]
        return (
            (q.dtype, k_cache.dtype) in _ENTRIES
            and k_cache.dtype == v_cache.dtype
            and v_cache.shape == k_cache.shape
            and all(t.is_contiguous() for t in (q, k_cache, v_cache, seq_lens))
            and tables.dtype == seq_lens.dtype == torch.int32
            and tables.stride(-1) == 1
            and tables.shape[0] == num_seqs
            and q.shape[0] == (num_seqs if self.query_lens is None else self.num_queries)
        )

    def per_query(self) -> DecodeBatch:
        """The same attention with one row per query token (for the torch fallback)."""
        if self.query_lens is None:
            return self
        lens = self.query_lens.long()
        tables = self.block_tables.repeat_interleave(lens, 0)
        ends = torch.repeat_interleave(self.seq_lens - self.query_lens, lens)  # [Q] first - 1
        starts = torch.cumsum(lens, 0) - lens  # [B] first row of each sequence
        offsets = torch.arange(self.num_queries) - starts.repeat_interleave(lens)  # [Q]
        seq_lens = (ends + offsets + 1).to(torch.int32)
        return DecodeBatch(tables, seq_lens, self.max_seq_len, 0, None, self.num_queries)


@dataclass(frozen=True)
class CacheAddresses:
    """Every layer's K and V caches as ``step_attention`` reaches them: int64 [layers, 2]
    addresses, and the first layer's pair, whose shape, dtype and layout all share. Made once
    for a pool's tensors, which never move (``of``)."""

    table: torch.Tensor
    first: tuple[torch.Tensor, torch.Tensor]

    @staticmethod
    def of(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> CacheAddresses | None:
        """None where the layers' caches differ in shape or dtype, or one is not contiguous."""
        if not caches:
            return None
        k0 = caches[0][0]
        for k, v in caches:
            if not (
                k.shape == v.shape == k0.shape
                and k.dtype == v.dtype == k0.dtype
                and k.is_contiguous()
                and v.is_contiguous()
            ):
                return None
        table = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in caches], dtype=torch.int64)
        return CacheAddresses(table, caches[0])


class DecodeKernel:
    """The loaded library. ``supports`` says which (cache dtype, head dim) pairs it has: every
    head size ``kernels.h`` lists (PAGEKV_HEAD_DIMS), in float32 and bfloat16."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {pair: getattr(library, name) for pair, name in _ENTRIES.items()}
        self._head_dim = build.head_dims(library.decode_head_dim)
        self._write_rows = library.write_rows
        self._quantize_kv = library.quantize_kv
        self._step_attention = ctypes.cast(library.step_attention, ctypes.c_void_p).value or 0
        self._argmax_bf16 = library.argmax_bf16_rows

    def supports(self, dtype: torch.dtype, head_dim: int, query: torch.dtype | None = None) -> bool:
        """Whether the kernel reads caches of ``dtype`` (8-bit: for queries of ``query``) with
        heads of ``head_dim``."""
        return (query or dtype, dtype) in self._functions and self._head_dim(head_dim)

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x.argmax(dim=-1)`` of bfloat16 [B, V] (the first maximum; NaN counts as the
        maximum), read in place; None for anything else."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] == 0:
            return None
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax_bf16(x.data_ptr(), out.data_ptr(), *x.shape, torch.get_num_threads())
        return out

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> bool:
        """``attention.write_kv`` in one C call (the same bytes land in the same slots), for
        contiguous tensors of one dtype and an int64 slot mapping; False (nothing written) for
        anything else, so the caller uses ``attention.write_kv``. A slot out of range raises
        ValueError before anything is written."""
        tokens = k.shape[0]
        if not (
            k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            and slot_mapping.dtype == torch.int64
            and k_cache.shape == v_cache.shape
            and k.shape == v.shape == (tokens, *k_cache.shape[2:])
            and slot_mapping.shape == (tokens,)
            and all(t.is_contiguous() for t in (k, v, k_cache, v_cache, slot_mapping))
        ):
            return False
        row_bytes = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()  # one slot
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        args = (k, v, k_cache, v_cache, slot_mapping)
        if self._write_rows(*(t.data_ptr() for t in args), tokens, row_bytes, num_slots) != 0:
            raise ValueError(f"KV write: a slot outside the cache's {num_slots} slots")
        return True

    def quantize_kv(
        self,
        caches: tuple[torch.Tensor, ...],
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> bool:
        """``attention.write_kv`` into 8-bit caches (k_cache, v_cache, k_scale, v_scale) in one
        C call, the same bytes in the same slots; False (nothing written) where the tensors are
        not what it takes. A slot out of range raises ValueError before anything is written."""
        if len(caches) != 4:
            return False
        k_cache, v_cache, k_scale, v_scale = caches
        tokens = k.shape[0]
        if not (
            k_cache.dtype in EIGHT_BIT_FORMATS
            and k.dtype == v.dtype
            and k.dtype in (torch.float32, torch.bfloat16)
            and k_cache.dtype == v_cache.dtype
            and k_scale.dtype == v_scale.dtype == torch.float16
            and k_cache.shape == v_cache.shape
            and k_scale.shape == v_scale.shape == k_cache.shape[:3]
            and k.shape == v.shape == (tokens, *k_cache.shape[2:])
            and slot_mapping.dtype == torch.int64
            and slot_mapping.shape == (tokens,)
            and all(t.is_contiguous() for t in (k, v, *caches, slot_mapping))
        ):
            return False
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        row, head_dim = k_cache.shape[2] * k_cache.shape[3], k_cache.shape[3]
        args = (k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        status = self._quantize_kv(
            *(t.data_ptr() for t in args), tokens, row, head_dim, num_slots,
            int(k.dtype == torch.bfloat16), EIGHT_BIT_FORMATS[k_cache.dtype],
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"KV write: a slot outside the cache's {num_slots} slots")
        return True

    def step_attention(
        self,
        caches: CacheAddresses,
        slot_mapping: torch.Tensor,
        batch: DecodeBatch,
        num_heads: int,
        scale: float,
        scales: CacheAddresses | None = None,
        activations: torch.dtype | None = None,
    ) -> NativeAttention | None:
        """A decode step's attention for C code to call layer by layer (decode.cpp's
        ``step_attention``: ``write_kv``, or ``quantize_kv`` for 8-bit caches with ``scales``
        and the model's ``activations`` dtype, then this kernel, its output in the activations'
        dtype), one query token per sequence. None where the kernel does not take these
        tensors."""
        k_cache, v_cache = caches.first
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        num_seqs = batch.seq_lens.shape[0]
        tables, seq_lens = batch.block_tables, batch.seq_lens
        eight_bit = k_cache.dtype in EIGHT_BIT_FORMATS
        dtype = activations if eight_bit else k_cache.dtype
        if dtype is None or eight_bit != (scales is not None):
            return None
        q_like = torch.empty((num_seqs, num_heads, head_dim), dtype=dtype)
        if not (
            self.supports(k_cache.dtype, head_dim, dtype)
            and batch.query_lens is None
            and batch.fits(q_like, k_cache, v_cache)
            and slot_mapping.dtype == torch.int64
            and slot_mapping.shape == (num_seqs,)
            and slot_mapping.is_contiguous()
            and num_heads % num_kv_heads == 0
        ):
            return None
        step = abi.StepAttention(
            caches.table.data_ptr(),
            0 if scales is None else scales.table.data_ptr(),
            slot_mapping.data_ptr(),
            tables.data_ptr(),
            seq_lens.data_ptr(),
            k_cache.shape[0] * block_size,
            num_kv_heads * head_dim * k_cache.element_size(),
            num_seqs,
            tables.stride(0),
            num_heads,
            num_kv_heads,
            block_size,
            batch.max_seq_len,
            head_dim,
            int(dtype == torch.bfloat16),
            torch.get_num_threads(),
            EIGHT_BIT_FORMATS.get(k_cache.dtype, 0),
            scale,
        )
        keep = (step, caches, scales, slot_mapping, tables, seq_lens)
        return NativeAttention(self._step_attention, ctypes.addressof(step), dtype, keep)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        start: int = 0,
        lse: torch.Tensor | None = None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q [Q, H, D] (Q = B, or ``batch.num_queries`` with query lengths) and caches
        [num_blocks, block_size, KVH, D], all float32 or all bfloat16 (the model's dtype, so no
        conversion), or 8-bit caches (int8, or fp8 e4m3 bits in uint8) with ``scales``, their
        float16 [num_blocks, block_size, KVH] -> float32 [Q, H, D].

        All contiguous on CPU; only positions [start, seq_len) are read (start below every
        sequence's first query position). Scores, softmax and the sum of values are float32
        whatever the input dtype. ``lse`` (float32 [Q, H]), if given, receives each head's
        log-sum-exp of its scaled scores, to merge this part with attention over [0, start).
        """
        _, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        seq_lens, query_lens = batch.seq_lens, batch.query_lens
        num_seqs = seq_lens.shape[0]
        first = seq_lens if query_lens is None else seq_lens - query_lens + 1
        # The C side trusts its pointers: check what a wrong caller would get silently wrong.
        if not (
            batch.fits(q, k_cache, v_cache)
            and (lse is None or (lse.dtype == torch.float32 and lse.shape == q.shape[:2]))
            and (lse is None or lse.is_contiguous())
            and (start == 0 or 0 < start < int(first.min()))
            and (k_cache.dtype in EIGHT_BIT_FORMATS) == (scales is not None)
            and (scales is None or _scales_fit(scales, k_cache))
        ):
            raise ValueError("decode kernel: wrong dtype, shape or layout of its inputs")
        out = torch.empty(q.shape, dtype=torch.float32)  # [Q, H, D]
        tensors = (q, k_cache, v_cache) if scales is None else (q, k_cache, v_cache, *scales)
        status = self._functions[q.dtype, k_cache.dtype](
            *(t.data_ptr() for t in tensors),
            batch.block_tables.data_ptr(),
            batch.seq_lens.data_ptr(),
            None if query_lens is None else query_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            batch.block_tables.stride(0),
            num_heads,
            num_kv_heads,
            block_size,
            head_dim,
            batch.max_seq_len,
            batch.max_query_len if query_lens is not None else 1,
            scale,
            torch.get_num_threads(),
            start,
            None if lse is None else lse.data_ptr(),
        )
        if status != 0:
            raise ValueError(f"decode kernel: no kernel for head_dim {head_dim}")
        return out


def _scales_fit(scales: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor) -> bool:
    return all(
        t.dtype == torch.float16 and t.shape == k_cache.shape[:3] and t.is_contiguous()
        for t in scales
    )


def load(target: str | None = None) -> DecodeKernel | None:
    """The kernel built for ``target`` (default: the selected one, ``isa.selected()``); None
    if unavailable or disabled (``PAGEKV_CPU_KERNEL=0``)."""
    return _wrap(build.library_for("decode", target, DISABLE_ENV))


@functools.cache
def _wrap(library: ctypes.CDLL | None) -> DecodeKernel | None:
    return None if library is None else DecodeKernel(library)
