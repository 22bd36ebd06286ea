# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""Paged attention in Triton: the GPU runner's kernels (the CPU's are the C kernels).

Two kernels, each with a wrapper of the same signature as its reference in
``runner/attention.py``:

- ``write_kv``: this step's new K/V rows into their slots (slot = block * block_size + offset;
  a negative slot is skipped).
- ``paged_attention``: causal attention of every query of the step over its sequence's history,
  read through the block table. Prefill chunks, prefix hits (a chunk that starts past 0) and
  decodes are one kernel: a program takes one sequence, one KV head and a tile of query rows,
  where a row is (query token j, query head of that KV head's group). Decode rows of a GQA
  group share their K/V reads, and a prefill tile reads each key tile once for the whole tile.
  Scores and the running softmax are float32 whatever the cache's dtype; any block size works,
  because keys are gathered one slot at a time (a tile of keys may span several blocks).

On a machine without a CUDA GPU, ``TRITON_INTERPRET=1`` (set before this module is imported)
runs the same kernels on CPU tensors: the tests do so.

Must not import ``pagekv.core``, ``models`` or ``server``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

NEG_INF = tl.constexpr(float("-inf"))  # a kernel reads only constexpr globals
NO_WINDOW = 2**30  # a window no sequence reaches: every key is inside it


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_new,  # elements between tokens of k / v
    stride_slot,  # elements between slots of the caches
    WIDTH: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,  # WIDTH rounded up to a power of two
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, BLOCK)
        inside = cols < WIDTH
        k = tl.load(k_ptr + token * stride_new + cols, mask=inside)
        v = tl.load(v_ptr + token * stride_new + cols, mask=inside)
        dst = slot * stride_slot + cols
        tl.store(k_cache_ptr + dst, k, mask=inside)
        tl.store(v_cache_ptr + dst, v, mask=inside)


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """k_cache, v_cache: [num_blocks, block_size, kv_heads, D] contiguous; k, v: [T, kv_heads,
    D]; slot_mapping: int [T]. In place."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = k.to(k_cache.dtype).contiguous(), v.to(v_cache.dtype).contiguous()  # torch rounds
    width = kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        width,
        width,
        WIDTH=width,
        BLOCK=triton.next_power_of_2(width),
    )


@triton.jit
def _rows(cache, scales, slot, scale_slot, dims, kv_mask, key_ok, EIGHT_BIT: tl.constexpr,
          FP8: tl.constexpr):  # fmt: skip
    """A tile of K or V rows [N, D]: as stored, or (8-bit) widened and times their scales."""
    rows = tl.load(cache + slot[:, None] + dims[None, :], mask=kv_mask, other=0)
    if EIGHT_BIT:
        if FP8:  # e4m3 decoded by hand (Triton's float8e4nv needs sm_89 or later)
            bits = rows.to(tl.int32)
            exponent = (bits >> 3) & 15
            mantissa = (bits & 7).to(tl.float32)
            normal = (8.0 + mantissa) * tl.exp2((exponent - 10).to(tl.float32))
            magnitude = tl.where(exponent == 0, mantissa * 0.001953125, normal)  # 2^-9
            rows = tl.where((bits & 128) != 0, -magnitude, magnitude)
        factor = tl.load(scales + scale_slot, mask=key_ok, other=0.0).to(tl.float32)
        rows = rows.to(tl.float32) * factor[:, None]
    return rows


@triton.jit
def _key_tile(
    q, m_i, l_i, acc, caches, slot, keys, key_ok, pos, dims, dim_ok, scale, softcap, window,
    scales, scale_slot,
    SOFTCAP: tl.constexpr, FLOAT32_DOTS: tl.constexpr, PRECISION: tl.constexpr,
    EIGHT_BIT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """One tile of keys into the running softmax: returns the new (max, sum, P @ V)."""
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = _rows(caches[0], scales[0], slot, scale_slot, dims, kv_mask, key_ok, EIGHT_BIT, FP8)
    if FLOAT32_DOTS:
        k = k.to(tl.float32)
    s = tl.dot(q.to(k.dtype), tl.trans(k), out_dtype=tl.float32, input_precision=PRECISION)
    s = s * scale  # [M, N]
    if SOFTCAP:  # tanh through exp: 1 - 2 / (e^(2x) + 1)
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    see = key_ok[None, :] & (keys[None, :] <= pos[:, None])
    see = see & (keys[None, :] > pos[:, None] - window)
    s = tl.where(see, s, NEG_INF)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    v = _rows(caches[1], scales[1], slot, scale_slot, dims, kv_mask, key_ok, EIGHT_BIT, FP8)
    if FLOAT32_DOTS:
        v = v.to(tl.float32)
    pv = tl.dot(p.to(v.dtype), v, out_dtype=tl.float32, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr,  # q, o [T, H, D]; caches [blocks, bs, KVH, D]
    k_scale_ptr, v_scale_ptr,  # an 8-bit cache's row scales [blocks, bs, KVH] (else unused)
    block_table_ptr, seq_lens_ptr, query_start_ptr,  # [B, max_blocks], [B], [B + 1]
    scale, softcap,  # with SOFTCAP: scores become tanh(s / softcap) * softcap
    window,  # a query at p sees keys p - window < k <= p only (no window: NO_WINDOW)
    stride_qt, stride_qh, stride_ot, stride_oh,  # between tokens, heads of q and o
    stride_cb, stride_cs, stride_ch,  # between blocks, slots, KV heads of a cache
    stride_sb, stride_ss, stride_sh,  # between blocks, slots, KV heads of a scale plane
    stride_bt, block_size,  # between rows of the block table; tokens per block
    SOFTCAP: tl.constexpr,
    FLOAT32_DOTS: tl.constexpr, PRECISION: tl.constexpr,  # see _float32_dots, _precision
    EIGHT_BIT: tl.constexpr, FP8: tl.constexpr,  # int8 rows, or e4m3 bits in uint8
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,  # query heads per KV head; head size
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_M: tl.constexpr,  # query rows (token, head of the group) per program
    BLOCK_N: tl.constexpr,  # keys per tile
):  # fmt: skip
    seq, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len * GROUP:
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
        row_ok = rows < q_len * GROUP
        token = rows // GROUP  # j among the sequence's new tokens
        head = kv_head * GROUP + rows % GROUP  # the query head of the row
        pos = seq_len - q_len + token  # [M] the query's position
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
        io_mask = row_ok[:, None] & dim_ok[None, :]
        q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile is no NaN
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        first_pos = seq_len - q_len  # the tile's rows span [first_pos + tile rows' tokens]
        hi = tl.minimum(seq_len, first_pos + (tile * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
        # the first key any row's window reaches: keys before it (their blocks may be given
        # back) are never loaded
        first_key = tl.maximum(0, first_pos + (tile * BLOCK_M) // GROUP - window + 1)
        lo = (first_key // BLOCK_N) * BLOCK_N
        table = block_table_ptr + seq.to(tl.int64) * stride_bt
        caches = (k_cache_ptr + kv_head * stride_ch, v_cache_ptr + kv_head * stride_ch)
        scales = (k_scale_ptr + kv_head * stride_sh, v_scale_ptr + kv_head * stride_sh)
        for start in range(lo, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)  # [N] key positions
            key_ok = (keys >= first_key) & (keys < hi)
            block = tl.load(table + keys // block_size, mask=key_ok, other=0).to(tl.int64)
            slot = block * stride_cb + (keys % block_size) * stride_cs  # [N]
            scale_slot = block * stride_sb + (keys % block_size) * stride_ss  # [N]
            m_i, l_i, acc = _key_tile(
                q, m_i, l_i, acc, caches, slot, keys, key_ok, pos, dims, dim_ok, scale, softcap,
                window, scales, scale_slot, SOFTCAP, FLOAT32_DOTS, PRECISION, EIGHT_BIT, FP8,
            )  # fmt: skip
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
        out = out.to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + o_rows[:, None] + dims[None, :], out, mask=io_mask)


@dataclass(frozen=True)
class Launch:
    """How ``paged_attention`` launches its kernel: keys per tile, warps per program, and the
    software pipeline's depth (the loads of the next tiles in flight while one is computed)."""

    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3  # Triton's own default on NVIDIA GPUs

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")

    @staticmethod
    def for_step(max_query_len: int, max_seq_len: int) -> Launch:
        """The launch for a step's shape, as measured on an H200 (``bench_gpu_attention.py
        --sweep``): decodes stream long histories best in wide tiles with more warps and a
        deeper pipeline, short ones in narrow tiles; prefill chunks keep the default."""
        if max_query_len > 1:
            return DEFAULT_LAUNCH
        return LONG_DECODE if max_seq_len > LONG_HISTORY_TOKENS else SHORT_DECODE


