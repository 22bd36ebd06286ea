// GGUF weights against int8 activations: the quantized stripes of quant.h multiplied with
// integer dot products, as llama.cpp multiplies its Q8 blocks.
//
// Each row of x is rounded per group of 32 inputs: q8 = round(x / a), a = max|x| / 127 (the
// group's scale). A weight group of 32 (or 16) inputs is w = s * q + m per column (quant.h), so
//   sum_k w_k * (a * q8_k) = s * a * sum_k q_k * q8_k + m * a * sum_k q8_k,
// the first sum exact in int32 (the second over the weight group's inputs: Q6_K's groups of 16
// take the sums of each half of a rounding group). A row's output is the float32 dot product
// of the exact weights with its rounded activations, up to float32 rounding; a row is rounded
// alone, so its output does not depend on the batch either. Every format of quant.h has them
// (has_dots<F>()): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K.
//
// Per target (its arch/ header): VD, W int32 lanes; load_quads<BITS>(rows, u0, u1), k rows
// [0, 4) of a stripe regrouped so that lane c of u0 holds column c's 4 quants as bytes, k
// ascending (u1: column W + c's: one byte permute each with AVX512-VBMI, else dword and byte
// shuffles; 5- and 6-bit quants with their high bits moved in by a bit test per byte);
// dot4<BITS>(acc, u, x) adds to each lane the sum over its 4 bytes of
// (u - DOT_BIAS<BITS>) * x, x 4 signed bytes in every lane. Where the dot product takes
// unsigned bytes as they are (VNNI, the generic body) the bias is 0; vpmaddubsw's pairs would
// overflow int16 at 8 bits, so there the 8-bit quants go in as signed (u - 128), with signs
// moved onto x.
//
// A batch of rows is multiplied a stripe at a time: a few rows straight from the stripe, more
// from its quads unpacked once into the thread's buffer (L2), so that unpacking is paid per
// stripe rather than per pass of rows. Every row's sums are the same in either way.
#pragma once
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "quant.h"

static const int DOT_GROUP = 32;  // the activations' rounding group: a multiple of every format's
template <class F>
static constexpr bool has_dots() {
    return F::BITS >= 4 && F::BITS <= 8 && F::BITS != 7 && DOT_GROUP % F::GROUP == 0;
}
// rows of a pass: two int32 and two float32 sums each in registers, beside the quads
static const int DOT_ROWS = VF::REGS >= 32 ? 4 : 2;

// x [M, K] rounded per group: q [M, K], and per group its scale a, a * sum(q), and a * the sum
// of each half (halves: 2 per group).
struct Int8Rows {
    const int8_t* q;
    const float* scale;
    const float* qsum;
    const float* halves;
    long K;
};

