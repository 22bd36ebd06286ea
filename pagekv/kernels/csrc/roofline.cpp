// Machine peaks for the roofline: float32 FMAs, bf16 dot products, memory reads.
#include "kernels.h"
#include <omp.h>

#include "vec.h"

// Each thread: CHAINS independent chains of one instruction, `iters` times; the sum keeps them.
// Enough chains to cover an FMA's latency on both units, few enough that they and the two
// operands stay in registers on every target (AVX2 has 16; spilled chains halve the rate).
// Float32 FMAs and reads on the vector layer (so on every target, at its width).
constexpr int CHAINS = 12;
int f32_lanes() { return VF::W; }
int peak_chains() { return CHAINS; }

double fma_f32(long iters, int threads) {
    double total = 0;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        VF acc[CHAINS];
        for (int i = 0; i < CHAINS; ++i) acc[i] = VF::set1(1.0f + i);
        const VF a = VF::set1(0.999999f), b = VF::set1(1e-6f);
        for (long n = 0; n < iters; ++n)
            for (int i = 0; i < CHAINS; ++i) acc[i] = fma(acc[i], a, b);
        for (int i = 0; i < CHAINS; ++i) total += acc[i].reduce_add();
    }
    return total;
}

// Sum of n floats (n a multiple of 64), read once by `threads` threads.
double read_f32(const float* x, long n, int threads) {
    constexpr int W = VF::W;
    double total = 0;
    #pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
    for (long block = 0; block < n / 16384; ++block) {
        VF s[4] = {VF::zero(), VF::zero(), VF::zero(), VF::zero()};
        for (long i = block * 16384; i < (block + 1) * 16384; i += 4 * W)
            for (int j = 0; j < 4; ++j) s[j] = s[j] + VF::load(x + i + W * j);
        total += ((s[0] + s[1]) + (s[2] + s[3])).reduce_add();
    }
    return total;
}

// bf16 dot products where the target has them (arch/bf16_dot.h), else -1.
template <int N>
static double bf16_dot_peak(Portable, long, int) {
    return -1;
}
double dot_bf16(long iters, int threads) {
    return bf16_dot_peak<CHAINS>(Native{}, iters, threads);
}
