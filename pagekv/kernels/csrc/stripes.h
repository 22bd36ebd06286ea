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

// How far ahead of itself a single pass over stripes (a few rows, bound by how fast memory
// streams to the core) requests each stripe's bytes into L2. Each call's streams start cold,
// and the hardware prefetcher, which restarts at every 4 KiB boundary, keeps too few lines in
// flight to fill the core's share of the memory bandwidth by itself.
static const long STREAM_AHEAD_BYTES = 3072;

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

// A source whose reader requests other bytes (from address `next`, 0 for none) into L2 as it
// goes, `slice` bytes per group of k's: another stripe, or the source's own bytes further on
// (`ahead`). Requested all at once, a stripe's lines would fill the core's miss buffers and
// stall the pass until they arrive. An address, not a pointer: `ahead` requests bytes past the
// end of a weight's last stripe (a prefetch never faults; a pointer there would be invalid).
template <class Src>
struct Fetching {
    static constexpr int GROUP = Src::GROUP;
    Src src;
    uintptr_t next;
    long slice;
    auto group(long k0) const {
        if (next != 0) prefetch_l2((const void*)(next + k0 / GROUP * slice), slice);
        return src.group(k0);
    }
};

// `src` (of a Stripes' stripes, K deep) requesting its own bytes STREAM_AHEAD_BYTES ahead of
// its reads: past its end, those of the stripe after it in memory.
template <class Stripes>
static Fetching<typename Stripes::Source> ahead(const Stripes& stripes, long s, long K) {
    const auto src = stripes.at(s);
    const long slice = stripes.stripe_bytes() * Stripes::Source::GROUP / K;
    return {src, uintptr_t(src.p) + STREAM_AHEAD_BYTES, slice};
}

// Rows [0, block) of x (row stride K) against one stripe into out (row stride ldo), in passes
// of rows split evenly; `next`: the stripe this thread reads after it (null for none), requested
// into L2 during the first pass (the hardware prefetcher loses a stream that many passes apart).
template <class Src, typename XT>
static void stripe_passes(const float* x, const Src& src, long stripe_bytes, const char* next,
                          long block, XT* out, long K, long ldo) {
    const long passes = (block + STRIPE_ROWS - 1) / STRIPE_ROWS;
    // the first pass through `head`, the rest through `rest`
    const auto run = [&](const auto& head, const auto& rest) {
        for (long pass = 0; pass < passes; ++pass) {
            const long m0 = block * pass / passes, rows = block * (pass + 1) / passes - m0;
            if (pass == 0) stripe_rows<STRIPE_ROWS, 1>(x + m0 * K, rows, &head, out + m0 * ldo, K, ldo);
            else stripe_rows<STRIPE_ROWS, 1>(x + m0 * K, rows, &rest, out + m0 * ldo, K, ldo);
        }
    };
    const long slice = (stripe_bytes * Src::GROUP / K + 63) / 64 * 64;
    if constexpr (Src::WIDEN) {
        if (passes > 1) {
            static thread_local std::vector<float> wide;
            if (long(wide.size()) < K * STRIPE) wide.resize(K * STRIPE);
            const Widening<Src> widening{src, wide.data()};
            return run(Fetching<Widening<Src>>{widening, uintptr_t(next), slice},
                       DenseStripe<float>{wide.data()});
        }
    }
    run(Fetching<Src>{src, uintptr_t(next), slice}, src);
}

// This thread's share [s0, s1) of `count` stripes or pairs of them.
static inline std::pair<long, long> thread_share(long count) {
    const long t = omp_get_thread_num(), nt = omp_get_num_threads();
    return {count * t / nt, count * (t + 1) / nt};
}

// out [M, N] (row stride ldo) = x [M, K] @ the N columns of `stripes`; -1 for a shape it
// cannot take.
template <class Stripes, typename XT>
static int stripes_matmul(const XT* x, const Stripes& stripes, XT* out, long M, long K, long N,
                          long ldo, int threads) {
    using Src = typename Stripes::Source;
    if (M < 1 || K < 1 || N % STRIPE != 0 || K % Src::GROUP != 0 || ldo < N) return -1;
    const float* xs = as_f32(x, M * K, threads);
    #pragma omp parallel num_threads(threads)
    {
        const auto [s0, s1] = thread_share(N / STRIPE);
        for (long first = 0; first < M; first += STRIPE_ROW_BLOCK) {
            const long block = M - first < STRIPE_ROW_BLOCK ? M - first : STRIPE_ROW_BLOCK;
            const float* xb = xs + first * K;
            XT* ob = out + first * ldo;
            for (long s = s0; s < s1; ++s) {
                if (block <= PAIR_ROWS && s + 1 < s1) {  // one pass of a few rows
                    const Fetching<Src> pair[2] = {ahead(stripes, s, K), ahead(stripes, s + 1, K)};
                    stripe_rows<PAIR_ROWS, 2>(xb, block, pair, ob + s * STRIPE, K, ldo);
                    ++s;
                    continue;
                }
                const char* next = s + 1 < s1 ? (const char*)stripes.at(s + 1).p : nullptr;
                stripe_passes(xb, stripes.at(s), stripes.stripe_bytes(), next, block,
                              ob + s * STRIPE, K, ldo);
            }
        }
    }
    return 0;
}

// out [M, I] = epilogue of x @ gate's I columns and x @ up's (a gated MLP's two halves, the
// same Stripes type): a stripe of each at a time, computed as stripes_matmul computes it (the
// same numbers) into this thread's buffer, then `epilogue(g, u, o)` on each row's STRIPE
// columns of both, so that the [M, 2I] halves are never written out. -1 for a shape it cannot
// take.
template <class Stripes, typename XT, class Epilogue>
static int stripes_gated(const XT* x, const Stripes& gate, const Stripes& up, XT* out, long M,
                         long K, long I, int threads, Epilogue epilogue) {
    using Src = typename Stripes::Source;
    if (M < 1 || K < 1 || I % STRIPE != 0 || K % Src::GROUP != 0) return -1;
    const float* xs = as_f32(x, M * K, threads);
    static const long WIDTH = 2 * STRIPE;  // a row of the buffer: gate's columns, then up's
    #pragma omp parallel num_threads(threads)
    {
        static thread_local std::vector<XT> buffer(STRIPE_ROW_BLOCK * WIDTH);
        XT* both = buffer.data();
        const auto [s0, s1] = thread_share(I / STRIPE);
        for (long first = 0; first < M; first += STRIPE_ROW_BLOCK) {
            const long block = M - first < STRIPE_ROW_BLOCK ? M - first : STRIPE_ROW_BLOCK;
            const float* xb = xs + first * K;
            for (long s = s0; s < s1; ++s) {
                if (block <= PAIR_ROWS) {  // one pass of a few rows over both
                    const Fetching<Src> pair[2] = {ahead(gate, s, K), ahead(up, s, K)};
                    stripe_rows<PAIR_ROWS, 2>(xb, block, pair, both, K, WIDTH);
                } else {
                    const char* next = s + 1 < s1 ? (const char*)gate.at(s + 1).p : nullptr;
                    stripe_passes(xb, gate.at(s), gate.stripe_bytes(), (const char*)up.at(s).p,
                                  block, both, K, WIDTH);
                    stripe_passes(xb, up.at(s), up.stripe_bytes(), next, block, both + STRIPE,
                                  K, WIDTH);
                }
                for (long m = 0; m < block; ++m)
                    epilogue(both + m * WIDTH, both + m * WIDTH + STRIPE,
                             out + (first + m) * I + s * STRIPE);
            }
        }
    }
    return 0;
}