static Int8Rows round_rows(const float* x, long M, long K, int threads) {
    static thread_local std::vector<int8_t> q;
    static thread_local std::vector<float> scales;
    const long groups = M * (K / DOT_GROUP);
    if (long(q.size()) < M * K) q.resize(M * K);
    if (long(scales.size()) < 4 * groups) scales.resize(4 * groups);
    int8_t* qs = q.data();
    float *scale = scales.data(), *qsum = scale + groups, *halves = qsum + groups;
    #pragma omp parallel for num_threads(threads) if(M * K >= 65536)
    for (long g = 0; g < groups; ++g) {  // K is a multiple of the group: group g at g * 32
        const float* xg = x + g * DOT_GROUP;
        VF largest = VF::zero();  // |x| lane by lane; max(a, b) is b where a is NaN
        for (int i = 0; i < DOT_GROUP; i += VF::W) {
            const VF v = VF::load(xg + i);
            largest = max(max(v, VF::zero() - v), largest);
        }
        const float amax = largest.reduce_max();
        const float inverse = amax > 0.f ? 127.f / amax : 0.f;
        int half[2] = {0, 0};
        for (int i = 0; i < DOT_GROUP; ++i) {
            const float r = std::nearbyint(xg[i] * inverse);
            const int v = int(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
            qs[g * DOT_GROUP + i] = int8_t(v);
            half[i / (DOT_GROUP / 2)] += v;
        }
        scale[g] = amax / 127.f;
        qsum[g] = scale[g] * float(half[0] + half[1]);
        halves[2 * g] = scale[g] * float(half[0]);
        halves[2 * g + 1] = scale[g] * float(half[1]);
    }
    return {qs, scale, qsum, halves, K};
}

// Where a stripe's numbers come from, as dot_block reads them: per weight group at k0 its
// scales s0, s1 and the offsets the biased sums need, o = m + DOT_BIAS * s (exact: a power of
// two times s), and its quads j = 0 .. GROUP / 4 - 1 as dot4 takes them.
// Read from the stripe itself (load_quads unpacks them each time: one pass of a few rows)...
template <class F>
struct PackedQuads {
    const QuantStripe<F>& src;
    struct Group {
        VF s0, s1, o0, o1;
        const uint8_t* rows;
        void quads(int j, VD& u0, VD& u1) const {
            load_quads<F::BITS>(rows + 4 * j * F::ROW_BYTES, u0, u1);
        }
    };
    Group at(long k0) const {
        const auto g = src.group(k0);
        const VF bias = VF::set1(float(DOT_BIAS<F::BITS>));
        return {g.s0, g.s1, fma(g.s0, bias, g.m0), fma(g.s1, bias, g.m1), g.rows};
    }
};

// ... or unpacked once into a buffer of the thread's, where many rows go through the stripe:
// the unpacking (the high bits' shuffles and tests) is then paid once, not once per DOT_ROWS.
template <class F>
struct UnpackedQuads {
    struct Group {
        VF s0, s1, o0, o1;
        VD q[F::GROUP / 4][2];
        void quads(int j, VD& u0, VD& u1) const {
            u0 = q[j][0];
            u1 = q[j][1];
        }
    };
    const Group* groups;
    const Group& at(long k0) const { return groups[k0 / F::GROUP]; }
};
// (a static function's buffer: one per library built, where a member function's static would
// be one object shared by every target's library loaded in the process, each its own size)
template <class F>
static UnpackedQuads<F> unpack_stripe(const QuantStripe<F>& src, long K) {
    using Group = typename UnpackedQuads<F>::Group;
    static thread_local std::vector<Group> buffer;
    if (long(buffer.size()) < K / F::GROUP) buffer.resize(K / F::GROUP);
    const PackedQuads<F> packed{src};
    for (long k0 = 0; k0 < K; k0 += F::GROUP) {
        const auto g = packed.at(k0);
        Group& u = buffer[k0 / F::GROUP];
        u.s0 = g.s0, u.s1 = g.s1, u.o0 = g.o0, u.o1 = g.o1;
        for (int j = 0; j < F::GROUP / 4; ++j) g.quads(j, u.q[j][0], u.q[j][1]);
    }
    return {buffer.data()};
}
// rows through one stripe from which its quads are unpacked first (more than one pass of
// DOT_ROWS), and the rows of a pass then: with no unpacking in the loop, registers hold more
// rows' sums
static const long DOT_UNPACK_MIN_ROWS = DOT_ROWS + 1;
static const int DOT_TILE_ROWS = VF::REGS >= 32 ? 6 : 3;

// Rows [m0, m0 + R) of x against one stripe's quads (PackedQuads or UnpackedQuads) -> out
// (row stride ldo).
template <int R, class F, class Quads, typename OT>
static inline void dot_block(const Int8Rows& x, long m0, const Quads& src, OT* out, long ldo) {
    const long K = x.K, groups = K / DOT_GROUP;
    VF acc[R][2];
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = VF::zero();
    constexpr int PARTS = DOT_GROUP / F::GROUP;  // weight groups per rounding group: 1 or 2
    for (long g = 0; g < groups; ++g)
        for (int part = 0; part < PARTS; ++part) {
            const long k0 = g * DOT_GROUP + part * F::GROUP;
            const auto& group = src.at(k0);
            // no software prefetch: a thread reads its stripes front to back, which the
            // hardware prefetchers follow; requests of its own only took load slots from the
            // dot products. P chains of dot products per sum, quads j = p, p + P, ...: with
            // few rows one chain would wait on each dot product's latency; int32 sums are
            // exact in any order, so the chains change no bit
            constexpr int P = R <= 2 ? 2 : 1;
            VD sum[R][2][P];
            for (int m = 0; m < R; ++m)
                for (int p = 0; p < P; ++p) sum[m][0][p] = sum[m][1][p] = VD::zero();
            for (int j = 0; j < F::GROUP / 4; j += P)
                for (int p = 0; p < P; ++p) {
                    VD u0, u1;
                    group.quads(j + p, u0, u1);
                    for (int m = 0; m < R; ++m) {
                        int32_t quad;
                        std::memcpy(&quad, x.q + (m0 + m) * K + k0 + 4 * (j + p), 4);
                        const VD xq = VD::set1(quad);
                        sum[m][0][p] = dot4<F::BITS>(sum[m][0][p], u0, xq);
                        sum[m][1][p] = dot4<F::BITS>(sum[m][1][p], u1, xq);
                    }
                }
            for (int m = 0; m < R; ++m)
                for (int p = 1; p < P; ++p) {
                    sum[m][0][0] = sum[m][0][0] + sum[m][0][p];
                    sum[m][1][0] = sum[m][1][0] + sum[m][1][p];
                }
            for (int m = 0; m < R; ++m) {
                const long at = (m0 + m) * groups + g;
                const VF a = VF::set1(x.scale[at]);
                const VF qs = VF::set1(PARTS == 1 ? x.qsum[at] : x.halves[2 * at + part]);
                acc[m][0] =
                    fma(group.o0, qs, fma(sum[m][0][0].to_float(), group.s0 * a, acc[m][0]));
                acc[m][1] =
                    fma(group.o1, qs, fma(sum[m][1][0].to_float(), group.s1 * a, acc[m][1]));
            }
        }
    for (int m = 0; m < R; ++m) {
        acc[m][0].store(out + m * ldo);
        acc[m][1].store(out + m * ldo + VF::W);
    }
}

template <int R, class F, class Quads, typename OT>
static void dot_rows(const Int8Rows& x, long m0, long rows, const Quads& src, OT* out, long ldo) {
    if (rows == R) return dot_block<R, F>(x, m0, src, out, ldo);
    if constexpr (R > 1) dot_rows<R - 1, F>(x, m0, rows, src, out, ldo);
}

// out [M, N] (row stride ldo) = x [M, K] rounded to int8 groups @ the N columns of
// `stripes`; each thread owns a range of stripes and takes every row through each (a stripe
// stays in L1/L2 while the rounded rows go by). -1 for a shape it cannot take.
template <class F, typename OT>
static int quant_dot_matmul(const float* x, const QuantStripes<F>& stripes, OT* out, long M,
                            long K, long N, long ldo, int threads) {
    static_assert(has_dots<F>(), "a format of 4- to 8-bit quants in groups within 32 inputs");
    if (M < 1 || K % F::SUPER != 0 || N % STRIPE != 0 || ldo < N) return -1;
    const Int8Rows rounded = round_rows(x, M, K, threads);
    const long count = N / STRIPE;
    #pragma omp parallel num_threads(threads)
    {
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (long s = count * t / nt; s < count * (t + 1) / nt; ++s) {
            const auto stripe = stripes.at(s);
            const auto through = [&](const auto& quads, auto rows_per_block) {
                constexpr int R = decltype(rows_per_block)::value;
                for (long m0 = 0; m0 < M; m0 += R) {
                    const long rows = M - m0 < R ? M - m0 : R;
                    dot_rows<R, F>(rounded, m0, rows, quads, out + m0 * ldo + s * STRIPE, ldo);
                }
            };
            if (M >= DOT_UNPACK_MIN_ROWS)
                through(unpack_stripe(stripe, K), std::integral_constant<int, DOT_TILE_ROWS>{});
            else
                through(PackedQuads<F>{stripe}, std::integral_constant<int, DOT_ROWS>{});
        }
    }
    return 0;
}
