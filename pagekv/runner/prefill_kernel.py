"""A C++ kernel for the prefill chunks of a step in bfloat16, on AMX tiles: causal attention of
every chunk's new tokens over its sequence, K/V read from the paged cache through the chunk's
block table. One call per layer for all chunks of the step.

Why not SDPA: torch's CPU flash kernel runs these shapes (a few hundred tokens, 9 query heads
over 3 kv heads, head dim 64) at 40-150 GFLOPS, a third of a prefill step's time on the
``random`` workload; the AMX unit multiplies bf16 tiles several times faster. Per chunk and kv
head the keys and values are packed once into the tiles AMX reads; then per query head and
block of 16 queries: the scores against every key it may see (one row of tiles), softmax in
float32 (the decode kernel's exp), the probabilities rounded to bf16 as SDPA does, times the
values, and a division by the row's sum at the end. Nothing is masked by a tensor: query j of a
chunk of L new tokens over S positions sees keys [0, S - L + j].

A row's numbers depend only on its own chunk (its query block's extra keys get probability 0,
which adds exact zeros), so they are the same whatever else the step holds; they differ from
SDPA's within bf16 rounding (another order of sums).

``load()`` returns None (callers keep SDPA) without AMX, a compiler, or with
``PAGEKV_PREFILL_KERNEL=0``. Must not import ``pagekv.core``, ``models`` or ``server``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from pagekv import native
from pagekv.runner.cpu_kernel import EXP_SOURCE

DISABLE_ENV = "PAGEKV_PREFILL_KERNEL"
CXX_FLAGS = (*native.BASE_CXX_FLAGS, "-fopenmp")

_SOURCE = (
    r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <immintrin.h>
#include <omp.h>
"""
    + EXP_SOURCE
    + native.AMX_SOURCE
    + r"""
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
static const int D = 64;          // head dim: two 32-wide halves of a query tile
static const int KEY_TILE = 16;   // keys per score tile (its columns)
static const int PAD = 64;        // keys are packed to a multiple of this (4 score tiles)

struct Chunk { int64_t q_start, num_tokens, seq_len, table_offset; };

// Keys of kv head h as score-tile operands: tile (block kb, half dh) holds, in row r, the
// pairs (d = 32 dh + 2r, +1) of keys 16 kb .. 16 kb + 15: [S/16][2][16 rows][16 keys x 2].
// Values as P.V operands: tile (pair block kp, quarter c) holds in row r keys 32 kp + 2r, +1
// of columns 16 c .. 16 c + 15, interleaved: [S/32][4][16 rows][16 cols x 2]. Positions past
// the sequence are zeros.
static void pack_kv(const uint16_t* kc, const uint16_t* vc, const int32_t* table, int seq_len,
                    int padded, int block_size, long token_stride, int h, uint16_t* kp,
                    uint16_t* vp) {
    const uint16_t zeros[D] = {};
    uint32_t* k32 = (uint32_t*)kp;
    for (int t = 0; t < padded; ++t) {
        const long slot = long(table[t / block_size]) * block_size + t % block_size;
        const bool real = t < seq_len;
        const uint16_t* k = real ? kc + slot * token_stride + long(h) * D : zeros;
        const uint16_t* v = real ? vc + slot * token_stride + long(h) * D : zeros;
        uint32_t pairs[D / 2];
        std::memcpy(pairs, k, sizeof(pairs));
        uint32_t* kt = k32 + long(t / KEY_TILE) * 512 + t % KEY_TILE;
        for (int p = 0; p < D / 2; ++p) kt[(p / 16) * 256 + (p % 16) * 16] = pairs[p];
        uint16_t* vt = vp + long(t / 32) * 2048 + ((t % 32) / 2) * 32 + t % 2;
        for (int d = 0; d < D; ++d) vt[(d / 16) * 512 + (d % 16) * 2] = v[d];
    }
}

// One query head and block of up to 16 queries of a chunk; kp/vp: its kv head, packed.
static void attend_block(const uint16_t* q, uint16_t* out, long row_stride, int rows,
                         int first_visible, const uint16_t* kp, const uint16_t* vp,
                         float scale, float* scores, uint16_t* probs, int width) {
    alignas(64) uint16_t qbuf[16 * D];
    std::memset(qbuf, 0, sizeof(qbuf));
    for (int r = 0; r < rows; ++r) std::memcpy(qbuf + r * D, q + r * row_stride, D * 2);
    // keys [0, visible(r)) for row r, visible(r) = first_visible + r
    const int keys = first_visible + rows - 1;
    _tile_loadd(4, qbuf, D * 2);
    _tile_loadd(5, qbuf + 32, D * 2);
    for (int kb = 0; kb * KEY_TILE < keys; kb += 4) {
        const uint16_t* t = kp + long(kb) * 1024;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(6, t, 64);        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, t + 512, 64);  _tile_dpbf16ps(0, 5, 7);
        _tile_loadd(6, t + 1024, 64); _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, t + 1536, 64); _tile_dpbf16ps(1, 5, 7);
        _tile_loadd(6, t + 2048, 64); _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, t + 2560, 64); _tile_dpbf16ps(2, 5, 7);
        _tile_loadd(6, t + 3072, 64); _tile_dpbf16ps(3, 4, 6);
        _tile_loadd(7, t + 3584, 64); _tile_dpbf16ps(3, 5, 7);
        float* s = scores + kb * KEY_TILE;
        _tile_stored(0, s, width * 4);
        _tile_stored(1, s + 16, width * 4);
        _tile_stored(2, s + 32, width * 4);
        _tile_stored(3, s + 48, width * 4);
    }
    const int pairs = (keys + 31) / 32;  // 32-key blocks of P.V
    alignas(64) float sums[16];
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < 16; ++r) {
        float* x = scores + long(r) * width;
        uint16_t* p = probs + long(r) * width;
        const int visible = r < rows ? first_visible + r : 0;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int k = 0; k < visible; k += 16) {
            const __mmask16 m = first_lanes(visible - k);
            vmax = _mm512_mask_max_ps(vmax, m, vmax,
                                      _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), vscale));
        }
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 vsum = _mm512_setzero_ps();
        for (int k = 0; k < pairs * 32; k += 16) {
            const __mmask16 m = k < visible ? first_lanes(visible - k) : __mmask16(0);
            const __m512 e = exp_nonpositive16(
                _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), vscale), top));
            const __m512 kept = _mm512_maskz_mov_ps(m, e);
            vsum = _mm512_add_ps(vsum, kept);
            _mm256_storeu_si256((__m256i*)(p + k), round_bf16x16(kept));
        }
        sums[r] = _mm512_reduce_add_ps(vsum);
    }
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int kb = 0; kb < pairs; ++kb) {
        const uint16_t* t = vp + long(kb) * 2048;
        _tile_loadd(4, probs + kb * 32, width * 2);
        _tile_loadd(6, t, 64);        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, t + 512, 64);  _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, t + 1024, 64); _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, t + 1536, 64); _tile_dpbf16ps(3, 4, 7);
    }
    alignas(64) float acc[16][D];
    _tile_stored(0, acc[0], D * 4);
    _tile_stored(1, acc[0] + 16, D * 4);
    _tile_stored(2, acc[0] + 32, D * 4);
    _tile_stored(3, acc[0] + 48, D * 4);
    for (int r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
        for (int c = 0; c < D; c += 16)
            _mm256_storeu_si256((__m256i*)(out + r * row_stride + c),
                                round_bf16x16(_mm512_mul_ps(_mm512_load_ps(acc[r] + c), inv)));
    }
}

static thread_local std::vector<uint16_t> packed;  // the caller's: K/V tiles of every chunk

extern "C" int prefill_attention_bf16_d64(const void* q, const void* kc, const void* vc,
                                          void* out, const int64_t* chunk_info, int num_chunks,
                                          const int32_t* tables, int num_heads, int kv_heads,
                                          int block_size, float scale, int threads) {
    if (!amx_permitted() || num_heads % kv_heads != 0) return -1;
    const Chunk* chunks = (const Chunk*)chunk_info;
    const int group = num_heads / kv_heads;
    const long token_stride = long(kv_heads) * D, row_stride = long(num_heads) * D;
    // where each (chunk, kv head)'s tiles go, and the work items: (chunk, head, query block)
    std::vector<long> offset(num_chunks + 1, 0), first_item(num_chunks + 1, 0);
    int width = PAD;
    for (int c = 0; c < num_chunks; ++c) {
        const int padded = int((chunks[c].seq_len + PAD - 1) / PAD * PAD);
        width = padded > width ? padded : width;
        offset[c + 1] = offset[c] + long(kv_heads) * padded * D * 2;  // K and V
        first_item[c + 1] = first_item[c] + long(num_heads) * ((chunks[c].num_tokens + 15) / 16);
    }
    if (long(packed.size()) < offset[num_chunks]) packed.resize(offset[num_chunks]);
    uint16_t* tiles = packed.data();
    const uint16_t* qs = (const uint16_t*)q;
    uint16_t* os = (uint16_t*)out;
    #pragma omp parallel num_threads(threads)
    {
        configure_tiles();
        #pragma omp for schedule(dynamic)
        for (long task = 0; task < long(num_chunks) * kv_heads; ++task) {
            const Chunk& ch = chunks[task / kv_heads];
            const int h = int(task % kv_heads);
            const int padded = int((ch.seq_len + PAD - 1) / PAD * PAD);
            uint16_t* kp = tiles + offset[task / kv_heads] + long(h) * padded * D * 2;
            pack_kv((const uint16_t*)kc, (const uint16_t*)vc, tables + ch.table_offset,
                    int(ch.seq_len), padded, block_size, token_stride, h, kp,
                    kp + long(padded) * D);
        }
        std::vector<float> scores(16L * width);
        std::vector<uint16_t> probs(16L * width);
        #pragma omp for schedule(dynamic)
        for (long item = 0; item < first_item[num_chunks]; ++item) {
            int c = 0;
            while (first_item[c + 1] <= item) ++c;
            const Chunk& ch = chunks[c];
            const long local = item - first_item[c];
            const int head = int(local % num_heads), block = int(local / num_heads);
            const int h = head / group, padded = int((ch.seq_len + PAD - 1) / PAD * PAD);
            const uint16_t* kp = tiles + offset[c] + long(h) * padded * D * 2;
            const long row = ch.q_start + block * 16L;
            const long left = ch.num_tokens - block * 16L;  // queries from this block on
            const int rows = int(left < 16 ? left : 16);
            const int history = int(ch.seq_len - ch.num_tokens);
            attend_block(qs + row * row_stride + head * D, os + row * row_stride + head * D,
                         row_stride, rows, history + block * 16 + 1, kp, kp + long(padded) * D,
                         scale, scores.data(), probs.data(), width);
        }
        _tile_release();
    }
    return 0;
}
extern "C" int prefill_kernel_available() { return amx_permitted(); }
#else
extern "C" int prefill_kernel_available() { return 0; }
extern "C" int prefill_attention_bf16_d64(const void*, const void*, const void*, void*,
                                          const int64_t*, int, const int32_t*, int, int, int,
                                          float, int) {
    return -1;  // no AMX here: the caller keeps SDPA
}
#endif
"""
)


