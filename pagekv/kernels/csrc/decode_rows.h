// The decode kernel's parts on rows (decode_sequence.h puts them together): the scores of a
// block of 16 key rows, the values weighed into the outputs, the softmax in between, and the
// prefetches that keep the scattered cache blocks coming. scores16, pv_group and
// scores16_pairs are written here on the vector layer (VF); a target may have its own body of
// each (arch/target.h): avx2's scores of eight rows at once, AVX-512's scores and values with
// each K/V row widened once in registers, AVX512-BF16's bf16 dot products.
#pragma once
#include <unistd.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include "attention_common.h"

struct Shape { int num_heads, kv_heads, group, block_size; long token_stride; };

// How many bytes of a sequence's values its score pass may request into L2 for the value pass:
// half of a core's L2 as the CPU reports it (the other half holds the keys streaming by, the
// scores and the queries), 1 MiB where it does not say.
static long values_in_l2_bytes() {
    static const long bytes = [] {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        return l2 > 0 ? l2 / 2 : 1L << 20;
    }();
    return bytes;
}

// Scores of `group` query heads (rows of q) against up to 16 key rows: s[g * stride + t], each
// one chain of FMAs over the query's vectors, then one horizontal sum in reduce_add's order. A
// query row's vectors stay in registers across the key rows.
template <int D, typename Q, typename KV>
static inline void scores16(Portable, const Q* q, const KV* const* rows, int count,
                            int group, float scale, float* s, long stride) {
    static_assert(D % VF::W == 0, "head dim: whole vectors");
    for (int g = 0; g < group; ++g) {
        VF qv[D / VF::W];
        for (int i = 0; i < D / VF::W; ++i) qv[i] = VF::load(q + g * D + VF::W * i);
        for (int t = 0; t < count; ++t) {
            VF acc = qv[0] * VF::load(rows[t]);
            for (int i = 1; i < D / VF::W; ++i)
                acc = fma(qv[i], VF::load(rows[t] + VF::W * i), acc);
            s[g * stride + t] = acc.reduce_add() * scale;
        }
    }
}

// int8 key rows: each query row (of D numbers) is rounded once to int16 steps of its own scale
// (amax / 32767, far finer than the keys' int8 steps), so that a score is a sum of integer
// products, exact in int32 (|sum| <= 256 * 32767 * 127 < 2^31), times the two scales.
template <int D, typename Q>
static inline void quantize_query(const Q* q, int16_t* q16, float* q_scale) {
    float amax = 0.f;
    for (int d = 0; d < D; ++d) {  // a compare, not fmax (as quantize_row)
        const float a = std::fabs(load(q[d]));
        amax = a > amax ? a : amax;
    }
    const float step = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int d = 0; d < D; ++d) q16[d] = int16_t(__builtin_nearbyintf(load(q[d]) * inv));
    *q_scale = step;
}

// Scores of `group` int16 query rows (q16, D apart; q_scale[g] each) against up to 16 int8 key
// rows (k_scale[t] each): s[g * stride + t] = (q16 . k) * (q_scale[g] * scale) * k_scale[t].
template <int D>
static inline void scores16_i8(Portable, const int16_t* q, const float* q_scale,
                               const int8_t* const* rows, const float* k_scale, int count,
                               int group, float scale, float* s, long stride) {
    for (int g = 0; g < group; ++g)
        for (int t = 0; t < count; ++t) {
            int32_t sum = 0;
            for (int d = 0; d < D; ++d) sum += int32_t(q[g * D + d]) * int32_t(rows[t][d]);
            s[g * stride + t] = float(sum) * (q_scale[g] * scale) * k_scale[t];
        }
}

// scores16 for many bfloat16 query rows at once, where a target has a faster way for them:
// here none (false: the caller takes scores16).
template <int D, typename Q, typename KV>
static inline bool scores16_pairs(Portable, const Q*, const KV* const*, int, int, float, float*,
                                  long) {
    return false;
}

// out[g] += sum_t p[g * p_stride + t] * rows[t] over W dims for G heads at once (head g's
// output at out + g * out_stride): each value row is widened to float32 once, in registers,
// and the G accumulators stay there. Each output is one chain of FMAs, t ascending, whatever
// G and W.
// Vectors of a head's output summed at once: all W / VF::W where the G heads' sums and one
// value row fit in the registers, else the widest power of two that does.
template <int W, int G>
static constexpr int pv_chunk() {
    int chunk = W / VF::W;
    while (chunk > 1 && (G + 1) * chunk + 1 > VF::REGS) chunk /= 2;
    return chunk;
}
template <int W, int G, typename KV>
static inline void pv_group(Portable, const float* p, long p_stride, const KV* const* rows,
                            int count, float* out, long out_stride) {
    static_assert(W % VF::W == 0, "a slice of whole vectors");
    constexpr int C = pv_chunk<W, G>();
    for (int c0 = 0; c0 < W / VF::W; c0 += C) {
        VF acc[G][C];
        for (int g = 0; g < G; ++g)
            for (int i = 0; i < C; ++i)
                acc[g][i] = VF::load(out + g * out_stride + VF::W * (c0 + i));
        for (int t = 0; t < count; ++t) {
            VF v[C];
            for (int i = 0; i < C; ++i) v[i] = VF::load(rows[t] + VF::W * (c0 + i));
            for (int g = 0; g < G; ++g) {
                const VF pt = VF::set1(p[g * p_stride + t]);
                for (int i = 0; i < C; ++i) acc[g][i] = fma(pt, v[i], acc[g][i]);
            }
        }
        for (int g = 0; g < G; ++g)
            for (int i = 0; i < C; ++i) acc[g][i].store(out + g * out_stride + VF::W * (c0 + i));
    }
}

