"""``LayerOps`` in C++: each of RMSNorm(+residual), RoPE+split and SiLU*up is one call per layer
instead of 3-12 torch ops, for float32 and bfloat16 models; and, in bfloat16, the matmuls of
decode steps (1-256 rows, weights packed at load into tiles that AMX or AVX512-BF16 vectors
multiply), which stream the weights faster than oneDNN does; in float32 (any AVX-512 CPU) every
matmul, through weights packed in stripes (1.3-1.5x oneDNN's at 1-16 rows, even from 256). A
decode layer's two halves around attention
(``attention_inputs``, ``mlp_block``) are one C call each on those batches: the same kernels in
the same order, so the same bits, without nine Python calls and their new tensors.

Owns the kernels' source, the weight layouts (``pack``) and their ctypes calls; the build and
its cache are ``pagekv.native``'s. The numbers follow ``layer_ops.TorchOps`` rounding point by
rounding point (float32 math, one rounding to the dtype wherever torch rounds); only the sum of
squares (another order) and exp (another polynomial) differ, by float32 ulps. Rows are split over
``torch.get_num_threads()`` OpenMP threads once a call has enough work (a prefill chunk; a decode
batch of short rows stays on one thread); each row is computed the same way whatever the split,
so threads never change a bit. The bf16 matmuls sum in their own orders: the AMX kernel in the
same order as oneDNN's up to 32 rows, and both tile kernels in one order for any row count
(oneDNN's order changes above 32 rows). So in bfloat16 a sequence's numbers depend, within a
bf16 ulp per matmul, only on whether its batch had up to 256 rows or more.
The float32 matmul sums each output in one order (k ascending, one FMA chain) for any row
count, so float32 stays batch-invariant; its sums differ from torch's by float32 rounding.

``load()`` returns None (callers keep ``TorchOps``) when there is no compiler, the build fails,
or ``PAGEKV_FUSED_OPS=0``. Imports nothing from runner/ or core/.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import torch

from pagekv import native
from pagekv.models import layer_ops

DISABLE_ENV = "PAGEKV_FUSED_OPS"
# No FMA contraction: g++ contracts a * b - c into one rounding even under -std=c++17, and torch
# rounds the product first.
CXX_FLAGS = (*native.BASE_CXX_FLAGS, "-fopenmp", "-ffp-contract=off")

# Plain loops that GCC vectorizes (the omp simd pragmas allow the reassociated sums; check with
# -fopt-info-vec); bfloat16 is widened and rounded with integer ops, the same round-to-nearest-
# even as torch.
_SOURCE = (
    r"""
#include <cmath>
#include <cstdint>
#include <cstring>

// Split rows over threads only when a call has at least this many elements: below it the
// fork and join cost more than the work. A 64-row decode batch's norm (37k elements) took
// 28.7 us on one thread and 19.4 us on two, its RoPE 21.4 and 17.5 us; 16 rows gain nothing.
static const long PARALLEL_MIN_ELEMENTS = 16384;

static inline float load(float x) { return x; }
static inline float load(uint16_t x) {  // bfloat16 -> float32 is exact: the high 16 bits
    return __builtin_bit_cast(float, uint32_t(x) << 16);
}
template <typename T> static inline T store(float f);
template <> inline float store<float>(float f) { return f; }
template <> inline uint16_t store<uint16_t>(float f) {  // round to nearest even, NaN stays NaN
    const uint32_t u = __builtin_bit_cast(uint32_t, f);
    const uint16_t r = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? uint16_t(0x7FC0) : r;
}
// The value torch holds after rounding to the dtype.
template <typename T> static inline float round_to(float f) { return load(store<T>(f)); }

// exp(x) for any x: Cephes' expf polynomial (rel. error ~2e-7), inf above 88.72, ~0 below -87.
// No std::floor and no memcpy: GCC vectorizes neither.
static inline float exp_any(float x) {
    const float big = x > 88.72f ? INFINITY : 1.f;
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round(x / ln 2): 1.5 * 2^23
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    // fused multiply-adds (this file is built without contraction, for the exact ops)
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
    p = std::fma(p * r, r, r + 1.f);
    const int32_t bits = (int32_t(n) + 127) << 23;
    return p * __builtin_bit_cast(float, bits) * big;
}

// Per row: (residual += x, rounded), then out = w * dtype(r * rsqrt(mean(r^2) + eps)). Without
// x (null), residual is only read: the plain norm.
template <typename T>
static void add_rms_norm(const T* x, T* residual, const T* w, T* out, long rows, long n,
                         float eps, int threads) {
    #pragma omp parallel for num_threads(threads) if(rows * n >= PARALLEL_MIN_ELEMENTS)
    for (long row = 0; row < rows; ++row) {
        T* res = residual + row * n;
        float sum = 0.f;
        if (x != nullptr) {
            const T* xr = x + row * n;
            #pragma omp simd reduction(+:sum)
            for (long i = 0; i < n; ++i) {
                const T r = store<T>(load(res[i]) + load(xr[i]));
                res[i] = r;
                sum += load(r) * load(r);
            }
        } else {
            #pragma omp simd reduction(+:sum)
            for (long i = 0; i < n; ++i) sum += load(res[i]) * load(res[i]);
        }
        const float inv = 1.f / std::sqrt(sum / float(n) + eps);
        T* o = out + row * n;
        #pragma omp simd
        for (long i = 0; i < n; ++i) o[i] = store<T>(load(w[i]) * round_to<T>(load(res[i]) * inv));
    }
}

