// Matmul through stripes, on every target: out [M, N] = x [M, K] @ w [N, K]^T for any M, with
// w packed once at load in stripes of STRIPE = 2 vectors of columns (a stripe's k-th row: its
// columns' weights at k). What a stripe holds is its source's business: float32 or bfloat16
// weights, [N/STRIPE][K][STRIPE] (DenseStripes; bf16 widened in registers: half the bytes
// streamed, float32 arithmetic), or GGUF quant blocks (quant.h), dequantized in registers.
// Up to STRIPE_ROWS rows x STRIPE columns of sums in registers, one FMA per row and weight
// vector, k ascending: every output is one chain of FMAs in one order whatever M is, so a
// row's numbers do not depend on its batch. Each thread owns a range of stripes; rows go in
// blocks of STRIPE_ROW_BLOCK (that block of x stays in cache while the stripes stream by, and
// a stripe of blocks is widened once per block), each block in passes of up to STRIPE_ROWS
// rows split evenly. bfloat16 activations are widened
// once per call into float32 scratch, and outputs rounded to the activations' type once, at
// the end of each chain.
#pragma once
#include <omp.h>
#include <cstdint>
#include <utility>
#include <vector>
#include "vec.h"

static const int STRIPE = 2 * VF::W;
// sums in registers: 2 per row, with 2 weight vectors and a broadcast beside them
static const int STRIPE_ROWS = (VF::REGS - 3) / 2 < 12 ? (VF::REGS - 3) / 2 : 12;
static const long STRIPE_ROW_BLOCK = 240;  // on every target: AVX2's narrower passes too

// A source is what one stripe's weights are read through: ``group(k0)`` for the GROUP k's
// from k0 (K is a multiple of GROUP), whose ``weights(kk, w0, w1)`` gives the two weight
// vectors at k0 + kk. WIDEN: whether the weights are not float32 as stored, so that several
// passes over a stripe read it widened once (Widening below) instead of each widening it.
template <typename WT>
struct DenseStripe {
    static constexpr int GROUP = 1;
    static constexpr bool WIDEN = sizeof(WT) != sizeof(float);
    const WT* p;  // [K][STRIPE]
    struct Group {
        const WT* row;
        void weights(int, VF& w0, VF& w1) const {
            w0 = VF::load(row);
            w1 = VF::load(row + VF::W);
        }
    };
    Group group(long k0) const { return {p + k0 * STRIPE}; }
};

// All stripes of a dense weight: stripe s at p + s * K * STRIPE.
template <typename WT>
struct DenseStripes {
    using Source = DenseStripe<WT>;
    const WT* p;
    long K;
    Source at(long s) const { return {p + s * K * STRIPE}; }
    long stripe_bytes() const { return K * STRIPE * long(sizeof(WT)); }
};

template <typename WT>
static void stripes_pack(const WT* ws, WT* ps, long N, long K) {
    #pragma omp parallel for
    for (long s = 0; s < N / STRIPE; ++s)
        for (long k = 0; k < K; ++k)
            for (int c = 0; c < STRIPE; ++c)
                ps[(s * K + k) * STRIPE + c] = ws[(s * STRIPE + c) * K + k];
}

// Passes of at most this many rows take NS = 2 neighbouring stripes at once: twice the
// independent sums, so that a few rows' chains of FMAs do not wait on each other's latency.
static const int PAIR_ROWS = VF::REGS >= 32 ? 4 : 2;

// rows [0, R) of x (row stride K) against NS neighbouring stripes: R x NS * STRIPE sums in
// registers, written to out (row stride ldo). Each sum is the same chain whatever R and NS.
template <int R, int NS, class Src, typename OT>
static inline void stripe_block(const float* x, const Src* src, OT* out, long K, long ldo) {
    VF acc[R][2 * NS];
    for (int m = 0; m < R; ++m)
        for (int v = 0; v < 2 * NS; ++v) acc[m][v] = VF::zero();
    for (long k0 = 0; k0 < K; k0 += Src::GROUP) {
        decltype(src[0].group(k0)) group[NS];
        for (int j = 0; j < NS; ++j) group[j] = src[j].group(k0);
        for (int kk = 0; kk < Src::GROUP; ++kk) {
            VF w[2 * NS];
            for (int j = 0; j < NS; ++j) group[j].weights(kk, w[2 * j], w[2 * j + 1]);
            const long k = k0 + kk;
            for (int m = 0; m < R; ++m) {
                const VF xm = VF::set1(x[m * K + k]);
                for (int v = 0; v < 2 * NS; ++v) acc[m][v] = fma(xm, w[v], acc[m][v]);
            }
        }
    }
    for (int m = 0; m < R; ++m)
        for (int v = 0; v < 2 * NS; ++v) acc[m][v].store(out + m * ldo + v * VF::W);
}

template <int R, int NS, class Src, typename OT>
static void stripe_rows(const float* x, long rows, const Src* src, OT* out, long K, long ldo) {
    if (rows == R) return stripe_block<R, NS>(x, src, out, K, ldo);
    if constexpr (R > 1) stripe_rows<R - 1, NS>(x, rows, src, out, K, ldo);
}

