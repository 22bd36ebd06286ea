// Machine peaks for the roofline: float32 FMAs, bf16 dot products, memory reads.
#include "kernels.h"
#include <immintrin.h>
#include <omp.h>

// Each thread: 16 independent chains of one instruction, `iters` times; the sum keeps them.
#if defined(__AVX512F__)
extern "C" double fma_f32(long iters, int threads) {
    double total = 0;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(1.0f + i);
        const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-6f);
        for (long n = 0; n < iters; ++n)
            for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
        for (int i = 0; i < 16; ++i) total += _mm512_reduce_add_ps(acc[i]);
    }
    return total;
}

// Sum of n floats (n a multiple of 64), read once by `threads` threads.
extern "C" double read_f32(const float* x, long n, int threads) {
    double total = 0;
    #pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
    for (long block = 0; block < n / 16384; ++block) {
        __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
        for (long i = block * 16384; i < (block + 1) * 16384; i += 64)
            for (int j = 0; j < 4; ++j) s[j] = _mm512_add_ps(s[j], _mm512_loadu_ps(x + i + 16 * j));
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s[0], s[1]),
                                                    _mm512_add_ps(s[2], s[3])));
    }
    return total;
}
#else
extern "C" double fma_f32(long, int) { return -1; }
extern "C" double read_f32(const float*, long, int) { return -1; }
#endif

#if defined(__AVX512BF16__)
extern "C" double dot_bf16(long iters, int threads) {
    double total = 0;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3A833A83);  // 0.001, twice
        for (long n = 0; n < iters; ++n)
            for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, a);
        for (int i = 0; i < 16; ++i) total += _mm512_reduce_add_ps(acc[i]);
    }
    return total;
}
#else
extern "C" double dot_bf16(long, int) { return -1; }
#endif