// The group size is a template argument so that pv_group's accumulators live in registers;
// uncommon sizes run one head at a time.
template <int W, typename KV>
static inline void pv_heads(int group, const float* p, long p_stride, const KV* const* rows,
                            int count, float* out, long out_stride) {
    switch (group) {
        case 1: return pv_group<W, 1>(Native{}, p, p_stride, rows, count, out, out_stride);
        case 2: return pv_group<W, 2>(Native{}, p, p_stride, rows, count, out, out_stride);
        case 3: return pv_group<W, 3>(Native{}, p, p_stride, rows, count, out, out_stride);
        case 4: return pv_group<W, 4>(Native{}, p, p_stride, rows, count, out, out_stride);
        default:
            for (int g = 0; g < group; ++g)
                pv_group<W, 1>(Native{}, p + g * p_stride, p_stride, rows, count,
                               out + g * out_stride, out_stride);
    }
}

// Softmax of the first `len` scores of each of `rows` rows, `stride` apart; lse (when given):
// per row, log of the sum of exp(x), for merging with another part.
static inline void softmax_rows(float* scores, int rows, int len, long stride, float* lse) {
    constexpr int W = VF::W;
    for (int h = 0; h < rows; ++h) {
        float* x = scores + h * stride;
        VF vmax = VF::set1(-INFINITY);
        for (int pos = 0; pos < len; pos += W)
            vmax = max(vmax, VF::load_first(x + pos, len - pos, -INFINITY));
        const float top = vmax.reduce_max();
        VF vsum = VF::zero();
        for (int pos = 0; pos < len; pos += W) {
            exp_nonpositive(VF::load_first(x + pos, len - pos) - VF::set1(top))
                .store_first(x + pos, len - pos);
            vsum = vsum + VF::load_first(x + pos, len - pos);  // lanes past len add zeros
        }
        const float sum = vsum.reduce_add();
        if (lse != nullptr) lse[h] = top + std::log(sum);
        const VF inv = VF::set1(1.f / sum);
        for (int pos = 0; pos < len; pos += W)
            (VF::load_first(x + pos, len - pos) * inv).store_first(x + pos, len - pos);
    }
}

// `count` 8-bit rows of D numbers widened to float32 and each times its scale, into buf (D
// apart); wide[t] points at row t.
template <int D, typename KV>
static inline void widen_rows(const KV* const* rows, const float* scale, int count, float* buf,
                              const float** wide) {
    for (int t = 0; t < count; ++t) {
        const VF factor = VF::set1(scale[t]);
        for (int i = 0; i < D / VF::W; ++i)
            (VF::load(rows[t] + VF::W * i) * factor).store(buf + t * D + VF::W * i);
        wide[t] = buf + t * D;
    }
}

// x[i] *= f[i] for i < len.
static inline void multiply_row(float* x, const float* f, int len) {
    for (int i = 0; i < len; i += VF::W)
        (VF::load_first(x + i, len - i) * VF::load_first(f + i, len - i)).store_first(x + i, len - i);
}

// Into L2, the rows of kv head `kvh` at positions [first, end): blocks sit anywhere in the
// pool, so the hardware prefetcher loses the stream at every block boundary.
template <typename KV, int D>
static inline void prefetch_rows(const KV* cache, const long* slots, int first, int end,
                                 long stride, int kvh) {
    for (int pos = first; pos < end; ++pos)
        prefetch_l2(cache + slots[pos] * stride + long(kvh) * D, long(sizeof(KV)) * D);
}

// Into L2, every kv head's rows at positions [first, end) of a sequence whose slots are not
// walked yet (the next one a thread will read).
template <typename KV>
static inline void prefetch_tokens(const KV* cache, const int32_t* table, int first, int end,
                                   int block_size, long token_stride) {
    for (int pos = first; pos < end; ++pos) {
        const long slot = long(table[pos / block_size]) * block_size + pos % block_size;
        prefetch_l2(cache + slot * token_stride, long(sizeof(KV)) * token_stride);
    }
}

static const int PREFETCH_AHEAD = 32;  // rows requested beyond the 16 being read

// Row pointers of kv head `kvh` at positions [first, first + 16) (fewer at the end); returns
// how many. Also prefetches the PREFETCH_AHEAD rows after them.
template <typename KV, int D>
static inline int rows16(const KV* cache, const long* slots, int first, int seq_len, long stride,
                         int kvh, const KV** rows) {
    const int count = seq_len - first < 16 ? seq_len - first : 16;
    const int ahead = first + 16 + PREFETCH_AHEAD;
    prefetch_rows<KV, D>(cache, slots, first + 16, seq_len < ahead ? seq_len : ahead, stride, kvh);
    for (int t = 0; t < count; ++t) rows[t] = cache + slots[first + t] * stride + long(kvh) * D;
    return count;
}

// One sequence's attention for its `qlen` query tokens (the last qlen positions; token t sees
// positions < seq_len - qlen + 1 + t) over positions [start, seq_len), in three parts: the
// scores [kv head][token][group head][len] (len = seq_len - start), their softmax (and, if lse
