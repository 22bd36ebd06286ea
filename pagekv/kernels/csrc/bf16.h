// bfloat16 helpers for the tile kernels (fused_ops.cpp matmuls, prefill.cpp attention):
// float32 -> bfloat16 rounding for any AVX-512 target (the vector layer's); the tile permission
// and one tile configuration where the target has AMX; which unit multiplies tiles.
#pragma once
#include <cstdint>
#include "simd.h"
#include "vec.h"
#if defined(__AVX512F__)
// 16 float32 -> bfloat16, rounded to nearest even as torch does; NaN stays NaN.
static inline void store_bf16x16(uint16_t* p, __m512 f) { VF{f}.store(p); }
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