// One head: dst = rotate(src) in halves (HF's rotate_half), float32 math, rounded once.
template <typename T>
static inline void rotate(const T* src, T* dst, const float* c, const float* s, int half) {
    #pragma omp simd
    for (int i = 0; i < half; ++i) {
        const float x1 = load(src[i]), x2 = load(src[i + half]);
        dst[i] = store<T>(x1 * c[i] - x2 * s[i]);
        dst[i + half] = store<T>(x2 * c[i] + x1 * s[i]);
    }
}

// qkv rows (row_stride apart) -> contiguous q [T, H, D], k and v [T, KVH, D]; q, k rotated.
template <typename T>
static void split_rope(const T* qkv, long row_stride, T* q, T* k, T* v, const float* cos,
                       const float* sin, long tokens, int heads, int kv_heads, int head_dim,
                       int threads) {
    const int half = head_dim / 2;
    #pragma omp parallel for num_threads(threads) if(tokens * row_stride >= PARALLEL_MIN_ELEMENTS)
    for (long t = 0; t < tokens; ++t) {
        const T* src = qkv + t * row_stride;
        const float* c = cos + t * half;
        const float* s = sin + t * half;
        for (int h = 0; h < heads; ++h)
            rotate(src + long(h) * head_dim, q + (t * heads + h) * head_dim, c, s, half);
        src += long(heads) * head_dim;
        for (int h = 0; h < kv_heads; ++h)
            rotate(src + long(h) * head_dim, k + (t * kv_heads + h) * head_dim, c, s, half);
        src += long(kv_heads) * head_dim;
        std::memcpy(v + t * kv_heads * head_dim, src, sizeof(T) * kv_heads * head_dim);
    }
}

// out [T, I] = dtype(silu(gate)) * up, gate_up [T, 2I]; silu(g) = g / (1 + exp(-g)) in float32.
template <typename T>
static void silu_mul(const T* gate_up, T* out, long rows, long inter, int threads) {
    #pragma omp parallel for num_threads(threads) if(rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (long row = 0; row < rows; ++row) {
        const T* g = gate_up + row * 2 * inter;
        const T* u = g + inter;
        T* o = out + row * inter;
        #pragma omp simd
        for (long i = 0; i < inter; ++i) {
            const float gv = load(g[i]);
            o[i] = store<T>(round_to<T>(gv / (1.f + exp_any(-gv))) * load(u[i]));
        }
    }
}

// Tiled matmul, bfloat16: out [M, N] = x [M, K] @ w [N, K]^T for decode batches (1 to 256
// rows), with w packed once at load (tiles_pack_bf16) into AMX's tiles:
// [N/16][K/32] tiles, each 16 k-pairs x 16 columns x 2 (the VNNI layout). Each thread owns a
// range of 32-column stripes and streams their tiles once, prefetching the next stripe into L2
// while it multiplies this one, spread evenly over all its passes over the stripe. Two units
// multiply: AMX tiles, two 16-row blocks a pass (up to 32 rows at memory speed, ~1.7x oneDNN's
// rate; whole steps at 48-64 rows 1.12-1.19x faster than when only the first pass prefetched,
// measured), or, on CPUs with AVX512-BF16 and no AMX (AMD Zen 4/5), vdpbf16ps with up to 12
// rows x 32 columns of sums in registers, a tile row of w loaded once for all of them. Every
// output row is summed in one order, k ascending, whatever M is, so a row's numbers do not
// depend on the batch it is in.
#if defined(__AVX512BF16__)
#include <cstring>
#include <omp.h>
#include <vector>
"""
    + native.BF16_SOURCE
    + r"""
static const int TILED_MAX_ROWS = 256;  // about even with oneDNN here; above, oneDNN's turn

extern "C" void tiles_pack_bf16(const void* w, void* packed, long N, long K) {
    const uint16_t* ws = (const uint16_t*)w;
    uint16_t* ps = (uint16_t*)packed;
    #pragma omp parallel for
    for (long nb = 0; nb < N / 16; ++nb)
        for (long kb = 0; kb < K / 32; ++kb) {
            uint16_t* tile = ps + (nb * (K / 32) + kb) * 512;
            for (int r = 0; r < 16; ++r)  // k pair
                for (int c = 0; c < 16; ++c)
                    for (int j = 0; j < 2; ++j)
                        tile[r * 32 + c * 2 + j] = ws[(nb * 16 + c) * K + kb * 32 + 2 * r + j];
        }
}

