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
            decode<KV, KV, decltype(d)::value>(                                                \
                (const KV*)q, (const KV*)kc, (const KV*)vc, nullptr, nullptr, tables, seq_lens, \
                query_lens, out, num_seqs, table_stride, num_heads, kv_heads, block_size,      \
                max_seq_len, max_query_len, scale, num_threads, start, lse);                   \
        });                                                                                    \
    }
ENTRY(decode_f32, float)
ENTRY(decode_bf16, uint16_t)

// 8-bit caches (int8, or fp8 e4m3 bits) with fp16 scales [num_slots][kv_heads] for K and V,
// queries Q (float32 or bfloat16); otherwise as above.
#define ENTRY8(NAME, Q, KV)                                                                   \
    extern "C" int NAME(const void* q, const void* kc, const void* vc, const void* ks,         \
                        const void* vs, const int32_t* tables, const int32_t* seq_lens,        \
                        const int32_t* query_lens, float* out, int num_seqs, int table_stride, \
                        int num_heads, int kv_heads, int block_size, int head_dim,             \
                        int max_seq_len, int max_query_len, float scale, int num_threads,      \
                        int start, float* lse) {                                               \
        return with_head_dim(head_dim, [&](auto d) {                                           \
            decode<Q, KV, decltype(d)::value>(                                                 \
                (const Q*)q, (const KV*)kc, (const KV*)vc, (const uint16_t*)ks,                \
                (const uint16_t*)vs, tables, seq_lens, query_lens, out, num_seqs,              \
                table_stride, num_heads, kv_heads, block_size, max_seq_len, max_query_len,     \
                scale, num_threads, start, lse);                                               \
        });                                                                                    \
    }
ENTRY8(decode_f32_int8, float, int8_t)
ENTRY8(decode_bf16_int8, uint16_t, int8_t)
ENTRY8(decode_f32_fp8, float, fp8e4m3)
ENTRY8(decode_bf16_fp8, uint16_t, fp8e4m3)

extern "C" int decode_head_dim(int head_dim) { return takes_head_dim(head_dim); }

// A decode step's attention as a layer stack calls it, layer after layer (fused_ops.cpp's
// decoder_stack_*), `step` a kernels.h StepAttention: what DecodeKernel.write_kv (for 8-bit
// caches, quantize_kv) and then DecodeKernel.__call__ do for one layer (the same bytes in the
// same slots, the same sums), with the float32 output rounded to the activations' type as
// torch rounds it (to nearest even) into out [num_seqs, num_heads, head_dim]. -1 (nothing
// written) for a slot out of range or a head size without a kernel.
template <typename Q, typename KV, int D>
static void step_decode(const StepAttention& s, int layer, const void* q, float* out) {
    const void* const* caches = (const void* const*)s.caches;
    const uint16_t* ks = nullptr;
    const uint16_t* vs = nullptr;
    if (s.scales != nullptr) {
        ks = (const uint16_t*)s.scales[2 * layer];
        vs = (const uint16_t*)s.scales[2 * layer + 1];
    }
    decode<Q, KV, D>((const Q*)q, (const KV*)caches[2 * layer], (const KV*)caches[2 * layer + 1],
                     ks, vs, s.tables, s.seq_lens, nullptr, out, s.num_seqs, s.table_stride,
                     s.num_heads, s.kv_heads, s.block_size, s.max_seq_len, 1, s.scale,
                     s.threads, 0, nullptr);
}

template <typename Q>
static void step_any(const StepAttention& s, int layer, const void* q, float* out) {
    with_head_dim(s.head_dim, [&](auto d) {
        constexpr int D = decltype(d)::value;
        if (s.kv_format == KV_INT8) step_decode<Q, int8_t, D>(s, layer, q, out);
        else if (s.kv_format == KV_FP8) step_decode<Q, fp8e4m3, D>(s, layer, q, out);
        else step_decode<Q, Q, D>(s, layer, q, out);
    });
}

