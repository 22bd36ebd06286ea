// The avx2 target: AVX2 + FMA (x86-64-v3). VF is one __m256 (8 float32 lanes; F16C widens
// fp16), VD one __m256i of int32 lanes whose byte dot products are vpmaddubsw's; the decode
// kernel's scores take eight key rows at a time. No unit multiplies bf16 tiles.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include "../bf16.h"
#include "target.h"
#include "x86_intrinsics.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "arch/avx2.h: build with the avx2 target's flags (pagekv/kernels/isa.py)"
#endif

struct VF {
    static constexpr int W = 8;
    static constexpr int REGS = 16;
    __m256 v;
    static VF zero() { return {_mm256_setzero_ps()}; }
    static VF set1(float x) { return {_mm256_set1_ps(x)}; }
    static VF load(const float* p) { return {_mm256_loadu_ps(p)}; }
    static VF load(const uint16_t* p) {
        const __m128i raw = _mm_loadu_si128((const __m128i*)p);
        return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
    }
    static VF load_half(const uint8_t* p) {  // F16C: part of the AVX2 target
        return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))};
    }
    static VF load(const int8_t* p) {
        return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)))};
    }
    static VF load(const fp8e4m3* p) {  // as e4m3_to_f32: fp16 bits, widened, times 256
        const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
        const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
        const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
        return {_mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(mag, sign)), _mm256_set1_ps(256.f))};
    }
    static __m256i first_mask(int n) {
        return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    }
    // Masked moves only for a part of a vector: AMD's masked stores are microcoded, many
    // times slower than a plain store.
    static VF load_first(const float* p, int n, float fill = 0.f) {
        if (n >= W) return load(p);
        const __m256i m = first_mask(n);
        return {_mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m),
                                 _mm256_castsi256_ps(m))};
    }
    void store(float* p) const { _mm256_storeu_ps(p, v); }
    void store_first(float* p, int n) const {
        if (n >= W) return store(p);
        _mm256_maskstore_ps(p, first_mask(n), v);
    }
    // The value from here on in a register: a load the compiler would otherwise fold into
    // each instruction that uses the value (a load per use, where the loop is load-bound).
    void in_register() { __asm__("" : "+x"(v)); }
    bool any_nan() const { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
    int first_equal(float x) const {  // the first lane equal to x, or -1
        const int m = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(x), _CMP_EQ_OQ));
        return m == 0 ? -1 : __builtin_ctz(unsigned(m));
    }
    VF keep_first(int n) const { return {_mm256_and_ps(v, _mm256_castsi256_ps(first_mask(n)))}; }
    __attribute__((always_inline)) void store(uint16_t* p) const {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
        // 8 x 32-bit -> 8 x 16-bit: every value fits, so the saturating pack is exact
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i*)p, packed);
    }
    float reduce_add() const {
        const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
    }
    float reduce_max() const {
        const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
    }
};
static inline VF operator+(VF a, VF b) { return {_mm256_add_ps(a.v, b.v)}; }
static inline VF operator-(VF a, VF b) { return {_mm256_sub_ps(a.v, b.v)}; }
static inline VF operator*(VF a, VF b) { return {_mm256_mul_ps(a.v, b.v)}; }
static inline VF fma(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
static inline VF max(VF a, VF b) { return {_mm256_max_ps(a.v, b.v)}; }
static inline VF floor(VF a) { return {_mm256_floor_ps(a.v)}; }
static inline VF pow2(VF n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
}
template <int BITS>
static inline void load_quants(const uint8_t* row, VF& q0, VF& q1) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)row));
    if constexpr (BITS == 8) {
        q0 = {_mm256_cvtepi32_ps(bytes)};
        q1 = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(row + 8))))};
    } else {
        __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi32(15));
        __m256i hi = _mm256_srli_epi32(bytes, 4);
        if constexpr (BITS > 4) {
            constexpr int HB = BITS - 4;
            uint32_t bits = 0;
            std::memcpy(&bits, row + 8, 16 * HB / 8);
            const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                      _mm256_set1_epi32(HB));
            const __m256i mask = _mm256_set1_epi32((1 << HB) - 1);
            const __m256i h0 = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32(int(bits)), shifts), mask);
            const __m256i h1 = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32(int(bits >> (8 * HB))), shifts), mask);
            lo = _mm256_or_si256(lo, _mm256_slli_epi32(h0, 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi32(h1, 4));
        }
        q0 = {_mm256_cvtepi32_ps(lo)};
        q1 = {_mm256_cvtepi32_ps(hi)};
    }
}