// Prefetch of the next stripe (two tile rows of `lines` cache lines each, from `next`), spread
// over every k step of every pass: this step's share.
static inline void prefetch_share(const uint16_t* next, long KB, long kb, long pass,
                                  long passes) {
    if (next == nullptr) return;
    const long step = pass * KB + kb, lines = KB * 16, steps = passes * KB;
    const long l0 = lines * step / steps, l1 = lines * (step + 1) / steps;
    for (long line = l0; line < l1; ++line) {
        _mm_prefetch((const char*)next + line * 64, _MM_HINT_T1);
        _mm_prefetch((const char*)(next + KB * 512) + line * 64, _MM_HINT_T1);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Row blocks b0 (and b0 + 1 if TWO) of x against one 32-column stripe (tiles b and b + KB*512):
// pass `pass` of `passes` over this stripe, which prefetches its share of the next stripe.
template <bool TWO>
static inline void amx_block(const uint16_t* a0, const uint16_t* a1, const uint16_t* b,
                             const uint16_t* next, uint16_t* out, long rows0, long rows1,
                             long K, long N, float (*c)[16][16], long pass, long passes) {
    const long KB = K / 32;
    const uint16_t* b1 = b + KB * 512;
    _tile_zero(0);
    _tile_zero(1);
    if (TWO) { _tile_zero(2); _tile_zero(3); }
    for (long kb = 0; kb < KB; ++kb) {
        prefetch_share(next, KB, kb, pass, passes);
        _tile_loadd(4, a0 + kb * 32, K * 2);
        _tile_loadd(6, b + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (TWO) {
            _tile_loadd(5, a1 + kb * 32, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (TWO) { _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64); }
    for (int h = 0; h < (TWO ? 2 : 1); ++h)
        for (long r = 0; r < (h ? rows1 : rows0); ++r) {
            uint16_t* o = out + (h * 16 + r) * N;
            _mm256_storeu_si256((__m256i*)o, round_bf16x16(_mm512_load_ps(c[2 * h][r])));
            _mm256_storeu_si256((__m256i*)(o + 16), round_bf16x16(_mm512_load_ps(c[2 * h + 1][r])));
        }
}

static void amx_linear(const void* x, const void* packed, void* out, long M, long K, long N,
                       int threads) {
    const uint16_t* xs = (const uint16_t*)x;
    const uint16_t* ps = (const uint16_t*)packed;
    uint16_t* os = (uint16_t*)out;
    const long full = M / 16, blocks = (M + 15) / 16, KB = K / 32, stripes = N / 32;
    std::vector<uint16_t> tail(M % 16 ? 16 * K : 0, 0);  // a tile always loads 16 rows
    if (M % 16) std::memcpy(tail.data(), xs + full * 16 * K, (M % 16) * K * 2);
    auto rows_of = [&](long blk) { return blk < full ? xs + blk * 16 * K : tail.data(); };
    auto count_of = [&](long blk) { return blk < full ? 16L : M % 16; };
    #pragma omp parallel num_threads(threads)
    {
        configure_tiles();
        alignas(64) float c[4][16][16];
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long s0 = stripes * t / nt, s1 = stripes * (t + 1) / nt;
        for (long s = s0; s < s1; ++s) {
            const uint16_t* b = ps + s * 2 * KB * 512;
            const uint16_t* next = s + 1 < s1 ? b + 2 * KB * 512 : nullptr;
            const long passes = (blocks + 1) / 2;
            for (long blk = 0; blk < blocks; blk += 2) {
                uint16_t* o = os + blk * 16 * N + s * 32;
                if (blk + 1 < blocks)
                    amx_block<true>(rows_of(blk), rows_of(blk + 1), b, next, o, count_of(blk),
                                    count_of(blk + 1), K, N, c, blk / 2, passes);
                else
                    amx_block<false>(rows_of(blk), nullptr, b, next, o, count_of(blk), 0, K, N,
                                     c, blk / 2, passes);
            }
        }
        _tile_release();
    }
}
#endif

// Rows [0, R) of x (row stride K) against one 32-column stripe: R x 32 sums in registers.
template <int R>
static inline void vector_block(const uint16_t* x, const uint16_t* b, const uint16_t* next,
                                uint16_t* out, long K, long N, long pass, long passes) {
    const long KB = K / 32;
    const uint16_t* b1 = b + KB * 512;
    __m512 acc[R][2];
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (long kb = 0; kb < KB; ++kb) {
        prefetch_share(next, KB, kb, pass, passes);
        for (int r = 0; r < 16; ++r) {  // k pair 16 kb + r
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b + kb * 512 + r * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + kb * 512 + r * 32);
            for (int m = 0; m < R; ++m) {
                int32_t bits;
                std::memcpy(&bits, x + m * K + kb * 32 + 2 * r, 4);
                const __m512bh xm = (__m512bh)_mm512_set1_epi32(bits);
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xm, w0);
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xm, w1);
            }
        }
    }
    for (int m = 0; m < R; ++m) {
        _mm256_storeu_si256((__m256i*)(out + m * N), round_bf16x16(acc[m][0]));
        _mm256_storeu_si256((__m256i*)(out + m * N + 16), round_bf16x16(acc[m][1]));
    }
}

static const int VECTOR_ROWS = 12;  // 24 sums, 2 weight rows and a broadcast: 27 registers

template <int R>
static void vector_rows(const uint16_t* x, long rows, const uint16_t* b, const uint16_t* next,
                        uint16_t* out, long K, long N, long pass, long passes) {
    if (rows == R) return vector_block<R>(x, b, next, out, K, N, pass, passes);
    if constexpr (R > 1) vector_rows<R - 1>(x, rows, b, next, out, K, N, pass, passes);
}

static void vector_linear(const void* x, const void* packed, void* out, long M, long K, long N,
                          int threads) {
    const uint16_t* xs = (const uint16_t*)x;
    const uint16_t* ps = (const uint16_t*)packed;
    uint16_t* os = (uint16_t*)out;
    const long KB = K / 32, stripes = N / 32, passes = (M + VECTOR_ROWS - 1) / VECTOR_ROWS;
    #pragma omp parallel num_threads(threads)
    {
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long s0 = stripes * t / nt, s1 = stripes * (t + 1) / nt;
        for (long s = s0; s < s1; ++s) {
            const uint16_t* b = ps + s * 2 * KB * 512;
            const uint16_t* next = s + 1 < s1 ? b + 2 * KB * 512 : nullptr;
            for (long pass = 0; pass < passes; ++pass) {  // rows split evenly over passes
                const long m0 = M * pass / passes, rows = M * (pass + 1) / passes - m0;
                vector_rows<VECTOR_ROWS>(xs + m0 * K, rows, b, next, os + m0 * N + s * 32, K,
                                         N, pass, passes);
            }
        }
    }
}

extern "C" int tiles_linear_bf16(const void* x, const void* packed, void* out, long M, long K,
                                 long N, int unit, int threads) {
    if (M < 1 || M > TILED_MAX_ROWS || K % 32 != 0 || N % 32 != 0 || unit > best_tile_unit())
        return -1;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (unit == 2) {
        amx_linear(x, packed, out, M, K, N, threads);
        return 0;
    }
#endif
    if (unit != 1) return -1;
    vector_linear(x, packed, out, M, K, N, threads);
    return 0;
}
extern "C" int tiles_linear_max_rows() { return TILED_MAX_ROWS; }
extern "C" int tiles_linear_unit() { return best_tile_unit(); }
#else
extern "C" void tiles_pack_bf16(const void*, void*, long, long) {}
extern "C" int tiles_linear_bf16(const void*, const void*, void*, long, long, long, int, int) {
    return -1;  // no AVX512-BF16 here: the caller keeps oneDNN's matmul
}
extern "C" int tiles_linear_max_rows() { return 0; }
extern "C" int tiles_linear_unit() { return 0; }
#endif

// Float32 matmul: out [M, N] = x [M, K] @ w [N, K]^T for any M, with w packed once at load in
// stripes of 32 columns, [N/32][K][32] (k-th row of a stripe: its 32 columns' weights at k).
// Up to 12 rows x 32 columns of sums in registers, one FMA per row and weight vector, k
// ascending: every output is one chain of FMAs in one order whatever M is, so a row's numbers
// do not depend on its batch. Each thread owns a range of stripes; rows go in blocks of 240
// (that block of x stays in L2 while the stripes stream by), each block in passes of up to 12
// rows split evenly. Against oneDNN's packed float32 matmul on AMD Zen 4 (a step's 30 layers,
// weights from memory): 1.3-1.5x at 1-16 rows, 1.21x at 32, 1.09x at 64, even at 256-2,048.
#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>
static const int STRIPE_ROWS = 12;         // 24 sums, 2 weight vectors and a broadcast
static const long STRIPE_ROW_BLOCK = 240;  // 20 passes of 12

extern "C" void stripes_pack_f32(const void* w, void* packed, long N, long K) {
    const float* ws = (const float*)w;
    float* ps = (float*)packed;
    #pragma omp parallel for
    for (long s = 0; s < N / 32; ++s)
        for (long k = 0; k < K; ++k)
            for (int c = 0; c < 32; ++c) ps[(s * K + k) * 32 + c] = ws[(s * 32 + c) * K + k];
}

// rows [0, R) of x (row stride K) against one stripe: R x 32 sums in registers
template <int R>
static inline void stripe_block(const float* x, const float* b, float* out, long K, long N) {
    __m512 acc[R][2];
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (long k = 0; k < K; ++k) {
        const __m512 w0 = _mm512_loadu_ps(b + k * 32);
        const __m512 w1 = _mm512_loadu_ps(b + k * 32 + 16);
        for (int m = 0; m < R; ++m) {
            const __m512 xm = _mm512_set1_ps(x[m * K + k]);
            acc[m][0] = _mm512_fmadd_ps(xm, w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(xm, w1, acc[m][1]);
        }
    }
    for (int m = 0; m < R; ++m) {
        _mm512_storeu_ps(out + m * N, acc[m][0]);
        _mm512_storeu_ps(out + m * N + 16, acc[m][1]);
    }
}

template <int R>
static void stripe_rows(const float* x, long rows, const float* b, float* out, long K, long N) {
    if (rows == R) return stripe_block<R>(x, b, out, K, N);
    if constexpr (R > 1) stripe_rows<R - 1>(x, rows, b, out, K, N);
}

extern "C" int stripes_linear_f32(const void* x, const void* packed, void* out, long M, long K,
                                  long N, int threads) {
    if (M < 1 || K < 1 || N % 32 != 0) return -1;
    const float* xs = (const float*)x;
    const float* ps = (const float*)packed;
    float* os = (float*)out;
    const long stripes = N / 32;
    #pragma omp parallel num_threads(threads)
    {
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long s0 = stripes * t / nt, s1 = stripes * (t + 1) / nt;
        for (long first = 0; first < M; first += STRIPE_ROW_BLOCK) {
            const long block = M - first < STRIPE_ROW_BLOCK ? M - first : STRIPE_ROW_BLOCK;
            const long passes = (block + STRIPE_ROWS - 1) / STRIPE_ROWS;
            for (long s = s0; s < s1; ++s)
                for (long pass = 0; pass < passes; ++pass) {  // rows split evenly over passes
                    const long m0 = first + block * pass / passes;
                    const long rows = first + block * (pass + 1) / passes - m0;
                    stripe_rows<STRIPE_ROWS>(xs + m0 * K, rows, ps + s * K * 32,
                                             os + m0 * N + s * 32, K, N);
                }
        }
    }
    return 0;
}
extern "C" int stripes_available() { return 1; }
#else
extern "C" void stripes_pack_f32(const void*, void*, long, long) {}
extern "C" int stripes_linear_f32(const void*, const void*, void*, long, long, long, int) {
    return -1;  // no AVX-512 here: the caller keeps oneDNN's matmul
}
extern "C" int stripes_available() { return 0; }
#endif

#define ENTRIES(SUFFIX, T)                                                                    \
    extern "C" void add_rms_norm_##SUFFIX(const void* x, void* residual, const void* w,       \
                                          void* out, long rows, long n, float eps, int threads) { \
        add_rms_norm<T>((const T*)x, (T*)residual, (const T*)w, (T*)out, rows, n, eps, threads); \
    }                                                                                         \
    extern "C" void split_rope_##SUFFIX(const void* qkv, long row_stride, void* q, void* k,   \
                                        void* v, const float* cos, const float* sin,          \
                                        long tokens, int heads, int kv_heads, int head_dim,   \
                                        int threads) {                                        \
        split_rope<T>((const T*)qkv, row_stride, (T*)q, (T*)k, (T*)v, cos, sin, tokens,       \
                      heads, kv_heads, head_dim, threads);                                    \
    }                                                                                         \
    extern "C" void silu_mul_##SUFFIX(const void* gate_up, void* out, long rows, long inter,  \
                                      int threads) {                                          \
        silu_mul<T>((const T*)gate_up, (T*)out, rows, inter, threads);                        \
    }
