// The vector layer: float32 lanes as one type, VF, whose body is the target's widest
// registers: 16 lanes of AVX-512, 8 of AVX2 + FMA, or 4 plain floats that the compiler
// vectorizes as it can (the generic target, and any CPU that is not x86). Kernels written
// against VF build for every target from one source; only a kernel that needs an instruction
// VF does not offer (bf16 dot products, AMX tiles) keeps a target branch of its own.
//
// load_quants<BITS>(row, q0, q1): one k of a quantized stripe (quant.h) as two vectors of
// small whole numbers, exact in float32: columns [0, W) into q0, [W, 2W) into q1. A row holds
// W bytes of 4-bit fields (byte i: column i low, column W + i high), then for 5 and 6 bits the
// fields' high bits (column c's at bit c * (BITS - 4)); for 8 bits, one byte per column.
//
// Every operation rounds as its scalar form does (fma is one rounding, but for the generic
// body on a CPU without FMA instructions, where it is a product and a sum), so a kernel's sums
// follow the order it writes on every target; only the lane count changes which partial sums
// a horizontal reduction adds in which order.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include "simd.h"
#endif

// bfloat16 <-> float32 for one number: widening is exact (the high 16 bits); rounding is to
// nearest even, as torch's, and a NaN stays a NaN.
static inline float bf16_to_f32(uint16_t x) { return __builtin_bit_cast(float, uint32_t(x) << 16); }
// fp16 -> float32 for one number, exact (subnormals, infinities and NaNs too).
static inline float half_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 31u, man = h & 1023u;
    if (exp == 31) return __builtin_bit_cast(float, sign | 0x7F800000u | (man << 13));
    if (exp == 0) {  // zero or subnormal: man * 2^-24
        const float f = float(man) * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    return __builtin_bit_cast(float, sign | ((exp + 112) << 23) | (man << 13));
}
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = __builtin_bit_cast(uint32_t, f);
    const uint16_t r = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? uint16_t(0x7FC0) : r;
}

// Requests [start, start + bytes) into L2. Not L1: requests for L1 hold its few miss buffers
// until their lines arrive, which holds up the loads the arithmetic waits on.
static inline void prefetch_l2(const void* start, long bytes) {
    for (long byte = 0; byte < bytes; byte += 64)
        __builtin_prefetch((const char*)start + byte, 0, 2);
}

