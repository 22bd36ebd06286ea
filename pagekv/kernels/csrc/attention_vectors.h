// Attention in float32 vectors (vec.h's VF) on every target and every head size of
// PAGEKV_HEAD_DIMS: prefill chunks, and cascade (shared-prefix) decode rows. Float32 inputs, or
// bfloat16 ones widened as they are packed; prefill.cpp's entry points call prefill_any and
// shared_prefix_any.
#pragma once
#include <cstdint>
#include <vector>
#include <omp.h>
#include "prefill_common.h"

// Float32 prefill attention on the vector layer (every target): the same work as the tile
// kernel with float32 FMAs. Per (chunk, kv head) the keys are packed once transposed in blocks
// of KB = VF::W keys ([S/KB][D][KB]: dim d of KB keys in one vector) and the values in panels
// of the dims one P.V pass reads ([D/PANEL][S][PANEL]: each pass streams contiguous memory),
// both as float32 (bfloat16 K/V are widened here, once). Per (chunk, query head, block of 16
// queries): the scores, SCORE_ROWS rows x SCORE_BLOCKS key blocks of sums in registers, one FMA
// per key block and dim with the query's number broadcast; the softmax; the sum of values,
// PV_ROWS rows x a panel in registers. All in float32, as torch's SDPA keeps them; outputs are
// rounded to the inputs' type once. Only the order of the sums differs from SDPA's. The tiles
// keep the loads (vectors and broadcasts) at about two per three FMAs, so that the FMAs set
// the pace; in_register stops the compiler from folding a vector's load into every FMA that
// reads it (a load per FMA again). Cascade rows (shared_prefix) reuse the packing and both
// products.
namespace f32 {
// Every function is a template on the head size D (one of PAGEKV_HEAD_DIMS, each a multiple of
// PANEL).
static const int KB = VF::W;                        // keys per packed block
static const int SCORE_ROWS = VF::REGS >= 32 ? 8 : 6;  // scores: query rows x key blocks of
static const int SCORE_BLOCKS = VF::REGS >= 32 ? 3 : 2;  // sums in registers at a time
static const int PV_COLS = VF::REGS >= 32 ? 64 / VF::W : 2;  // P.V: output vectors per pass
static const int PV_ROWS = 6;                                 // P.V: rows per pass
static const int PANEL = PV_COLS * VF::W;                     // P.V: dims per pass

template <int D, typename T>
static void pack_kv(const T* kc, const T* vc, const int32_t* table, int seq_len, int padded,
                    int block_size, long token_stride, int h, float* kt, float* vp) {
    for (int t = 0; t < padded; ++t) {
        float* tile = kt + long(t / KB) * KB * D + t % KB;  // column t % KB of its block
        const auto value = [vp, padded, t](int d) -> float& {  // dim d of value t, in its panel
            return vp[(long(d / PANEL) * padded + t) * PANEL + d % PANEL];
        };
        if (t < seq_len) {
            const long slot = long(table[t / block_size]) * block_size + t % block_size;
            const T* k = kc + slot * token_stride + long(h) * D;
            const T* vs = vc + slot * token_stride + long(h) * D;
            for (int d = 0; d < D; ++d) tile[d * KB] = load(k[d]);
            for (int d = 0; d < D; ++d) value(d) = load(vs[d]);
        } else {  // past the sequence: zeros (never weighted, but read by the last block)
            for (int d = 0; d < D; ++d) tile[d * KB] = 0.f;
            for (int d = 0; d < D; ++d) value(d) = 0.f;
        }
    }
}

// Scores of query rows [0, N) of qbuf against key blocks [0, B) of kt (KB keys each), N x B
// vectors of sums in registers, stored at `scores` (rows `width` apart); each score one chain
// of FMAs over the dims. `rows` and `blocks` beyond N and B take N and B; below, the first.
template <int D, int N, int B>
static inline void score_tile(int rows, int blocks, const float (*qbuf)[D], const float* kt,
                              float* scores, int width) {
    if constexpr (N > 1)
        if (rows < N) return score_tile<D, N - 1, B>(rows, blocks, qbuf, kt, scores, width);
    if constexpr (B > 1)
        if (blocks < B) return score_tile<D, N, B - 1>(rows, blocks, qbuf, kt, scores, width);
    VF s[N][B];
    for (int m = 0; m < N; ++m)
        for (int b = 0; b < B; ++b) s[m][b] = VF::zero();
    for (int d = 0; d < D; ++d) {
        VF k[B];
        for (int b = 0; b < B; ++b) {
            k[b] = VF::load(kt + long(b) * KB * D + d * KB);
            k[b].in_register();
        }
        for (int m = 0; m < N; ++m) {
            const VF qm = VF::set1(qbuf[m][d]);
            for (int b = 0; b < B; ++b) s[m][b] = fma(qm, k[b], s[m][b]);
        }
    }
    for (int m = 0; m < N; ++m)
        for (int b = 0; b < B; ++b) s[m][b].store(scores + long(m) * width + b * KB);
}

// Rows [0, N) of out = their probabilities (rows of p, width apart) . the values of keys
// [0, reach) (panels of PANEL dims, `panel_floats` apart), divided by sums[m] (the row's sum
// of p, or 1 to leave it unnormalized); a panel (C vectors) of each row at a time. The row
// count is a template argument so that the sums stay in registers (`count` below N: the first
// count rows). Each output is one chain of FMAs, keys ascending.
template <int D, int N, typename T>
static inline void pv_rows(int count, const float* p, int width, int reach, const float* vp,
                           long panel_floats, const float* sums, T* out, long row_stride) {
    if constexpr (N > 1)
        if (count < N)
            return pv_rows<D, N - 1>(count, p, width, reach, vp, panel_floats, sums, out,
                                  row_stride);
    constexpr int C = PV_COLS;
    for (int c0 = 0; c0 < D / VF::W; c0 += C) {
        VF a[N][C];
        for (int m = 0; m < N; ++m)
            for (int c = 0; c < C; ++c) a[m][c] = VF::zero();
        for (int t = 0; t < reach; ++t) {
            const float* v = vp + c0 / C * panel_floats + long(t) * PANEL;
            VF vv[C];
            for (int c = 0; c < C; ++c) {
                vv[c] = VF::load(v + c * VF::W);
                vv[c].in_register();
            }
            for (int m = 0; m < N; ++m) {
                const VF pm = VF::set1(p[long(m) * width + t]);
                for (int c = 0; c < C; ++c) a[m][c] = fma(pm, vv[c], a[m][c]);
            }
        }
        for (int m = 0; m < N; ++m) {
            const VF inv = VF::set1(1.f / sums[m]);
            T* o = out + m * row_stride + c0 * VF::W;
            for (int c = 0; c < C; ++c) (a[m][c] * inv).store(o + c * VF::W);
        }
    }
}

// Which keys each row of a block of up to 16 query rows sees: row r, [0, first + r * growth).
// growth 1: a prefill chunk's causal rows; 0: cascade rows, each seeing the whole prefix.
struct Visible {
    int first, growth;
    int of(int r) const { return first + r * growth; }
};

// Query rows [0, rows) of qbuf (zeros past them) against the packed keys kt: their scores,
// then in place their softmax numerators in float32 (exp_row), rows `width` apart in `scores`;
// tops[r] and sums[r] as exp_row gives them.
template <int D>
static void numerators(const float (*qbuf)[D], int rows, Visible visible, const float* kt,
                       float scale, float* scores, int width, float* tops, float* sums) {
    const int blocks = (visible.of(rows - 1) + KB - 1) / KB;  // of the keys any row sees
    // the rows in passes of at most SCORE_ROWS, split evenly (16: 6, 5, 5 rather than 6, 6, 4)
    const int passes = (rows + SCORE_ROWS - 1) / SCORE_ROWS;
    for (int kb = 0; kb < blocks; kb += SCORE_BLOCKS)
        for (int pass = 0; pass < passes; ++pass) {
            const int m0 = rows * pass / passes, m1 = rows * (pass + 1) / passes;
            score_tile<D, SCORE_ROWS, SCORE_BLOCKS>(m1 - m0, blocks - kb, qbuf + m0,
                                                 kt + long(kb) * KB * D,
                                                 scores + long(m0) * width + kb * KB, width);
        }
    for (int r = 0; r < rows; ++r) {
        float* x = scores + long(r) * width;
        const auto store = [x](int k, VF e) { e.store(x + k); };
        tops[r] = exp_row(x, visible.of(r), blocks * KB, scale, store, sums + r);
    }
}

// Rows [0, rows) of out (row_stride apart): each row's numerators (in `scores`, rows `width`
// apart) times the values vp (packed for `padded` positions), divided by divisors[r]. The rows
// in passes of at most PV_ROWS, split evenly as the scores are.
template <int D, typename T>
static void weigh_values(const float* scores, int width, int rows, Visible visible,
                         const float* vp, int padded, const float* divisors, T* out,
                         long row_stride) {
    const int passes = (rows + PV_ROWS - 1) / PV_ROWS;
    for (int pass = 0; pass < passes; ++pass) {
        const int m0 = rows * pass / passes, m1 = rows * (pass + 1) / passes;
        const int reach = visible.of(m1 - 1);  // keys any of these rows sees
        pv_rows<D, PV_ROWS>(m1 - m0, scores + long(m0) * width, width, reach, vp,
                            long(padded) * PANEL, divisors + m0, out + m0 * row_stride,
                            row_stride);
    }
}

// Up to 16 query rows of one head (at q, row_stride apart): row r sees keys
// [0, first_visible + r). Writes their outputs. `scores`: 16 x width floats of scratch.
template <int D, typename T>
static void attend_block(const T* q, T* out, long row_stride, int rows, int first_visible,
                         const float* kt, const float* vp, int padded, float scale,
                         float* scores, int width) {
    alignas(64) float qbuf[16][D];
    for (int r = 0; r < 16; ++r)
        for (int d = 0; d < D; ++d) qbuf[r][d] = r < rows ? load(q[r * row_stride + d]) : 0.f;
    const Visible visible{first_visible, 1};
    float tops[16], sums[16];
    numerators<D>(qbuf, rows, visible, kt, scale, scores, width, tops, sums);
    weigh_values<D>(scores, width, rows, visible, vp, padded, sums, out, row_stride);
}

static thread_local std::vector<float> packed;  // the caller's: K/V of every (chunk, kv head)

template <int D, typename T>
static void prefill(const T* qs, const T* kc, const T* vc, T* os, const Chunk* chunks,
                   int num_chunks, const int32_t* tables, int num_heads, int kv_heads,
                   int block_size, float scale, int threads) {
    const long token_stride = long(kv_heads) * D, row_stride = long(num_heads) * D;
    const PrefillWork work(chunks, num_chunks, num_heads, kv_heads, 16, D);
    if (long(packed.size()) < work.packed_size()) packed.resize(work.packed_size());
    float* tiles = packed.data();
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(dynamic)
        for (long task = 0; task < long(num_chunks) * kv_heads; ++task) {
            const int c = int(task / kv_heads), h = int(task % kv_heads);
            float* kt = tiles + work.pack_at(c, h);
            pack_kv<D>(kc, vc, tables + chunks[c].table_offset, int(chunks[c].seq_len),
                    work.padded(c), block_size, token_stride, h, kt,
                    kt + long(work.padded(c)) * D);
        }
        std::vector<float> scores(16L * work.width);
        #pragma omp for schedule(dynamic)
        for (long i = 0; i < work.items(); ++i) {
            const PrefillWork::Item it = work.item(i);
            const float* kt = tiles + it.pack;
            const long at = it.first_row * row_stride + it.head * D;
            const int padded = work.padded(it.chunk);
            attend_block<D>(qs + at, os + at, row_stride, it.rows, it.first_visible, kt,
                         kt + long(padded) * D, padded, scale, scores.data(), work.width);
        }
    }
}

