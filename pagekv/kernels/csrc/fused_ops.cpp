// The fused ops library's entry points (kernels.h's fused_ops.cpp section): the layer ops
// (layer_ops.h), the matmuls of decode steps through packed weights: bf16 tiles
// (dense_tiles.h), float32 and bf16 stripes (stripes.h), GGUF weights in quantized stripes
// (quant_matmul.h), and a decode layer's two halves and a step's whole layer stack
// (layer_stack.h). Built without FMA contraction: g++ contracts a * b - c into one rounding
// even under -std=c++17, and torch rounds the product first.
#include <cstdint>
#include "dense_tiles.h"
#include "kernels.h"
#include "layer_ops.h"
#include "layer_stack.h"
#include "quant_matmul.h"
#include "stripes.h"

#define ENTRIES(SUFFIX, T)                                                                    \
    extern "C" void add_rms_norm_##SUFFIX(const void* x, void* residual, const void* w,       \
                                          void* out, long rows, long n, float eps, int threads) { \
        add_rms_norm<T>((const T*)x, (T*)residual, (const T*)w, (T*)out, rows, n, eps, threads); \
    }                                                                                         \
    extern "C" void split_rope_##SUFFIX(const void* qkv, long row_stride, void* q, void* k,   \
                                        void* v, const float* cos, const float* sin,          \
                                        long tokens, int heads, int kv_heads, int head_dim,   \
                                        int threads) {                                        \
        split_rope<T>((const T*)qkv, row_stride, (T*)q, (T*)k, (T*)v, cos, sin, tokens,       \
                      heads, kv_heads, head_dim, threads);                                    \
    }                                                                                         \
    extern "C" void silu_mul_##SUFFIX(const void* gate_up, void* out, long rows, long inter,  \
                                      int threads) {                                          \
        silu_mul<T>((const T*)gate_up, (T*)out, rows, inter, threads);                        \
    }
ENTRIES(f32, float)
ENTRIES(bf16, uint16_t)

void tiles_pack_bf16(const void* w, void* packed, long N, long K) {
    tiles_pack((const uint16_t*)w, (uint16_t*)packed, N, K);
}
int tiles_linear_bf16(const void* x, const void* packed, void* out, long M, long K, long N,
                      int unit, int threads) {
    return tiles_linear((const uint16_t*)x, (const uint16_t*)packed, (uint16_t*)out, M, K, N,
                        unit, threads);
}
int tiles_linear_max_rows() { return best_tile_unit() > 0 ? TILED_MAX_ROWS : 0; }
int tiles_linear_unit() { return best_tile_unit(); }

int stripes_width() { return STRIPE; }
void stripes_pack_f32(const void* w, void* packed, long N, long K) {
    stripes_pack((const float*)w, (float*)packed, N, K);
}
void stripes_pack_bf16(const void* w, void* packed, long N, long K) {
    stripes_pack((const uint16_t*)w, (uint16_t*)packed, N, K);
}
int stripes_linear_f32(const void* x, const void* packed, void* out, long M, long K, long N,
                       int threads) {
    return stripes_matmul((const float*)x, DenseStripes<float>{(const float*)packed, K},
                          (float*)out, M, K, N, N, threads);
}
int stripes_linear_bf16(const void* x, const void* packed, void* out, long M, long K, long N,
                        int threads) {
    return stripes_matmul((const uint16_t*)x, DenseStripes<uint16_t>{(const uint16_t*)packed, K},
                          (uint16_t*)out, M, K, N, N, threads);
}

long quant_packed_bytes(int bits, int group, int superblock, int offsets, int zero, long N,
                        long K) {
    long bytes = -1;
    with_quant_format(bits, group, superblock, offsets, zero, [&](auto f) {
        bytes = N / STRIPE * decltype(f)::stripe_bytes(K);
        return 0;
    });
    return bytes;
}
int quant_pack(int bits, int group, int superblock, int offsets, int zero, const uint8_t* q,
               const uint16_t* d, const uint16_t* dm, const uint8_t* sc, const uint8_t* mk,
               void* packed, long N, long K) {
    if (N % STRIPE != 0 || superblock <= 0 || K % superblock != 0) return -1;
    return with_quant_format(bits, group, superblock, offsets, zero, [&](auto f) {
        quant_pack<decltype(f)>(q, d, dm, sc, mk, (uint8_t*)packed, N, K);
        return 0;
    });
}
int quant_rows(const QuantWeight* weight, const int64_t* ids, long n, float* out, long K) {
    return quant_weight_rows(*weight, ids, n, out, K);
}
int quant_linear_f32(int bits, int group, int superblock, int offsets, int zero, int dots,
                     const void* x, const void* packed, void* out, long M, long K, long N,
                     long ldo, int threads) {
    return quant_linear(bits, group, superblock, offsets, zero, dots, (const float*)x, packed,
                        (float*)out, M, K, N, ldo, threads);
}
int quant_linear_bf16(int bits, int group, int superblock, int offsets, int zero, int dots,
                      const void* x, const void* packed, void* out, long M, long K, long N,
                      long ldo, int threads) {
    return quant_linear(bits, group, superblock, offsets, zero, dots, (const uint16_t*)x,
                        packed, (uint16_t*)out, M, K, N, ldo, threads);
}

