// The amx target: the avx512bf16 target's instructions and AMX's tiles (AMX-TILE, AMX-BF16:
// Sapphire Rapids and later). Packed bf16 tiles are multiplied by AMX where Linux grants this
// process the tile state, else by the vector unit (bf16_dot.h).
#pragma once
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <omp.h>
#include <cstdint>
#include <cstring>
#include <vector>
#include "avx512_common.h"
#include "bf16_dot.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "arch/amx.h: build with the amx target's flags (pagekv/kernels/isa.py)"
#endif

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

// AMX multiplies two 16-row blocks a pass (up to 32 rows at memory speed; spreading the
// prefetch over every pass, not only the first, keeps larger batches fed too), the weight's
// tiles streamed as the vector unit streams them (bf16_dot.h).

// Row blocks b0 (and b0 + 1 if TWO) of x against one 32-column stripe (tiles b and b + KB*512)
// into out (row stride ldo): pass `pass` of `passes` over this stripe, which prefetches its
// share of the next stripe.
template <bool TWO>
static inline void amx_block(const uint16_t* a0, const uint16_t* a1, const uint16_t* b,
                             const uint16_t* next, uint16_t* out, long rows0, long rows1,
                             long K, long ldo, float (*c)[16][16], long pass, long passes) {
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
            uint16_t* o = out + (h * 16 + r) * ldo;
            store_bf16x16(o, _mm512_load_ps(c[2 * h][r]));
            store_bf16x16(o + 16, _mm512_load_ps(c[2 * h + 1][r]));
        }
}

// x's 16-row blocks as tiles load them (16 rows each): a partial last block is copied into
// 16 rows, zeros after the real ones.
struct RowBlocks {
    const uint16_t* x;
    long M, K, full, blocks;
    std::vector<uint16_t> tail;
    RowBlocks(const uint16_t* x, long M, long K)
        : x(x), M(M), K(K), full(M / 16), blocks((M + 15) / 16), tail(M % 16 ? 16 * K : 0, 0) {
        if (M % 16) std::memcpy(tail.data(), x + full * 16 * K, (M % 16) * K * 2);
    }
    const uint16_t* rows(long blk) const { return blk < full ? x + blk * 16 * K : tail.data(); }
    long count(long blk) const { return blk < full ? 16 : M % 16; }
};

// Row blocks [b0, b1) of x against one stripe's tiles `b`, two blocks a pass, into out (row
// stride ldo); `next`: the stripe after it, prefetched over these passes (null for none).
static void amx_stripe(const RowBlocks& xb, long b0, long b1, const uint16_t* b,
                       const uint16_t* next, uint16_t* out, long K, long ldo,
                       float (*c)[16][16]) {
    const long passes = (b1 - b0 + 1) / 2;
    for (long blk = b0; blk < b1; blk += 2) {
        uint16_t* o = out + blk * 16 * ldo;
        if (blk + 1 < b1)
            amx_block<true>(xb.rows(blk), xb.rows(blk + 1), b, next, o, xb.count(blk),
                            xb.count(blk + 1), K, ldo, c, (blk - b0) / 2, passes);
        else
            amx_block<false>(xb.rows(blk), nullptr, b, next, o, xb.count(blk), 0, K, ldo, c,
                             (blk - b0) / 2, passes);
    }
}

static void amx_linear(const void* x, const void* packed, void* out, long M, long K, long N,
                       int threads) {
    const uint16_t* ps = (const uint16_t*)packed;
    const RowBlocks xb((const uint16_t*)x, M, K);
    const long KB = K / 32, stripes = N / 32;
    #pragma omp parallel num_threads(threads)
    {
        configure_tiles();
        alignas(64) float c[4][16][16];
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long s0 = stripes * t / nt, s1 = stripes * (t + 1) / nt;
        for (long s = s0; s < s1; ++s) {
            const uint16_t* b = ps + s * 2 * KB * 512;
            const uint16_t* next = s + 1 < s1 ? b + 2 * KB * 512 : nullptr;
            amx_stripe(xb, 0, xb.blocks, b, next, (uint16_t*)out + s * 32, K, N, c);
        }
        _tile_release();
    }
}

static const long AMX_ROWS_IN_L2_BYTES = 1L << 20;  // a chunk's rows of x (bf16 bytes)

// quant_vector_linear's work on AMX: the rows in chunks whose x stays in L2, each stripe
// converted once per chunk and multiplied as amx_linear multiplies a dense bf16 weight's tiles.
template <class Stripes>
static void quant_amx_linear(const uint16_t* x, const Stripes& stripes, uint16_t* out, long M,
                             long K, long N, long ldo, int threads) {
    const RowBlocks xb(x, M, K);
    const long chunk = std::max(2L, AMX_ROWS_IN_L2_BYTES / (16 * K * 2) / 2 * 2);  // blocks
    #pragma omp parallel num_threads(threads)
    {
        configure_tiles();
        alignas(64) float c[4][16][16];
        uint16_t* tiles = scratch_tiles(K);
        const long count = N / TILE_STRIPE, t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long s0 = count * t / nt, s1 = count * (t + 1) / nt;
        for (long b0 = 0; b0 < xb.blocks; b0 += chunk)
            for (long s = s0; s < s1; ++s) {
                stripe_to_tiles(stripes.at(s), K, tiles);
                amx_stripe(xb, b0, std::min(xb.blocks, b0 + chunk), tiles, nullptr,
                           out + s * TILE_STRIPE, K, ldo, c);
            }
        _tile_release();
    }
}

// What multiplies packed bf16 tiles (isa.TILE_UNITS' codes): 2, AMX, where Linux grants it;
// else 1, the vector unit.
static inline int best_tile_unit() { return amx_permitted() ? 2 : 1; }

static inline int tiles_multiply(Native, const uint16_t* x, const uint16_t* packed, uint16_t* out,
                                 long M, long K, long N, int unit, int threads) {
    if (unit == 2) amx_linear(x, packed, out, M, K, N, threads);
    else vector_linear(x, packed, out, M, K, N, threads);
    return 0;
}

template <class Stripes>
static inline int quant_tiles_multiply(Native, const uint16_t* x, const Stripes& stripes,
                                       uint16_t* out, long M, long K, long N, long ldo,
                                       int threads) {
    if (best_tile_unit() == 2) quant_amx_linear(x, stripes, out, M, K, N, ldo, threads);
    else quant_vector_linear(x, stripes, out, M, K, N, ldo, threads);
    return 0;
}