// Cascade attention (shared_prefix_attention_f32 and _bf16_f32; kernels.h has the contract):
// per kv head the prefix is packed once, as a chunk's K/V are; then every (sequence, query
// head) row of that kv head is a query row seeing the whole prefix, 16 rows at a time through
// the products above, where the decode kernel would read the prefix once per sequence. Each
// row's prefix part is left unnormalized (divided by ones) for merge_prefix.
template <int D, typename T>
static void shared_prefix(const T* qs, const T* kc, const T* vc, const int32_t* table,
                          int prefix_len, int num_seqs, int num_heads, int kv_heads,
                          int block_size, float scale, float* out, const float* lse,
                          int threads) {
    static const float ones[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    const int group = num_heads / kv_heads;
    const int padded = (prefix_len + 15) / 16 * 16;  // whole key blocks, as a chunk's
    const long per_head = long(padded) * D * 2, rows_per_head = long(num_seqs) * group;
    const long blocks_per_head = (rows_per_head + 15) / 16;
    if (long(packed.size()) < per_head * kv_heads) packed.resize(per_head * kv_heads);
    float* buffer = packed.data();
    const Visible visible{prefix_len, 0};
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for
        for (int h = 0; h < kv_heads; ++h)
            pack_kv<D>(kc, vc, table, prefix_len, padded, block_size, long(kv_heads) * D, h,
                       buffer + h * per_head, buffer + h * per_head + long(padded) * D);
        std::vector<float> scores(16L * padded);
        #pragma omp for schedule(dynamic)
        for (long item = 0; item < kv_heads * blocks_per_head; ++item) {
            const int h = int(item / blocks_per_head);
            const long first = (item % blocks_per_head) * 16;
            const int rows = int(rows_per_head - first < 16 ? rows_per_head - first : 16);
            alignas(64) float qbuf[16][D] = {};
            long index[16];  // each row's (sequence, query head) in q, out and lse
            for (int r = 0; r < rows; ++r) {
                const long b = (first + r) / group, g = (first + r) % group;
                index[r] = b * num_heads + long(h) * group + g;
                for (int d = 0; d < D; ++d) qbuf[r][d] = load(qs[index[r] * D + d]);
            }
            const float* kt = buffer + h * per_head;
            alignas(64) float acc[16][D];
            float tops[16], sums[16];
            numerators<D>(qbuf, rows, visible, kt, scale, scores.data(), padded, tops, sums);
            weigh_values<D>(scores.data(), padded, rows, visible, kt + long(padded) * D, padded,
                            ones, acc[0], D);
            for (int r = 0; r < rows; ++r)
                merge_prefix(acc[r], tops[r], sums[r], lse[index[r]], out + index[r] * D, D);
        }
    }
}

