// Every entry point of the kernel libraries, declared once. The Python side reads this file
// (pagekv/kernels/build.py) for the ctypes signatures, so a declaration here is the whole
// contract: pointers are addresses (ctypes c_void_p), and only the scalar types void, int,
// long, float and double appear by value. Each library defines its own section. A struct
// passed by its address is declared here too, once, and mirrored field by field as a
// ctypes.Structure in pagekv/kernels/abi.py (tests/kernels/test_abi.py holds the two equal).
#pragma once
#include <cstdint>

extern "C" {

// The head sizes the attention kernels are built for: the decode kernel (decode.cpp) and the
// float32-vector prefill and cascade kernels (prefill.cpp) on every target. Adding one here
// builds them all for it; Python asks decode_head_dim and prefill_head_dim.
#define PAGEKV_HEAD_DIMS(X) X(64) X(128) X(256)

// decode.cpp: paged decode attention; q, caches and out as the Python wrapper lays them out.
// start: the first position each row attends (0: all of it); lse: null, or float32
// [rows, num_heads] for each head's log-sum-exp over those positions; query_lens: null (one
// query token per sequence) or int32 [num_seqs], the rows of q per sequence. 0, or -1 (nothing
// written) for a head size without a kernel.
int decode_f32(const void* q, const void* kc, const void* vc, const int32_t* tables,
               const int32_t* seq_lens, const int32_t* query_lens, float* out, int num_seqs,
               int table_stride, int num_heads, int kv_heads, int block_size, int head_dim,
               int max_seq_len, int max_query_len, float scale, int num_threads, int start,
               float* lse);
int decode_bf16(const void* q, const void* kc, const void* vc, const int32_t* tables,
                const int32_t* seq_lens, const int32_t* query_lens, float* out, int num_seqs,
                int table_stride, int num_heads, int kv_heads, int block_size, int head_dim,
                int max_seq_len, int max_query_len, float scale, int num_threads, int start,
                float* lse);
// The same over 8-bit caches (int8, or fp8 e4m3 bits) with fp16 scales ks, vs
// [num_slots][kv_heads]: queries float32 (decode_f32_*) or bfloat16 (decode_bf16_*).
int decode_f32_int8(const void* q, const void* kc, const void* vc, const void* ks,
                    const void* vs, const int32_t* tables, const int32_t* seq_lens,
                    const int32_t* query_lens, float* out, int num_seqs, int table_stride,
                    int num_heads, int kv_heads, int block_size, int head_dim, int max_seq_len,
                    int max_query_len, float scale, int num_threads, int start, float* lse);
int decode_bf16_int8(const void* q, const void* kc, const void* vc, const void* ks,
                     const void* vs, const int32_t* tables, const int32_t* seq_lens,
                     const int32_t* query_lens, float* out, int num_seqs, int table_stride,
                     int num_heads, int kv_heads, int block_size, int head_dim, int max_seq_len,
                     int max_query_len, float scale, int num_threads, int start, float* lse);
int decode_f32_fp8(const void* q, const void* kc, const void* vc, const void* ks,
                   const void* vs, const int32_t* tables, const int32_t* seq_lens,
                   const int32_t* query_lens, float* out, int num_seqs, int table_stride,
                   int num_heads, int kv_heads, int block_size, int head_dim, int max_seq_len,
                   int max_query_len, float scale, int num_threads, int start, float* lse);
int decode_bf16_fp8(const void* q, const void* kc, const void* vc, const void* ks,
                    const void* vs, const int32_t* tables, const int32_t* seq_lens,
                    const int32_t* query_lens, float* out, int num_seqs, int table_stride,
                    int num_heads, int kv_heads, int block_size, int head_dim, int max_seq_len,
                    int max_query_len, float scale, int num_threads, int start, float* lse);
// 1 if the decode kernel takes head_dim (one of PAGEKV_HEAD_DIMS), else 0.
int decode_head_dim(int head_dim);
// The first maximum of each bfloat16 row (a NaN counts as the maximum, as in torch).
void argmax_bf16_rows(const uint16_t* x, int64_t* out, long rows, long cols, int num_threads);
// A step's new K/V rows into their cache slots; -1 (nothing written) for a slot out of range.
int write_rows(const char* k, const char* v, char* kc, char* vc, const int64_t* slots,
               long tokens, long row_bytes, long num_slots);
// A decode step's attention as a layer stack calls it, layer after layer: one query token per
// sequence, the whole of each history, no log-sum-exp (pagekv/kernels/decode.py fills it).
// The rows a KV cache holds: the activations' type (float32 or bfloat16), or 8 bits with an
// fp16 scale per slot and kv head (int8 steps, or fp8 e4m3 bits).
enum KvFormat { KV_ACTIVATIONS = 0, KV_INT8 = 1, KV_FP8 = 2 };
struct StepAttention {
    const int64_t* caches;  // [layers][2]: each layer's K and V cache addresses
    const int64_t* scales;  // [layers][2]: their scales' addresses (8-bit caches), or null
    const int64_t* slots;   // [num_seqs]: where this step's K/V rows go
    const int32_t* tables;  // [num_seqs][table_stride]
    const int32_t* seq_lens;
    int64_t num_slots, row_bytes;
    int32_t num_seqs, table_stride, num_heads, kv_heads, block_size, max_seq_len, head_dim,
        bf16, threads, kv_format;
    float scale;
};
// One layer of a decode step: its new K/V rows into their slots, then the decode kernel into
// out (q's type); `step` a StepAttention. 0, or -1 with nothing written. Its address is what a
// layer stack (decoder_stack_*) calls for each layer's attention.
int step_attention(const void* step, int layer, const void* q, const void* k, const void* v,
                   void* out);
// This step's new K/V rows (k, v: [tokens][row_elements], float32 or, with bf16, bfloat16)
// rounded to 8 bits (format KV_INT8 or KV_FP8) into their slots of kc and vc, each head's
// fp16 scale into ks and vs ([num_slots][row_elements / head_dim]), as quantize_rows rounds
// them. 0, or -1 with nothing written for a slot out of range.
int quantize_kv(const void* k, const void* v, void* kc, void* vc, void* ks, void* vs,
                const int64_t* slots, long tokens, long row_elements, long head_dim,
                long num_slots, int bf16, int format);

// prefill.cpp: attention in tiles. Each returns 0, or -1 where this target has no kernel for
// the call (the caller keeps SDPA or the decode kernel).
int prefill_attention_bf16_d64(const void* q, const void* kc, const void* vc, void* out,
                               const int64_t* chunk_info, int num_chunks, const int32_t* tables,
                               int num_heads, int kv_heads, int block_size, float scale,
                               int threads);
// Cascade attention: decode rows q [B, H, D] whose sequences begin with the same `prefix_len`
// positions (the blocks `table`), each row's attention over that prefix merged into `out`
// (float32 [B, H, D]), which holds its attention over the rest of its sequence, normalized;
// `lse` ([B, H], read only) holds that rest's log-sum-exp of scaled scores, by which the two
// parts are weighed. -1 (nothing written) also for num_heads % kv_heads != 0 or prefix_len < 1.
int shared_prefix_attention_bf16_d64(const void* q, const void* kc, const void* vc,
                                     const int32_t* table, int prefix_len, int num_seqs,
                                     int num_heads, int kv_heads, int block_size, float scale,
                                     float* out, const float* lse, int threads);
int decode_attention_bf16_d64(const void* q, const void* kc, const void* vc, void* out,
                              const int32_t* tables, int table_stride, const int32_t* seq_lens,
                              const int32_t* query_lens, int num_seqs, int num_heads,
                              int kv_heads, int block_size, int max_seq_len, float scale,
                              int threads);
// The unit multiplying tiles (2 AMX, 1 AVX512-BF16 vectors, 0 none); `request` 1 or 2
// switches to it where it can, anything else only asks.
int prefill_kernel_backend(int request);
// Prefill chunks and cascade attention with float32 arithmetic on every target and every head
// size of PAGEKV_HEAD_DIMS (-1 for another): float32 inputs, or bfloat16 ones widened as they
// are packed (where the target has no bf16 tiles, or the tiles not this head size).
// 1 if these take head_dim (one of PAGEKV_HEAD_DIMS), else 0.
int prefill_head_dim(int head_dim);
int prefill_attention_f32(const void* q, const void* kc, const void* vc, void* out,
                          const int64_t* chunk_info, int num_chunks, const int32_t* tables,
                          int num_heads, int kv_heads, int block_size, int head_dim,
                          float scale, int threads);
int prefill_attention_bf16_f32(const void* q, const void* kc, const void* vc, void* out,
                               const int64_t* chunk_info, int num_chunks, const int32_t* tables,
                               int num_heads, int kv_heads, int block_size, int head_dim,
                               float scale, int threads);
// shared_prefix_attention_bf16_d64's contract, any head size of PAGEKV_HEAD_DIMS.
int shared_prefix_attention_f32(const void* q, const void* kc, const void* vc,
                                const int32_t* table, int prefix_len, int num_seqs, int num_heads,
                                int kv_heads, int block_size, int head_dim, float scale,
                                float* out, const float* lse, int threads);
int shared_prefix_attention_bf16_f32(const void* q, const void* kc, const void* vc,
                                     const int32_t* table, int prefix_len, int num_seqs,
                                     int num_heads, int kv_heads, int block_size, int head_dim,
                                     float scale, float* out, const float* lse, int threads);

// fused_ops.cpp: the layer ops, float32 (_f32) and bfloat16 (_bf16).
void add_rms_norm_f32(const void* x, void* residual, const void* w, void* out, long rows, long n,
                      float eps, int threads);
void add_rms_norm_bf16(const void* x, void* residual, const void* w, void* out, long rows,
                       long n, float eps, int threads);
void split_rope_f32(const void* qkv, long row_stride, void* q, void* k, void* v,
                    const float* cos, const float* sin, long tokens, int heads, int kv_heads,
                    int head_dim, int threads);
void split_rope_bf16(const void* qkv, long row_stride, void* q, void* k, void* v,
                     const float* cos, const float* sin, long tokens, int heads, int kv_heads,
                     int head_dim, int threads);
void silu_mul_f32(const void* gate_up, void* out, long rows, long inter, int threads);
void silu_mul_bf16(const void* gate_up, void* out, long rows, long inter, int threads);
// bfloat16 matmul through packed tiles (AMX / AVX512-BF16): 0, or -1 for a call it declines.
void tiles_pack_bf16(const void* w, void* packed, long N, long K);
int tiles_linear_bf16(const void* x, const void* packed, void* out, long M, long K, long N,
                      int unit, int threads);
int tiles_linear_max_rows(void);
int tiles_linear_unit(void);
// Matmul through weights packed in stripes of stripes_width() columns, on every target:
// float32 or bfloat16 weights and activations (the weights' type), float32 sums.
int stripes_width(void);
void stripes_pack_f32(const void* w, void* packed, long N, long K);
void stripes_pack_bf16(const void* w, void* packed, long N, long K);
int stripes_linear_f32(const void* x, const void* packed, void* out, long M, long K, long N,
                       int threads);
int stripes_linear_bf16(const void* x, const void* packed, void* out, long M, long K, long N,
                        int threads);
// GGUF-quantized weights in stripes, dequantized in registers. A format is (bits, group,
// superblock, offsets, zero) as quant.h describes it; -1 (or bytes -1) for one it lacks.
// A weight [N, K] is one run of stripes or a few, each of one format over consecutive output
// columns (the segments of a fused projection; pagekv/kernels/quant.py's PackedQuant).
struct QuantRun {
    long bits, group, superblock, offsets, zero;  // the format
    long first, columns;                          // output columns [first, first + columns)
    long offset;                                  // its stripes' first byte in the weight's
};
// `dots`: its matmuls round the activations to int8 and multiply them by integer dot products
// where a run's format has them (quant_dot.h).
struct QuantWeight {
    const QuantRun* runs;
    long num_runs;
    const void* stripes;
    long dots;
};
// quant_pack takes the decoded form (pagekv/models/quantized.py); quant_linear_*: one run's
// out [M, N], row stride ldo >= N (a slice of a wider output), activations float32 or
// bfloat16, `dots` as a QuantWeight's; quant_rows: rows `ids` of the weight, float32 [n, K],
// -1 (nothing written) for an id outside every run.
long quant_packed_bytes(int bits, int group, int superblock, int offsets, int zero, long N,
                        long K);
int quant_pack(int bits, int group, int superblock, int offsets, int zero, const uint8_t* q,
               const uint16_t* d, const uint16_t* dm, const uint8_t* sc, const uint8_t* mk,
               void* packed, long N, long K);
int quant_rows(const QuantWeight* weight, const int64_t* ids, long n, float* out, long K);
int quant_linear_f32(int bits, int group, int superblock, int offsets, int zero, int dots,
                     const void* x, const void* packed, void* out, long M, long K, long N,
                     long ldo, int threads);
int quant_linear_bf16(int bits, int group, int superblock, int offsets, int zero, int dots,
                      const void* x, const void* packed, void* out, long M, long K, long N,
                      long ldo, int threads);
// silu(x @ gate^T) * (x @ up^T) into out [M, I] from a gated MLP's weight (gate's I columns,
// then up's), the numbers quant_linear_* and silu_mul_* give; -1 (nothing written) for a
// weight or shape it does not take.
int quant_gated_f32(const QuantWeight* weight, const void* x, void* out, long M, long K, long I,
                    int threads);
int quant_gated_bf16(const QuantWeight* weight, const void* x, void* out, long M, long K,
                     long I, int threads);
// A decode layer's two halves around attention in one call each (-1: declined), dense weights
// of the activations' type: float32 in stripes, bfloat16 in tiles or stripes (`unit`: what
// multiplies the tiles).
int attention_inputs_dense_f32(const void* x, void* residual, const void* norm, float eps,
                               const void* qkv, const float* cos, const float* sin, void* q,
                               void* k, void* v, long M, long hidden, int heads, int kv_heads,
                               int head_dim, int unit, int threads);
int attention_inputs_dense_bf16(const void* x, void* residual, const void* norm, float eps,
                                const void* qkv, const float* cos, const float* sin, void* q,
                                void* k, void* v, long M, long hidden, int heads, int kv_heads,
                                int head_dim, int unit, int threads);
int mlp_block_dense_f32(const void* attn, void* residual, const void* o, const void* norm,
                        float eps, const void* gate_up, const void* down, void* out, long M,
                        long hidden, long q_size, long inter, int unit, int threads);
int mlp_block_dense_bf16(const void* attn, void* residual, const void* o, const void* norm,
                         float eps, const void* gate_up, const void* down, void* out, long M,
                         long hidden, long q_size, long inter, int unit, int threads);
// The same halves with GGUF weights in quantized stripes, float32 or bfloat16 activations.
int attention_inputs_quant_f32(const void* x, void* residual, const void* norm, float eps,
                               const QuantWeight* qkv, const float* cos, const float* sin,
                               void* q, void* k, void* v, long M, long hidden, int heads,
                               int kv_heads, int head_dim, int threads);
int attention_inputs_quant_bf16(const void* x, void* residual, const void* norm, float eps,
                                const QuantWeight* qkv, const float* cos, const float* sin,
                                void* q, void* k, void* v, long M, long hidden, int heads,
                                int kv_heads, int head_dim, int threads);
int mlp_block_quant_f32(const void* attn, void* residual, const QuantWeight* o,
                        const void* norm, float eps, const QuantWeight* gate_up,
                        const QuantWeight* down, void* out, long M, long hidden, long q_size,
                        long inter, int threads);
int mlp_block_quant_bf16(const void* attn, void* residual, const QuantWeight* o,
                         const void* norm, float eps, const QuantWeight* gate_up,
                         const QuantWeight* down, void* out, long M, long hidden, long q_size,
                         long inter, int threads);

// A decode step's whole layer stack and final norm in one call, each layer's attention by
// the C function `attention` with `context` (decode.cpp's step_attention); `layers` of them in
// `table`. 0; -1 (nothing written) where a matmul does not take the shape; 1 where the
// attention failed. A matmul of the stack: for decoder_stack_quant_* a GGUF weight (`quant`),
// for decoder_stack_dense_* a dense weight of the activations' type in tiles or stripes
// (`packed`, and `unit`: what multiplies the tiles), as the layer halves take them; `bias`
// (GGUF weights only): null, or the output's bias [N] in the activations' type, added after
// the matmul (Qwen2's q/k/v), rounded as torch's add.
struct StackMatmul {
    const QuantWeight* quant;
    const void* packed;
    long unit;
    const void* bias;
};
struct StackLayer {
    const void* input_norm;
    StackMatmul qkv;
    const void* post_norm;
    StackMatmul o, gate_up, down;
};
int decoder_stack_quant_f32(const StackLayer* table, int layers, void* residual,
                            const void* final_norm, float eps, const float* cos,
                            const float* sin, void* out, long M, long hidden, int heads,
                            int kv_heads, int head_dim, long inter, const void* attention,
                            const void* context, int threads);
int decoder_stack_quant_bf16(const StackLayer* table, int layers, void* residual,
                             const void* final_norm, float eps, const float* cos,
                             const float* sin, void* out, long M, long hidden, int heads,
                             int kv_heads, int head_dim, long inter, const void* attention,
                             const void* context, int threads);
int decoder_stack_dense_f32(const StackLayer* table, int layers, void* residual,
                            const void* final_norm, float eps, const float* cos,
                            const float* sin, void* out, long M, long hidden, int heads,
                            int kv_heads, int head_dim, long inter, const void* attention,
                            const void* context, int threads);
int decoder_stack_dense_bf16(const StackLayer* table, int layers, void* residual,
                             const void* final_norm, float eps, const float* cos,
                             const float* sin, void* out, long M, long hidden, int heads,
                             int kv_heads, int head_dim, long inter, const void* attention,
                             const void* context, int threads);

// roofline.cpp: this machine's peaks (-1 where the target lacks the instructions).
int f32_lanes(void);
int peak_chains(void);
double fma_f32(long iters, int threads);
double read_f32(const float* x, long n, int threads);
double dot_bf16(long iters, int threads);

}  // extern "C"