ENTRIES(f32, float)
ENTRIES(bf16, uint16_t)

// A decode step's layer in two calls instead of nine, bfloat16: the ops above in the order
// LlamaDecoderLayer calls them one by one, through the same kernels (so the same bits), the
// intermediates in this thread's scratch instead of new tensors. Each matmul is the one
// FusedOps.linear picks: the tiles. Only for row counts and shapes the tiles take; checked
// before anything is written (-1: the caller goes op by op).
#if defined(__AVX512BF16__)
static uint16_t* scratch(long elements) {
    static thread_local std::vector<uint16_t> buffer;
    if (long(buffer.size()) < elements) buffer.resize(elements);
    return buffer.data();
}

static inline bool decode_matmul_fits(long M, long K, long N) {
    return M >= 1 && M <= TILED_MAX_ROWS && K % 32 == 0 && N % 32 == 0;
}

// x null (the first layer): the norm of the residual alone, which is left as it is.
extern "C" int attention_inputs_bf16(const void* x, void* residual, const void* norm, float eps,
                                     const void* t_qkv, const float* cos,
                                     const float* sin, void* q, void* k, void* v, long M,
                                     long hidden, int heads, int kv_heads, int head_dim,
                                     int unit, int threads) {
    const long width = long(heads + 2 * kv_heads) * head_dim;
    if (!decode_matmul_fits(M, hidden, width) || unit < 1 || unit > best_tile_unit()) return -1;
    uint16_t* h = scratch(M * (hidden + width));
    uint16_t* qkv = h + M * hidden;
    add_rms_norm<uint16_t>((const uint16_t*)x, (uint16_t*)residual, (const uint16_t*)norm, h, M,
                           hidden, eps, threads);
    tiles_linear_bf16(h, t_qkv, qkv, M, hidden, width, unit, threads);
    split_rope<uint16_t>(qkv, width, (uint16_t*)q, (uint16_t*)k, (uint16_t*)v, cos, sin, M,
                         heads, kv_heads, head_dim, threads);
    return 0;
}

