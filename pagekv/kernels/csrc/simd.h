// The x86 intrinsics, included once for every kernel. GCC 12's AVX-512 headers trip
// -W(maybe-)uninitialized on their own deliberately undefined values once inlined (GCC bug
// 105593); the warning is silenced for the headers' lines only, not for the kernels.
#pragma once
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif
