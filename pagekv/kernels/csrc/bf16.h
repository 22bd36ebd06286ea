// bfloat16 and fp16 numbers one at a time, the same on every target: widening is exact (a
// bfloat16 is the high 16 bits of a float32), rounding to bfloat16 is to nearest even as
// torch's, and a NaN stays a NaN. The vectors' forms are the vector layer's (vec.h); what
// multiplies bf16 tiles is the target's (arch/).
#pragma once
#include <cstdint>

static inline float bf16_to_f32(uint16_t x) { return __builtin_bit_cast(float, uint32_t(x) << 16); }
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = __builtin_bit_cast(uint32_t, f);
    const uint16_t r = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? uint16_t(0x7FC0) : r;
}
// fp16 -> float32, exact (subnormals, infinities and NaNs too).
static inline float half_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 31u, man = h & 1023u;
    if (exp == 31) return __builtin_bit_cast(float, sign | 0x7F800000u | (man << 13));
    if (exp == 0) {  // zero or subnormal: man * 2^-24
        const float f = float(man) * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    return __builtin_bit_cast(float, sign | ((exp + 112) << 23) | (man << 13));
}

// half_to_f32 without its branches for a finite number: the 15 bits placed as a float32's
// exponent and mantissa are the value times 2^-112 (a subnormal half becomes a subnormal
// float), which one exact multiplication restores. For the scales of 8-bit KV rows, read one
// per row.
static inline float finite_half_to_f32(uint16_t h) {
    if ((h & 0x7C00u) == 0x7C00u) return half_to_f32(h);  // infinity or NaN
    const float m = __builtin_bit_cast(float, uint32_t(h & 0x7FFFu) << 13) * 0x1p112f;
    return h & 0x8000u ? -m : m;
}

// float32 -> fp16, rounded to nearest even as torch rounds (subnormals, overflow to infinity).
static inline uint16_t f32_to_half(float f) {
    const uint32_t u = __builtin_bit_cast(uint32_t, f), sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u);  // NaN
    if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // rounds past 65504: infinity
    if (a < 0x38800000u) {  // below 2^-14: a subnormal half, man * 2^-24, rounded by the FPU
        const float m = __builtin_bit_cast(float, a) * 16777216.f;  // exact: a power of two
        return uint16_t(sign | uint32_t(__builtin_nearbyintf(m)));
    }
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);  // to 10 mantissa bits, ties to even
    return uint16_t(sign | ((r - 0x38000000u) >> 13));
}

// 8-bit KV rows: int8 steps, or fp8 e4m3 (OCP's e4m3fn: bias 7, no infinities, 0x7F and 0xFF
// NaN, largest 448), each row times a float16 scale of its own (runner/attention.py's
// quantize_rows). The e4m3 bits are their own type so that loads widen them as fp8, not as
// integers.
struct fp8e4m3 {
    uint8_t bits;
};
// e4m3 -> float32, exact: the 7 magnitude bits placed as an fp16's exponent and mantissa give
// the value times 2^-8 (subnormals alike), which 256 restores.
static inline float e4m3_to_f32(fp8e4m3 x) {
    const float m = half_to_f32(uint16_t((x.bits & 0x7Fu) << 7)) * 256.f;
    return x.bits & 0x80u ? -m : m;
}
// float32 (already within [-448, 448]) -> e4m3, rounded to nearest even as torch rounds.
static inline fp8e4m3 f32_to_e4m3(float f) {
    const uint32_t u = __builtin_bit_cast(uint32_t, f), sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7FFFFFFFu;
    uint32_t bits;
    if (a < 0x3C800000u) {  // below 2^-6: a subnormal, man * 2^-9
        bits = uint32_t(__builtin_nearbyintf(__builtin_bit_cast(float, a) * 512.f));
    } else {
        const uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);  // to 3 mantissa bits
        bits = (r >> 20) - (120u << 3);                      // exponent bias 127 -> 7
    }
    return fp8e4m3{uint8_t(sign | (bits > 0x7Eu ? 0x7Eu : bits))};
}

// An element of a float32, bfloat16 or 8-bit tensor as float32, for loops written once for all.
static inline float load(float x) { return x; }
static inline float load(uint16_t x) { return bf16_to_f32(x); }
static inline float load(int8_t x) { return float(x); }
static inline float load(fp8e4m3 x) { return e4m3_to_f32(x); }
