// What the AVX-512 targets (avx512, avx512bf16, amx: x86-64-v4 and more) share: VF is one
// __m512 (16 float32 lanes), VD one __m512i of int32 lanes (each target's header adds how its
// bytes are regrouped and multiplied), and the decode kernel's row bodies: each K/V row
// widened to float32 in registers once (the compiler's vectorizer misses the bf16 widening),
// sixteen scores summed horizontally at once.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include "../bf16.h"
#include "target.h"
#include "x86_intrinsics.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "arch/avx512_common.h: build with an AVX-512 target's flags (pagekv/kernels/isa.py)"
#endif

struct VF {
    static constexpr int W = 16;     // lanes
    static constexpr int REGS = 32;  // vector registers
    __m512 v;
    static VF zero() { return {_mm512_setzero_ps()}; }
    static VF set1(float x) { return {_mm512_set1_ps(x)}; }
    static VF load(const float* p) { return {_mm512_loadu_ps(p)}; }
    static VF load(const uint16_t* p) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
        return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
    }
    static VF load_half(const uint8_t* p) {  // W fp16 -> float32, exact
        return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))};
    }
    static VF load(const int8_t* p) {
        return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))};
    }
    static VF load(const fp8e4m3* p) {  // as e4m3_to_f32: fp16 bits, widened, times 256
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
        const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
        const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
        return {_mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(mag, sign)), _mm512_set1_ps(256.f))};
    }
    // lanes [0, min(n, W)) from p, the rest `fill`
    static __mmask16 first_mask(int n) {
        return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
    }
    static VF load_first(const float* p, int n, float fill = 0.f) {
        return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), first_mask(n), p)};
    }
    void store(float* p) const { _mm512_storeu_ps(p, v); }
    void store_first(float* p, int n) const { _mm512_mask_storeu_ps(p, first_mask(n), v); }
    // The value from here on in a register: a load the compiler would otherwise fold into
    // each instruction that uses the value (a load per use, where the loop is load-bound).
    void in_register() { __asm__("" : "+v"(v)); }
    bool any_nan() const { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
    int first_equal(float x) const {  // the first lane equal to x, or -1
        const unsigned m = _mm512_cmp_ps_mask(v, _mm512_set1_ps(x), _CMP_EQ_OQ);
        return m == 0 ? -1 : __builtin_ctz(m);
    }
    VF keep_first(int n) const { return {_mm512_maskz_mov_ps(first_mask(n), v)}; }  // rest 0
    // rounded to bfloat16 as f32_to_bf16 rounds each lane
    __attribute__((always_inline)) void store(uint16_t* p) const {
        const __m512i u = _mm512_castps_si512(v);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7FC0));
        _mm256_storeu_si256((__m256i*)p, _mm512_maskz_cvtepi32_epi16(__mmask16(0xFFFF), r));
    }
    float reduce_add() const { return _mm512_reduce_add_ps(v); }
    float reduce_max() const { return _mm512_reduce_max_ps(v); }
};
static inline VF operator+(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline VF operator-(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline VF operator*(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline VF fma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a*b+c
static inline VF max(VF a, VF b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline VF floor(VF a) {
    return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};
}
static inline VF pow2(VF n) {  // 2^n for whole n in [-127, 127]
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
template <int BITS>
static inline void load_quants(const uint8_t* row, VF& q0, VF& q1) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)row));
    if constexpr (BITS == 8) {
        q0 = {_mm512_cvtepi32_ps(bytes)};
        const __m128i next = _mm_loadu_si128((const __m128i*)(row + 16));
        q1 = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(next))};
    } else {
        __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi32(15));
        __m512i hi = _mm512_srli_epi32(bytes, 4);
        if constexpr (BITS > 4) {
            constexpr int HB = BITS - 4;
            uint64_t bits = 0;
            std::memcpy(&bits, row + 16, 32 * HB / 8);
            const __m512i shifts = _mm512_mullo_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(HB));
            const __m512i mask = _mm512_set1_epi32((1 << HB) - 1);
            const __m512i h0 = _mm512_and_si512(
                _mm512_srlv_epi32(_mm512_set1_epi32(int(uint32_t(bits))), shifts), mask);
            const __m512i h1 = _mm512_and_si512(
                _mm512_srlv_epi32(_mm512_set1_epi32(int(uint32_t(bits >> (16 * HB)))), shifts),
                mask);
            lo = _mm512_or_si512(lo, _mm512_slli_epi32(h0, 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi32(h1, 4));
        }
        q0 = {_mm512_cvtepi32_ps(lo)};
        q1 = {_mm512_cvtepi32_ps(hi)};
    }
}
// 16 float32 -> bfloat16, rounded to nearest even as torch does; NaN stays NaN.
static inline void store_bf16x16(uint16_t* p, __m512 f) { VF{f}.store(p); }

