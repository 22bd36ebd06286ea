// The bf16 tile kernels' operands and products (attention_tiles.h runs attention on them):
// K and V of a sequence packed once into the layouts the tiles read, and the two products,
// scores (Q.K) and P.V, on either unit: AMX tiles where the CPU has them and Linux grants
// them, else AVX512-BF16 dot products doing the same tile products a row of sums at a time.
// Only where the target has AVX512-BF16 (PAGEKV_BF16_TILES); head size 64 only.
#pragma once
#include <cstdint>
#include <cstring>
#include "attention_common.h"
#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEKV_BF16_TILES 1
#else
#define PAGEKV_BF16_TILES 0
#endif

#if PAGEKV_BF16_TILES
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_TILES 1
#else
#define HAVE_TILES 0
#endif

namespace tiles {
static const int D = 64;          // head dim: two 32-wide halves of a query tile
static const int KEY_TILE = 16;   // keys per score tile (its columns)
static const int PAD = 64;        // keys are packed to a multiple of this (4 score tiles)

// Which unit multiplies the packed operands (best_tile_unit's codes): the best one here, or
// the one prefill_kernel_backend chose.
static int& backend_choice() { static int choice = best_tile_unit(); return choice; }
static inline bool tiles_on() { return HAVE_TILES && backend_choice() == 2; }

// Entered and left once per thread of a parallel region that may use the tiles.
static inline void tiles_begin() {
#if HAVE_TILES
    if (tiles_on()) configure_tiles();
#endif
}
static inline void tiles_end() {
#if HAVE_TILES
    if (tiles_on()) _tile_release();
#endif
}

// 16 x 16 transpose of 32-bit lanes: row j of the result is lane j of r[0..15].
static inline void transpose16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // 128-bit lane L of r[i + m]: lane 4L + m of rows i..i+3
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int m = 0; m < 4; ++m) {  // gather the four 128-bit lanes L of rows 0-3, ..., 12-15
        t[m] = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x88);        // L0, L2 of rows 0-7
        t[4 + m] = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xDD);    // L1, L3
        t[8 + m] = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x88);
        t[12 + m] = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xDD);
    }
    for (int m = 0; m < 4; ++m) {
        r[m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0x88);            // lane 0 + m
        r[8 + m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0xDD);        // lane 8 + m
        r[4 + m] = _mm512_shuffle_i32x4(t[4 + m], t[12 + m], 0x88);   // lane 4 + m
        r[12 + m] = _mm512_shuffle_i32x4(t[4 + m], t[12 + m], 0xDD);  // lane 12 + m
    }
}

// Keys of kv head h as score-tile operands: tile (block kb, half dh) holds, in row r, the
// pairs (d = 32 dh + 2r, +1) of keys 16 kb .. 16 kb + 15: [S/16][2][16 rows][16 keys x 2].
// Values as P.V operands: tile (pair block kp, quarter c) holds in row r keys 32 kp + 2r, +1
// of columns 16 c .. 16 c + 15, interleaved: [S/32][4][16 rows][16 cols x 2]. Positions past
// the sequence are zeros. 32 positions at a time: a key tile is a transpose of 16 rows' pairs,
// a value row two rows' columns interleaved.
static void pack_kv(const uint16_t* kc, const uint16_t* vc, const int32_t* table, int seq_len,
                    int padded, int block_size, long token_stride, int h, uint16_t* kp,
                    uint16_t* vp) {
    alignas(64) static const uint16_t zeros[D] = {};
    __m512i even_lo, even_hi;  // permutex2var indices: a[i], b[i] for i in [0, 16) / [16, 32)
    {
        alignas(64) uint16_t lo[32], hi[32];
        for (int i = 0; i < 16; ++i) {
            lo[2 * i] = uint16_t(i), lo[2 * i + 1] = uint16_t(32 + i);
            hi[2 * i] = uint16_t(16 + i), hi[2 * i + 1] = uint16_t(48 + i);
        }
        even_lo = _mm512_load_si512(lo);
        even_hi = _mm512_load_si512(hi);
    }
    const uint16_t* krow[32];
    const uint16_t* vrow[32];
    for (int first = 0; first < padded; first += 32) {
        // the next 32 rows, requested now into L2: blocks lie anywhere in the pool, so the
        // hardware prefetcher loses the stream at every block boundary; into L1 they would hold
        // its few miss buffers and slow the stream
        for (int t = first + 32; t < first + 64 && t < seq_len; ++t) {
            const long slot = long(table[t / block_size]) * block_size + t % block_size;
            const char* k = (const char*)(kc + slot * token_stride + long(h) * D);
            const char* v = (const char*)(vc + slot * token_stride + long(h) * D);
            _mm_prefetch(k, _MM_HINT_T1);
            _mm_prefetch(k + 64, _MM_HINT_T1);
            _mm_prefetch(v, _MM_HINT_T1);
            _mm_prefetch(v + 64, _MM_HINT_T1);
        }
        for (int i = 0; i < 32; ++i) {
            const int t = first + i;
            krow[i] = vrow[i] = zeros;
            if (t < seq_len) {  // (the table has no entry past the sequence)
                const long slot = long(table[t / block_size]) * block_size + t % block_size;
                krow[i] = kc + slot * token_stride + long(h) * D;
                vrow[i] = vc + slot * token_stride + long(h) * D;
            }
        }
        for (int half = 0; half < 2; ++half)  // keys first .. +15, then +16 .. +31
            for (int dh = 0; dh < 2; ++dh) {
                __m512i r[16];
                for (int c = 0; c < 16; ++c)
                    r[c] = _mm512_loadu_si512(krow[16 * half + c] + 32 * dh);
                transpose16x16(r);
                uint16_t* tile = kp + long(first / 16 + half) * 1024 + dh * 512;
                for (int row = 0; row < 16; ++row) _mm512_storeu_si512(tile + row * 32, r[row]);
            }
        uint16_t* tiles = vp + long(first / 32) * 2048;
        for (int row = 0; row < 16; ++row) {
            const uint16_t* a = vrow[2 * row];
            const uint16_t* b = vrow[2 * row + 1];
            for (int dh = 0; dh < 2; ++dh) {  // columns 32 dh .. 32 dh + 31: quarters 2dh, +1
                const __m512i va = _mm512_loadu_si512(a + 32 * dh);
                const __m512i vb = _mm512_loadu_si512(b + 32 * dh);
                _mm512_storeu_si512(tiles + (2 * dh) * 512 + row * 32,
                                    _mm512_permutex2var_epi16(va, even_lo, vb));
                _mm512_storeu_si512(tiles + (2 * dh + 1) * 512 + row * 32,
                                    _mm512_permutex2var_epi16(va, even_hi, vb));
            }
        }
    }
}