// x as float32: itself, or widened from bfloat16 into this thread's scratch.
static inline const float* as_f32(const float* x, long, int) { return x; }
static inline const float* as_f32(const uint16_t* x, long n, int threads) {
    static thread_local std::vector<float> widened;
    if (long(widened.size()) < n) widened.resize(n);
    float* w = widened.data();
    #pragma omp parallel for num_threads(threads) if(n >= 65536)
    for (long i = 0; i < n; ++i) w[i] = bf16_to_f32(x[i]);
    return w;
}

// A stripe read through its source that also writes what it reads into `wide` ([K][STRIPE],
// this thread's, in L2): the first pass over a stripe widens it for the passes after it, which
// then multiply float32 without widening again (the same numbers, so the same sums). Widening
// inside that pass hides the stores and the wait for the stripe's bytes behind its FMAs; a
// single pass (a few rows, memory-bound) reads the stripe itself, fewer bytes.
template <class Src>
struct Widening {
    static constexpr int GROUP = Src::GROUP;
    Src src;
    float* wide;
    struct Group {
        decltype(std::declval<Src>().group(0)) from;
        float* to;
        void weights(int kk, VF& w0, VF& w1) const {
            from.weights(kk, w0, w1);
            w0.store(to + kk * STRIPE);
            w1.store(to + kk * STRIPE + VF::W);
        }
    };
    Group group(long k0) const { return {src.group(k0), wide + k0 * STRIPE}; }
};

// A source whose reader requests another stripe (`next`, null for none) into L2 as it goes,
// `slice` bytes per group of k's: requested all at once, a stripe's lines would fill the
// core's miss buffers and stall the pass until they arrive.
template <class Src>
struct Fetching {
    static constexpr int GROUP = Src::GROUP;
    Src src;
    const char* next;
    long slice;
    auto group(long k0) const {
        if (next != nullptr) prefetch_l2(next + k0 / GROUP * slice, slice);
        return src.group(k0);
    }
};

// out [M, N] (row stride ldo) = x [M, K] @ the N columns of `stripes`; -1 for a shape it
// cannot take.
template <class Stripes, typename XT>
static int stripes_matmul(const XT* x, const Stripes& stripes, XT* out, long M, long K, long N,
                          long ldo, int threads) {
    using Src = typename Stripes::Source;
    if (M < 1 || K < 1 || N % STRIPE != 0 || K % Src::GROUP != 0 || ldo < N) return -1;
    const float* xs = as_f32(x, M * K, threads);
    const long count = N / STRIPE;
    #pragma omp parallel num_threads(threads)
    {
        static thread_local std::vector<float> wide;
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long s0 = count * t / nt, s1 = count * (t + 1) / nt;
        for (long first = 0; first < M; first += STRIPE_ROW_BLOCK) {
            const long block = M - first < STRIPE_ROW_BLOCK ? M - first : STRIPE_ROW_BLOCK;
            const long passes = (block + STRIPE_ROWS - 1) / STRIPE_ROWS;
            for (long s = s0; s < s1; ++s) {
                if (block <= PAIR_ROWS && s + 1 < s1) {  // one pass of a few rows
                    const Src pair[2] = {stripes.at(s), stripes.at(s + 1)};
                    stripe_rows<PAIR_ROWS, 2>(xs + first * K, block, pair,
                                              out + first * ldo + s * STRIPE, K, ldo);
                    ++s;
                    continue;
                }
                // passes of rows split evenly: the first through `head`, the rest through `rest`
                const auto run = [&](const auto& head, const auto& rest) {
                    for (long pass = 0; pass < passes; ++pass) {
                        const long m0 = first + block * pass / passes;
                        const long rows = first + block * (pass + 1) / passes - m0;
                        const float* xm = xs + m0 * K;
                        XT* o = out + m0 * ldo + s * STRIPE;
                        if (pass == 0) stripe_rows<STRIPE_ROWS, 1>(xm, rows, &head, o, K, ldo);
                        else stripe_rows<STRIPE_ROWS, 1>(xm, rows, &rest, o, K, ldo);
                    }
                };
                const Src src = stripes.at(s);
                // the next stripe, into L2 during this one's first pass (the hardware
                // prefetcher loses a stream that many passes apart)
                const char* next = s + 1 < s1 ? (const char*)stripes.at(s + 1).p : nullptr;
                const long slice = (stripes.stripe_bytes() * Src::GROUP / K + 63) / 64 * 64;
                if constexpr (Src::WIDEN) {
                    if (passes > 1) {
                        if (long(wide.size()) < K * STRIPE) wide.resize(K * STRIPE);
                        const Widening<Src> widening{src, wide.data()};
                        run(Fetching<Widening<Src>>{widening, next, slice},
                            DenseStripe<float>{wide.data()});
                        continue;
                    }
                }
                run(Fetching<Src>{src, next, slice}, src);
            }
        }
    }
    return 0;
}
