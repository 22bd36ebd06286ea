// The generic target: any CPU, the compiler's default instruction set (on x86-64 SSE2; on
// aarch64 NEON, which the compiler finds in these plain loops). VF is 4 float32 lanes in an
// array, VD 4 int32 lanes; every kernel step takes its portable body (arch/target.h), and no
// unit multiplies bf16 tiles.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include "../bf16.h"
#include "target.h"

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
    static float widen(int8_t x) { return float(x); }
    static float widen(fp8e4m3 x) { return e4m3_to_f32(x); }
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

// quant_dot.h's int32 lanes: a dot product of 4 unsigned bytes with 4 signed ones per lane.
struct VD {
    uint32_t v[4];
    static VD zero() { return {{0, 0, 0, 0}}; }
    static VD set1(int32_t x) { return {{uint32_t(x), uint32_t(x), uint32_t(x), uint32_t(x)}}; }
    VD operator+(VD o) const {
        VD r;
        for (int i = 0; i < 4; ++i) r.v[i] = v[i] + o.v[i];
        return r;
    }
    VF to_float() const {
        VF r;
        for (int i = 0; i < 4; ++i) r.v[i] = float(int32_t(v[i]));
        return r;
    }
};
template <int BITS>
static inline void load_quads(const uint8_t* rows, VD& u0, VD& u1) {
    constexpr int ROW = 2 * VF::W * BITS / 8, HB = BITS - 4;
    for (int c = 0; c < VF::W; ++c) {
        uint32_t a = 0, b = 0;
        for (int k = 0; k < 4; ++k) {
            const uint8_t* r = rows + k * ROW;
            uint32_t lo = BITS == 8 ? r[c] : r[c] & 15u;
            uint32_t hi = BITS == 8 ? r[VF::W + c] : uint32_t(r[c]) >> 4;
            if constexpr (HB > 0 && HB < 4) {  // column c's HB high bits at bit HB * c
                uint64_t high = 0;
                std::memcpy(&high, r + VF::W, 2 * VF::W * HB / 8);
                lo |= uint32_t(high >> (HB * c) & ((1u << HB) - 1)) << 4;
                hi |= uint32_t(high >> (HB * (VF::W + c)) & ((1u << HB) - 1)) << 4;
            }
            a |= lo << (8 * k);
            b |= hi << (8 * k);
        }
        u0.v[c] = a;
        u1.v[c] = b;
    }
}
template <int BITS>
static constexpr int DOT_BIAS = 0;
template <int BITS>
static inline VD dot4(VD acc, VD u, VD x) {
    for (int c = 0; c < VF::W; ++c) {
        int32_t sum = 0;
        for (int b = 0; b < 4; ++b)
            sum += int32_t((u.v[c] >> (8 * b)) & 255u) * int32_t(int8_t(x.v[c] >> (8 * b)));
        acc.v[c] = uint32_t(int32_t(acc.v[c]) + sum);
    }
    return acc;
}

static inline int best_tile_unit() { return 0; }