// The two products of attend_rows, on either unit. Scores: rows x keys float32 into `scores`
// (row stride `width`), at least the first `keys` of each row. P.V: every row's sum over the
// first `pairs` 32-key blocks of probs x values into acc (rows past `rows` may be skipped).
#if HAVE_TILES
static void scores_tiles(const uint16_t* qbuf, int keys, const uint16_t* kp, float* scores,
                         int width) {
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
}

static void pv_tiles(const uint16_t* probs, int pairs, const uint16_t* vp, int width,
                     float (*acc)[D]) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int kb = 0; kb < pairs; ++kb) {
        const uint16_t* t = vp + long(kb) * 2048;
        _tile_loadd(4, probs + kb * 32, width * 2);
        _tile_loadd(6, t, 64);        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, t + 512, 64);  _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, t + 1024, 64); _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, t + 1536, 64); _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, acc[0], D * 4);
    _tile_stored(1, acc[0] + 16, D * 4);
    _tile_stored(2, acc[0] + 32, D * 4);
    _tile_stored(3, acc[0] + 48, D * 4);
}
#else
static void scores_tiles(const uint16_t*, int, const uint16_t*, float*, int) {}
static void pv_tiles(const uint16_t*, int, const uint16_t*, int, float (*)[D]) {}
#endif

static inline __m512bh pair_of(const uint16_t* x) {  // x[0], x[1] in each 32-bit lane
    int32_t bits;
    std::memcpy(&bits, x, 4);
    return (__m512bh)_mm512_set1_epi32(bits);
}

// A tile product as vector ones: a key tile row (16 keys x one pair of dims) meets the same
// pair of every query row, 16 keys at a time, 16 rows of sums in registers.
static void scores_vector(const uint16_t* qbuf, int keys, const uint16_t* kp, float* scores,
                          int width) {
    for (int kb = 0; kb * KEY_TILE < keys; ++kb) {
        const uint16_t* t = kp + long(kb) * 1024;  // both halves: pair p of d at row p
        __m512 s[16];
        for (int m = 0; m < 16; ++m) s[m] = _mm512_setzero_ps();
        for (int p = 0; p < D / 2; ++p) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(t + p * 32);
            for (int m = 0; m < 16; ++m)
                s[m] = _mm512_dpbf16_ps(s[m], pair_of(qbuf + m * D + 2 * p), k);
        }
        for (int m = 0; m < 16; ++m)
            _mm512_storeu_ps(scores + long(m) * width + kb * KEY_TILE, s[m]);
    }
}

// P.V four rows at a time: a value tile row (two keys x 16 columns) meets those keys'
// probabilities in each row; all 64 columns of four rows in registers.
static void pv_vector(const uint16_t* probs, int rows, int pairs, const uint16_t* vp, int width,
                      float (*acc)[D]) {
    for (int m0 = 0; m0 < rows; m0 += 4) {
        __m512 a[4][4];
        for (int m = 0; m < 4; ++m)
            for (int c = 0; c < 4; ++c) a[m][c] = _mm512_setzero_ps();
        for (int kb = 0; kb < pairs; ++kb) {
            const uint16_t* t = vp + long(kb) * 2048;
            for (int r = 0; r < 16; ++r) {
                __m512bh v[4];
                for (int c = 0; c < 4; ++c)
                    v[c] = (__m512bh)_mm512_loadu_si512(t + c * 512 + r * 32);
                for (int m = 0; m < 4; ++m) {
                    const __m512bh pm = pair_of(probs + long(m0 + m) * width + kb * 32 + 2 * r);
                    for (int c = 0; c < 4; ++c) a[m][c] = _mm512_dpbf16_ps(a[m][c], pm, v[c]);
                }
            }
        }
        for (int m = 0; m < 4; ++m)
            for (int c = 0; c < 4; ++c) _mm512_store_ps(acc[m0 + m] + 16 * c, a[m][c]);
    }
}
}  // namespace tiles
#endif  // PAGEKV_BF16_TILES
