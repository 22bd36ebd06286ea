// GGUF weights against int8 activations: the quantized stripes of quant.h multiplied with
// integer dot products, as llama.cpp multiplies its Q8 blocks.
//
// Each row of x is rounded per group of 32 inputs: q8 = round(x / a), a = max|x| / 127 (the
// group's scale). A weight group of 32 inputs is w = s * q + m per column (quant.h), so
//   sum_k w_k * (a * q8_k) = s * a * sum_k q_k * q8_k + m * a * sum_k q8_k,
// the first sum exact in int32. A row's output is the float32 dot product of the exact weights
// with its rounded activations, up to float32 rounding; a row is rounded alone, so its output
// does not depend on the batch either. For the formats whose quants are 4 or 8 bits in groups
// of 32 (Q8_0, Q4_0, Q4_1, Q4_K): has_dots<F>(); the others keep the float32 kernel.
//
// Per target (vec.h's): VD, W int32 lanes; load_quads<BITS>(rows, u0, u1), k rows [0, 4) of a
// stripe regrouped so that lane c of u0 holds column c's 4 quants as bytes, k ascending (u1:
// column W + c's: one byte permute each with AVX512-VBMI, else dword and byte shuffles); dot4<BITS>(acc, u, x) adds to each lane the sum over its 4 bytes of
// (u - DOT_BIAS<BITS>) * x, x 4 signed bytes in every lane. Where the dot product takes
// unsigned bytes as they are (VNNI, the generic body) the bias is 0; vpmaddubsw's pairs would
// overflow int16 at 8 bits, so there the 8-bit quants go in as signed (u - 128), with signs
// moved onto x.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "quant.h"