DEFAULT_LAUNCH = Launch()
SHORT_DECODE = Launch(block_n=32, num_warps=4, num_stages=4)
LONG_DECODE = Launch(block_n=128, num_warps=8, num_stages=4)
LONG_HISTORY_TOKENS = 1024


def _float32_dots(dtype: torch.dtype) -> bool:
    """Whether the dots widen bf16 K/V to float32 first: only in the interpreter, whose
    bf16 dot is wrong (numpy has no bf16); a GPU multiplies bf16 tiles in its tensor cores."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def _precision(dtype: torch.dtype) -> str:
    """float32 caches multiply in full float32 ("ieee"): a GPU's default for float32 dots is
    TF32, whose 10-bit mantissa would part the float32 engine from the reference. bf16 and
    fp16 tiles multiply exactly in the tensor cores whatever this says."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    launch: Launch = DEFAULT_LAUNCH,
    scales: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """q: [T, H, D]; caches: [num_blocks, block_size, KVH, D] with unit stride in D;
    block_tables: int [B, max_blocks]; seq_lens: int [B] (after this step); query_start_loc:
    int [B + 1]. Returns [T, H, D] in q's dtype. The step's K/V are already written.
    ``scales``: an 8-bit cache's (K, V) row scales, [num_blocks, block_size, KVH] each (int8
    rows, or e4m3 bits in uint8): rows are widened to float32 and scaled as they load."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim or k_cache.stride(3) != 1:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    group = num_heads // num_kv_heads
    q = q.contiguous()
    out = q.new_empty(q.shape)
    if num_tokens == 0:
        return out
    rows = max_query_len * group
    block_m = 16 if rows <= 16 else 64  # tl.dot takes at least 16 rows
    grid = (seq_lens.shape[0], num_kv_heads, triton.cdiv(rows, block_m))
    eight_bit = scales is not None
    k_scale, v_scale = scales if scales is not None else (k_cache, v_cache)  # unread if not
    math_dtype = torch.float32 if eight_bit else k_cache.dtype  # 8-bit rows widen to float32
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
        scale, softcap or 1.0, NO_WINDOW if window is None else window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        block_tables.stride(0), k_cache.shape[1],
        SOFTCAP=softcap is not None,
        FLOAT32_DOTS=_float32_dots(math_dtype),
        PRECISION=_precision(math_dtype),
        EIGHT_BIT=eight_bit,
        FP8=k_cache.dtype == torch.uint8,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=launch.block_n,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )  # fmt: skip
    return out
