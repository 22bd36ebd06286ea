// GGUF's block-quantized weights as the stripes matmul (stripes.h) reads them: dequantized in
// registers, every weight exactly the float32 that gguf's reference dequantization gives.
//
// Every supported GGUF type is, per group of GROUP consecutive inputs of one output column,
// w = scale * q + offset with q a BITS-bit whole number (pagekv/models/quantized.py decodes
// the file's blocks into q and the parts of scale and offset). Where a type has no offset of
// its own it is -ZERO * scale (ZERO a power of two, so exact). Where a type has offsets,
// scale * q is exact in float32 (an fp16 scale times a 6-bit block scale times a 5-bit q: 22
// bits), so one fused multiply-add rounds as the reference's product-then-sum does; without
// offsets, fma(scale, q, -ZERO * scale) is the exact scale * (q - ZERO) rounded once, as the
// reference's single product (exact itself but for Q6_K's, which may need 25 bits).
//
// The scales are kept as the file has them, so the stripes take about the file's bytes: per
// super-block of SUPER inputs a head of STRIPE fp16 d (then STRIPE fp16 dm), per group of
// GROUP inputs in it, where the type has them, STRIPE multipliers of d (then of dm) as bytes,
// and GROUP rows of STRIPE quants (vec.h's load_quants layout, ROW_BYTES each). scale = d * sc
// and offset = dm * mk are exact in float32 (11 bits times 8).
#pragma once
#include <cstdint>
#include <cstring>
#include "stripes.h"

template <int BITS_, int GROUP_, int SUPER_, bool OFFSETS_, int ZERO_>
struct QuantFormat {
    static constexpr int BITS = BITS_, GROUP = GROUP_, SUPER = SUPER_, ZERO = ZERO_;
    static constexpr bool OFFSETS = OFFSETS_;
    static constexpr bool MULTIPLIERS = SUPER > GROUP;  // the K types
    static constexpr bool SIGNED = MULTIPLIERS && !OFFSETS;  // stored + 128 (Q6_K)
    static constexpr long ROW_BYTES = STRIPE * BITS / 8;
    static constexpr long HEAD_BYTES = STRIPE * 2 * (OFFSETS ? 2 : 1);  // fp16 d (and dm)
    static constexpr long SUBHEAD_BYTES = MULTIPLIERS ? STRIPE * (OFFSETS ? 2 : 1) : 0;
    static constexpr long GROUP_BYTES = SUBHEAD_BYTES + GROUP * ROW_BYTES;
    static constexpr long SUPER_BYTES = HEAD_BYTES + SUPER / GROUP * GROUP_BYTES;
    static long stripe_bytes(long K) { return K / SUPER * SUPER_BYTES; }
};

template <class F>
struct QuantStripe {
    static constexpr int GROUP = F::GROUP;
    static constexpr bool WIDEN = true;
    const uint8_t* p;
    struct Group {
        VF s0, s1, m0, m1;
        const uint8_t* rows;
        void weights(int kk, VF& w0, VF& w1) const {
            VF q0, q1;
            load_quants<F::BITS>(rows + kk * F::ROW_BYTES, q0, q1);
            w0 = fma(s0, q0, m0);
            w1 = fma(s1, q1, m1);
        }
    };
    Group group(long k0) const {
        const uint8_t* super = p + k0 / F::SUPER * F::SUPER_BYTES;
        const uint8_t* own = super + F::HEAD_BYTES + k0 % F::SUPER / GROUP * F::GROUP_BYTES;
        Group g;
        g.s0 = VF::load_half(super);
        g.s1 = VF::load_half(super + 2 * VF::W);
        if constexpr (F::MULTIPLIERS) {  // exact: an fp16 times a whole number below 256
            VF c0, c1;
            load_quants<8>(own, c0, c1);
            if constexpr (F::SIGNED) {
                c0 = c0 - VF::set1(128.f);
                c1 = c1 - VF::set1(128.f);
            }
            g.s0 = g.s0 * c0;
            g.s1 = g.s1 * c1;
        }
        if constexpr (F::OFFSETS) {
            g.m0 = VF::load_half(super + 2 * STRIPE);
            g.m1 = VF::load_half(super + 2 * STRIPE + 2 * VF::W);
            if constexpr (F::MULTIPLIERS) {
                VF c0, c1;
                load_quants<8>(own + STRIPE, c0, c1);
                g.m0 = g.m0 * c0;
                g.m1 = g.m1 * c1;
            }
        } else {
            g.m0 = g.s0 * VF::set1(-float(F::ZERO));
            g.m1 = g.s1 * VF::set1(-float(F::ZERO));
        }
        g.rows = own + F::SUBHEAD_BYTES;
        return g;
    }
};