template <typename T>
static int prefill_any(const void* q, const void* kc, const void* vc, void* out,
                       const int64_t* chunk_info, int num_chunks, const int32_t* tables,
                       int num_heads, int kv_heads, int block_size, int head_dim, float scale,
                       int threads) {
    if (num_heads % kv_heads != 0) return -1;
    return with_head_dim(head_dim, [&](auto d) {
        prefill<decltype(d)::value>((const T*)q, (const T*)kc, (const T*)vc, (T*)out,
                                    (const Chunk*)chunk_info, num_chunks, tables, num_heads,
                                    kv_heads, block_size, scale, threads);
    });
}

template <typename T>
static int shared_prefix_any(const void* q, const void* kc, const void* vc,
                             const int32_t* table, int prefix_len, int num_seqs, int num_heads,
                             int kv_heads, int block_size, int head_dim, float scale, float* out,
                             const float* lse, int threads) {
    if (num_heads % kv_heads != 0 || prefix_len < 1) return -1;
    return with_head_dim(head_dim, [&](auto d) {
        shared_prefix<decltype(d)::value>((const T*)q, (const T*)kc, (const T*)vc, table,
                                          prefix_len, num_seqs, num_heads, kv_heads,
                                          block_size, scale, out, lse, threads);
    });
}
}  // namespace f32