#define DENSE_HALVES(SUFFIX, T)                                                               \
    extern "C" int attention_inputs_dense_##SUFFIX(                                           \
        const void* x, void* residual, const void* norm, float eps, const void* qkv,         \
        const float* cos, const float* sin, void* q, void* k, void* v, long M, long hidden,  \
        int heads, int kv_heads, int head_dim, int unit, int threads) {                      \
        return attention_inputs((const T*)x, (T*)residual, (const T*)norm, eps,              \
                                DenseDecodeMatmul<T>{qkv, unit}, cos, sin, (T*)q, (T*)k,     \
                                (T*)v, M, hidden, heads, kv_heads, head_dim, threads);       \
    }                                                                                         \
    extern "C" int mlp_block_dense_##SUFFIX(                                                  \
        const void* attn, void* residual, const void* o, const void* norm, float eps,        \
        const void* gate_up, const void* down, void* out, long M, long hidden, long q_size,  \
        long inter, int unit, int threads) {                                                 \
        return mlp_block((const T*)attn, (T*)residual, DenseDecodeMatmul<T>{o, unit},        \
                         (const T*)norm, eps, DenseDecodeMatmul<T>{gate_up, unit},           \
                         DenseDecodeMatmul<T>{down, unit}, (T*)out, M, hidden, q_size,       \
                         inter, threads);                                                    \
    }
DENSE_HALVES(f32, float)
DENSE_HALVES(bf16, uint16_t)

#define GATED_ENTRY(SUFFIX, T)                                                                 \
    extern "C" int quant_gated_##SUFFIX(const QuantWeight* weight, const void* x, void* out,   \
                                        long M, long K, long I, int threads) {                 \
        return QuantDecodeMatmul{weight}.gated((const T*)x, (T*)out, M, K, I, threads);        \
    }
GATED_ENTRY(f32, float)
GATED_ENTRY(bf16, uint16_t)

#define QUANT_HALVES(SUFFIX, T)                                                               \
    extern "C" int attention_inputs_quant_##SUFFIX(                                           \
        const void* x, void* residual, const void* norm, float eps, const QuantWeight* qkv,  \
        const float* cos, const float* sin, void* q, void* k, void* v, long M, long hidden,  \
        int heads, int kv_heads, int head_dim, int threads) {                                \
        return attention_inputs((const T*)x, (T*)residual, (const T*)norm, eps,              \
                                QuantDecodeMatmul{qkv}, cos, sin, (T*)q, (T*)k, (T*)v, M,    \
                                hidden, heads, kv_heads, head_dim, threads);                 \
    }                                                                                         \
    extern "C" int mlp_block_quant_##SUFFIX(                                                  \
        const void* attn, void* residual, const QuantWeight* o, const void* norm, float eps, \
        const QuantWeight* gate_up, const QuantWeight* down, void* out, long M, long hidden, \
        long q_size, long inter, int threads) {                                              \
        return mlp_block((const T*)attn, (T*)residual, QuantDecodeMatmul{o}, (const T*)norm, \
                         eps, QuantDecodeMatmul{gate_up}, QuantDecodeMatmul{down}, (T*)out,  \
                         M, hidden, q_size, inter, threads);                                 \
    }
QUANT_HALVES(f32, float)
QUANT_HALVES(bf16, uint16_t)

#define STACK_ENTRY(NAME, T, MM)                                                              \
    extern "C" int NAME(const StackLayer* table, int layers, void* residual,                  \
                        const void* final_norm, float eps, const float* cos, const float* sin, \
                        void* out, long M, long hidden, int heads, int kv_heads,              \
                        int head_dim, long inter, const void* attention, const void* context, \
                        int threads) {                                                        \
        return decoder_stack<T, MM>(table, layers, (T*)residual, (const T*)final_norm, eps,   \
                                    cos, sin, (T*)out, M, hidden, heads, kv_heads, head_dim,  \
                                    inter, attention, context, threads);                      \
    }
STACK_ENTRY(decoder_stack_quant_f32, float, QuantDecodeMatmul)
STACK_ENTRY(decoder_stack_quant_bf16, uint16_t, QuantDecodeMatmul)
STACK_ENTRY(decoder_stack_dense_f32, float, DenseDecodeMatmul<float>)
STACK_ENTRY(decoder_stack_dense_bf16, uint16_t, DenseDecodeMatmul<uint16_t>)