template <class F>
struct QuantStripes {
    using Source = QuantStripe<F>;
    const uint8_t* p;
    long K;
    Source at(long s) const { return {p + s * F::stripe_bytes(K)}; }
    long stripe_bytes() const { return F::stripe_bytes(K); }
};

// The decoded form [N rows] (pagekv/models/quantized.py: q [N, K]; d, dm fp16 [N, K / SUPER];
// sc, mk [N, K / GROUP], null where the format has none) -> the stripes.
template <class F>
static void quant_pack(const uint8_t* q, const uint16_t* d, const uint16_t* dm,
                       const uint8_t* sc, const uint8_t* mk, uint8_t* packed, long N, long K) {
    const long supers = K / F::SUPER, groups = K / F::GROUP;
    #pragma omp parallel for
    for (long s = 0; s < N / STRIPE; ++s)
        for (long b = 0; b < supers; ++b) {
            uint8_t* super = packed + s * F::stripe_bytes(K) + b * F::SUPER_BYTES;
            for (int c = 0; c < STRIPE; ++c) {
                const long row = s * STRIPE + c;
                std::memcpy(super + 2 * c, d + row * supers + b, 2);
                if constexpr (F::OFFSETS)
                    std::memcpy(super + 2 * (STRIPE + c), dm + row * supers + b, 2);
            }
            for (long g = 0; g < F::SUPER / F::GROUP; ++g) {
                uint8_t* own = super + F::HEAD_BYTES + g * F::GROUP_BYTES;
                const long group = b * (F::SUPER / F::GROUP) + g;
                if constexpr (F::MULTIPLIERS)
                    for (int c = 0; c < STRIPE; ++c) {
                        const long row = s * STRIPE + c;
                        own[c] = sc[row * groups + group];
                        if constexpr (F::OFFSETS) own[STRIPE + c] = mk[row * groups + group];
                    }
                for (int kk = 0; kk < F::GROUP; ++kk) {
                    uint8_t* r = own + F::SUBHEAD_BYTES + kk * F::ROW_BYTES;
                    std::memset(r, 0, F::ROW_BYTES);
                    uint64_t high = 0;
                    for (int c = 0; c < STRIPE; ++c) {
                        const uint8_t v = q[(s * STRIPE + c) * K + group * F::GROUP + kk];
                        if constexpr (F::BITS == 8) {
                            r[c] = v;
                        } else {
                            r[c % VF::W] |= uint8_t((v & 15) << (c < VF::W ? 0 : 4));
                            high |= uint64_t(v >> 4) << (c * (F::BITS - 4));
                        }
                    }
                    if constexpr (F::BITS > 4 && F::BITS < 8)
                        std::memcpy(r + VF::W, &high, STRIPE * (F::BITS - 4) / 8);
                }
            }
        }
}

// Column `c` of packed stripes, dequantized into out [K] float32: the kernel's own weights
// (an embedding lookup of a tied head; tests).
template <class F>
static void quant_column(const uint8_t* packed, long c, float* out, long K) {
    const auto src = QuantStripes<F>{packed, K}.at(c / STRIPE);
    const int lane = int(c % STRIPE);
    float w[STRIPE];
    for (long k0 = 0; k0 < K; k0 += F::GROUP) {
        const auto group = src.group(k0);
        for (int kk = 0; kk < F::GROUP; ++kk) {
            VF w0, w1;
            group.weights(kk, w0, w1);
            w0.store(w);
            w1.store(w + VF::W);
            out[k0 + kk] = w[lane];
        }
    }
}

// Calls body(F{}) with the format that (bits, group, superblock, offsets, zero) names; -1 if
// none does.
template <class Body>
static int with_quant_format(int bits, int group, int superblock, int offsets, int zero,
                             Body body) {
    const auto is = [&](int b, int g, int s, int o, int z) {
        return bits == b && group == g && superblock == s && offsets == o && zero == z;
    };
    if (is(8, 32, 32, 0, 128)) return body(QuantFormat<8, 32, 32, false, 128>{});  // Q8_0
    if (is(4, 32, 32, 0, 8)) return body(QuantFormat<4, 32, 32, false, 8>{});      // Q4_0
    if (is(4, 32, 32, 1, 0)) return body(QuantFormat<4, 32, 32, true, 0>{});       // Q4_1
    if (is(5, 32, 32, 0, 16)) return body(QuantFormat<5, 32, 32, false, 16>{});    // Q5_0
    if (is(5, 32, 32, 1, 0)) return body(QuantFormat<5, 32, 32, true, 0>{});       // Q5_1
    if (is(4, 32, 256, 1, 0)) return body(QuantFormat<4, 32, 256, true, 0>{});     // Q4_K
    if (is(5, 32, 256, 1, 0)) return body(QuantFormat<5, 32, 256, true, 0>{});     // Q5_K
    if (is(6, 16, 256, 0, 32)) return body(QuantFormat<6, 16, 256, false, 32>{});  // Q6_K
    return -1;
}
