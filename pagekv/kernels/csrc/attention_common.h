// Shared by the attention kernels (decode.cpp, prefill.cpp): the vector layer, the head sizes
// they are built for (with_head_dim), bfloat16 widening of one number, and exp for the softmaxes on 16 float32 lanes where the target has
// AVX-512 (the same operations as vec.h's exp_nonpositive, written with masks).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "vec.h"

// f(std::integral_constant<int, D>{}) for D == head_dim, one of PAGEKV_HEAD_DIMS: each kernel
// is a template on D, and this is where a call picks its instance. 0, or -1 (f not called)
// for another head size.
template <typename F>
static inline int with_head_dim(int head_dim, F&& f) {
    switch (head_dim) {
#define PAGEKV_HEAD_DIM_CASE(D)              \
    case D:                                  \
        f(std::integral_constant<int, D>{}); \
        return 0;
        PAGEKV_HEAD_DIMS(PAGEKV_HEAD_DIM_CASE)
#undef PAGEKV_HEAD_DIM_CASE
        default:
            return -1;
    }
}

static inline bool takes_head_dim(int head_dim) {
    return with_head_dim(head_dim, [](auto) {}) == 0;
}

static inline float load(float x) { return x; }
static inline float load(uint16_t x) { return bf16_to_f32(x); }

// exp(x) for x <= 0 on 16 float32 lanes and a mask of the first n lanes.
#if defined(__AVX512F__)
#include "simd.h"
// The decode kernel's exp_nonpositive on 16 lanes, the same operations in the same order. (GCC
// leaves a scalar loop of it unvectorized: it calls floorf per element, which made the softmax a
// third of the decode kernel's time.)
static inline __m512 exp_nonpositive16(__m512 x) {
    const auto c = [](float v) { return _mm512_set1_ps(v); };
    x = _mm512_max_ps(x, c(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, c(1.44269504f)), c(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, c(0.693359375f))),
                                   _mm512_mul_ps(n, c(2.12194440e-4f)));
    __m512 p = c(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), c(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), c(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), c(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), c(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), c(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), c(1.f));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

static inline __mmask16 first_lanes(int n) {  // lanes [0, min(n, 16))
    return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}
#endif