#if defined(__AVX512F__)
struct VD {
    __m512i v;
    static VD zero() { return {_mm512_setzero_si512()}; }
    static VD set1(int32_t x) { return {_mm512_set1_epi32(x)}; }
    VF to_float() const { return {_mm512_cvtepi32_ps(v)}; }
    VD operator+(VD o) const { return {_mm512_add_epi32(v, o.v)}; }
};
// 128-bit lane k: the 16 quant bytes of columns 0-15 at k -> lane c: column c's 4 bytes.
static inline __m512i quads_of(__m512i rows) {
    const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i bytes = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(dwords, rows), bytes);
}
#if defined(__AVX512VBMI__)
// Byte 4c + k of a quad <- byte ROW * k + FIRST + c of its rows: one byte permute regroups it.
template <int ROW, int FIRST>
struct QuadIndex {
    alignas(64) uint8_t bytes[64];
    constexpr QuadIndex() : bytes() {
        for (int i = 0; i < 64; ++i) bytes[i] = uint8_t(ROW * (i % 4) + FIRST + i / 4);
    }
};
template <int ROW, int FIRST>
static inline __m512i quad_index() {
    static constexpr QuadIndex<ROW, FIRST> index;
    return _mm512_load_si512(index.bytes);
}
template <int BITS>
static inline void load_quads(const uint8_t* rows, VD& u0, VD& u1) {
    if constexpr (BITS == 4) {  // 4 rows of 16 bytes: (k, c) at 16k + c, low and high fields
        const __m512i v = _mm512_loadu_si512(rows), low = _mm512_set1_epi8(15);
        const __m512i index = quad_index<16, 0>();
        u0 = {_mm512_permutexvar_epi8(index, _mm512_and_si512(v, low))};
        u1 = {_mm512_permutexvar_epi8(index, _mm512_and_si512(_mm512_srli_epi16(v, 4), low))};
    } else {  // 4 rows of 32 bytes: (k, c) at 32k + c of the 128 bytes a, b
        const __m512i a = _mm512_loadu_si512(rows), b = _mm512_loadu_si512(rows + 64);
        u0 = {_mm512_permutex2var_epi8(a, quad_index<32, 0>(), b)};
        u1 = {_mm512_permutex2var_epi8(a, quad_index<32, 16>(), b)};
    }
}
#else
template <int BITS>
static inline void load_quads(const uint8_t* rows, VD& u0, VD& u1) {
    if constexpr (BITS == 4) {  // 4 rows of 16 bytes
        const __m512i v = _mm512_loadu_si512(rows), low = _mm512_set1_epi8(15);
        u0 = {quads_of(_mm512_and_si512(v, low))};
        u1 = {quads_of(_mm512_and_si512(_mm512_srli_epi16(v, 4), low))};
    } else {  // 4 rows of 32 bytes: 128-bit lanes k0 c0-15, k0 c16-31, k1 c0-15, ...
        const __m512i a = _mm512_loadu_si512(rows), b = _mm512_loadu_si512(rows + 64);
        u0 = {quads_of(_mm512_shuffle_i64x2(a, b, 0x88))};
        u1 = {quads_of(_mm512_shuffle_i64x2(a, b, 0xDD))};
    }
}
#endif
#if defined(__AVX512VNNI__)
template <int BITS>
static constexpr int DOT_BIAS = 0;
template <int BITS>
static inline VD dot4(VD acc, VD u, VD x) {
    return {_mm512_dpbusd_epi32(acc.v, u.v, x.v)};
}
#else
template <int BITS>
static constexpr int DOT_BIAS = BITS == 8 ? 128 : 0;
template <int BITS>
static inline VD dot4(VD acc, VD u, VD x) {
    __m512i a = u.v, b = x.v;
    if constexpr (BITS == 8) {
        const __m512i w = _mm512_xor_si512(u.v, _mm512_set1_epi8(char(0x80)));
        a = _mm512_abs_epi8(w);
        b = _mm512_mask_sub_epi8(x.v, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x.v);
    }
    const __m512i pairs = _mm512_maddubs_epi16(a, b);
    return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
struct VD {
    __m256i v;
    static VD zero() { return {_mm256_setzero_si256()}; }
    static VD set1(int32_t x) { return {_mm256_set1_epi32(x)}; }
    VF to_float() const { return {_mm256_cvtepi32_ps(v)}; }
    VD operator+(VD o) const { return {_mm256_add_epi32(v, o.v)}; }
};
// dwords 4j + k <- rows' dword at (k, j) as `dwords` places them, then each 128-bit lane's
// 4 x 4 bytes transposed: lane c = column c's 4 bytes.
static inline __m256i quads_of(__m256i rows, __m256i dwords) {
    const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(rows, dwords), bytes);
}
template <int BITS>
static inline void load_quads(const uint8_t* rows, VD& u0, VD& u1) {
    if constexpr (BITS == 4) {  // 4 rows of 8 bytes: dword (k, j) at 2k + j
        const __m256i v = _mm256_loadu_si256((const __m256i*)rows), low = _mm256_set1_epi8(15);
        const __m256i dwords = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        u0 = {quads_of(_mm256_and_si256(v, low), dwords)};
        u1 = {quads_of(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), dwords)};
    } else {  // 4 rows of 16 bytes; unpacked: k0, k2 | k1, k3 (8 bytes each)
        const __m256i a = _mm256_loadu_si256((const __m256i*)rows);
        const __m256i b = _mm256_loadu_si256((const __m256i*)(rows + 32));
        const __m256i dwords = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7);
        u0 = {quads_of(_mm256_unpacklo_epi64(a, b), dwords)};
        u1 = {quads_of(_mm256_unpackhi_epi64(a, b), dwords)};
    }
}
template <int BITS>
static constexpr int DOT_BIAS = BITS == 8 ? 128 : 0;
template <int BITS>
static inline VD dot4(VD acc, VD u, VD x) {
    __m256i a = u.v, b = x.v;
    if constexpr (BITS == 8) {
        const __m256i w = _mm256_xor_si256(u.v, _mm256_set1_epi8(char(0x80)));
        a = _mm256_sign_epi8(w, w);  // |w|; -128 stays 0x80, 128 unsigned
        b = _mm256_sign_epi8(x.v, w);
    }
    const __m256i pairs = _mm256_maddubs_epi16(a, b);
    return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))};
}
#else
struct VD {
    uint32_t v[4];
    static VD zero() { return {{0, 0, 0, 0}}; }
    static VD set1(int32_t x) { return {{uint32_t(x), uint32_t(x), uint32_t(x), uint32_t(x)}}; }
    VD operator+(VD o) const {
        VD r;
        for (int i = 0; i < 4; ++i) r.v[i] = v[i] + o.v[i];
        return r;
    }
    VF to_float() const {
        VF r;
        for (int i = 0; i < 4; ++i) r.v[i] = float(int32_t(v[i]));
        return r;
    }
};
template <int BITS>
static inline void load_quads(const uint8_t* rows, VD& u0, VD& u1) {
    constexpr int ROW = 2 * VF::W * BITS / 8;
    for (int c = 0; c < VF::W; ++c) {
        uint32_t a = 0, b = 0;
        for (int k = 0; k < 4; ++k) {
            const uint8_t* r = rows + k * ROW;
            const uint32_t lo = BITS == 4 ? r[c] & 15u : r[c];
            const uint32_t hi = BITS == 4 ? uint32_t(r[c]) >> 4 : r[VF::W + c];
            a |= lo << (8 * k);
            b |= hi << (8 * k);
        }
        u0.v[c] = a;
        u1.v[c] = b;
    }
}
template <int BITS>
static constexpr int DOT_BIAS = 0;
template <int BITS>
static inline VD dot4(VD acc, VD u, VD x) {
    for (int c = 0; c < VF::W; ++c) {
        int32_t sum = 0;
        for (int b = 0; b < 4; ++b)
            sum += int32_t((u.v[c] >> (8 * b)) & 255u) * int32_t(int8_t(x.v[c] >> (8 * b)));
        acc.v[c] = uint32_t(int32_t(acc.v[c]) + sum);
    }
    return acc;
}
#endif

static const int DOT_GROUP = 32;  // the activations' rounding group: every format's group
template <class F>
static constexpr bool has_dots() {
    return (F::BITS == 4 || F::BITS == 8) && F::GROUP == DOT_GROUP;
}
// rows of a pass: two int32 and two float32 sums each in registers, beside the quads
static const int DOT_ROWS = VF::REGS >= 32 ? 4 : 2;

