// Paged decode attention: per sequence (or per kv head of one, when sequences are fewer than
// threads), the scores of every query head against every cached key, read in place through the
// block table, block by block; softmax in float32; then one pass over the values. Each K and V
// row is read from memory once and reused by the G query heads that share its kv head.
#include "attention_common.h"
#include "kernels.h"
#include <omp.h>
#include <unistd.h>
#include <algorithm>
#include <memory>
#include <vector>

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

// Row primitives over D elements: dot(q, k) and acc += p * v. Written with AVX-512 intrinsics
// where available (the K/V row is converted to float32 in registers once, and the compiler's
// auto-vectorizer misses the bf16 widening); plain loops elsewhere.
#if defined(__AVX512F__)
#include "simd.h"
static inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
static inline __m512 load16(const uint16_t* x) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// q.k for one row, left unreduced: 16 partial sums whose total is the dot product.
template <int D, typename KV>
static inline __m512 row_dot(const KV* q, const KV* k) {
    __m512 acc = _mm512_mul_ps(load16(q), load16(k));
    for (int i = 1; i < D / 16; ++i)
        acc = _mm512_fmadd_ps(load16(q + 16 * i), load16(k + 16 * i), acc);
    return acc;
}
#if defined(__AVX512BF16__)
// bfloat16 rows: products of pairs in hardware (vdpbf16ps), float32 accumulation.
template <int D>
static inline __m512 row_dot(const uint16_t* q, const uint16_t* k) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < D / 32; ++i)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + 32 * i),
                               (__m512bh)_mm512_loadu_si512(k + 32 * i));
    return acc;
}
#endif

// Lane t of the result = the sum of v[t]'s 16 lanes: sixteen horizontal sums for ~35 shuffles
// and adds, instead of sixteen separate reductions of ~9 each.
static inline __m512 sum4_in_lanes(__m512 a, __m512 b, __m512 c, __m512 d) {
    // per 128-bit lane L: [sum_L(a), sum_L(b), sum_L(c), sum_L(d)]
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}
static inline __m512 hsum16(const __m512* v) {
    const __m512 r0 = sum4_in_lanes(v[0], v[1], v[2], v[3]);
    const __m512 r1 = sum4_in_lanes(v[4], v[5], v[6], v[7]);
    const __m512 r2 = sum4_in_lanes(v[8], v[9], v[10], v[11]);
    const __m512 r3 = sum4_in_lanes(v[12], v[13], v[14], v[15]);
    // add the four 128-bit lanes of each r_j, and put r_j's result in lane j
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(r0, r1, 0x88),
                                     _mm512_shuffle_f32x4(r0, r1, 0xDD));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(r2, r3, 0x88),
                                     _mm512_shuffle_f32x4(r2, r3, 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88),
                         _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

// Scores of `group` query heads (rows of q) against up to 16 key rows: s[g * stride + t].
template <int D, typename KV>
static inline void scores16(const KV* q, const KV* const* rows, int count, int group,
                            float scale, float* s, long stride) {
    const __mmask16 valid = __mmask16((1u << count) - 1);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int g = 0; g < group; ++g) {
        __m512 acc[16];
        for (int t = 0; t < 16; ++t)
            acc[t] = t < count ? row_dot<D>(q + g * D, rows[t]) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(s + g * stride, valid, _mm512_mul_ps(hsum16(acc), vscale));
    }
}
#if defined(__AVX512BF16__)
// In place: r[j] becomes column j of the 16 x 16 matrix of 32-bit words whose rows were r[0..15].
static inline void transpose16x16(__m512i* r) {
    __m512i t[16], u[16];
    for (int k = 0; k < 8; ++k) {  // per 128-bit lane L: [r2k[4L], r2k+1[4L], r2k[4L+1], ...]
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; ++k) {  // u[4k + c], lane L: rows 4k .. 4k+3 of column 4L + c
        u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int c = 0; c < 4; ++c) {  // column 4L + c: lane k of it is lane L of u[4k + c]
        const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
        const __m512i b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
    }
}

