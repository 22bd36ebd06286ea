// Attention in bf16 tiles (head size 64; operands and products in tile_products.h): prefill
// chunks, cascade (shared-prefix) decode and drafted decodes, each packing a sequence's (or
// prefix's) K/V once per kv head and taking 16 query rows at a time. prefill.cpp's entry
// points call these where the target has the tiles.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>
#include "prefill_common.h"
#include "tile_products.h"

#if PAGEKV_BF16_TILES
namespace tiles {
// Attention of up to 16 query rows (qbuf: 16 x D bf16, zero past `rows`) over packed keys:
// row r sees keys [0, visible[r]), visible nondecreasing. Leaves in acc the row's sum of p * v
// over its keys with p = exp(scale * s - tops[r]) rounded to bf16, and in sums[r] the float32
// total of p. Rows past `rows` are left out of the softmax: their acc rows are garbage.
static void attend_rows(const uint16_t* qbuf, int rows, const int* visible, const uint16_t* kp,
                        const uint16_t* vp, float scale, float* scores, uint16_t* probs,
                        int width, float (*acc)[D], float* tops, float* sums) {
    const int keys = visible[rows - 1];  // the most any row sees
    if (tiles_on())
        scores_tiles(qbuf, keys, kp, scores, width);
    else
        scores_vector(qbuf, keys, kp, scores, width);
    const int pairs = (keys + 31) / 32;  // 32-key blocks of P.V
    for (int r = 0; r < rows; ++r) {  // probabilities rounded to bf16, as SDPA rounds them
        uint16_t* p = probs + long(r) * width;
        const auto store = [p](int k, VF e) { e.store(p + k); };  // rounded to bf16
        tops[r] = exp_row(scores + long(r) * width, visible[r], pairs * 32, scale, store, sums + r);
    }
    if (tiles_on())
        pv_tiles(probs, pairs, vp, width, acc);
    else
        pv_vector(probs, rows, pairs, vp, width, acc);
}

// One query head and block of up to 16 queries of a chunk (rows of q at row_stride); the
// first sees `first_visible` keys, each next one more. Writes the bf16 outputs.
static void attend_block(const uint16_t* q, uint16_t* out, long row_stride, int rows,
                         int first_visible, const uint16_t* kp, const uint16_t* vp,
                         float scale, float* scores, uint16_t* probs, int width) {
    alignas(64) uint16_t qbuf[16 * D];
    std::memset(qbuf, 0, sizeof(qbuf));
    for (int r = 0; r < rows; ++r) std::memcpy(qbuf + r * D, q + r * row_stride, D * 2);
    alignas(64) float acc[16][D];
    float tops[16], sums[16];
    int visible[16];
    for (int r = 0; r < 16; ++r) visible[r] = first_visible + (r < rows ? r : rows - 1);
    attend_rows(qbuf, rows, visible, kp, vp, scale, scores, probs, width, acc, tops, sums);
    for (int r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
        for (int c = 0; c < D; c += 16)
            store_bf16x16(out + r * row_stride + c,
                          _mm512_mul_ps(_mm512_load_ps(acc[r] + c), inv));
    }
}

static thread_local std::vector<uint16_t> packed;  // the caller's: K/V tiles of every chunk

// Prefill chunks (prefill_attention_bf16_d64): per (chunk, kv head) the K/V packed once, then
// every (chunk, query head, block of 16 queries) through attend_block.
static int prefill(const void* q, const void* kc, const void* vc, void* out,
                   const int64_t* chunk_info, int num_chunks, const int32_t* tables,
                   int num_heads, int kv_heads, int block_size, float scale, int threads) {
    if (num_heads % kv_heads != 0) return -1;
    const Chunk* chunks = (const Chunk*)chunk_info;
    const long token_stride = long(kv_heads) * D, row_stride = long(num_heads) * D;
    const PrefillWork work(chunks, num_chunks, num_heads, kv_heads, PAD, D);
    if (long(packed.size()) < work.packed_size()) packed.resize(work.packed_size());
    uint16_t* buffer = packed.data();
    const uint16_t* qs = (const uint16_t*)q;
    uint16_t* os = (uint16_t*)out;
    #pragma omp parallel num_threads(threads)
    {
        tiles_begin();
        #pragma omp for schedule(dynamic)
        for (long task = 0; task < long(num_chunks) * kv_heads; ++task) {
            const int c = int(task / kv_heads), h = int(task % kv_heads);
            uint16_t* kp = buffer + work.pack_at(c, h);
            pack_kv((const uint16_t*)kc, (const uint16_t*)vc, tables + chunks[c].table_offset,
                    int(chunks[c].seq_len), work.padded(c), block_size, token_stride, h, kp,
                    kp + long(work.padded(c)) * D);
        }
        std::vector<float> scores(16L * work.width);
        std::vector<uint16_t> probs(16L * work.width);
        #pragma omp for schedule(dynamic)
        for (long i = 0; i < work.items(); ++i) {
            const PrefillWork::Item it = work.item(i);
            const uint16_t* kp = buffer + it.pack;
            const long at = it.first_row * row_stride + it.head * D;
            attend_block(qs + at, os + at, row_stride, it.rows, it.first_visible, kp,
                         kp + long(work.padded(it.chunk)) * D, scale, scores.data(),
                         probs.data(), work.width);
        }
        tiles_end();
    }
    return 0;
}

// Cascade attention (shared_prefix_attention_bf16_d64; kernels.h has the contract): per kv
// head the prefix is packed once and every row of every sequence that reads it goes through
// the tiles, 16 (sequence, query head) rows at a time, where the decode kernel would read the
// prefix once per sequence; merge_prefix then folds each row's prefix part into its rest.
static int shared_prefix(const void* q, const void* kc, const void* vc, const int32_t* table,
                         int prefix_len, int num_seqs, int num_heads, int kv_heads,
                         int block_size, float scale, float* out, const float* lse,
                         int threads) {
    if (num_heads % kv_heads != 0 || prefix_len < 1) return -1;
    const int group = num_heads / kv_heads;
    const int padded = (prefix_len + PAD - 1) / PAD * PAD;
    const long per_head = long(padded) * D * 2, rows_per_head = long(num_seqs) * group;
    const long blocks_per_head = (rows_per_head + 15) / 16;
    if (long(packed.size()) < per_head * kv_heads) packed.resize(per_head * kv_heads);
    uint16_t* buffer = packed.data();
    const uint16_t* qs = (const uint16_t*)q;
    #pragma omp parallel num_threads(threads)
    {
        tiles_begin();
        #pragma omp for
        for (int h = 0; h < kv_heads; ++h)
            pack_kv((const uint16_t*)kc, (const uint16_t*)vc, table, prefix_len, padded,
                    block_size, long(kv_heads) * D, h, buffer + h * per_head,
                    buffer + h * per_head + long(padded) * D);
        std::vector<float> scores(16L * padded);
        std::vector<uint16_t> probs(16L * padded);
        #pragma omp for schedule(dynamic)
        for (long item = 0; item < kv_heads * blocks_per_head; ++item) {
            const int h = int(item / blocks_per_head);
            const long first = (item % blocks_per_head) * 16;
            const int rows = int(rows_per_head - first < 16 ? rows_per_head - first : 16);
            alignas(64) uint16_t qbuf[16 * D] = {};
            long index[16];  // each row's (sequence, query head) in q, out and lse
            for (int r = 0; r < rows; ++r) {
                const long b = (first + r) / group, g = (first + r) % group;
                index[r] = b * num_heads + long(h) * group + g;
                std::memcpy(qbuf + r * D, qs + index[r] * D, D * 2);
            }
            alignas(64) float acc[16][D];
            float tops[16], sums[16];
            const uint16_t* kp = buffer + h * per_head;
            int visible[16];
            for (int r = 0; r < 16; ++r) visible[r] = prefix_len;
            attend_rows(qbuf, rows, visible, kp, kp + long(padded) * D, scale, scores.data(),
                        probs.data(), padded, acc, tops, sums);
            for (int r = 0; r < rows; ++r)
                merge_prefix(acc[r], tops[r], sums[r], lse[index[r]], out + index[r] * D, D);
        }
        tiles_end();
    }
    return 0;
}

// Decode rows through the tiles: sequence b's last qlen_b positions (one query token each, or a
// drafted decode's tokens; token t sees positions [0, seq_len - qlen + 1 + t)). Per sequence and
// kv head the history is packed once, then its qlen x group rows (every query head of the kv
// head, every token) go through the tiles 16 at a time: the decode kernel's one read of each
// K/V row, with the products on AMX. `query_lens` may be null (one token each). Writes bf16 rows
// of `out` [sum qlen, H, D].
static int decode(const void* q, const void* kc, const void* vc, void* out,
                  const int32_t* tables, int table_stride, const int32_t* seq_lens,
                  const int32_t* query_lens, int num_seqs, int num_heads, int kv_heads,
                  int block_size, int max_seq_len, float scale, int threads) {
    if (num_heads % kv_heads != 0) return -1;
    const int group = num_heads / kv_heads;
    const int width = (max_seq_len + PAD - 1) / PAD * PAD;
    std::vector<long> first_row(num_seqs + 1, 0);  // sequence b's first row of q and out
    for (int b = 0; b < num_seqs; ++b)
        first_row[b + 1] = first_row[b] + (query_lens == nullptr ? 1 : query_lens[b]);
    const uint16_t* qs = (const uint16_t*)q;
    uint16_t* os = (uint16_t*)out;
    #pragma omp parallel num_threads(threads)
    {
        tiles_begin();
        std::vector<uint16_t> buffer(long(width) * D * 2);  // one (sequence, kv head): K, V
        std::vector<float> scores(16L * width);
        std::vector<uint16_t> probs(16L * width);
        #pragma omp for schedule(dynamic)
        for (long task = 0; task < long(num_seqs) * kv_heads; ++task) {
            const int b = int(task / kv_heads), h = int(task % kv_heads);
            const int seq_len = seq_lens[b], qlen = int(first_row[b + 1] - first_row[b]);
            const int padded = (seq_len + PAD - 1) / PAD * PAD;
            uint16_t* kp = buffer.data();
            uint16_t* vp = kp + long(padded) * D;
            pack_kv((const uint16_t*)kc, (const uint16_t*)vc, tables + long(b) * table_stride,
                    seq_len, padded, block_size, long(kv_heads) * D, h, kp, vp);
            for (int first = 0; first < qlen * group; first += 16) {
                const int rows = qlen * group - first < 16 ? qlen * group - first : 16;
                alignas(64) uint16_t qbuf[16 * D] = {};
                long index[16];  // each row's (token, query head) in q and out
                int visible[16];
                for (int r = 0; r < rows; ++r) {  // rows token-major: visible nondecreasing
                    const int t = (first + r) / group, g = (first + r) % group;
                    index[r] = (first_row[b] + t) * num_heads + long(h) * group + g;
                    visible[r] = seq_len - qlen + 1 + t;
                    std::memcpy(qbuf + r * D, qs + index[r] * D, D * 2);
                }
                alignas(64) float acc[16][D];
                float tops[16], sums[16];
                attend_rows(qbuf, rows, visible, kp, vp, scale, scores.data(), probs.data(),
                            width, acc, tops, sums);
                for (int r = 0; r < rows; ++r) {
                    const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
                    for (int c = 0; c < D; c += 16)
                        store_bf16x16(os + index[r] * D + c,
                                      _mm512_mul_ps(_mm512_load_ps(acc[r] + c), inv));
                }
            }
        }
        tiles_end();
    }
    return 0;
}

// The unit in use (2 tiles, 1 vectors); `request` 1 or 2 switches to it where it can (tests
// run both units on a CPU with AMX), anything else only asks.
static int backend(int request) {
    if (request == 1 || (request == 2 && best_tile_unit() == 2)) backend_choice() = request;
    return backend_choice();
}
}  // namespace tiles
#endif  // PAGEKV_BF16_TILES