extern "C" int mlp_block_bf16(const void* attn, void* residual, const void* t_o,
                              const void* norm, float eps, const void* t_gate_up,
                              const void* t_down, void* out, long M, long hidden, long q_size,
                              long inter, int unit, int threads) {
    if (!decode_matmul_fits(M, q_size, hidden) || !decode_matmul_fits(M, hidden, 2 * inter) ||
        !decode_matmul_fits(M, inter, hidden) || unit < 1 || unit > best_tile_unit())
        return -1;
    uint16_t* o = scratch(M * (2 * hidden + 3 * inter));
    uint16_t* h = o + M * hidden;
    uint16_t* gate_up = h + M * hidden;
    uint16_t* act = gate_up + M * 2 * inter;
    tiles_linear_bf16(attn, t_o, o, M, q_size, hidden, unit, threads);
    add_rms_norm<uint16_t>(o, (uint16_t*)residual, (const uint16_t*)norm, h, M, hidden, eps,
                           threads);
    tiles_linear_bf16(h, t_gate_up, gate_up, M, hidden, 2 * inter, unit, threads);
    silu_mul<uint16_t>(gate_up, act, M, inter, threads);
    tiles_linear_bf16(act, t_down, out, M, inter, hidden, unit, threads);
    return 0;
}
#else
extern "C" int attention_inputs_bf16(const void*, void*, const void*, float, const void*,
                                     const float*, const float*, void*, void*, void*, long,
                                     long, int, int, int, int, int) {
    return -1;
}
extern "C" int mlp_block_bf16(const void*, void*, const void*, const void*, float,
                              const void*, const void*, void*, long, long, long, long, int,
                              int) {
    return -1;
}
#endif
"""
)

_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES: dict[str, list[type]] = {
    "add_rms_norm": [_P, _P, _P, _P, _L, _L, _F, _I],
    "split_rope": [_P, _L, _P, _P, _P, _P, _P, _L, _I, _I, _I, _I],
    "silu_mul": [_P, _P, _L, _L, _I],
}


class FusedOps:
    """``LayerOps`` through the loaded library, for the dtypes ``supports`` accepts.

    The C side trusts its pointers, so every call checks dtypes, shapes and layout first and
    raises ValueError on a mismatch (a caller bug, not a fallback case).
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions: dict[tuple[str, torch.dtype], Any] = {}  # ctypes functions
        for op, argtypes in _SIGNATURES.items():
            for dtype, suffix in _SUFFIXES.items():
                fn = getattr(library, f"{op}_{suffix}")
                fn.restype = None
                fn.argtypes = argtypes
                self._functions[(op, dtype)] = fn
        self._tiled = library.tiles_linear_bf16
        self._tiled.restype = ctypes.c_int
        self._tiled.argtypes = [_P, _P, _P, _L, _L, _L, _I, _I]
        self._tiles_pack = library.tiles_pack_bf16
        self._tiles_pack.restype = None
        self._tiles_pack.argtypes = [_P, _P, _L, _L]
        library.tiles_linear_max_rows.restype = ctypes.c_int
        library.tiles_linear_unit.restype = ctypes.c_int
        self._tiles_max_rows = int(library.tiles_linear_max_rows())  # 0: no AVX512-BF16
        self._best_unit = int(library.tiles_linear_unit())
        self._unit = self._best_unit  # which multiplies the tiles: 2 AMX, 1 vectors
        self._attention_inputs = library.attention_inputs_bf16
        self._attention_inputs.restype = _I
        self._attention_inputs.argtypes = [_P, _P, _P, _F, _P, _P, _P, _P, _P, _P, _L, _L]
        self._attention_inputs.argtypes += [_I] * 5
        self._mlp_block = library.mlp_block_bf16
        self._mlp_block.restype = _I
        self._mlp_block.argtypes = [_P, _P, _P, _P, _F, _P, _P, _P, _L, _L, _L, _L]
        self._mlp_block.argtypes += [_I, _I]
        self._stripes_pack = library.stripes_pack_f32
        self._stripes_pack.restype = None
        self._stripes_pack.argtypes = [_P, _P, _L, _L]
        self._stripes = library.stripes_linear_f32
        self._stripes.restype = _I
        self._stripes.argtypes = [_P, _P, _P, _L, _L, _L, _I]
        self._has_stripes = bool(library.stripes_available())  # float32: needs AVX-512

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _SUFFIXES

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _check_rows(x, weight)
        out = torch.empty_like(x)
        fn = self._functions[("add_rms_norm", x.dtype)]
        fn(None, x.data_ptr(), weight.data_ptr(), out.data_ptr(), *x.shape, eps, _threads())
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Updates ``residual`` in place and returns it."""
        _check_rows(residual, weight)
        if not (x.is_contiguous() and x.shape == residual.shape and x.dtype == residual.dtype):
            raise ValueError("fused add_rms_norm: x must match the residual")
        out = torch.empty_like(x)
        fn = self._functions[("add_rms_norm", x.dtype)]
        rows, n = residual.shape
        fn(
            x.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            n,
            eps,
            _threads(),
        )
        return out, residual

    def split_rope(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens, width = qkv.shape
        half = cos.shape[-1]
        head_dim = 2 * half
        if not (
            qkv.dtype in _SUFFIXES
            and qkv.stride(1) == 1
            and width == (num_heads + 2 * num_kv_heads) * head_dim
            and cos.dtype == sin.dtype == torch.float32
            and cos.is_contiguous()
            and sin.is_contiguous()
            and cos.shape == sin.shape == (num_tokens, half)
        ):
            raise ValueError("fused split_rope: wrong dtype, shape or layout of its inputs")
        q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype)
        k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype)
        v = torch.empty_like(k)
        fn = self._functions[("split_rope", qkv.dtype)]
        fn(
            qkv.data_ptr(),
            qkv.stride(0),
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
            _threads(),
        )
        return q, k, v

    @property
    def matmul_unit(self) -> str | None:
        """What multiplies packed tiles: "amx", "avx512-bf16" (vectors), or None (no tiles)."""
        return native.TILE_UNITS.get(self._unit) if self._tiles_max_rows else None

    def use_matmul_unit(self, name: str) -> bool:
        """Multiply tiles on "amx" or "avx512-bf16" where this CPU has it (tests compare the
        two; the packed layout is the same). True if now in use."""
        code = next((c for c, n in native.TILE_UNITS.items() if n == name), 0)
        if 0 < code <= self._best_unit:
            self._unit = code
        return self._unit == code

    def pack(
        self, weight: torch.Tensor, allocate: layer_ops.Allocate = layer_ops.torch_empty
    ) -> torch.Tensor | None:
        """The same numbers of an [out, in] weight reordered for this object's matmuls: in bf16
        (on CPUs with AVX512-BF16, sides multiples of 32) the tiled kernel's tiles, a [out /
        16, in / 32, 16, 32] tensor; in float32 (on CPUs with AVX-512, out a multiple of 32)
        the stripes of the float32 kernel, [out / 32, in, 32]; otherwise ``layer_ops.pack``
        (oneDNN's copy, or None). Tiles and stripes go into a tensor from ``allocate``."""
        out_features, in_features = weight.shape
        if not (weight.is_contiguous() and out_features % 32 == 0):
            return layer_ops.pack(weight)
        if weight.dtype == torch.float32 and self._has_stripes:
            packed = allocate((out_features // 32, in_features, 32), torch.float32)
            self._stripes_pack(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
            return packed
        if not (self._tiles_max_rows and weight.dtype == torch.bfloat16 and in_features % 32 == 0):
            return layer_ops.pack(weight)
        packed = allocate((out_features // 16, in_features // 32, 16, 32), torch.bfloat16)
        self._tiles_pack(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
        return packed

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """bf16 without bias, at up to 256 rows with tiles from ``pack`` (none on CPUs without
        AVX512-BF16): the tiled kernel (AMX, or vectors), within a bf16 ulp of torch's matmul,
        streaming a step's weights faster than oneDNN up to 32 rows (about even above).
        float32 without bias, with stripes from ``pack``: the float32 kernel at any row count.
        Otherwise ``layer_ops.linear``."""
        rows, width = x.shape
        ours = packed is not None and packed.dim() in (3, 4)  # stripes or tiles, not oneDNN's
        if packed is not None and packed.dim() == 3:
            if packed.shape != (weight.shape[0] // 32, width, 32) or x.dtype != torch.float32:
                raise ValueError("fused linear: packed stripes do not match the weight or x")
            if bias is None and x.is_contiguous():
                out = torch.empty((rows, weight.shape[0]), dtype=torch.float32)
                args = (x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, width)
                if self._stripes(*args, weight.shape[0], _threads()) == 0:
                    return out
        if packed is not None and packed.dim() == 4 and rows <= self._tiles_max_rows:
            out_features = weight.shape[0]
            if packed.shape != (out_features // 16, width // 32, 16, 32):
                raise ValueError("fused linear: packed tiles do not match the weight")
            if x.dtype == torch.bfloat16 and bias is None and x.is_contiguous():
                out = torch.empty((rows, out_features), dtype=x.dtype)
                args = (x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, width)
                if self._tiled(*args, out_features, self._unit, _threads()) == 0:
                    return out  # else (a shape the C side declines): torch
        return layer_ops.linear(x, weight, None if ours else packed, bias)

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
        """``layer_ops.attention_inputs`` in one C call for bf16 decode batches whose matmul
        the tiles take (the same kernels, so the same bits); op by op otherwise."""
        rows, hidden = residual.shape
        half = cos.shape[-1]
        if (
            self._fits_one_call(residual, norm, rows, (qkv,))
            and (x is None or (x.shape == residual.shape and x.dtype == residual.dtype))
            and (x is None or x.is_contiguous())
            and qkv.weight.shape == ((num_heads + 2 * num_kv_heads) * 2 * half, hidden)
            and cos.dtype == sin.dtype == torch.float32
            and cos.shape == sin.shape == (rows, half)
            and cos.is_contiguous()
            and sin.is_contiguous()
        ):
            q = torch.empty((rows, num_heads, 2 * half), dtype=torch.bfloat16)
            k = torch.empty((rows, num_kv_heads, 2 * half), dtype=torch.bfloat16)
            v = torch.empty_like(k)
            status = self._attention_inputs(
                None if x is None else x.data_ptr(),
                residual.data_ptr(),
                norm.data_ptr(),
                eps,
                _tiles(qkv.packed),
                cos.data_ptr(),
                sin.data_ptr(),
                q.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                rows,
                hidden,
                num_heads,
                num_kv_heads,
                2 * half,
                self._unit,
                _threads(),
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
        """``layer_ops.mlp_block`` in one C call for bf16 decode batches whose matmuls the
        tiles take (the same kernels, so the same bits); op by op otherwise."""
        rows, hidden = residual.shape
        inter = down.weight.shape[1]
        if (
            self._fits_one_call(residual, norm, rows, (o_proj, gate_up, down))
            and attn.dtype == torch.bfloat16
            and attn.is_contiguous()
            and attn.shape == (rows, o_proj.weight.shape[1])
            and o_proj.weight.shape[0] == hidden
            and gate_up.weight.shape == (2 * inter, hidden)
            and down.weight.shape[0] == hidden
        ):
            out = torch.empty_like(residual)
            status = self._mlp_block(
                attn.data_ptr(),
                residual.data_ptr(),
                _tiles(o_proj.packed),
                norm.data_ptr(),
                eps,
                _tiles(gate_up.packed),
                _tiles(down.packed),
                out.data_ptr(),
                rows,
                hidden,
                attn.shape[1],
                inter,
                self._unit,
                _threads(),
            )
            if status == 0:
                return out, residual
        return layer_ops.mlp_block(self, attn, residual, o_proj, norm, eps, gate_up, down)

    def _fits_one_call(
        self,
        residual: torch.Tensor,
        norm: torch.Tensor,
        rows: int,
        linears: tuple[layer_ops.Linear, ...],
    ) -> bool:
        """Whether a layer half of ``rows`` bf16 rows can go through one C call: the residual
        and norm as the C side reads them, and every matmul one ``linear`` would give the
        tiles (a bias never)."""
        if not (
            0 < rows <= self._tiles_max_rows
            and residual.dtype == norm.dtype == torch.bfloat16
            and residual.is_contiguous()
            and norm.is_contiguous()
            and norm.shape == residual.shape[1:]
        ):
            return False
        for weight, packed, bias in linears:
            out_features, in_features = weight.shape
            tiles = (out_features // 16, in_features // 32, 16, 32)
            if bias is not None or weight.dtype != torch.bfloat16 or packed is None:
                return False
            if packed.shape != tiles:
                return False
        return True

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not (
            gate_up.dtype in _SUFFIXES
            and gate_up.is_contiguous()
            and gate_up.dim() == 2
            and gate_up.shape[1] % 2 == 0
        ):
            raise ValueError("fused silu_mul: gate_up must be a contiguous [T, 2 * I]")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        fn = self._functions[("silu_mul", gate_up.dtype)]
        fn(gate_up.data_ptr(), out.data_ptr(), rows, inter, _threads())
        return out


def _tiles(packed: torch.Tensor | None) -> int | None:
    """The address of packed tiles; None for no copy or oneDNN's (no storage to point at)."""
    return packed.data_ptr() if packed is not None and packed.dim() == 4 else None


def _threads() -> int:
    return torch.get_num_threads()  # the engine's thread setting, as the decode kernel's


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not (
        x.dim() == 2
        and x.is_contiguous()
        and weight.is_contiguous()
        and weight.shape == (x.shape[1],)
        and x.dtype == weight.dtype
        and x.dtype in _SUFFIXES
    ):
        raise ValueError("fused rms_norm: x must be a contiguous [T, hidden] like its weight")


@functools.cache
def load() -> FusedOps | None:
    """The compiled ops, built once per machine and cached; None if unavailable or disabled."""
    library = native.load_optional("fused_ops", _SOURCE, CXX_FLAGS, DISABLE_ENV, logging.DEBUG)
    return None if library is None else FusedOps(library)