// x [M, K] rounded per group: q [M, K], and per group its scale a and a * sum(q).
struct Int8Rows {
    const int8_t* q;
    const float* scale;
    const float* qsum;
    long K;
};

static Int8Rows round_rows(const float* x, long M, long K, int threads) {
    static thread_local std::vector<int8_t> q;
    static thread_local std::vector<float> scales;
    const long groups = M * (K / DOT_GROUP);
    if (long(q.size()) < M * K) q.resize(M * K);
    if (long(scales.size()) < 2 * groups) scales.resize(2 * groups);
    int8_t* qs = q.data();
    float *scale = scales.data(), *qsum = scale + groups;
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
        int sum = 0;
        for (int i = 0; i < DOT_GROUP; ++i) {
            const float r = std::nearbyint(xg[i] * inverse);
            const int v = int(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
            qs[g * DOT_GROUP + i] = int8_t(v);
            sum += v;
        }
        scale[g] = amax / 127.f;
        qsum[g] = scale[g] * float(sum);
    }
    return {qs, scale, qsum, K};
}

// Rows [m0, m0 + R) of x against one stripe -> out (row stride ldo).
template <int R, class F, typename OT>
static inline void dot_block(const Int8Rows& x, long m0, const QuantStripe<F>& src, OT* out,
                             long ldo) {
    const long K = x.K, groups = K / DOT_GROUP;
    VF acc[R][2];
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = VF::zero();
    const VF bias = VF::set1(float(DOT_BIAS<F::BITS>));
    for (long g = 0; g < groups; ++g) {
        const auto group = src.group(g * DOT_GROUP);
        // no software prefetch: a thread reads its stripes front to back, which the hardware
        // prefetchers follow; requests of its own only took load slots from the dot products
        // P chains of dot products per sum, quads j = p, p + P, ...: with few rows one chain
        // would wait on each dot product's latency; int32 sums are exact in any order, so the
        // chains change no bit
        constexpr int P = R <= 2 ? 2 : 1;
        VD sum[R][2][P];
        for (int m = 0; m < R; ++m)
            for (int p = 0; p < P; ++p) sum[m][0][p] = sum[m][1][p] = VD::zero();
        for (int j = 0; j < DOT_GROUP / 4; j += P)
            for (int p = 0; p < P; ++p) {
                VD u0, u1;
                load_quads<F::BITS>(group.rows + 4 * (j + p) * F::ROW_BYTES, u0, u1);
                for (int m = 0; m < R; ++m) {
                    int32_t quad;
                    std::memcpy(&quad, x.q + (m0 + m) * K + g * DOT_GROUP + 4 * (j + p), 4);
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
        // the offsets the biased sums need: m + bias * s (exact: a power of two times s)
        const VF o0 = fma(group.s0, bias, group.m0), o1 = fma(group.s1, bias, group.m1);
        for (int m = 0; m < R; ++m) {
            const long at = (m0 + m) * groups + g;
            const VF a = VF::set1(x.scale[at]), qs = VF::set1(x.qsum[at]);
            acc[m][0] = fma(o0, qs, fma(sum[m][0][0].to_float(), group.s0 * a, acc[m][0]));
            acc[m][1] = fma(o1, qs, fma(sum[m][1][0].to_float(), group.s1 * a, acc[m][1]));
        }
    }
    for (int m = 0; m < R; ++m) {
        acc[m][0].store(out + m * ldo);
        acc[m][1].store(out + m * ldo + VF::W);
    }
}

template <int R, class F, typename OT>
static void dot_rows(const Int8Rows& x, long m0, long rows, const QuantStripe<F>& src, OT* out,
                     long ldo) {
    if (rows == R) return dot_block<R>(x, m0, src, out, ldo);
    if constexpr (R > 1) dot_rows<R - 1>(x, m0, rows, src, out, ldo);
}

// out [M, N] (row stride ldo) = x [M, K] rounded to int8 groups @ the N columns of
// `stripes`; each thread owns a range of stripes and takes every row through each (a stripe
// stays in L1/L2 while the rounded rows go by). -1 for a shape it cannot take.
template <class F, typename OT>
static int quant_dot_matmul(const float* x, const QuantStripes<F>& stripes, OT* out, long M,
                            long K, long N, long ldo, int threads) {
    static_assert(has_dots<F>(), "a format of 4- or 8-bit quants in groups of 32");
    if (M < 1 || K % F::SUPER != 0 || N % STRIPE != 0 || ldo < N) return -1;
    const Int8Rows rounded = round_rows(x, M, K, threads);
    const long count = N / STRIPE;
    #pragma omp parallel num_threads(threads)
    {
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (long s = count * t / nt; s < count * (t + 1) / nt; ++s) {
            const auto src = stripes.at(s);
            for (long m0 = 0; m0 < M; m0 += DOT_ROWS) {
                const long rows = M - m0 < DOT_ROWS ? M - m0 : DOT_ROWS;
                dot_rows<DOT_ROWS>(rounded, m0, rows, src, out + m0 * ldo + s * STRIPE, ldo);
            }
        }
    }
    return 0;
}