#if defined(__AVX512F__)
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
    __attribute__((always_inline)) void store(uint16_t* p) const {  // rounded to bfloat16 as f32_to_bf16 rounds each lane
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
#elif defined(__AVX2__) && defined(__FMA__)
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
#else
struct VF {
    static constexpr int W = 4;
    static constexpr int REGS = 16;
    float v[4];
    static VF zero() { return {{0.f, 0.f, 0.f, 0.f}}; }
    static VF set1(float x) { return {{x, x, x, x}}; }
    template <typename T>
    static VF load(const T* p) {
        VF r;
        for (int i = 0; i < W; ++i) r.v[i] = widen(p[i]);
        return r;
    }
    static VF load_first(const float* p, int n, float fill = 0.f) {
        VF r = set1(fill);
        for (int i = 0; i < n && i < W; ++i) r.v[i] = p[i];
        return r;
    }
    static VF load_half(const uint8_t* p) {
        VF r;
        for (int i = 0; i < W; ++i) {
            uint16_t h;
            std::memcpy(&h, p + 2 * i, 2);
            r.v[i] = half_to_f32(h);
        }
        return r;
    }
    void store(float* p) const {
        for (int i = 0; i < W; ++i) p[i] = v[i];
    }
    void store_first(float* p, int n) const {
        for (int i = 0; i < n && i < W; ++i) p[i] = v[i];
    }
    void in_register() {}  // the compiler's choice
    bool any_nan() const { return v[0] != v[0] || v[1] != v[1] || v[2] != v[2] || v[3] != v[3]; }
    int first_equal(float x) const {  // the first lane equal to x, or -1
        for (int i = 0; i < W; ++i)
            if (v[i] == x) return i;
        return -1;
    }
    VF keep_first(int n) const {
        VF r = zero();
        for (int i = 0; i < n && i < W; ++i) r.v[i] = v[i];
        return r;
    }
    __attribute__((always_inline)) void store(uint16_t* p) const {
        for (int i = 0; i < W; ++i) p[i] = f32_to_bf16(v[i]);
    }
    float reduce_add() const { return (v[0] + v[2]) + (v[1] + v[3]); }
    float reduce_max() const {
        const float a = v[0] > v[2] ? v[0] : v[2], b = v[1] > v[3] ? v[1] : v[3];
        return a > b ? a : b;
    }
    static float widen(float x) { return x; }
    static float widen(uint16_t x) { return bf16_to_f32(x); }
};
#define PAGEKV_VF_LANEWISE(EXPR)             \
    VF r;                                    \
    for (int i = 0; i < VF::W; ++i) r.v[i] = EXPR; \
    return r
static inline VF operator+(VF a, VF b) { PAGEKV_VF_LANEWISE(a.v[i] + b.v[i]); }
static inline VF operator-(VF a, VF b) { PAGEKV_VF_LANEWISE(a.v[i] - b.v[i]); }
static inline VF operator*(VF a, VF b) { PAGEKV_VF_LANEWISE(a.v[i] * b.v[i]); }
#if defined(__FMA__) || defined(__aarch64__)
static inline VF fma(VF a, VF b, VF c) { PAGEKV_VF_LANEWISE(std::fma(a.v[i], b.v[i], c.v[i])); }
#else  // no FMA instruction: std::fma would be a software emulation, so two roundings
static inline VF fma(VF a, VF b, VF c) { PAGEKV_VF_LANEWISE(a.v[i] * b.v[i] + c.v[i]); }
#endif
static inline VF max(VF a, VF b) { PAGEKV_VF_LANEWISE(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
static inline VF floor(VF a) { PAGEKV_VF_LANEWISE(std::floor(a.v[i])); }
static inline VF pow2(VF n) {
    VF r;
    for (int i = 0; i < VF::W; ++i) {
        const int32_t bits = (int32_t(n.v[i]) + 127) << 23;
        std::memcpy(&r.v[i], &bits, 4);
    }
    return r;
}
#undef PAGEKV_VF_LANEWISE
template <int BITS>
static inline void load_quants(const uint8_t* row, VF& q0, VF& q1) {
    constexpr int HB = BITS > 4 && BITS < 8 ? BITS - 4 : 0;
    uint32_t bits = 0;
    if constexpr (HB > 0) std::memcpy(&bits, row + VF::W, 2 * VF::W * HB / 8);
    for (int i = 0; i < VF::W; ++i) {
        if constexpr (BITS == 8) {
            q0.v[i] = float(row[i]);
            q1.v[i] = float(row[VF::W + i]);
        } else {
            uint32_t lo = row[i] & 15u, hi = uint32_t(row[i]) >> 4;
            if constexpr (HB > 0) {
                const uint32_t mask = (1u << HB) - 1;
                lo |= ((bits >> (i * HB)) & mask) << 4;
                hi |= ((bits >> ((VF::W + i) * HB)) & mask) << 4;
            }
            q0.v[i] = float(lo);
            q1.v[i] = float(hi);
        }
    }
}
#endif

// exp(x) for x <= 0 (scores minus their max): Cephes' expf polynomial, relative error ~2e-7,
// the same operations in the same order on every target. Inline and branch-free so the
// softmaxes stay in registers; libm's expf is a scalar call.
static inline VF exp_nonpositive(VF x) {
    x = max(x, VF::set1(-87.f));
    const VF n = floor(x * VF::set1(1.44269504f) + VF::set1(0.5f));
    const VF r = (x - n * VF::set1(0.693359375f)) + n * VF::set1(2.12194440e-4f);
    VF p = VF::set1(1.9875691500e-4f);
    p = p * r + VF::set1(1.3981999507e-3f);
    p = p * r + VF::set1(8.3334519073e-3f);
    p = p * r + VF::set1(4.1665795894e-2f);
    p = p * r + VF::set1(1.6666665459e-1f);
    p = p * r + VF::set1(5.0000001201e-1f);
    p = (p * r * r + r) + VF::set1(1.f);
    return p * pow2(n);
}
