// The matmuls of GGUF weights in quantized stripes (quant.h), float32 or bfloat16 activations:
// one run of one format (quant_linear), a whole weight of runs as the layer halves multiply it
// (QuantDecodeMatmul), and a weight's rows read back (quant_weight_rows). A weight and its
// runs are kernels.h's QuantWeight and QuantRun.
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>
#include "kernels.h"
#include "layer_ops.h"
#include "quant_dot.h"

// GGUF weights against a batch of bfloat16 rows through bf16 tiles, where the target has a
// unit for them (arch/: each stripe dequantized once into the tiles a dense bf16 weight is
// packed in, then multiplied as that weight is; every weight the float32 the stripes give,
// rounded to the nearest bf16). The conversion costs about one pass of the stripes kernel, so
// only batches of QUANT_TILES_MIN_ROWS rows or more pay for it. Sums in one order, k
// ascending, for every row of such a batch.
static const long QUANT_TILES_MIN_ROWS = 8;

template <typename XT>
static bool quant_tiles_fit(long M, long K, long N) {
    return std::is_same<XT, uint16_t>::value && best_tile_unit() > 0 && STRIPE == 32 &&
           M >= QUANT_TILES_MIN_ROWS && K % 32 == 0 && N % STRIPE == 0;
}

// Where no unit multiplies tiles: declined (-1).
template <typename XT, class Stripes>
static int quant_tiles_multiply(Portable, const XT*, const Stripes&, XT*, long, long, long, long,
                                int) {
    return -1;
}

// One run's out [M, N] (row stride ldo) = x [M, K] @ its stripes^T. `dots`: int8 activations
// and integer dot products (quant_dot.h) where the format has them.
template <typename XT>
static int quant_linear(int bits, int group, int superblock, int offsets, int zero, int dots,
                        const XT* x, const void* packed, XT* out, long M, long K, long N,
                        long ldo, int threads) {
    if (superblock <= 0 || K % superblock != 0) return -1;
    return with_quant_format(bits, group, superblock, offsets, zero, [&](auto f) {
        using F = decltype(f);
        const QuantStripes<F> stripes{(const uint8_t*)packed, K};
        if constexpr (has_dots<F>())
            if (dots)
                return quant_dot_matmul(as_f32(x, M * K, threads), stripes, out, M, K, N, ldo,
                                        threads);
        if (quant_tiles_fit<XT>(M, K, N))
            return quant_tiles_multiply(Native{}, x, stripes, out, M, K, N, ldo, threads);
        return stripes_matmul(x, stripes, out, M, K, N, ldo, threads);
    });
}

// body(F{}) with the format of `run`; -1 if quant.h has none such.
template <class Body>
static int with_run_format(const QuantRun& run, Body body) {
    return with_quant_format(int(run.bits), int(run.group), int(run.superblock),
                             int(run.offsets), int(run.zero), body);
}

// Rows `ids` [n] of the weight as float32 [n, K]; -1 (nothing written) for an id outside every
// run.
static int quant_weight_rows(const QuantWeight& w, const int64_t* ids, long n, float* out,
                             long K) {
    std::vector<const QuantRun*> run_of(n, nullptr);  // each id's run, all checked first
    for (long i = 0; i < n; ++i)
        for (long r = 0; r < w.num_runs; ++r) {
            const QuantRun& run = w.runs[r];
            if (ids[i] >= run.first && ids[i] < run.first + run.columns) run_of[i] = &run;
        }
    for (long i = 0; i < n; ++i)
        if (run_of[i] == nullptr || K % run_of[i]->superblock != 0) return -1;
    int failed = 0;
    #pragma omp parallel for reduction(| : failed) if(n * K >= 65536)
    for (long i = 0; i < n; ++i) {
        const QuantRun& run = *run_of[i];
        failed |= with_run_format(run, [&](auto f) {
            quant_column<decltype(f)>((const uint8_t*)w.stripes + run.offset, ids[i] - run.first,
                                      out + i * K, K);
            return 0;
        });
    }
    return failed ? -1 : 0;
}

// A GGUF weight as the layer halves multiply it (layer_stack.h): each run by quant_linear.
struct QuantDecodeMatmul {
    const QuantWeight* w;
    const void* bias = nullptr;  // StackMatmul's
    static QuantDecodeMatmul of(const StackMatmul& m) { return {m.quant, m.bias}; }
    bool fits(long M, long K, long N) const {
        long columns = 0;
        for (long r = 0; r < w->num_runs; ++r) {
            const QuantRun& run = w->runs[r];
            const int ok = with_run_format(run, [](auto) { return 0; });
            if (ok != 0 || run.first != columns || run.columns % STRIPE != 0 ||
                K % run.superblock != 0)
                return false;
            columns += run.columns;
        }
        return M >= 1 && columns == N;
    }
    // silu_mul of this weight's output in one pass over it (stripes_gated), the same numbers:
    // where the weight is a gated MLP's 2I columns, gate's then up's, in one run or in a run
    // for each of one format, multiplied in stripes; -1 (nothing written) otherwise.
    template <typename T>
    int gated(const T* x, T* out, long M, long K, long I, int threads) const {
        if (!fits(M, K, 2 * I) || I % STRIPE != 0 || w->num_runs < 1 || w->num_runs > 2)
            return -1;
        const QuantRun &gate = w->runs[0], &up = w->runs[w->num_runs - 1];
        const bool one_run = w->num_runs == 1;
        if (gate.bits != up.bits || gate.group != up.group || gate.superblock != up.superblock ||
            gate.offsets != up.offsets || gate.zero != up.zero)
            return -1;
        if (w->dots != 0 || bias != nullptr || (!one_run && gate.columns != I)) return -1;
        if (quant_tiles_fit<T>(M, K, I)) return -1;
        const uint8_t* stripes = (const uint8_t*)w->stripes;
        return with_run_format(gate, [&](auto f) {
            using F = decltype(f);
            const uint8_t* up_at = one_run ? stripes + gate.offset + I / STRIPE * F::stripe_bytes(K)
                                           : stripes + up.offset;
            const auto epilogue = [](const T* g, const T* u, T* o) {
                silu_mul_row(g, u, o, STRIPE);
            };
            return stripes_gated(x, QuantStripes<F>{stripes + gate.offset, K},
                                 QuantStripes<F>{up_at, K}, out, M, K, I, threads, epilogue);
        });
    }
    template <typename T>
    void operator()(const T* x, T* out, long M, long K, long N, int threads) const {
        for (long r = 0; r < w->num_runs; ++r) {
            const QuantRun& run = w->runs[r];
            quant_linear(int(run.bits), int(run.group), int(run.superblock), int(run.offsets),
                         int(run.zero), int(w->dots), x, (const uint8_t*)w->stripes + run.offset,
                         out + run.first, M, K, run.columns, N, threads);
        }
        if (bias != nullptr) add_bias<T>(out, (const T*)bias, M, N);
    }
};