// scores16 for many bfloat16 query rows (a drafted decode's tokens x heads): the 16 key rows
// are transposed once, as pairs of dims (kp[i], lane t: dims 2i and 2i+1 of key t), so each
// query row's 16 scores are D/2 vdpbf16ps with the query's pair i broadcast: no horizontal sums,
// the transpose shared by all rows. For a few rows (one token's heads) the transpose costs more
// than it saves, even in cache, so one_sequence keeps scores16 there. A
// score's sum runs over even pairs and odd pairs in order, then adds the two.
static const int PAIRS_MIN_ROWS = 6;
template <int D>
static inline void scores16_pairs(const uint16_t* q, const uint16_t* const* rows, int count,
                                  int num_rows, float scale, float* s, long stride) {
    static_assert(D % 32 == 0, "head dim: whole 16-pair words");
    __m512i kp[D / 2];
    for (int half = 0; half < D / 32; ++half) {  // pairs [16 half, 16 half + 16)
        __m512i* block = kp + 16 * half;
        for (int t = 0; t < 16; ++t)
            block[t] = t < count ? _mm512_loadu_si512(rows[t] + 32 * half)
                                 : _mm512_setzero_si512();
        transpose16x16(block);
    }
    const __mmask16 valid = __mmask16((1u << count) - 1);
    const __m512 vscale = _mm512_set1_ps(scale);
    const uint32_t* qp = (const uint32_t*)q;  // query pairs
    int r = 0;
    for (; r + 2 <= num_rows; r += 2) {  // two rows at a time: four independent sums
        const uint32_t* a = qp + long(r) * (D / 2);
        const uint32_t* b = a + D / 2;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
        for (int i = 0; i < D / 2; i += 2) {
            const __m512bh k0 = (__m512bh)kp[i], k1 = (__m512bh)kp[i + 1];
            a0 = _mm512_dpbf16_ps(a0, k0, (__m512bh)_mm512_set1_epi32(int(a[i])));
            a1 = _mm512_dpbf16_ps(a1, k1, (__m512bh)_mm512_set1_epi32(int(a[i + 1])));
            b0 = _mm512_dpbf16_ps(b0, k0, (__m512bh)_mm512_set1_epi32(int(b[i])));
            b1 = _mm512_dpbf16_ps(b1, k1, (__m512bh)_mm512_set1_epi32(int(b[i + 1])));
        }
        _mm512_mask_storeu_ps(s + r * stride, valid, _mm512_mul_ps(_mm512_add_ps(a0, a1), vscale));
        _mm512_mask_storeu_ps(s + (r + 1) * stride, valid,
                              _mm512_mul_ps(_mm512_add_ps(b0, b1), vscale));
    }
    for (; r < num_rows; ++r) {
        const uint32_t* a = qp + long(r) * (D / 2);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (int i = 0; i < D / 2; i += 2) {
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)kp[i], (__m512bh)_mm512_set1_epi32(int(a[i])));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)kp[i + 1],
                                  (__m512bh)_mm512_set1_epi32(int(a[i + 1])));
        }
        _mm512_mask_storeu_ps(s + r * stride, valid, _mm512_mul_ps(_mm512_add_ps(a0, a1), vscale));
    }
}
#endif
// out[g] += sum_t p[g * p_stride + t] * rows[t] over W dims for G heads at once (head g's
// output at out + g * out_stride): each value row is widened to float32 once, in registers,
// and the G accumulators (G * W / 16 registers) stay there. Each output is one chain of FMAs,
// t ascending, whatever G and W.
template <int W, int G, typename KV>
static inline void pv_group(const float* p, long p_stride, const KV* const* rows, int count,
                            float* out, long out_stride) {
    __m512 acc[G][W / 16];
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < W / 16; ++i)
            acc[g][i] = _mm512_loadu_ps(out + g * out_stride + 16 * i);
    for (int t = 0; t < count; ++t) {
        __m512 v[W / 16];
        for (int i = 0; i < W / 16; ++i) v[i] = load16(rows[t] + 16 * i);
        for (int g = 0; g < G; ++g) {
            const __m512 pt = _mm512_set1_ps(p[g * p_stride + t]);
            for (int i = 0; i < W / 16; ++i) acc[g][i] = _mm512_fmadd_ps(pt, v[i], acc[g][i]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < W / 16; ++i) _mm512_storeu_ps(out + g * out_stride + 16 * i, acc[g][i]);
}
#else
// The same two primitives on the vector layer (AVX2, generic). Each score is one chain of
// FMAs over the query's vectors, then one horizontal sum in reduce_add's order.
#if defined(__AVX2__)
// Lane j of the result: v[j].reduce_add(), added in the same order (the halves, then lanes
// 0 + 2 and 1 + 3, then those two), for eight vectors at once.
static inline VF reduce_add8(const VF* v) {
    __m256 h[4];  // v[j]'s halves summed in the low 128 bits, v[j + 4]'s in the high
    for (int j = 0; j < 4; ++j)
        h[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[j].v, v[j + 4].v, 0x20),
                             _mm256_permute2f128_ps(v[j].v, v[j + 4].v, 0x31));
    // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of h[j] = a, h[j + 1] = b
    const __m256 p01 =
        _mm256_add_ps(_mm256_unpacklo_ps(h[0], h[1]), _mm256_unpackhi_ps(h[0], h[1]));
    const __m256 p23 =
        _mm256_add_ps(_mm256_unpacklo_ps(h[2], h[3]), _mm256_unpackhi_ps(h[2], h[3]));
    return {_mm256_add_ps(_mm256_shuffle_ps(p01, p23, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm256_shuffle_ps(p01, p23, _MM_SHUFFLE(3, 2, 3, 2)))};
}
// Eight key rows at a time, the query's vectors in the outer loop (eight sums, a query vector
// and a key vector in registers), the eight horizontal sums shared and stored as one vector.
template <int D, typename KV>
static inline void scores16(const KV* q, const KV* const* rows, int count, int group,
                            float scale, float* s, long stride) {
    static_assert(D % VF::W == 0 && VF::W == 8, "head dim: whole vectors of eight");
    for (int g = 0; g < group; ++g)
        for (int t0 = 0; t0 < count; t0 += 8) {
            const int n = count - t0 < 8 ? count - t0 : 8;
            const KV* r[8];  // past the last row: its first, summed and not stored
            for (int t = 0; t < 8; ++t) r[t] = rows[t0 + (t < n ? t : 0)];
            VF acc[8];
            const VF q0 = VF::load(q + g * D);
            for (int t = 0; t < 8; ++t) acc[t] = q0 * VF::load(r[t]);
            for (int i = 1; i < D / VF::W; ++i) {
                const VF qi = VF::load(q + g * D + VF::W * i);
                for (int t = 0; t < 8; ++t) acc[t] = fma(qi, VF::load(r[t] + VF::W * i), acc[t]);
            }
            (reduce_add8(acc) * VF::set1(scale)).store_first(s + g * stride + t0, n);
        }
}
#else
// A query row's vectors stay in registers across the key rows.
template <int D, typename KV>
static inline void scores16(const KV* q, const KV* const* rows, int count, int group,
                            float scale, float* s, long stride) {
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
#endif
// Vectors of a head's output summed at once: all W / VF::W where the G heads' sums and one
// value row fit in the registers, else the widest power of two that does.
template <int W, int G>
static constexpr int pv_chunk() {
    int chunk = W / VF::W;
    while (chunk > 1 && (G + 1) * chunk + 1 > VF::REGS) chunk /= 2;
    return chunk;
}
template <int W, int G, typename KV>
static inline void pv_group(const float* p, long p_stride, const KV* const* rows, int count,
                            float* out, long out_stride) {
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
#endif

// The group size is a template argument so that pv_group's accumulators live in registers;
// uncommon sizes run one head at a time.
template <int W, typename KV>
static inline void pv_heads(int group, const float* p, long p_stride, const KV* const* rows,
                            int count, float* out, long out_stride) {
    switch (group) {
        case 1: return pv_group<W, 1>(p, p_stride, rows, count, out, out_stride);
        case 2: return pv_group<W, 2>(p, p_stride, rows, count, out, out_stride);
        case 3: return pv_group<W, 3>(p, p_stride, rows, count, out, out_stride);
        case 4: return pv_group<W, 4>(p, p_stride, rows, count, out, out_stride);
        default:
            for (int g = 0; g < group; ++g)
                pv_group<W, 1>(p + g * p_stride, p_stride, rows, count, out + g * out_stride,
                               out_stride);
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
// is given, each head's log-sum-exp of its scores at lse[token * num_heads + head]), then the
// weighted sums of the values into out. Each K (then V) row is read once and reused by every
// query head of its group, of every token, while in cache: a drafted decode's tokens cost one
// read of the history, not one each. Every row's arithmetic is that of the same token alone,
// except bf16 scores of 2+ tokens, which take scores16_pairs (float32 sums in another order).
// The parts take ranges (of positions, of softmax rows, of kv heads and dims) so that threads
// can share one sequence, each number computed as it is by one thread alone (one_sequence).
// `slots` (room for seq_len) holds each position's cache slot, walked from the block table
// once; `qbuf` (room for qlen * heads * D) the queries of each kv head, token by token.
template <typename KV, int D>
struct Sequence {
    const KV *q, *kc, *vc;
    int seq_len, qlen, start;
    const Shape& sh;
    float scale;
    float* scores;  // [kv head][qlen * group][len]
    long* slots;
    KV* qbuf;
    float* out;
    float* lse;

    int len() const { return seq_len - start; }
    int rows_per_kvh() const { return qlen * sh.group; }
    long q_stride() const { return long(sh.num_heads) * D; }
    float* scores_of(int kvh) const { return scores + long(kvh) * rows_per_kvh() * len(); }
    // whether the values of n positions fit in L2 beside the rest: longer histories would push
    // out their own first rows, and then the prefetch costs more than it saves
    bool values_fit_l2(int n) const {
        return long(n) * sh.kv_heads * D * long(sizeof(KV)) <= values_in_l2_bytes();
    }

    void walk(const int32_t* table) const {
        for (int pos = 0, b = 0; pos < seq_len; ++b) {
            const long base = long(table[b]) * sh.block_size;
            for (int j = 0; j < sh.block_size && pos < seq_len; ++j, ++pos) slots[pos] = base + j;
        }
        const int g = sh.group;
        for (int kvh = 0; kvh < sh.kv_heads && qlen > 1; ++kvh)  // only qlen > 1 reads it
            for (int t = 0; t < qlen; ++t)
                std::memcpy(qbuf + (long(kvh) * rows_per_kvh() + t * g) * D,
                            q + t * q_stride() + long(kvh) * g * D, sizeof(KV) * g * D);
    }

    // Scores of kv heads [k0, k1) at positions [first0, end), first0 - start a multiple of 16;
    // `prefetch_values`: the values at those positions go to L2 for the last part (else the
    // memory idles through the softmax and waits at each block of that part).
    void score(int first0, int end, int k0, int k1, bool prefetch_values) const {
        const KV* rows[16];
        for (int first = first0; first < end; first += 16)  // 16 positions at a time
            for (int kvh = k0; kvh < k1; ++kvh) {
                const int count = rows16<KV, D>(kc, slots, first, end, sh.token_stride, kvh, rows);
                if (prefetch_values)
                    prefetch_rows<KV, D>(vc, slots, first, first + count, sh.token_stride, kvh);
                const KV* qh = qlen > 1 ? qbuf + long(kvh) * rows_per_kvh() * D
                                        : q + long(kvh) * sh.group * D;
                float* s = scores_of(kvh) + (first - start);
#if defined(__AVX512BF16__)
                if constexpr (std::is_same<KV, uint16_t>::value)
                    if (rows_per_kvh() >= PAIRS_MIN_ROWS) {
                        scores16_pairs<D>(qh, rows, count, rows_per_kvh(), scale, s, len());
                        continue;
                    }
#endif
                scores16<D>(qh, rows, count, rows_per_kvh(), scale, s, len());
            }
    }

    // Softmax rows [r0, r1), row r = (kv head r / qlen, token r % qlen): its group's heads.
    void softmax(int r0, int r1) const {
        const int g = sh.group;
        for (int r = r0; r < r1; ++r) {
            const int kvh = r / qlen, t = r % qlen;
            float* row_lse = lse == nullptr ? nullptr : lse + t * sh.num_heads + long(kvh) * g;
            softmax_rows(scores_of(kvh) + long(t) * g * len(), g, len() - (qlen - 1 - t), len(),
                         row_lse);
        }
    }

    // The outputs of kv head kvh's query heads, dims [d0, d0 + W), every token.
    template <int W>
    void weigh(int kvh, int d0) const {
        const int g = sh.group;
        for (int t = 0; t < qlen; ++t)
            for (int h = 0; h < g; ++h)
                std::memset(out + t * q_stride() + (long(kvh) * g + h) * D + d0, 0,
                            sizeof(float) * W);
        const KV* rows[16];
        for (int first = start; first < seq_len; first += 16) {
            const int count = rows16<KV, D>(vc, slots, first, seq_len, sh.token_stride, kvh, rows);
            for (int i = 0; i < count; ++i) rows[i] += d0;
            for (int t = 0; t < qlen; ++t) {
                const int visible = len() - (qlen - 1 - t) - (first - start);  // of these 16
                if (visible <= 0) continue;
                const float* p = scores_of(kvh) + long(t) * g * len() + (first - start);
                pv_heads<W>(g, p, len(), rows, count < visible ? count : visible,
                            out + t * q_stride() + long(kvh) * g * D + d0, D);
            }
        }
    }
};

// The whole of one sequence by one thread.
template <typename KV, int D>
static void one_sequence(const Sequence<KV, D>& s, const int32_t* table) {
    s.walk(table);
    s.score(s.start, s.seq_len, 0, s.sh.kv_heads, s.values_fit_l2(s.len()));
    s.softmax(0, s.sh.kv_heads * s.qlen);
    for (int kvh = 0; kvh < s.sh.kv_heads; ++kvh) s.template weigh<D>(kvh, 0);
}

// One sequence shared by the threads of the enclosing parallel region, with barriers between
// the parts: the scores by positions (whole blocks of 16), the softmax by rows, the values by
// kv head and slices of dims (each a multiple of 16 floats): every thread reads about as many
// K and V bytes as the others, where a split by kv head alone leaves one thread two heads of
// three. Each number is computed as one_sequence computes it.
template <int W, typename KV, int D>
static void weigh_slices(const Sequence<KV, D>& s, int slices, int t, int nt) {
    const int tasks = s.sh.kv_heads * slices;
    for (int task = tasks * t / nt; task < tasks * (t + 1) / nt; ++task)
        s.template weigh<W>(task / slices, task % slices * W);
}
template <typename KV, int D>
static void shared_sequence(const Sequence<KV, D>& s, const int32_t* table) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    s.walk(table);  // each thread its own slots and queries
    const int blocks = (s.len() + 15) / 16, kvh = s.sh.kv_heads;
    const int first = s.start + 16 * (blocks * t / nt);
    const int end = std::min(s.seq_len, s.start + 16 * (blocks * (t + 1) / nt));
    s.score(first, end, 0, kvh, s.values_fit_l2(end - first));
    #pragma omp barrier
    const int rows = kvh * s.qlen;
    s.softmax(rows * t / nt, rows * (t + 1) / nt);
    #pragma omp barrier
    // slices: the fewest of 1, 2, 4 that share out the kv heads evenly (D >= 64: a slice is
    // whole vectors)
    const int slices = kvh % nt == 0 ? 1 : (2 * kvh) % nt == 0 ? 2 : 4;
    if (slices == 1) weigh_slices<D>(s, 1, t, nt);
    else if (slices == 2) weigh_slices<D / 2>(s, 2, t, nt);
    else weigh_slices<D / 4>(s, 4, t, nt);
    #pragma omp barrier  // the scores are the next sequence's
}

template <typename KV, int D>
static void decode(const KV* q, const KV* kc, const KV* vc, const int32_t* tables,
                   const int32_t* seq_lens, const int32_t* query_lens, float* out, int num_seqs,
                   int table_stride, int num_heads, int kv_heads, int block_size,
                   int max_seq_len, int max_query_len, float scale, int num_threads, int start,
                   float* lse) {
    const Shape sh{num_heads, kv_heads, num_heads / kv_heads, block_size, long(kv_heads) * D};
    // Sequence b's query tokens start at row first_row[b] of q, out and lse.
    std::vector<long> first_row(num_seqs + 1, 0);
    for (int b = 0; b < num_seqs; ++b)
        first_row[b + 1] = first_row[b] + (query_lens == nullptr ? 1 : query_lens[b]);
    const long rows = long(num_heads) * max_query_len;
    // With fewer sequences than threads, all threads take each sequence in turn
    // (shared_sequence), its scores in one buffer. Otherwise whole sequences are tasks, each
    // streaming its blocks contiguously; threads take them one at a time from a shared counter,
    // each taking its next task when it starts one: the first rows of that next sequence are
    // requested then, since a short history ends before the prefetches inside it get ahead
    // (this matters for short histories only).
    const bool share = num_seqs < num_threads;
    const std::unique_ptr<float[]> shared_scores(new float[share ? rows * (max_seq_len + 1) : 0]);
    long taken = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        // each thread's scratch, left uninitialized (each part writes before it reads)
        const std::unique_ptr<float[]> own_scores(new float[share ? 0 : rows * (max_seq_len + 1)]);
        const std::unique_ptr<long[]> slots(new long[max_seq_len + 1]);
        const std::unique_ptr<KV[]> qbuf(new KV[rows * D]);
        const auto sequence = [&](int b) {
            const long row = first_row[b];
            return Sequence<KV, D>{q + row * num_heads * D, kc, vc, seq_lens[b],
                                   int(first_row[b + 1] - row), start, sh, scale,
                                   share ? shared_scores.get() : own_scores.get(),
                                   slots.get(), qbuf.get(), out + row * num_heads * D,
                                   lse == nullptr ? nullptr : lse + row * num_heads};
        };
        if (share) {
            for (int b = 0; b < num_seqs; ++b)
                shared_sequence(sequence(b), tables + long(b) * table_stride);
        } else {
            const auto take = [&taken]() {
                return __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
            };
            for (long b = take(), next; b < num_seqs; b = next) {
                next = take();
                if (next < num_seqs) {
                    const int end = std::min(seq_lens[next], start + PREFETCH_AHEAD);
                    prefetch_tokens(kc, tables + next * table_stride, start, end, block_size,
                                    sh.token_stride);
                }
                one_sequence(sequence(int(b)), tables + b * table_stride);
            }
        }
    }
}

// start: the first position each row attends (0: all of it); lse: null, or float32
// [rows, num_heads] for each head's log-sum-exp over those positions; query_lens: null (one
// query token per sequence) or int32 [num_seqs], the rows of q per sequence.
#define ENTRY(NAME, KV)                                                                       \
    extern "C" int NAME(const void* q, const void* kc, const void* vc, const int32_t* tables,  \
                        const int32_t* seq_lens, const int32_t* query_lens, float* out,        \
                        int num_seqs, int table_stride, int num_heads, int kv_heads,           \
                        int block_size, int head_dim, int max_seq_len, int max_query_len,      \
                        float scale, int num_threads, int start, float* lse) {                 \
        return with_head_dim(head_dim, [&](auto d) {                                           \
            decode<KV, decltype(d)::value>((const KV*)q, (const KV*)kc, (const KV*)vc, tables, \
                                           seq_lens, query_lens, out, num_seqs, table_stride,  \
                                           num_heads, kv_heads, block_size, max_seq_len,       \
                                           max_query_len, scale, num_threads, start, lse);     \
        });                                                                                    \
    }
ENTRY(decode_f32, float)
ENTRY(decode_bf16, uint16_t)

extern "C" int decode_head_dim(int head_dim) { return takes_head_dim(head_dim); }

// A decode step's attention as a layer stack calls it, layer after layer (fused_ops.cpp's
// decoder_stack_*), laid out as pagekv/kernels/decode.py's StepAttention builds it: one query
// token per sequence, the whole of each history, no log-sum-exp.
struct StepAttention {
    const int64_t* caches;  // [layers][2]: each layer's K and V cache addresses
    const int64_t* slots;   // [num_seqs]: where this step's K/V rows go
    const int32_t* tables;  // [num_seqs][table_stride]
    const int32_t* seq_lens;
    int64_t num_slots, row_bytes;
    int32_t num_seqs, table_stride, num_heads, kv_heads, block_size, max_seq_len, head_dim,
        bf16, threads;
    float scale;
};

// What DecodeKernel.write_kv and then DecodeKernel.__call__ do for one layer (the same bytes
// in the same slots, the same sums), with the float32 output rounded to the cache's type as
// torch rounds it (to nearest even) into out [num_seqs, num_heads, head_dim]. -1 (nothing
// written) for a slot out of range or a head size without a kernel.
template <typename KV, int D>
static void step_decode(const StepAttention& s, const void* q, const void* kc, const void* vc,
                        float* out) {
    decode<KV, D>((const KV*)q, (const KV*)kc, (const KV*)vc, s.tables, s.seq_lens, nullptr,
                  out, s.num_seqs, s.table_stride, s.num_heads, s.kv_heads, s.block_size,
                  s.max_seq_len, 1, s.scale, s.threads, 0, nullptr);
}

extern "C" int step_attention(const void* step, int layer, const void* q, const void* k,
                              const void* v, void* out) {
    const StepAttention& s = *(const StepAttention*)step;
    if (!takes_head_dim(s.head_dim)) return -1;
    char* kc = (char*)s.caches[2 * layer];
    char* vc = (char*)s.caches[2 * layer + 1];
    if (write_rows((const char*)k, (const char*)v, kc, vc, s.slots, s.num_seqs, s.row_bytes,
                   s.num_slots) != 0)
        return -1;
    const long n = long(s.num_seqs) * s.num_heads * s.head_dim;
    if (!s.bf16)  // float32 caches: the kernel's output is already the activations' type
        return with_head_dim(s.head_dim, [&](auto d) {
            step_decode<float, decltype(d)::value>(s, q, kc, vc, (float*)out);
        });
    static thread_local std::vector<float> wide;
    if (long(wide.size()) < n) wide.resize(n);
    with_head_dim(s.head_dim, [&](auto d) {
        step_decode<uint16_t, decltype(d)::value>(s, q, kc, vc, wide.data());
    });
    uint16_t* o = (uint16_t*)out;
    for (long i = 0; i < n; ++i) o[i] = f32_to_bf16(wide[i]);
    return 0;
}

// The first maximum of each of `rows` bfloat16 rows of `cols` (a NaN counts as the maximum, as
// in torch): greedy sampling straight from the LM head's bf16 logits, without widening them all
// to float32 first. Two passes per row, both in vectors; the second finds the first lane equal
// to the maximum.
extern "C" void argmax_bf16_rows(const uint16_t* x, int64_t* out, long rows, long cols,
                                 int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long r = 0; r < rows; ++r) {
        const uint16_t* row = x + r * cols;
        float best = -INFINITY;
        long nan_at = -1;
        VF vmax = VF::set1(-INFINITY);
        long c = 0;
        for (; c + VF::W <= cols; c += VF::W) {
            const VF v = VF::load(row + c);
            if (nan_at < 0 && v.any_nan()) {
                for (long j = c; j < c + VF::W; ++j)
                    if (std::isnan(load(row[j]))) { nan_at = j; break; }
            }
            vmax = max(vmax, v);
        }
        best = vmax.reduce_max();
        for (long j = c; j < cols; ++j) {
            const float v = load(row[j]);
            if (std::isnan(v) && nan_at < 0) nan_at = j;
            best = v > best ? v : best;
        }
        if (nan_at >= 0) { out[r] = nan_at; continue; }
        long at = -1;  // the first position of the maximum: vectors, then the tail
        for (c = 0; c + VF::W <= cols && at < 0; c += VF::W) {
            const int lane = VF::load(row + c).first_equal(best);
            if (lane >= 0) at = c + lane;
        }
        for (; at < 0 && c < cols; ++c)
            if (load(row[c]) == best) at = c;
        out[r] = at < 0 ? 0 : at;
    }
}

// This step's new K and V rows (row_bytes each, token t at slots[t]) into the caches, which
// hold `num_slots` rows each. Every slot is checked before anything is written (returns -1 on
// one out of range). The destination rows lie anywhere in the pool, so each is requested 8
// rows ahead of its copy: the misses overlap instead of stalling one after another.
extern "C" int write_rows(const char* k, const char* v, char* kc, char* vc, const int64_t* slots,
                          long tokens, long row_bytes, long num_slots) {
    for (long t = 0; t < tokens; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const long ahead = 8;
    for (long t = 0; t < tokens + ahead; ++t) {
        if (t < tokens) {
            for (long b = 0; b < row_bytes; b += 64) {
                __builtin_prefetch(kc + slots[t] * row_bytes + b, 1);
                __builtin_prefetch(vc + slots[t] * row_bytes + b, 1);
            }
        }
        const long w = t - ahead;
        if (w >= 0) {
            std::memcpy(kc + slots[w] * row_bytes, k + w * row_bytes, row_bytes);
            std::memcpy(vc + slots[w] * row_bytes, v + w * row_bytes, row_bytes);
        }
    }
    return 0;
}
