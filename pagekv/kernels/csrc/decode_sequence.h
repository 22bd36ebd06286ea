// The decode kernel: per sequence (or per kv head of one, when sequences are fewer than
// threads), the scores of every query head against every cached key, read in place through the
// block table, block by block; softmax in float32; then one pass over the values. Each K and V
// row is read from memory once and reused by the G query heads that share its kv head. The
// parts on rows are decode_rows.h's.
#pragma once
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#include "decode_rows.h"

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
// Queries are Q (float32 or bfloat16), cached rows KV: Q too, or 8 bits (int8_t, fp8e4m3) with
// an fp16 scale per slot and kv head in ks and vs ([slot][kv head]; null for float rows). An
// 8-bit row's scale multiplies its scores (as they are computed) and its probabilities (after
// the softmax, from `vscales`, [kv head][len]), never its elements.
template <typename Q, typename KV, int D>
struct Sequence {
    const Q* q;
    const KV *kc, *vc;
    const uint16_t *ks, *vs;
    int seq_len, qlen, start;
    const Shape& sh;
    float scale;
    float* scores;  // [kv head][qlen * group][len]
    float* vscales;
    long* slots;
    Q* qbuf;
    int16_t* q16;  // int8 rows: the queries in int16 steps (quantize_query), [row][D]
    float* q16_scales;
    float* qf;  // fp8 rows: the queries in float32, [row][D]
    float* kbuf;  // fp8 rows: 16 key rows widened and scaled, [16][D]
    float* out;
    float* lse;
    static constexpr bool INT8 = std::is_same_v<KV, int8_t>;
    static constexpr bool FP8 = std::is_same_v<KV, fp8e4m3>;

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
        for (int kvh = 0; kvh < sh.kv_heads && (qlen > 1 || INT8 || FP8); ++kvh)
            for (int t = 0; t < qlen; ++t) {  // each kv head's rows, token after token
                const long row = long(kvh) * rows_per_kvh() + t * g;
                const Q* from = q + t * q_stride() + long(kvh) * g * D;
                if constexpr (INT8) {
                    for (int h = 0; h < g; ++h)
                        quantize_query<D>(from + h * D, q16 + (row + h) * D, q16_scales + row + h);
                } else if constexpr (FP8) {
                    for (long i = 0; i < long(g) * D; ++i) qf[row * D + i] = load(from[i]);
                } else {  // only qlen > 1 reads it
                    std::memcpy(qbuf + row * D, from, sizeof(Q) * g * D);
                }
            }
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
                const Q* qh = qlen > 1 ? qbuf + long(kvh) * rows_per_kvh() * D
                                       : q + long(kvh) * sh.group * D;
                float* s = scores_of(kvh) + (first - start);
                alignas(64) float k_scale[16];
                if (ks != nullptr) row_scales(first, count, kvh, k_scale);
                const long row = long(kvh) * rows_per_kvh();
                if constexpr (INT8) {
                    scores16_i8<D>(Native{}, q16 + row * D, q16_scales + row, rows, k_scale,
                                   count, rows_per_kvh(), scale, s, len());
                } else if constexpr (FP8) {  // each row widened once for all its query rows
                    const float* wide[16];
                    widen_rows<D>(rows, k_scale, count, kbuf, wide);
                    scores16<D>(Native{}, qf + row * D, wide, count, rows_per_kvh(), scale, s,
                                len());
                } else if (!scores16_pairs<D>(Native{}, qh, rows, count, rows_per_kvh(), scale, s,
                                              len())) {
                    scores16<D>(Native{}, qh, rows, count, rows_per_kvh(), scale, s, len());
                }
            }
    }

    // 8-bit rows: the scales of kv head kvh's keys at positions [first, first + count) into
    // k_scale; their values' kept in vscales for the softmax.
    void row_scales(int first, int count, int kvh, float* k_scale) const {
        float* vscale = vscales + long(kvh) * len() + (first - start);
        for (int t = 0; t < count; ++t) {
            const long at = slots[first + t] * sh.kv_heads + kvh;
            k_scale[t] = finite_half_to_f32(ks[at]);
            vscale[t] = finite_half_to_f32(vs[at]);
        }
    }

    // Softmax rows [r0, r1), row r = (kv head r / qlen, token r % qlen): its group's heads.
    void softmax(int r0, int r1) const {
        const int g = sh.group;
        for (int r = r0; r < r1; ++r) {
            const int kvh = r / qlen, t = r % qlen;
            float* row_lse = lse == nullptr ? nullptr : lse + t * sh.num_heads + long(kvh) * g;
            float* p = scores_of(kvh) + long(t) * g * len();
            softmax_rows(p, g, len() - (qlen - 1 - t), len(), row_lse);
            if (vs != nullptr)  // 8-bit rows: each probability times its value's scale
                for (int h = 0; h < g; ++h)
                    multiply_row(p + long(h) * len(), vscales + long(kvh) * len(), len());
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
template <typename Q, typename KV, int D>
static void one_sequence(const Sequence<Q, KV, D>& s, const int32_t* table) {
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
template <int W, typename Q, typename KV, int D>
static void weigh_slices(const Sequence<Q, KV, D>& s, int slices, int t, int nt) {
    const int tasks = s.sh.kv_heads * slices;
    for (int task = tasks * t / nt; task < tasks * (t + 1) / nt; ++task)
        s.template weigh<W>(task / slices, task % slices * W);
}
template <typename Q, typename KV, int D>
static void shared_sequence(const Sequence<Q, KV, D>& s, const int32_t* table) {
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

template <typename Q, typename KV, int D>
static void decode(const Q* q, const KV* kc, const KV* vc, const uint16_t* ks, const uint16_t* vs,
                   const int32_t* tables, const int32_t* seq_lens, const int32_t* query_lens,
                   float* out, int num_seqs, int table_stride, int num_heads, int kv_heads,
                   int block_size, int max_seq_len, int max_query_len, float scale,
                   int num_threads, int start, float* lse) {
    const Shape sh{num_heads, kv_heads, num_heads / kv_heads, block_size, long(kv_heads) * D};
    // Sequence b's query tokens start at row first_row[b] of q, out and lse.
    std::vector<long> first_row(num_seqs + 1, 0);
    for (int b = 0; b < num_seqs; ++b)
        first_row[b + 1] = first_row[b] + (query_lens == nullptr ? 1 : query_lens[b]);
    const long rows = long(num_heads) * max_query_len;
    const long vscale_floats = vs == nullptr ? 0 : long(kv_heads) * (max_seq_len + 1);
    // With fewer sequences than threads, all threads take each sequence in turn
    // (shared_sequence), its scores in one buffer. Otherwise whole sequences are tasks, each
    // streaming its blocks contiguously; threads take them one at a time from a shared counter,
    // each taking its next task when it starts one: the first rows of that next sequence are
    // requested then, since a short history ends before the prefetches inside it get ahead
    // (this matters for short histories only).
    const bool share = num_seqs < num_threads;
    const std::unique_ptr<float[]> shared_scores(
        new float[share ? rows * (max_seq_len + 1) + vscale_floats : 0]);
    long taken = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        // each thread's scratch, left uninitialized (each part writes before it reads)
        const std::unique_ptr<float[]> own_scores(
            new float[share ? 0 : rows * (max_seq_len + 1) + vscale_floats]);
        const std::unique_ptr<long[]> slots(new long[max_seq_len + 1]);
        const std::unique_ptr<Q[]> qbuf(new Q[rows * D]);
        const bool int8 = std::is_same_v<KV, int8_t>;
        const std::unique_ptr<int16_t[]> q16(new int16_t[int8 ? rows * D : 0]);
        const std::unique_ptr<float[]> q16_scales(new float[int8 ? rows : 0]);
        const bool fp8 = std::is_same_v<KV, fp8e4m3>;
        const std::unique_ptr<float[]> qf(new float[fp8 ? rows * D : 0]);
        const std::unique_ptr<float[]> kbuf(new float[fp8 ? 16 * D : 0]);
        float* scores = share ? shared_scores.get() : own_scores.get();
        const auto sequence = [&](int b) {
            const long row = first_row[b];
            return Sequence<Q, KV, D>{q + row * num_heads * D, kc, vc, ks, vs, seq_lens[b],
                                      int(first_row[b + 1] - row), start, sh, scale, scores,
                                      scores + rows * (max_seq_len + 1), slots.get(), qbuf.get(),
                                      q16.get(), q16_scales.get(), qf.get(), kbuf.get(),
                                      out + row * num_heads * D,
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
