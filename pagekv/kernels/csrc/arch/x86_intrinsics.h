// The x86 intrinsics, for the x86 targets' headers. GCC 12's AVX-512 headers trip
// -W(maybe-)uninitialized on their own deliberately undefined values once inlined (GCC bug
// 105593); the warning is silenced for the headers' lines only, not for the kernels.
#pragma once
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
