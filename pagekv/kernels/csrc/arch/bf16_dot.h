// What the targets with AVX512-BF16 (avx512bf16, amx) share: AVX512-VBMI's byte permutes and
// AVX512-VNNI's byte dot products for quant_dot.h, vdpbf16ps for the decode kernel's bfloat16
// rows and for the vector unit that multiplies packed bf16 tiles (dense_tiles.h), the
// conversion of quantized stripes into such tiles, and the roofline's bf16 peak.
#pragma once
#include <omp.h>
#include <cstdint>
#include <cstring>
#include <vector>
#include "avx512_common.h"

#if !defined(__AVX512BF16__) || !defined(__AVX512VNNI__) || !defined(__AVX512VBMI__)
#error "arch/bf16_dot.h: build with the avx512bf16 or amx target's flags (pagekv/kernels/isa.py)"
#endif

// quant_dot.h's quads: one byte permute regroups them.
// Byte 4c + k of a quad <- byte ROW * k + FIRST + c of its rows: one byte permute regroups it.
template <int ROW, int FIRST>
struct QuadIndex {
    alignas(64) uint8_t bytes[64];
    constexpr QuadIndex() : bytes() {
        for (int i = 0; i < 64; ++i) bytes[i] = uint8_t(ROW * (i % 4) + FIRST + i / 4);
    }
};
template <int ROW, int FIRST>
static inline __m512i quad_index() {
    static constexpr QuadIndex<ROW, FIRST> index;
    return _mm512_load_si512(index.bytes);
}
template <int BITS>
static inline void load_quads(const uint8_t* rows, VD& u0, VD& u1) {
    if constexpr (BITS < 8) {  // 4 rows' quants, lane k row k's (k, c) at 16k + c
        __m512i lo, hi;
        quant_lanes<BITS>(rows, lo, hi);
        const __m512i index = quad_index<16, 0>();
        u0 = {_mm512_permutexvar_epi8(index, lo)};
        u1 = {_mm512_permutexvar_epi8(index, hi)};
    } else {  // 4 rows of 32 bytes: (k, c) at 32k + c of the 128 bytes a, b
        const __m512i a = _mm512_loadu_si512(rows), b = _mm512_loadu_si512(rows + 64);
        u0 = {_mm512_permutex2var_epi8(a, quad_index<32, 0>(), b)};
        u1 = {_mm512_permutex2var_epi8(a, quad_index<32, 16>(), b)};
    }
}
template <int BITS>
static constexpr int DOT_BIAS = 0;
template <int BITS>
static inline VD dot4(VD acc, VD u, VD x) {
    return {_mm512_dpbusd_epi32(acc.v, u.v, x.v)};
}

// The decode kernel's bfloat16 rows: products of pairs in hardware (vdpbf16ps), float32
// accumulation; and their scores for many query rows at once (scores16_pairs).
template <int D>
static inline __m512 row_dot(Native, const uint16_t* q, const uint16_t* k) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < D / 32; ++i)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + 32 * i),
                               (__m512bh)_mm512_loadu_si512(k + 32 * i));
    return acc;
}

// In place: r[j] becomes column j of the 16 x 16 matrix of 32-bit words whose rows were r[0..15].
static inline void transpose_words16(__m512i* r) {
    __m512i t[16], u[16];
    for (int k = 0; k < 8; ++k) {  // per 128-bit lane L: [r2k[4L], r2k+1[4L], r2k[4L+1], ...]
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; ++k) {  // u[4k + c], lane L: rows 4k .. 4k+3 of column 4L + c
        u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int c = 0; c < 4; ++c) {  // column 4L + c: lane k of it is lane L of u[4k + c]
        const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
        const __m512i b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
    }
}

// scores16 for many bfloat16 query rows (a drafted decode's tokens x heads): the 16 key rows
// are transposed once, as pairs of dims (kp[i], lane t: dims 2i and 2i+1 of key t), so each
// query row's 16 scores are D/2 vdpbf16ps with the query's pair i broadcast: no horizontal sums,
// the transpose shared by all rows. For a few rows (one token's heads) the transpose costs more
// than it saves, even in cache, so below PAIRS_MIN_ROWS rows this declines (false) and the
// caller takes scores16. A score's sum runs over even pairs and odd pairs in order, then adds
// the two.
static const int PAIRS_MIN_ROWS = 6;
template <int D>
static inline bool scores16_pairs(Native, const uint16_t* q, const uint16_t* const* rows,
                                  int count, int num_rows, float scale, float* s, long stride) {
    static_assert(D % 32 == 0, "head dim: whole 16-pair words");
    if (num_rows < PAIRS_MIN_ROWS) return false;
    __m512i kp[D / 2];
    for (int half = 0; half < D / 32; ++half) {  // pairs [16 half, 16 half + 16)
        __m512i* block = kp + 16 * half;
        for (int t = 0; t < 16; ++t)
            block[t] = t < count ? _mm512_loadu_si512(rows[t] + 32 * half)
                                 : _mm512_setzero_si512();
        transpose_words16(block);
    }
    const __mmask16 valid = __mmask16((1u << count) - 1);
    const __m512 vscale = _mm512_set1_ps(scale);
    const uint32_t* qp = (const uint32_t*)q;  // query pairs
    int r = 0;
    for (; r + 2 <= num_rows; r += 2) {  // two rows at a time: four independent sums
        const uint32_t* a = qp + long(r) * (D / 2);
        const uint32_t* b = a + D / 2;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
        for (int i = 0; i < D / 2; i += 2) {
            const __m512bh k0 = (__m512bh)kp[i], k1 = (__m512bh)kp[i + 1];
            a0 = _mm512_dpbf16_ps(a0, k0, (__m512bh)_mm512_set1_epi32(int(a[i])));
            a1 = _mm512_dpbf16_ps(a1, k1, (__m512bh)_mm512_set1_epi32(int(a[i + 1])));
            b0 = _mm512_dpbf16_ps(b0, k0, (__m512bh)_mm512_set1_epi32(int(b[i])));
            b1 = _mm512_dpbf16_ps(b1, k1, (__m512bh)_mm512_set1_epi32(int(b[i + 1])));
        }
        _mm512_mask_storeu_ps(s + r * stride, valid, _mm512_mul_ps(_mm512_add_ps(a0, a1), vscale));
        _mm512_mask_storeu_ps(s + (r + 1) * stride, valid,
                              _mm512_mul_ps(_mm512_add_ps(b0, b1), vscale));
    }
    for (; r < num_rows; ++r) {
        const uint32_t* a = qp + long(r) * (D / 2);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (int i = 0; i < D / 2; i += 2) {
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)kp[i], (__m512bh)_mm512_set1_epi32(int(a[i])));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)kp[i + 1],
                                  (__m512bh)_mm512_set1_epi32(int(a[i + 1])));
        }
        _mm512_mask_storeu_ps(s + r * stride, valid, _mm512_mul_ps(_mm512_add_ps(a0, a1), vscale));
    }
    return true;
}

// The vector unit that multiplies packed bf16 tiles (dense_tiles.h's layout: [N/16][K/32]
// tiles of 16 k-pairs x 16 columns x 2): up to VECTOR_ROWS rows x 32 columns of sums in
// registers, a tile row of the weight loaded once for all of them, vdpbf16ps. Each thread owns
// a range of 32-column stripes and streams their tiles once, prefetching the next stripe into
// L2 while it multiplies this one, spread evenly over all its passes over the stripe.

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
        store_bf16x16(out + m * N, acc[m][0]);
        store_bf16x16(out + m * N + 16, acc[m][1]);
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

// GGUF weights against a batch of bfloat16 rows (quant_matmul.h): each 32-column stripe
// dequantized once into the bf16 tiles a dense bf16 weight is packed in (in this thread's
// scratch, L2-sized), then multiplied as that weight is. Every weight is the float32 the
// stripes give, rounded to the nearest bf16 (the dense bf16 path's weight).
static const int TILE_STRIPE = 32;  // columns: two tiles of 16
static_assert(2 * VF::W == TILE_STRIPE, "a quantized stripe converts into one stripe of tiles");

// Lanes 2i and 2i + 1 of a tile row: column i's bf16 at the even k, then at the odd one.
alignas(64) static const uint16_t PAIR_LANES[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                                    21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                    11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

static inline void store_pairs(uint16_t* p, const VF& even, const VF& odd) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd.v, even.v);  // low: even, high: odd
    _mm512_storeu_si512(p, _mm512_permutexvar_epi16(_mm512_load_si512(PAIR_LANES), both));
}

// This thread's room for one stripe's tiles.
static inline uint16_t* scratch_tiles(long K) {
    static thread_local std::vector<uint16_t> buffer;
    if (long(buffer.size()) < 2 * K * 16) buffer.resize(2 * K * 16);
    return buffer.data();
}

// One quantized stripe (quant.h's QuantStripe) -> tiles [2][K / 32][512] (the columns 0-15
// and 16-31 of tiles_pack's).
template <class Stripe>
static void stripe_to_tiles(const Stripe& src, long K, uint16_t* tiles) {
    uint16_t* right = tiles + K / 32 * 512;
    for (long k0 = 0; k0 < K; k0 += Stripe::GROUP) {
        const auto group = src.group(k0);
        for (int kk = 0; kk < Stripe::GROUP; kk += 2) {
            VF e0, e1, o0, o1;
            group.weights(kk, e0, e1);
            group.weights(kk + 1, o0, o1);
            const long k = k0 + kk, at = k / 32 * 512 + k % 32 / 2 * 32;
            store_pairs(tiles + at, e0, o0);
            store_pairs(right + at, e1, o1);
        }
    }
}

// out [M, N] (row stride ldo) = x @ `stripes` (quant.h's QuantStripes) by the vector unit.
template <class Stripes>
static void quant_vector_linear(const uint16_t* x, const Stripes& stripes, uint16_t* out, long M,
                                long K, long N, long ldo, int threads) {
    const long count = N / TILE_STRIPE, passes = (M + VECTOR_ROWS - 1) / VECTOR_ROWS;
    #pragma omp parallel num_threads(threads)
    {
        uint16_t* tiles = scratch_tiles(K);
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (long s = count * t / nt; s < count * (t + 1) / nt; ++s) {
            stripe_to_tiles(stripes.at(s), K, tiles);
            for (long pass = 0; pass < passes; ++pass) {
                const long m0 = M * pass / passes, rows = M * (pass + 1) / passes - m0;
                vector_rows<VECTOR_ROWS>(x + m0 * K, rows, tiles, nullptr,
                                         out + m0 * ldo + s * TILE_STRIPE, K, ldo, pass, passes);
            }
        }
    }
}

// roofline.cpp's bf16 peak: CHAINS independent chains of vdpbf16ps on each thread.
template <int CHAINS>
static double bf16_dot_peak(Native, long iters, int threads) {
    double total = 0;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m512 acc[CHAINS];
        for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_setzero_ps();
        const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3A833A83);  // 0.001, twice
        for (long n = 0; n < iters; ++n)
            for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, a);
        for (int i = 0; i < CHAINS; ++i) total += _mm512_reduce_add_ps(acc[i]);
    }
    return total;
}
