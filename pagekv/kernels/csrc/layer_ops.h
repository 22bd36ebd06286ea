// The layer ops on rows: RMSNorm (+ residual), RoPE + split, SiLU x up, float32 or bfloat16
// (T), their numbers torch's rounding point by rounding point (float32 math, one rounding to
// the dtype wherever torch rounds). Plain loops that GCC vectorizes (the omp simd pragmas allow
// the reassociated sums; check with -fopt-info-vec); bfloat16 is widened and rounded with
// integer ops (bf16.h), the same round-to-nearest-even as torch. The library is built without
// FMA contraction (fused_ops.cpp says why).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include "bf16.h"

// Split rows over threads only when a call has at least this many elements: below it the
// fork and join cost more than the work (a 16-row decode batch's norm gains nothing from a
// second thread; a 64-row one's does).
static const long PARALLEL_MIN_ELEMENTS = 16384;

template <typename T> static inline T store(float f);
template <> inline float store<float>(float f) { return f; }
template <> inline uint16_t store<uint16_t>(float f) { return f32_to_bf16(f); }
// The value torch holds after rounding to the dtype.
template <typename T> static inline float round_to(float f) { return load(store<T>(f)); }

// out [M, N] += bias [N], each sum rounded to T (torch's add_).
template <typename T>
static void add_bias(T* out, const T* bias, long M, long N) {
    for (long m = 0; m < M; ++m)
        for (long n = 0; n < N; ++n) out[m * N + n] = store<T>(load(out[m * N + n]) + load(bias[n]));
}

// exp(x) for any x: Cephes' expf polynomial (rel. error ~2e-7), inf above 88.72, ~0 below -87.
// No std::floor and no memcpy: GCC vectorizes neither. Always inlined: a call inside a loop
// keeps the loop scalar, and GCC's own choice leaves it a call on some targets.
__attribute__((always_inline)) static inline float exp_any(float x) {
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

// o [n] = dtype(silu(g)) * u; silu(g) = g / (1 + exp(-g)) in float32.
template <typename T>
static inline void silu_mul_row(const T* g, const T* u, T* o, long n) {
    #pragma omp simd
    for (long i = 0; i < n; ++i) {
        const float gv = load(g[i]);
        o[i] = store<T>(round_to<T>(gv / (1.f + exp_any(-gv))) * load(u[i]));
    }
}

// out [T, I] = silu_mul_row of each row of gate_up [T, 2I] (gate, then up).
template <typename T>
static void silu_mul(const T* gate_up, T* out, long rows, long inter, int threads) {
    #pragma omp parallel for num_threads(threads) if(rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (long row = 0; row < rows; ++row)
        silu_mul_row(gate_up + row * 2 * inter, gate_up + row * 2 * inter + inter,
                     out + row * inter, inter);
}