// quant_dot.h's int32 lanes: 4 unsigned bytes times 4 signed ones per lane by vpmaddubsw.
struct VD {
    __m256i v;
    static VD zero() { return {_mm256_setzero_si256()}; }
    static VD set1(int32_t x) { return {_mm256_set1_epi32(x)}; }
    VF to_float() const { return {_mm256_cvtepi32_ps(v)}; }
    VD operator+(VD o) const { return {_mm256_add_epi32(v, o.v)}; }
};
// dwords 4j + k <- rows' dword at (k, j) as `dwords` places them, then each 128-bit lane's
// 4 x 4 bytes transposed: lane c = column c's 4 bytes.
static inline __m256i quads_of(__m256i rows, __m256i dwords) {
    const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(rows, dwords), bytes);
}
// 4 rows of a stripe of 4-, 5- or 6-bit quants (quant.h's layout: a row's 8 bytes of nibbles,
// columns c and 8 + c, then HB = BITS - 4 bits a column, column c's at bit HB * c), whole, as
// bytes: quadword k of lo holds row k's quants of columns 0-7, of hi columns 8-15. The high
// bits come in by a byte shuffle of each row's high bytes within its quadword (HighBits: the
// byte holding column c's, and the bit) and a bit test per byte.
template <int HB>
struct HighBits {
    alignas(32) uint8_t of_lo[32], of_hi[32], bit[HB][32];
    constexpr HighBits() : of_lo(), of_hi(), bit() {
        for (int i = 0; i < 32; ++i) {  // byte i: row i / 8 (its 128-bit lane's), column i % 8
            const int own = i % 16 / 8 * 8, c = i % 8;
            of_lo[i] = uint8_t(own + c * HB / 8);
            of_hi[i] = uint8_t(own + (8 + c) * HB / 8);  // 8 * HB bits later: the same bits
            for (int b = 0; b < HB; ++b) bit[b][i] = uint8_t(1 << ((c * HB + b) % 8));
        }
    }
};
template <int BITS>
static inline void quant_quadwords(const uint8_t* rows, __m256i& lo, __m256i& hi) {
    constexpr int ROW = 16 * BITS / 8, HB = BITS - 4;
    const auto at = [&](int k, int skip, int bytes) {
        uint64_t v = 0;
        std::memcpy(&v, rows + k * ROW + skip, bytes);
        return (long long)v;
    };
    const __m256i v = HB == 0 ? _mm256_loadu_si256((const __m256i*)rows)
                              : _mm256_setr_epi64x(at(0, 0, 8), at(1, 0, 8), at(2, 0, 8), at(3, 0, 8));
    const __m256i low = _mm256_set1_epi8(15);
    lo = _mm256_and_si256(v, low);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if constexpr (HB > 0) {
        static constexpr HighBits<HB> table;
        const auto load = [](const uint8_t* p) { return _mm256_load_si256((const __m256i*)p); };
        const int n = 2 * HB;  // a row's bytes of high bits
        const __m256i h = _mm256_setr_epi64x(at(0, 8, n), at(1, 8, n), at(2, 8, n), at(3, 8, n));
        const __m256i of_lo = _mm256_shuffle_epi8(h, load(table.of_lo));
        const __m256i of_hi = _mm256_shuffle_epi8(h, load(table.of_hi));
        for (int b = 0; b < HB; ++b) {
            const __m256i bit = load(table.bit[b]), add = _mm256_set1_epi8(char(16 << b));
            const auto set = [&](__m256i of) {
                return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(of, bit), bit), add);
            };
            lo = _mm256_or_si256(lo, set(of_lo));
            hi = _mm256_or_si256(hi, set(of_hi));
        }
    }
}
template <int BITS>
static inline void load_quads(const uint8_t* rows, VD& u0, VD& u1) {
    if constexpr (BITS < 8) {  // 4 rows' quants: dword (k, j) at 2k + j
        __m256i lo, hi;
        quant_quadwords<BITS>(rows, lo, hi);
        const __m256i dwords = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        u0 = {quads_of(lo, dwords)};
        u1 = {quads_of(hi, dwords)};
    } else {  // 4 rows of 16 bytes; unpacked: k0, k2 | k1, k3 (8 bytes each)
        const __m256i a = _mm256_loadu_si256((const __m256i*)rows);
        const __m256i b = _mm256_loadu_si256((const __m256i*)(rows + 32));
        const __m256i dwords = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7);
        u0 = {quads_of(_mm256_unpacklo_epi64(a, b), dwords)};
        u1 = {quads_of(_mm256_unpackhi_epi64(a, b), dwords)};
    }
}
template <int BITS>
static constexpr int DOT_BIAS = BITS == 8 ? 128 : 0;
template <int BITS>
static inline VD dot4(VD acc, VD u, VD x) {
    __m256i a = u.v, b = x.v;
    if constexpr (BITS == 8) {
        const __m256i w = _mm256_xor_si256(u.v, _mm256_set1_epi8(char(0x80)));
        a = _mm256_sign_epi8(w, w);  // |w|; -128 stays 0x80, 128 unsigned
        b = _mm256_sign_epi8(x.v, w);
    }
    const __m256i pairs = _mm256_maddubs_epi16(a, b);
    return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))};
}

