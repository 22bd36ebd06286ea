// The decode library's entry points: paged decode attention (decode_sequence.h), a decode
// step's new K/V rows into their cache slots, both for one layer of a layer stack
// (step_attention), and greedy sampling from bfloat16 logits.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "decode_sequence.h"
#include "kernels.h"

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
// decoder_stack_*), `step` a kernels.h StepAttention: what DecodeKernel.write_kv and then
// DecodeKernel.__call__ do for one layer (the same bytes in the same slots, the same sums),
// with the float32 output rounded to the cache's type as torch rounds it (to nearest even)
// into out [num_seqs, num_heads, head_dim]. -1 (nothing written) for a slot out of range or a
// head size without a kernel.
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