@dataclass(frozen=True)
class PrefillBatch:
    """The prefill chunks of a step, as the kernel reads them."""

    chunks: torch.Tensor  # int64 [C, 4]: first flat row, new tokens, sequence length, table start
    tables: torch.Tensor  # int32 [sum of blocks]: each chunk's blocks, chunk after chunk


class PrefillKernel:
    """The loaded library; ``supports`` says which (dtype, head dim) it has."""

    def __init__(self, library: ctypes.CDLL) -> None:
        library.prefill_kernel_available.restype = ctypes.c_int
        self.available = bool(library.prefill_kernel_available())  # AMX here, and granted
        self._fn = library.prefill_attention_bf16_d64
        self._fn.restype = ctypes.c_int
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        # q, k_cache, v_cache, out, chunks, #chunks, tables, heads, kv heads, block size, scale,
        # threads
        self._fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, ptr, i32, i32, i32, ctypes.c_float, i32]

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return self.available and dtype == torch.bfloat16 and head_dim == 64

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
        [num_blocks, block_size, KVH, D] (the chunks' new K/V already written), all bf16 and
        contiguous. False (nothing written) where the C side declines: no AMX."""
        num_heads, head_dim = q.shape[1:]
        _, block_size, num_kv_heads, _ = k_cache.shape
        if not (
            q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16
            and head_dim == 64
            and v_cache.shape == k_cache.shape
            and out.shape == q.shape
            and all(t.is_contiguous() for t in (q, k_cache, v_cache, out, batch.chunks))
            and batch.chunks.dtype == torch.int64
            and batch.tables.dtype == torch.int32
            and batch.tables.is_contiguous()
        ):
            raise ValueError("prefill kernel: wrong dtype, shape or layout of its inputs")
        status = self._fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            batch.chunks.data_ptr(),
            batch.chunks.shape[0],
            batch.tables.data_ptr(),
            num_heads,
            num_kv_heads,
            block_size,
            scale,
            torch.get_num_threads(),
        )
        return bool(status == 0)


@functools.cache
def load() -> PrefillKernel | None:
    """The compiled kernel, built once per machine and cached; None if unavailable."""
    library = native.load_optional("prefill", _SOURCE, CXX_FLAGS, DISABLE_ENV, logging.DEBUG)
    return None if library is None else PrefillKernel(library)
