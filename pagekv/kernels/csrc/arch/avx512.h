// The avx512 target: AVX-512 F, BW, DQ, VL, CD (x86-64-v4), without AVX512-BF16, VNNI or
// VBMI: avx512_common.h's VF and decode bodies, quant_dot.h's quants regrouped by dword and
// byte shuffles and multiplied by vpmaddubsw. No unit multiplies bf16 tiles.
#pragma once
#include "avx512_common.h"

// 128-bit lane k: the 16 quant bytes of columns 0-15 at k -> lane c: column c's 4 bytes.
static inline __m512i quads_of(__m512i rows) {
    const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i bytes = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(dwords, rows), bytes);
}
template <int BITS>
static inline void load_quads(const uint8_t* rows, VD& u0, VD& u1) {
    if constexpr (BITS < 8) {  // 4 rows of 16 bytes of nibbles (and their high bits)
        __m512i lo, hi;
        quant_lanes<BITS>(rows, lo, hi);
        u0 = {quads_of(lo)};
        u1 = {quads_of(hi)};
    } else {  // 4 rows of 32 bytes: 128-bit lanes k0 c0-15, k0 c16-31, k1 c0-15, ...
        const __m512i a = _mm512_loadu_si512(rows), b = _mm512_loadu_si512(rows + 64);
        u0 = {quads_of(_mm512_shuffle_i64x2(a, b, 0x88))};
        u1 = {quads_of(_mm512_shuffle_i64x2(a, b, 0xDD))};
    }
}
template <int BITS>
static constexpr int DOT_BIAS = BITS == 8 ? 128 : 0;
template <int BITS>
static inline VD dot4(VD acc, VD u, VD x) {
    __m512i a = u.v, b = x.v;
    if constexpr (BITS == 8) {
        const __m512i w = _mm512_xor_si512(u.v, _mm512_set1_epi8(char(0x80)));
        a = _mm512_abs_epi8(w);
        b = _mm512_mask_sub_epi8(x.v, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x.v);
    }
    const __m512i pairs = _mm512_maddubs_epi16(a, b);
    return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}

static inline int best_tile_unit() { return 0; }