// quant_dot.h's int32 lanes (load_quads and dot4: the target's header).
struct VD {
    __m512i v;
    static VD zero() { return {_mm512_setzero_si512()}; }
    static VD set1(int32_t x) { return {_mm512_set1_epi32(x)}; }
    VF to_float() const { return {_mm512_cvtepi32_ps(v)}; }
    VD operator+(VD o) const { return {_mm512_add_epi32(v, o.v)}; }
};

// quant_dot.h's quants of 4 rows k of a stripe of 4-, 5- or 6-bit quants (quant.h's layout:
// a row's 16 bytes of nibbles, columns c and 16 + c, then HB = BITS - 4 bits a column, column
// c's at bit HB * c), whole: 128-bit lane k of lo holds row k's quants of columns 0-15 as bytes,
// of hi columns 16-31. The high bits come in by a byte shuffle of each row's high bytes within
// its lane (HighBits: the byte holding column c's, and the bit) and a bit test per byte.
template <int HB>
struct HighBits {
    alignas(16) uint8_t of_lo[16], of_hi[16], bit[HB][16];
    constexpr HighBits() : of_lo(), of_hi(), bit() {
        for (int c = 0; c < 16; ++c) {  // 16 columns later: 2 * HB bytes later, the same bits
            of_lo[c] = uint8_t(c * HB / 8);
            of_hi[c] = uint8_t((16 + c) * HB / 8);
            for (int b = 0; b < HB; ++b) bit[b][c] = uint8_t(1 << ((c * HB + b) % 8));
        }
    }
};
static inline __m512i lanes_of(const uint8_t* bytes) {
    return _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)bytes));
}
static inline __m512i four_lanes(__m128i a, __m128i b, __m128i c, __m128i d) {
    const __m512i ab = _mm512_inserti32x4(_mm512_castsi128_si512(a), b, 1);
    return _mm512_inserti32x4(_mm512_inserti32x4(ab, c, 2), d, 3);
}
template <int BITS>
static inline void quant_lanes(const uint8_t* rows, __m512i& lo, __m512i& hi) {
    constexpr int ROW = 32 * BITS / 8, HB = BITS - 4;
    const auto row = [&](int k) { return _mm_loadu_si128((const __m128i*)(rows + k * ROW)); };
    const __m512i v = HB == 0 ? _mm512_loadu_si512(rows) : four_lanes(row(0), row(1), row(2), row(3));
    const __m512i low = _mm512_set1_epi8(15);
    lo = _mm512_and_si512(v, low);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if constexpr (HB > 0) {
        static constexpr HighBits<HB> table;
        const auto high = [&](int k) {  // row k's 4 * HB bytes of high bits
            uint64_t bits = 0;
            std::memcpy(&bits, rows + k * ROW + 16, 4 * HB);
            return _mm_cvtsi64_si128((long long)bits);
        };
        const __m512i h = four_lanes(high(0), high(1), high(2), high(3));
        const __m512i of_lo = _mm512_shuffle_epi8(h, lanes_of(table.of_lo));
        const __m512i of_hi = _mm512_shuffle_epi8(h, lanes_of(table.of_hi));
        for (int b = 0; b < HB; ++b) {
            const __m512i bit = lanes_of(table.bit[b]), add = _mm512_set1_epi8(char(16 << b));
            lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(of_lo, bit), add));
            hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(of_hi, bit), add));
        }
    }
}

// The decode kernel's row bodies (decode_rows.h says what each computes). row_dot takes the
// tag too, so that a later header's body for bfloat16 rows (bf16_dot.h) is found where there is
// one, and taken as the more specific.
static inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
static inline __m512 load16(const uint16_t* x) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 load16(const int8_t* x) { return VF::load(x).v; }
static inline __m512 load16(const fp8e4m3* x) { return VF::load(x).v; }
// q.k for one row, left unreduced: 16 partial sums whose total is the dot product.
template <int D, typename Q, typename KV>
static inline __m512 row_dot(Native, const Q* q, const KV* k) {
    __m512 acc = _mm512_mul_ps(load16(q), load16(k));
    for (int i = 1; i < D / 16; ++i)
        acc = _mm512_fmadd_ps(load16(q + 16 * i), load16(k + 16 * i), acc);
    return acc;
}

