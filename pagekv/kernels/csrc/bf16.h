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

// An element of a float32 or bfloat16 tensor as float32, for loops written once for both.
static inline float load(float x) { return x; }
static inline float load(uint16_t x) { return bf16_to_f32(x); }
