// The avx512bf16 target: the avx512 target's instructions with AVX512-BF16, AVX512-VNNI and
// AVX512-VBMI (Zen 4 and later, Sapphire Rapids and later without AMX's tiles): bf16_dot.h's
// bodies, and packed bf16 tiles multiplied by its vector unit.
#pragma once
#include <cstdint>
#include "avx512_common.h"
#include "bf16_dot.h"

// What multiplies packed bf16 tiles (isa.TILE_UNITS' codes): 1, the vector unit.
static inline int best_tile_unit() { return 1; }

static inline int tiles_multiply(Native, const uint16_t* x, const uint16_t* packed, uint16_t* out,
                                 long M, long K, long N, int, int threads) {
    vector_linear(x, packed, out, M, K, N, threads);
    return 0;
}

template <class Stripes>
static inline int quant_tiles_multiply(Native, const uint16_t* x, const Stripes& stripes,
                                       uint16_t* out, long M, long K, long N, long ldo,
                                       int threads) {
    quant_vector_linear(x, stripes, out, M, K, N, ldo, threads);
    return 0;
}
