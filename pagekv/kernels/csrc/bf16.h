// bfloat16 helpers for the tile kernels (fused_ops.cpp matmuls, prefill.cpp attention):
// float32 -> bfloat16 rounding for any AVX-512 target; the tile permission and one tile
// configuration where the target has AMX; which unit multiplies tiles.
#pragma once
#if defined(__AVX512F__)
#include <cstdint>
#include "simd.h"

// 16 float32 -> bfloat16, rounded to nearest even as torch does; NaN stays NaN.
static inline __m256i round_bf16x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7FC0));
    return _mm512_maskz_cvtepi32_epi16(__mmask16(0xFFFF), r);  // maskz: no undefined source
}
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

static bool amx_permitted() {  // Linux grants the tile state on request, once per process
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return ok;
}

// Every tile register 16 rows x 64 bytes: 16 x 32 bf16 operands, 16 x 16 float32 sums.
static inline void configure_tiles() {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}
#endif
#if defined(__AVX512F__)
// What multiplies packed bf16 tiles here (the codes of TILE_UNITS): 2, AMX (built for it and
// granted by Linux); 1, AVX512-BF16 vector dot products reading the same tiles.
static inline int best_tile_unit() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return amx_permitted() ? 2 : 1;
#else
    return 1;
#endif
}
#endif
