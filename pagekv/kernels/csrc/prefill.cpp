// The prefill library's entry points (declared in kernels.h): attention where many query rows
// read the same keys. Prefill chunks, cascade (shared-prefix) decode rows and drafted decodes
// in bf16 tiles (attention_tiles.h: head size 64, where the target has AVX512-BF16); prefill
// chunks and cascade rows in float32 vectors on every target and head size of
// PAGEKV_HEAD_DIMS (attention_vectors.h). One translation unit: the headers hold the bodies.
#include <cstdint>
#include "attention_tiles.h"
#include "attention_vectors.h"
#include "kernels.h"

#if PAGEKV_BF16_TILES
// The unit in use (2 tiles, 1 vectors); `request` 1 or 2 switches to it where it can (tests
// run both units on a CPU with AMX), anything else only asks.
int prefill_kernel_backend(int request) { return tiles::backend(request); }

int prefill_attention_bf16_d64(const void* q, const void* kc, const void* vc, void* out,
                               const int64_t* chunk_info, int num_chunks, const int32_t* tables,
                               int num_heads, int kv_heads, int block_size, float scale,
                               int threads) {
    return tiles::prefill(q, kc, vc, out, chunk_info, num_chunks, tables, num_heads, kv_heads,
                          block_size, scale, threads);
}

int shared_prefix_attention_bf16_d64(const void* q, const void* kc, const void* vc,
                                     const int32_t* table, int prefix_len, int num_seqs,
                                     int num_heads, int kv_heads, int block_size, float scale,
                                     float* out, const float* lse, int threads) {
    return tiles::shared_prefix(q, kc, vc, table, prefix_len, num_seqs, num_heads, kv_heads,
                                block_size, scale, out, lse, threads);
}

int decode_attention_bf16_d64(const void* q, const void* kc, const void* vc, void* out,
                              const int32_t* tables, int table_stride, const int32_t* seq_lens,
                              const int32_t* query_lens, int num_seqs, int num_heads,
                              int kv_heads, int block_size, int max_seq_len, float scale,
                              int threads) {
    return tiles::decode(q, kc, vc, out, tables, table_stride, seq_lens, query_lens, num_seqs,
                         num_heads, kv_heads, block_size, max_seq_len, scale, threads);
}
#else  // no bf16 tiles on this target: each declines, and the caller takes another path
int prefill_kernel_backend(int) { return 0; }
int prefill_attention_bf16_d64(const void*, const void*, const void*, void*, const int64_t*, int,
                               const int32_t*, int, int, int, float, int) {
    return -1;
}
int shared_prefix_attention_bf16_d64(const void*, const void*, const void*, const int32_t*, int,
                                     int, int, int, int, float, float*, const float*, int) {
    return -1;
}
int decode_attention_bf16_d64(const void*, const void*, const void*, void*, const int32_t*, int,
                              const int32_t*, const int32_t*, int, int, int, int, int, float,
                              int) {
    return -1;
}
#endif

int prefill_head_dim(int head_dim) { return takes_head_dim(head_dim); }

int prefill_attention_f32(const void* q, const void* kc, const void* vc, void* out,
                          const int64_t* chunk_info, int num_chunks, const int32_t* tables,
                          int num_heads, int kv_heads, int block_size, int head_dim,
                          float scale, int threads) {
    return f32::prefill_any<float>(q, kc, vc, out, chunk_info, num_chunks, tables, num_heads,
                                   kv_heads, block_size, head_dim, scale, threads);
}

int prefill_attention_bf16_f32(const void* q, const void* kc, const void* vc, void* out,
                               const int64_t* chunk_info, int num_chunks, const int32_t* tables,
                               int num_heads, int kv_heads, int block_size, int head_dim,
                               float scale, int threads) {
    return f32::prefill_any<uint16_t>(q, kc, vc, out, chunk_info, num_chunks, tables, num_heads,
                                      kv_heads, block_size, head_dim, scale, threads);
}

int shared_prefix_attention_f32(const void* q, const void* kc, const void* vc,
                                const int32_t* table, int prefix_len, int num_seqs, int num_heads,
                                int kv_heads, int block_size, int head_dim, float scale,
                                float* out, const float* lse, int threads) {
    return f32::shared_prefix_any<float>(q, kc, vc, table, prefix_len, num_seqs, num_heads,
                                         kv_heads, block_size, head_dim, scale, out, lse,
                                         threads);
}

int shared_prefix_attention_bf16_f32(const void* q, const void* kc, const void* vc,
                                     const int32_t* table, int prefix_len, int num_seqs,
                                     int num_heads, int kv_heads, int block_size, int head_dim,
                                     float scale, float* out, const float* lse, int threads) {
    return f32::shared_prefix_any<uint16_t>(q, kc, vc, table, prefix_len, num_seqs, num_heads,
                                            kv_heads, block_size, head_dim, scale, out, lse,
                                            threads);
}