// Lane t of the result = the sum of v[t]'s 16 lanes: sixteen horizontal sums for ~35 shuffles
// and adds, instead of sixteen separate reductions of ~9 each.
static inline __m512 sum4_in_lanes(__m512 a, __m512 b, __m512 c, __m512 d) {
    // per 128-bit lane L: [sum_L(a), sum_L(b), sum_L(c), sum_L(d)]
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}
static inline __m512 hsum16(const __m512* v) {
    const __m512 r0 = sum4_in_lanes(v[0], v[1], v[2], v[3]);
    const __m512 r1 = sum4_in_lanes(v[4], v[5], v[6], v[7]);
    const __m512 r2 = sum4_in_lanes(v[8], v[9], v[10], v[11]);
    const __m512 r3 = sum4_in_lanes(v[12], v[13], v[14], v[15]);
    // add the four 128-bit lanes of each r_j, and put r_j's result in lane j
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(r0, r1, 0x88),
                                     _mm512_shuffle_f32x4(r0, r1, 0xDD));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(r2, r3, 0x88),
                                     _mm512_shuffle_f32x4(r2, r3, 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88),
                         _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

// Scores of `group` query heads (rows of q) against up to 16 key rows: s[g * stride + t].
template <int D, typename Q, typename KV>
static inline void scores16(Native, const Q* q, const KV* const* rows, int count, int group,
                            float scale, float* s, long stride) {
    const __mmask16 valid = __mmask16((1u << count) - 1);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int g = 0; g < group; ++g) {
        __m512 acc[16];
        for (int t = 0; t < 16; ++t)
            acc[t] = t < count ? row_dot<D>(Native{}, q + g * D, rows[t]) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(s + g * stride, valid, _mm512_mul_ps(hsum16(acc), vscale));
    }
}
// scores16_i8 (decode_rows.h): each key row widened to int16 32 numbers at a time and
// multiplied in pairs into int32 lanes (vpmaddwd), sixteen rows' sums then reduced at once.
template <int D>
static inline void scores16_i8(Native, const int16_t* q, const float* q_scale,
                               const int8_t* const* rows, const float* k_scale, int count,
                               int group, float scale, float* s, long stride) {
    static_assert(D % 32 == 0, "head dim: whole int16 vectors");
    const __mmask16 valid = __mmask16((1u << count) - 1);
    const __m512 k_scales = _mm512_maskz_loadu_ps(valid, k_scale);
    for (int g = 0; g < group; ++g) {
        __m512i qv[D / 32];
        for (int i = 0; i < D / 32; ++i) qv[i] = _mm512_loadu_si512(q + g * D + 32 * i);
        __m512 acc[16];
        for (int t = 0; t < 16; ++t) {
            __m512i sum = _mm512_setzero_si512();
            for (int i = 0; t < count && i < D / 32; ++i) {
                const __m256i k8 = _mm256_loadu_si256((const __m256i*)(rows[t] + 32 * i));
                sum = _mm512_add_epi32(sum, _mm512_madd_epi16(qv[i], _mm512_cvtepi8_epi16(k8)));
            }
            acc[t] = _mm512_cvtepi32_ps(sum);
        }
        const __m512 factor = _mm512_set1_ps(q_scale[g] * scale);
        const __m512 scores = _mm512_mul_ps(_mm512_mul_ps(hsum16(acc), factor), k_scales);
        _mm512_mask_storeu_ps(s + g * stride, valid, scores);
    }
}
// out[g] += sum_t p[g * p_stride + t] * rows[t] over W dims for G heads at once (head g's
// output at out + g * out_stride): each value row is widened to float32 once, in registers,
// and the G accumulators (G * W / 16 registers) stay there. Each output is one chain of FMAs,
// t ascending, whatever G and W.
template <int W, int G, typename KV>
static inline void pv_group(Native, const float* p, long p_stride, const KV* const* rows,
                            int count, float* out, long out_stride) {
    __m512 acc[G][W / 16];
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < W / 16; ++i)
            acc[g][i] = _mm512_loadu_ps(out + g * out_stride + 16 * i);
    for (int t = 0; t < count; ++t) {
        __m512 v[W / 16];
        for (int i = 0; i < W / 16; ++i) v[i] = load16(rows[t] + 16 * i);
        for (int g = 0; g < G; ++g) {
            const __m512 pt = _mm512_set1_ps(p[g * p_stride + t]);
            for (int i = 0; i < W / 16; ++i) acc[g][i] = _mm512_fmadd_ps(pt, v[i], acc[g][i]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < W / 16; ++i) _mm512_storeu_ps(out + g * out_stride + 16 * i, acc[g][i]);
}