extern "C" int step_attention(const void* step, int layer, const void* q, const void* k,
                              const void* v, void* out) {
    const StepAttention& s = *(const StepAttention*)step;
    if (!takes_head_dim(s.head_dim)) return -1;
    char* kc = (char*)s.caches[2 * layer];
    char* vc = (char*)s.caches[2 * layer + 1];
    const int status =
        s.kv_format == KV_ACTIVATIONS
            ? write_rows((const char*)k, (const char*)v, kc, vc, s.slots, s.num_seqs,
                         s.row_bytes, s.num_slots)
            : quantize_kv(k, v, kc, vc, (void*)s.scales[2 * layer], (void*)s.scales[2 * layer + 1],
                          s.slots, s.num_seqs, s.kv_heads * s.head_dim, s.head_dim, s.num_slots,
                          s.bf16, s.kv_format);
    if (status != 0) return -1;
    const long n = long(s.num_seqs) * s.num_heads * s.head_dim;
    if (!s.bf16) {  // float32 activations: the kernel's output is already their type
        step_any<float>(s, layer, q, (float*)out);
        return 0;
    }
    static thread_local std::vector<float> wide;
    if (long(wide.size()) < n) wide.resize(n);
    step_any<uint16_t>(s, layer, q, wide.data());
    uint16_t* o = (uint16_t*)out;
    for (long i = 0; i < n; ++i) o[i] = f32_to_bf16(wide[i]);
    return 0;
}

// One row of D elements of x (float32 or bfloat16) rounded to 8 bits with its fp16 scale, as
// runner/attention.py's quantize_rows rounds it: the scale amax / 127 (int8) or amax / 448
// (fp8) rounded to fp16, then each element divided by that rounded scale (an all-zero row:
// scale 0, elements 0) and rounded to nearest even, int8 clamped to [-127, 127].
template <typename X>
static void quantize_row(const X* x, long n, int format, void* row, uint16_t* scale) {
    float amax = 0.f;
    for (long i = 0; i < n; ++i) {  // a compare, not fmax: GCC 12's aarch64 vectorizer fails on it
        const float a = std::fabs(load(x[i]));
        amax = a > amax ? a : amax;
    }
    const uint16_t h = f32_to_half(amax / (format == KV_FP8 ? 448.f : 127.f));
    const float stored = half_to_f32(h), divisor = stored > 0.f ? stored : 1.f;
    *scale = h;
    for (long i = 0; i < n; ++i) {
        const float y = load(x[i]) / divisor;
        if (format == KV_FP8)
            ((fp8e4m3*)row)[i] = f32_to_e4m3(std::fmin(std::fmax(y, -448.f), 448.f));
        else
            ((int8_t*)row)[i] = int8_t(std::fmin(std::fmax(__builtin_nearbyintf(y), -127.f), 127.f));
    }
}

extern "C" int quantize_kv(const void* k, const void* v, void* kc, void* vc, void* ks, void* vs,
                           const int64_t* slots, long tokens, long row_elements, long head_dim,
                           long num_slots, int bf16, int format) {
    for (long t = 0; t < tokens; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const long heads = row_elements / head_dim;
    for (long t = 0; t < tokens; ++t)
        for (long h = 0; h < heads; ++h) {
            const long from = t * row_elements + h * head_dim;
            const long to = slots[t] * row_elements + h * head_dim, at = slots[t] * heads + h;
            for (int which = 0; which < 2; ++which) {
                const void* x = which == 0 ? k : v;
                char* cache = (char*)(which == 0 ? kc : vc);
                uint16_t* scale = (uint16_t*)(which == 0 ? ks : vs) + at;
                if (bf16) quantize_row((const uint16_t*)x + from, head_dim, format, cache + to, scale);
                else quantize_row((const float*)x + from, head_dim, format, cache + to, scale);
            }
        }
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
