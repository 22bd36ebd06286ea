// The vector layer: float32 lanes as one type, VF, whose body is the target's widest
// registers: 16 lanes of AVX-512, 8 of AVX2 + FMA, or 4 plain floats that the compiler
// vectorizes as it can (the generic target, and any CPU that is not x86). Kernels written
// against VF build for every target from one source. The bodies are the target's header,
// arch/<target>.h, which the build names (-DPAGEKV_ARCH); arch/target.h lists what such a
// header defines (VF, the int32 lanes of quant_dot.h, what multiplies bf16 tiles, and its own
// bodies of some kernel steps) and how a target is added.
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
#include "arch/target.h"
#include "bf16.h"

// Requests [start, start + bytes) into L2. Not L1: requests for L1 hold its few miss buffers
// until their lines arrive, which holds up the loads the arithmetic waits on.
static inline void prefetch_l2(const void* start, long bytes) {
    for (long byte = 0; byte < bytes; byte += 64)
        __builtin_prefetch((const char*)start + byte, 0, 2);
}

#ifndef PAGEKV_ARCH  // a build names its target's header; an editor reading this file, none
#define PAGEKV_ARCH "arch/generic.h"
#endif
#include PAGEKV_ARCH

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
