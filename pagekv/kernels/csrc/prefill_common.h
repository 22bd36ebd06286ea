// What prefill.cpp's two kernel families (tiles: attention_tiles.h; float32 vectors:
// attention_vectors.h) share: a row's softmax numerators, the split of a prefill call into
// work items, and cascade attention's merge of a prefix part into a row's rest.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>
#include "attention_common.h"

// One query row's softmax numerators, for both prefill kernels: exp(scale * x[k] - top) for
// the `seen` scores of x, zeros from there to `end` (a multiple of VF::W), handed to
// store(k, e) a vector at a time; *sum gets their float32 total. Returns top, the row's
// largest scaled score.
template <typename Store>
static inline float exp_row(const float* x, int seen, int end, float scale, Store store,
                            float* sum) {
    constexpr int W = VF::W;
    const VF vscale = VF::set1(scale);
    VF vmax = VF::set1(-INFINITY);
    for (int k = 0; k < seen; k += W)
        vmax = max(vmax, VF::load_first(x + k, seen - k, -INFINITY) * vscale);
    const float top = vmax.reduce_max();
    const VF vtop = VF::set1(top);
    VF vsum = VF::zero();
    for (int k = 0; k < end; k += W) {
        const VF e =
            exp_nonpositive(VF::load_first(x + k, seen - k) * vscale - vtop).keep_first(seen - k);
        vsum = vsum + e;
        store(k, e);
    }
    *sum = vsum.reduce_add();
    return top;
}

// A prefill chunk as the caller lays it out (PrefillBatch.chunks).
struct Chunk { int64_t q_start, num_tokens, seq_len, table_offset; };

// A prefill call's work, for either element type. Each (chunk, kv head) packs its K/V of
// `padded(c)` positions once, at pack_at(c, h) of one buffer (K then V, head_dim numbers a
// position); then each (chunk, query head, block of 16 queries) is one item, chunk after chunk.
struct PrefillWork {
    struct Item {
        int chunk, head, rows, first_visible;  // rows: queries of the block; row r sees keys
        long first_row, pack;                  // [0, first_visible + r)
    };
    const Chunk* chunks;
    int num_heads, kv_heads, pad, head_dim, width;  // width: the widest padded chunk
    std::vector<long> offset, first_item;           // per chunk, and one past the last

    PrefillWork(const Chunk* chunks, int num_chunks, int num_heads, int kv_heads, int pad,
                int head_dim)
        : chunks(chunks), num_heads(num_heads), kv_heads(kv_heads), pad(pad),
          head_dim(head_dim), width(pad), offset(num_chunks + 1, 0),
          first_item(num_chunks + 1, 0) {
        for (int c = 0; c < num_chunks; ++c) {
            width = padded(c) > width ? padded(c) : width;
            offset[c + 1] = offset[c] + long(kv_heads) * padded(c) * head_dim * 2;
            const long blocks = (chunks[c].num_tokens + 15) / 16;  // of queries
            first_item[c + 1] = first_item[c] + long(num_heads) * blocks;
        }
    }
    int padded(int c) const { return int((chunks[c].seq_len + pad - 1) / pad * pad); }
    long pack_at(int c, int h) const { return offset[c] + long(h) * padded(c) * head_dim * 2; }
    long packed_size() const { return offset.back(); }
    long items() const { return first_item.back(); }
    Item item(long i) const {
        int c = 0;
        while (first_item[c + 1] <= i) ++c;
        const Chunk& ch = chunks[c];
        const long local = i - first_item[c];
        const int head = int(local % num_heads), block = int(local / num_heads);
        const long left = ch.num_tokens - block * 16L;  // queries from this block on
        return {c, head, int(left < 16 ? left : 16),
                int(ch.seq_len - ch.num_tokens) + block * 16 + 1, ch.q_start + block * 16L,
                pack_at(c, head / (num_heads / kv_heads))};
    }
};

// Cascade attention's merge for one decode row: `o` (head_dim floats) holds the row's
// attention over the rest of its sequence, normalized, and `rest` that part's log-sum-exp of
// scaled scores; `acc` holds the prefix part unnormalized (the sum of p * v with p = exp(scaled
// score - top)) and `sum` the sum of p. Each part is weighed by its sum of exp, both taken
// relative to the larger maximum so that neither overflows; `o` gets the attention over both.
static inline void merge_prefix(const float* acc, float top, float sum, float rest, float* o,
                                int head_dim) {
    const float high = top > rest ? top : rest;
    const float here = std::exp(top - high), there = std::exp(rest - high);
    const float total = sum * here + there;
    const VF a = VF::set1(here / total), b = VF::set1(there / total);
    for (int c = 0; c < head_dim; c += VF::W)
        (VF::load(acc + c) * a + VF::load(o + c) * b).store(o + c);
}