// The decode kernel's scores (decode_rows.h), by reduce_add8. Lane j of the result:
// v[j].reduce_add(), added in the same order (the halves, then lanes 0 + 2 and 1 + 3, then
// those two), for eight vectors at once.
static inline VF reduce_add8(const VF* v) {
    __m256 h[4];  // v[j]'s halves summed in the low 128 bits, v[j + 4]'s in the high
    for (int j = 0; j < 4; ++j)
        h[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[j].v, v[j + 4].v, 0x20),
                             _mm256_permute2f128_ps(v[j].v, v[j + 4].v, 0x31));
    // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of h[j] = a, h[j + 1] = b
    const __m256 p01 =
        _mm256_add_ps(_mm256_unpacklo_ps(h[0], h[1]), _mm256_unpackhi_ps(h[0], h[1]));
    const __m256 p23 =
        _mm256_add_ps(_mm256_unpacklo_ps(h[2], h[3]), _mm256_unpackhi_ps(h[2], h[3]));
    return {_mm256_add_ps(_mm256_shuffle_ps(p01, p23, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm256_shuffle_ps(p01, p23, _MM_SHUFFLE(3, 2, 3, 2)))};
}
// Eight key rows at a time, the query's vectors in the outer loop (eight sums, a query vector
// and a key vector in registers), the eight horizontal sums shared and stored as one vector.
template <int D, typename Q, typename KV>
static inline void scores16(Native, const Q* q, const KV* const* rows, int count, int group,
                            float scale, float* s, long stride) {
    static_assert(D % VF::W == 0 && VF::W == 8, "head dim: whole vectors of eight");
    for (int g = 0; g < group; ++g)
        for (int t0 = 0; t0 < count; t0 += 8) {
            const int n = count - t0 < 8 ? count - t0 : 8;
            const KV* r[8];  // past the last row: its first, summed and not stored
            for (int t = 0; t < 8; ++t) r[t] = rows[t0 + (t < n ? t : 0)];
            VF acc[8];
            const VF q0 = VF::load(q + g * D);
            for (int t = 0; t < 8; ++t) acc[t] = q0 * VF::load(r[t]);
            for (int i = 1; i < D / VF::W; ++i) {
                const VF qi = VF::load(q + g * D + VF::W * i);
                for (int t = 0; t < 8; ++t) acc[t] = fma(qi, VF::load(r[t] + VF::W * i), acc[t]);
            }
            (reduce_add8(acc) * VF::set1(scale)).store_first(s + g * stride + t0, n);
        }
}

// scores16_i8 (decode_rows.h): each key row widened to int16 16 numbers at a time and
// multiplied in pairs into int32 lanes (vpmaddwd), eight rows' sums reduced at once.
template <int D>
static inline void scores16_i8(Native, const int16_t* q, const float* q_scale,
                               const int8_t* const* rows, const float* k_scale, int count,
                               int group, float scale, float* s, long stride) {
    static_assert(D % 16 == 0, "head dim: whole int16 vectors");
    for (int g = 0; g < group; ++g)
        for (int t0 = 0; t0 < count; t0 += 8) {
            const int n = count - t0 < 8 ? count - t0 : 8;
            VF acc[8];
            for (int t = 0; t < 8; ++t) {
                const int8_t* k = rows[t0 + (t < n ? t : 0)];  // past the last: its first
                __m256i sum = _mm256_setzero_si256();
                for (int i = 0; i < D / 16; ++i) {
                    const __m256i k16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(k + 16 * i)));
                    const __m256i q16 = _mm256_loadu_si256((const __m256i*)(q + g * D + 16 * i));
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(q16, k16));
                }
                acc[t] = {_mm256_cvtepi32_ps(sum)};
            }
            const VF scores = reduce_add8(acc) * VF::set1(q_scale[g] * scale);
            (scores * VF::load_first(k_scale + t0, n)).store_first(s + g * stride + t0, n);
        }
}

static inline int best_tile_unit() { return 0; }
