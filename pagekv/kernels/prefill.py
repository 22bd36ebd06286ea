"""Attention kernels (``csrc/prefill.cpp``; tiles in ``attention_tiles.h``, float32 vectors in
``attention_vectors.h``) for where many queries read the same keys:

- the prefill chunks of a step: causal attention of every chunk's new tokens over its
  sequence, K/V read from the paged cache through the chunk's block table, one call per layer
  for all chunks. In bf16 tiles where the target has them and the head size is 64 (AMX, or
  AVX512-BF16 vectors reading the same layout); on every target and every head size of
  ``kernels.h``'s PAGEKV_HEAD_DIMS (64, 128, 256) in float32 vectors (``vec.h``): scores of 16
  queries against a vector of keys a register at a time, softmax and values in float32 as SDPA
  keeps them, bf16 K/V widened once as they are packed;
- decode rows that share a prefix (cascade attention, ``shared_prefix``): the shared blocks
  attended once for all rows, merged with each row's own rest, which the decode kernel
  attends, by log-sum-exp. In bf16 tiles where the target has them and the head size is 64;
  else, on every target and every head size of PAGEKV_HEAD_DIMS, in float32 vectors with the
  prefill kernel's products (float32 inputs, or bf16 ones widened as they are packed);
- drafted decodes (several query tokens per sequence, tiles only, head size 64): per sequence
  and kv head the history is packed once and every token's query heads fill one block of 16
  rows (``decode``).

Why not SDPA: torch's CPU flash kernel runs prefill shapes (a few hundred tokens, 9 query heads
over 3 kv heads, head dim 64) far below the machine's FMA rate. Per chunk (or prefix) and kv
head the keys and values are packed once; then per block of 16 query rows: the scores against
every key a row may see, softmax in float32 (the decode kernel's exp), in tiles the
probabilities rounded to bf16 as SDPA does, times the values, and a division by the row's sum
at the end. Nothing is masked by a tensor: query j of a chunk of L new tokens over S positions
sees keys [0, S - L + j].

Two units multiply the tiles, chosen once per process: AMX where the CPU has it and Linux grants
it, else AVX512-BF16 dot products (``vdpbf16ps``) doing the same tile products a row of sums at
a time. Only the order of the float32 sums differs.

A prefill row's numbers depend only on its own chunk (its query block's extra keys get
probability 0, which adds exact zeros), so they are the same whatever else the step holds;
they differ from SDPA's within rounding (another order of sums). A cascade row's depend on how
much of its prefix the batch shares (the split point), within rounding (bf16's in tiles,
float32's in vectors).

``load()`` returns None (callers keep SDPA) without a compiler, with
``PAGEKV_PREFILL_KERNEL=0`` or ``PAGEKV_CPU_ISA=none``; ``supports`` (the tile paths),
``supports_prefill`` and ``supports_cascade`` say what the target takes. Must not import
``pagekv.core``, ``models`` or ``server``.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pagekv.kernels import build
from pagekv.kernels.decode import DecodeBatch
from pagekv.kernels.isa import TILE_UNITS

DISABLE_ENV = "PAGEKV_PREFILL_KERNEL"


@dataclass(frozen=True)
class PrefillBatch:
    """The prefill chunks of a step, as the kernel reads them."""

    chunks: torch.Tensor  # int64 [C, 4]: first flat row, new tokens, sequence length, table start
    tables: torch.Tensor  # int32 [sum of blocks]: each chunk's blocks, chunk after chunk


class PrefillKernel:
    """The loaded library; ``supports``, ``supports_prefill`` and ``supports_cascade`` say
    which (dtype, head dim) each path takes."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._backend = library.prefill_kernel_backend
        self.available = self.backend is not None  # bf16 tiles: AVX512-BF16, AMX or not
        self._tiles = library.prefill_attention_bf16_d64  # bf16, head_dim 64, in tiles
        self._vectors = {  # float32 vectors on every target and head size of kernels.h
            torch.float32: library.prefill_attention_f32,
            torch.bfloat16: library.prefill_attention_bf16_f32,  # widened as they are packed
        }
        self._prefill_dtypes = set(self._vectors)
        self._head_dim = build.head_dims(library.prefill_head_dim)
        self._shared_tiles = library.shared_prefix_attention_bf16_d64
        self._shared_vectors = {  # the same dtypes and head sizes as the prefill vectors
            torch.float32: library.shared_prefix_attention_f32,
            torch.bfloat16: library.shared_prefix_attention_bf16_f32,
        }
        self._decode = library.decode_attention_bf16_d64

    @property
    def backend(self) -> str | None:
        """The unit that multiplies: "amx" (tiles), "avx512-bf16" (vectors), or None."""
        return TILE_UNITS.get(self._backend(0))

    def use_backend(self, name: str) -> bool:
        """Switch to "amx" or "avx512-bf16" where this CPU has it (for every caller of the
        process: tests compare the two). True if now in use."""
        code = next((c for c, n in TILE_UNITS.items() if n == name), 0)
        return bool(code) and self._backend(code) == code

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the bf16 tiles take this (bf16 at head size 64, on a target with them): the
        one path of drafted decodes (``decode``), and the one prefill chunks and cascade
        attention take where it applies."""
        return self.available and dtype == torch.bfloat16 and head_dim == 64

    def supports_prefill(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether ``__call__`` (prefill chunks) takes this: bf16 and float32 on every target
        and every head size of ``kernels.h`` (bf16 in tiles where the target has them and the
        head size is theirs, else widened to float32)."""
        return dtype in self._prefill_dtypes and self._head_dim(head_dim)

    def supports_cascade(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether ``shared_prefix`` (cascade attention) takes this: as ``supports_prefill``,
        bf16 and float32 on every target and every head size of ``kernels.h``."""
        return dtype in self._shared_vectors and self._head_dim(head_dim)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PrefillBatch,
        scale: float,
        out: torch.Tensor,
    ) -> bool:
        """Writes the chunks' rows of ``out`` [T, H, D] from q [T, H, D] and the caches
        [num_blocks, block_size, KVH, D] (the chunks' new K/V already written), all of one
        dtype (bf16 or float32) and contiguous. False (nothing written) where the C side
        declines or lacks the dtype."""
        num_heads, head_dim = q.shape[1:]
        _, block_size, num_kv_heads, _ = k_cache.shape
        if not (
            q.dtype == k_cache.dtype == v_cache.dtype == out.dtype
            and self.supports_prefill(q.dtype, head_dim)
            and v_cache.shape == k_cache.shape
            and out.shape == q.shape
            and all(t.is_contiguous() for t in (q, k_cache, v_cache, out, batch.chunks))
            and batch.chunks.dtype == torch.int64
            and batch.chunks.dim() == 2
            and batch.chunks.shape[1] == 4
            and batch.tables.dtype == torch.int32
            and batch.tables.is_contiguous()
        ):
            raise ValueError("prefill kernel: wrong dtype, shape or layout of its inputs")
        pointers = (q, k_cache, v_cache, out, batch.chunks)
        call = [*(t.data_ptr() for t in pointers), batch.chunks.shape[0], batch.tables.data_ptr()]
        call += [num_heads, num_kv_heads, block_size]
        threads = torch.get_num_threads()
        if self.supports(q.dtype, head_dim):
            status = self._tiles(*call, scale, threads)
        else:
            status = self._vectors[q.dtype](*call, head_dim, scale, threads)
        return bool(status == 0)

    def shared_prefix(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        table: torch.Tensor,
        prefix_len: int,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> bool:
        """Decode rows q [B, H, D] whose sequences all begin with the blocks ``table`` (int32,
        covering ``prefix_len`` positions): their attention over that prefix merged into
        ``out`` (float32 [B, H, D]), which holds their attention over the rest of their
        sequences, each part weighed by its sum of exp: ``lse`` ([B, H], read, not changed)
        holds the rest's log-sum-exp (``DecodeKernel`` with ``start``). q and the caches bf16
        or float32, of a head size ``supports_cascade`` takes; in tiles where ``supports``
        says so. False (nothing changed) where the C side declines."""
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if not (
            q.dtype == k_cache.dtype == v_cache.dtype
            and self.supports_cascade(q.dtype, head_dim)
            and k_cache.shape[3] == head_dim
            and v_cache.shape == k_cache.shape
            and out.dtype == lse.dtype == torch.float32
            and out.shape == q.shape
            and lse.shape == q.shape[:2]
            and table.dtype == torch.int32
            and 0 < prefix_len <= len(table) * block_size
            and all(t.is_contiguous() for t in (q, k_cache, v_cache, table, out, lse))
        ):
            raise ValueError("shared prefix attention: wrong dtype, shape or layout of inputs")
        pointers = (q, k_cache, v_cache, table)
        call = [*(t.data_ptr() for t in pointers), prefix_len, num_seqs, num_heads]
        call += [num_kv_heads, block_size]
        results = (out.data_ptr(), lse.data_ptr(), torch.get_num_threads())
        if self.supports(q.dtype, head_dim):
            status = self._shared_tiles(*call, scale, *results)
        else:
            status = self._shared_vectors[q.dtype](*call, head_dim, scale, *results)
        return bool(status == 0)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        out: torch.Tensor,
    ) -> bool:
        """Decode rows q [Q, H, D] (``batch`` as for ``DecodeKernel``, query lengths included)
        into ``out`` [Q, H, D], all bf16, each sequence's history read once through the tiles.
        False (nothing written) where the C side declines."""
        _, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        tables, seq_lens, query_lens = batch.block_tables, batch.seq_lens, batch.query_lens
        if not (
            batch.fits(q, k_cache, v_cache)
            and q.dtype == out.dtype == torch.bfloat16
            and head_dim == 64
            and out.shape == q.shape
            and out.is_contiguous()
        ):
            raise ValueError("decode on tiles: wrong dtype, shape or layout of its inputs")
        status = self._decode(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            seq_lens.data_ptr(),
            None if query_lens is None else query_lens.data_ptr(),
            seq_lens.shape[0],
            num_heads,
            num_kv_heads,
            block_size,
            batch.max_seq_len,
            scale,
            torch.get_num_threads(),
        )
        return bool(status == 0)


def load(target: str | None = None) -> PrefillKernel | None:
    """The kernel built for ``target`` (default: the selected one, ``isa.selected()``); None
    if unavailable or disabled (``PAGEKV_PREFILL_KERNEL=0``)."""
    return _wrap(build.library_for("prefill", target, DISABLE_ENV))


@functools.cache
def _wrap(library: ctypes.CDLL | None) -> PrefillKernel | None:
    return None if library is None else PrefillKernel(library)
