// What a kernel target's header defines. Every target of pagekv/kernels/isa.py's TARGETS is one
// header here, arch/<target>.h, with all of that target's intrinsics; the build names it
// (-DPAGEKV_ARCH="arch/<target>.h") and vec.h includes it. The kernels are written once, on
// what these headers define, and hold no instruction-set branches (tests/kernels/
// test_kernels.py names the files that still do). Adding a target: its header and its entry in
// TARGETS (the compiler flags that select its instruction sets, the CPU features it needs);
// the compile check (python -m pagekv.kernels.check) builds every library for it on any x86-64
// machine. Files here that are not a target's name are parts that several targets' headers
// include (avx512_common.h, bf16_dot.h, x86_intrinsics.h).
//
// Each target header defines:
//   VF               float32 lanes: W, REGS, zero, set1, load (float32, bf16), load_half (fp16),
//                    load_first, store (float32, bf16), store_first, in_register, any_nan,
//                    first_equal, keep_first, reduce_add, reduce_max; + - *, fma, max, floor,
//                    pow2 (vec.h says how they round)
//   load_quants<BITS>  one k of a quantized stripe as two VF (vec.h)
//   VD, load_quads<BITS>, DOT_BIAS<BITS>, dot4<BITS>   int32 lanes and byte dot products
//                    (quant_dot.h)
//   best_tile_unit()   what multiplies packed bf16 tiles here (isa.TILE_UNITS' codes; 0: none)
// and may define its own body of a step that also has a portable body in the kernel's file
// (on VF, or one that declines): the portable body takes `Portable` as its first parameter, a
// target's own `Native`, and the kernel calls it with Native{}: the target's body where its
// header has one (an exact match beats the conversion to the base), the portable one
// elsewhere. Such steps:
//   scores16, pv_group, scores16_pairs    decode_rows.h (the decode kernel)
//   tiles_multiply, quant_tiles_multiply  dense_tiles.h, quant_matmul.h (bf16 tiles; the
//                                         portable body declines)
//   bf16_dot_peak                         roofline.cpp
#pragma once

struct Portable {};
struct Native : Portable {};
