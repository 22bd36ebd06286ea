// A decode step's layer in two calls instead of nine (attention_inputs, mlp_block), and all
// of a step's layers in one (decoder_stack): the layer ops in the order LlamaDecoderLayer calls
// them one by one, through the same kernels (so the same bits), the intermediates in this
// thread's scratch instead of new tensors. Each matmul is the one FusedOps.linear picks for a
// decode batch: for bf16 weights the tiles where the target has them, else the stripes; for
// GGUF weights the quantized stripes, float32 or bf16 activations. Only for row counts and
// shapes those take; checked before anything is written (-1: the caller goes op by op).
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>
#include "dense_tiles.h"
#include "kernels.h"
#include "layer_ops.h"
#include "quant_matmul.h"
#include "stripes.h"

template <typename T>
static T* scratch(long elements) {
    static thread_local std::vector<T> buffer;
    if (long(buffer.size()) < elements) buffer.resize(elements);
    return buffer.data();
}

// A dense weight packed for decode steps, of the activations' type T (float32 or bf16): bf16 in
// tiles where the target has a unit for them (`unit`: which multiplies them), else in stripes.
template <typename T>
struct DenseDecodeMatmul {
    const void* packed;
    int unit;  // stripes have none
    static DenseDecodeMatmul of(const StackMatmul& m) { return {m.packed, int(m.unit)}; }
    static bool tiled() { return std::is_same<T, uint16_t>::value && best_tile_unit() > 0; }
    bool fits(long M, long K, long N) const {
        if (tiled()) return tiles_fit(M, K, N, unit);
        return M >= 1 && K >= 1 && N % STRIPE == 0;
    }
    void operator()(const T* x, T* out, long M, long K, long N, int threads) const {
        if (tiled())
            tiles_linear((const uint16_t*)x, (const uint16_t*)packed, (uint16_t*)out, M, K, N,
                         unit, threads);
        else
            stripes_matmul(x, DenseStripes<T>{(const T*)packed, K}, out, M, K, N, N, threads);
    }
    int gated(const T*, T*, long, long, long, int) const { return -1; }
};

// x null (the first layer): the norm of the residual alone, which is left as it is.
template <typename T, class MM>
static int attention_inputs(const T* x, T* residual, const T* norm, float eps, const MM& qkv_mm,
                            const float* cos, const float* sin, T* q, T* k, T* v, long M,
                            long hidden, int heads, int kv_heads, int head_dim, int threads) {
    const long width = long(heads + 2 * kv_heads) * head_dim;
    if (!qkv_mm.fits(M, hidden, width)) return -1;
    T* h = scratch<T>(M * (hidden + width));
    T* qkv = h + M * hidden;
    add_rms_norm<T>(x, residual, norm, h, M, hidden, eps, threads);
    qkv_mm(h, qkv, M, hidden, width, threads);
    split_rope<T>(qkv, width, q, k, v, cos, sin, M, heads, kv_heads, head_dim, threads);
    return 0;
}

template <typename T, class MM>
static int mlp_block(const T* attn, T* residual, const MM& o_mm, const T* norm, float eps,
                     const MM& gate_up_mm, const MM& down_mm, T* out, long M, long hidden,
                     long q_size, long inter, int threads) {
    if (!o_mm.fits(M, q_size, hidden) || !gate_up_mm.fits(M, hidden, 2 * inter) ||
        !down_mm.fits(M, inter, hidden))
        return -1;
    T* o = scratch<T>(M * (2 * hidden + 3 * inter));
    T* h = o + M * hidden;
    T* gate_up = h + M * hidden;
    T* act = gate_up + M * 2 * inter;
    o_mm(attn, o, M, q_size, hidden, threads);
    add_rms_norm<T>(o, residual, norm, h, M, hidden, eps, threads);
    if (gate_up_mm.gated(h, act, M, hidden, inter, threads) != 0) {
        gate_up_mm(h, gate_up, M, hidden, 2 * inter, threads);
        silu_mul<T>(gate_up, act, M, inter, threads);
    }
    down_mm(act, out, M, inter, hidden, threads);
    return 0;
}

// A decode step's every layer and the final norm in one call: for each layer
// attention_inputs, its attention (a C function the runner gives: decode.cpp's
// step_attention), mlp_block, as LlamaForCausalLM.forward calls them one by one (so the same
// bits), then the final add_rms_norm into out. `table`: a kernels.h StackLayer per layer, its
// matmuls MM's (QuantDecodeMatmul or DenseDecodeMatmul). `residual` holds the embeddings and
// becomes the residual stream. -1 (nothing written) where a layer's matmul does not take this
// shape; 1 where the attention failed (layers before it ran).
using StackAttention = int (*)(const void*, int, const void*, const void*, const void*, void*);

template <typename T, class MM>
static int decoder_stack(const StackLayer* table, int layers, T* residual, const T* final_norm,
                         float eps, const float* cos, const float* sin, T* out, long M,
                         long hidden, int heads, int kv_heads, int head_dim, long inter,
                         const void* attention, const void* context, int threads) {
    const long q_size = long(heads) * head_dim, kv_size = long(kv_heads) * head_dim;
    for (int l = 0; l < layers; ++l) {
        const StackLayer& layer = table[l];
        if (!MM::of(layer.qkv).fits(M, hidden, q_size + 2 * kv_size) ||
            !MM::of(layer.o).fits(M, q_size, hidden) ||
            !MM::of(layer.gate_up).fits(M, hidden, 2 * inter) ||
            !MM::of(layer.down).fits(M, inter, hidden))
            return -1;
    }
    if (layers < 1) return -1;
    std::vector<T> buffers(M * (2 * q_size + 2 * kv_size + hidden));
    T* q = buffers.data();
    T* k = q + M * q_size;
    T* v = k + M * kv_size;
    T* attn = v + M * kv_size;
    T* x = attn + M * q_size;  // a layer's output
    const StackAttention attend = (StackAttention)attention;
    for (int l = 0; l < layers; ++l) {
        const StackLayer& layer = table[l];
        attention_inputs<T>(l == 0 ? nullptr : x, residual, (const T*)layer.input_norm, eps,
                            MM::of(layer.qkv), cos, sin, q, k, v, M, hidden, heads, kv_heads,
                            head_dim, threads);
        if (attend(context, l, q, k, v, attn) != 0) return 1;
        mlp_block<T>(attn, residual, MM::of(layer.o), (const T*)layer.post_norm, eps,
                     MM::of(layer.gate_up), MM::of(layer.down), x, M, hidden, q_size, inter,
                     threads);
    }
    add_rms_norm<T>(x, residual, final_norm, out, M, hidden, eps, threads);
    return 0;
}
