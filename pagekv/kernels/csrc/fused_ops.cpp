// The layer ops (RMSNorm + residual, RoPE + split, SiLU x up) and the matmuls of decode steps.
// Plain loops that GCC vectorizes (the omp simd pragmas allow the reassociated sums; check with
// -fopt-info-vec); bfloat16 is widened and rounded with integer ops, the same round-to-nearest-
// even as torch. Built without FMA contraction: g++ contracts a * b - c into one rounding even
// under -std=c++17, and torch rounds the product first.
#include "kernels.h"
#include "simd.h"
#include <cmath>
#include <cstdint>
#include <cstring>

// Split rows over threads only when a call has at least this many elements: below it the
// fork and join cost more than the work (a 16-row decode batch's norm gains nothing from a
// second thread; a 64-row one's does).
static const long PARALLEL_MIN_ELEMENTS = 16384;

static inline float load(float x) { return x; }
static inline float load(uint16_t x) {  // bfloat16 -> float32 is exact: the high 16 bits
    return __builtin_bit_cast(float, uint32_t(x) << 16);
}
template <typename T> static inline T store(float f);
template <> inline float store<float>(float f) { return f; }
template <> inline uint16_t store<uint16_t>(float f) {  // round to nearest even, NaN stays NaN
    const uint32_t u = __builtin_bit_cast(uint32_t, f);
    const uint16_t r = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? uint16_t(0x7FC0) : r;
}
// The value torch holds after rounding to the dtype.
template <typename T> static inline float round_to(float f) { return load(store<T>(f)); }

// exp(x) for any x: Cephes' expf polynomial (rel. error ~2e-7), inf above 88.72, ~0 below -87.
// No std::floor and no memcpy: GCC vectorizes neither. Always inlined: a call inside a loop
// keeps the loop scalar, and GCC's own choice leaves it a call on some targets.
__attribute__((always_inline)) static inline float exp_any(float x) {
    const float big = x > 88.72f ? INFINITY : 1.f;
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round(x / ln 2): 1.5 * 2^23
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    // fused multiply-adds (this file is built without contraction, for the exact ops)
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
    p = std::fma(p * r, r, r + 1.f);
    const int32_t bits = (int32_t(n) + 127) << 23;
    return p * __builtin_bit_cast(float, bits) * big;
}

// Per row: (residual += x, rounded), then out = w * dtype(r * rsqrt(mean(r^2) + eps)). Without
// x (null), residual is only read: the plain norm.
template <typename T>
static void add_rms_norm(const T* x, T* residual, const T* w, T* out, long rows, long n,
                         float eps, int threads) {
    #pragma omp parallel for num_threads(threads) if(rows * n >= PARALLEL_MIN_ELEMENTS)
    for (long row = 0; row < rows; ++row) {
        T* res = residual + row * n;
        float sum = 0.f;
        if (x != nullptr) {
            const T* xr = x + row * n;
            #pragma omp simd reduction(+:sum)
            for (long i = 0; i < n; ++i) {
                const T r = store<T>(load(res[i]) + load(xr[i]));
                res[i] = r;
                sum += load(r) * load(r);
            }
        } else {
            #pragma omp simd reduction(+:sum)
            for (long i = 0; i < n; ++i) sum += load(res[i]) * load(res[i]);
        }
        const float inv = 1.f / std::sqrt(sum / float(n) + eps);
        T* o = out + row * n;
        #pragma omp simd
        for (long i = 0; i < n; ++i) o[i] = store<T>(load(w[i]) * round_to<T>(load(res[i]) * inv));
    }
}

// One head: dst = rotate(src) in halves (HF's rotate_half), float32 math, rounded once.
template <typename T>
static inline void rotate(const T* src, T* dst, const float* c, const float* s, int half) {
    #pragma omp simd
    for (int i = 0; i < half; ++i) {
        const float x1 = load(src[i]), x2 = load(src[i + half]);
        dst[i] = store<T>(x1 * c[i] - x2 * s[i]);
        dst[i + half] = store<T>(x2 * c[i] + x1 * s[i]);
    }
}

// qkv rows (row_stride apart) -> contiguous q [T, H, D], k and v [T, KVH, D]; q, k rotated.
template <typename T>
static void split_rope(const T* qkv, long row_stride, T* q, T* k, T* v, const float* cos,
                       const float* sin, long tokens, int heads, int kv_heads, int head_dim,
                       int threads) {
    const int half = head_dim / 2;
    #pragma omp parallel for num_threads(threads) if(tokens * row_stride >= PARALLEL_MIN_ELEMENTS)
    for (long t = 0; t < tokens; ++t) {
        const T* src = qkv + t * row_stride;
        const float* c = cos + t * half;
        const float* s = sin + t * half;
        for (int h = 0; h < heads; ++h)
            rotate(src + long(h) * head_dim, q + (t * heads + h) * head_dim, c, s, half);
        src += long(heads) * head_dim;
        for (int h = 0; h < kv_heads; ++h)
            rotate(src + long(h) * head_dim, k + (t * kv_heads + h) * head_dim, c, s, half);
        src += long(kv_heads) * head_dim;
        std::memcpy(v + t * kv_heads * head_dim, src, sizeof(T) * kv_heads * head_dim);
    }
}

// o [n] = dtype(silu(g)) * u; silu(g) = g / (1 + exp(-g)) in float32.
template <typename T>
static inline void silu_mul_row(const T* g, const T* u, T* o, long n) {
    #pragma omp simd
    for (long i = 0; i < n; ++i) {
        const float gv = load(g[i]);
        o[i] = store<T>(round_to<T>(gv / (1.f + exp_any(-gv))) * load(u[i]));
    }
}

// out [T, I] = silu_mul_row of each row of gate_up [T, 2I] (gate, then up).
template <typename T>
static void silu_mul(const T* gate_up, T* out, long rows, long inter, int threads) {
    #pragma omp parallel for num_threads(threads) if(rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (long row = 0; row < rows; ++row)
        silu_mul_row(gate_up + row * 2 * inter, gate_up + row * 2 * inter + inter,
                     out + row * inter, inter);
}

// Tiled matmul, bfloat16: out [M, N] = x [M, K] @ w [N, K]^T for decode batches (1 to 256
// rows), with w packed once at load (tiles_pack_bf16) into AMX's tiles:
// [N/16][K/32] tiles, each 16 k-pairs x 16 columns x 2 (the VNNI layout). Each thread owns a
// range of 32-column stripes and streams their tiles once, prefetching the next stripe into L2
// while it multiplies this one, spread evenly over all its passes over the stripe. Two units
// multiply: AMX tiles, two 16-row blocks a pass (up to 32 rows at memory speed; spreading the
// prefetch over every pass, not only the first, keeps larger batches fed too), or, on CPUs with AVX512-BF16 and no AMX (AMD Zen 4/5), vdpbf16ps with up to 12
// rows x 32 columns of sums in registers, a tile row of w loaded once for all of them. Every
// output row is summed in one order, k ascending, whatever M is, so a row's numbers do not
// depend on the batch it is in.
#if defined(__AVX512BF16__)
#include <cstring>
#include <omp.h>
#include <vector>
#include "bf16.h"
static const int TILED_MAX_ROWS = 256;  // about even with oneDNN here; above, oneDNN's turn

extern "C" void tiles_pack_bf16(const void* w, void* packed, long N, long K) {
    const uint16_t* ws = (const uint16_t*)w;
    uint16_t* ps = (uint16_t*)packed;
    #pragma omp parallel for
    for (long nb = 0; nb < N / 16; ++nb)
        for (long kb = 0; kb < K / 32; ++kb) {
            uint16_t* tile = ps + (nb * (K / 32) + kb) * 512;
            for (int r = 0; r < 16; ++r)  // k pair
                for (int c = 0; c < 16; ++c)
                    for (int j = 0; j < 2; ++j)
                        tile[r * 32 + c * 2 + j] = ws[(nb * 16 + c) * K + kb * 32 + 2 * r + j];
        }
}

// Prefetch of the next stripe (two tile rows of `lines` cache lines each, from `next`), spread
// over every k step of every pass: this step's share.
static inline void prefetch_share(const uint16_t* next, long KB, long kb, long pass,
                                  long passes) {
    if (next == nullptr) return;
    const long step = pass * KB + kb, lines = KB * 16, steps = passes * KB;
    const long l0 = lines * step / steps, l1 = lines * (step + 1) / steps;
    for (long line = l0; line < l1; ++line) {
        _mm_prefetch((const char*)next + line * 64, _MM_HINT_T1);
        _mm_prefetch((const char*)(next + KB * 512) + line * 64, _MM_HINT_T1);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Row blocks b0 (and b0 + 1 if TWO) of x against one 32-column stripe (tiles b and b + KB*512)
// into out (row stride ldo): pass `pass` of `passes` over this stripe, which prefetches its
// share of the next stripe.
template <bool TWO>
static inline void amx_block(const uint16_t* a0, const uint16_t* a1, const uint16_t* b,
                             const uint16_t* next, uint16_t* out, long rows0, long rows1,
                             long K, long ldo, float (*c)[16][16], long pass, long passes) {
    const long KB = K / 32;
    const uint16_t* b1 = b + KB * 512;
    _tile_zero(0);
    _tile_zero(1);
    if (TWO) { _tile_zero(2); _tile_zero(3); }
    for (long kb = 0; kb < KB; ++kb) {
        prefetch_share(next, KB, kb, pass, passes);
        _tile_loadd(4, a0 + kb * 32, K * 2);
        _tile_loadd(6, b + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (TWO) {
            _tile_loadd(5, a1 + kb * 32, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (TWO) { _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64); }
    for (int h = 0; h < (TWO ? 2 : 1); ++h)
        for (long r = 0; r < (h ? rows1 : rows0); ++r) {
            uint16_t* o = out + (h * 16 + r) * ldo;
            store_bf16x16(o, _mm512_load_ps(c[2 * h][r]));
            store_bf16x16(o + 16, _mm512_load_ps(c[2 * h + 1][r]));
        }
}

// x's 16-row blocks as tiles load them (16 rows each): a partial last block is copied into
// 16 rows, zeros after the real ones.
struct RowBlocks {
    const uint16_t* x;
    long M, K, full, blocks;
    std::vector<uint16_t> tail;
    RowBlocks(const uint16_t* x, long M, long K)
        : x(x), M(M), K(K), full(M / 16), blocks((M + 15) / 16), tail(M % 16 ? 16 * K : 0, 0) {
        if (M % 16) std::memcpy(tail.data(), x + full * 16 * K, (M % 16) * K * 2);
    }
    const uint16_t* rows(long blk) const { return blk < full ? x + blk * 16 * K : tail.data(); }
    long count(long blk) const { return blk < full ? 16 : M % 16; }
};

// Row blocks [b0, b1) of x against one stripe's tiles `b`, two blocks a pass, into out (row
// stride ldo); `next`: the stripe after it, prefetched over these passes (null for none).
static void amx_stripe(const RowBlocks& xb, long b0, long b1, const uint16_t* b,
                       const uint16_t* next, uint16_t* out, long K, long ldo,
                       float (*c)[16][16]) {
    const long passes = (b1 - b0 + 1) / 2;
    for (long blk = b0; blk < b1; blk += 2) {
        uint16_t* o = out + blk * 16 * ldo;
        if (blk + 1 < b1)
            amx_block<true>(xb.rows(blk), xb.rows(blk + 1), b, next, o, xb.count(blk),
                            xb.count(blk + 1), K, ldo, c, (blk - b0) / 2, passes);
        else
            amx_block<false>(xb.rows(blk), nullptr, b, next, o, xb.count(blk), 0, K, ldo, c,
                             (blk - b0) / 2, passes);
    }
}

static void amx_linear(const void* x, const void* packed, void* out, long M, long K, long N,
                       int threads) {
    const uint16_t* ps = (const uint16_t*)packed;
    const RowBlocks xb((const uint16_t*)x, M, K);
    const long KB = K / 32, stripes = N / 32;
    #pragma omp parallel num_threads(threads)
    {
        configure_tiles();
        alignas(64) float c[4][16][16];
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long s0 = stripes * t / nt, s1 = stripes * (t + 1) / nt;
        for (long s = s0; s < s1; ++s) {
            const uint16_t* b = ps + s * 2 * KB * 512;
            const uint16_t* next = s + 1 < s1 ? b + 2 * KB * 512 : nullptr;
            amx_stripe(xb, 0, xb.blocks, b, next, (uint16_t*)out + s * 32, K, N, c);
        }
        _tile_release();
    }
}
#endif

// Rows [0, R) of x (row stride K) against one 32-column stripe: R x 32 sums in registers.
template <int R>
static inline void vector_block(const uint16_t* x, const uint16_t* b, const uint16_t* next,
                                uint16_t* out, long K, long N, long pass, long passes) {
    const long KB = K / 32;
    const uint16_t* b1 = b + KB * 512;
    __m512 acc[R][2];
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (long kb = 0; kb < KB; ++kb) {
        prefetch_share(next, KB, kb, pass, passes);
        for (int r = 0; r < 16; ++r) {  // k pair 16 kb + r
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b + kb * 512 + r * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + kb * 512 + r * 32);
            for (int m = 0; m < R; ++m) {
                int32_t bits;
                std::memcpy(&bits, x + m * K + kb * 32 + 2 * r, 4);
                const __m512bh xm = (__m512bh)_mm512_set1_epi32(bits);
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xm, w0);
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xm, w1);
            }
        }
    }
    for (int m = 0; m < R; ++m) {
        store_bf16x16(out + m * N, acc[m][0]);
        store_bf16x16(out + m * N + 16, acc[m][1]);
    }
}

static const int VECTOR_ROWS = 12;  // 24 sums, 2 weight rows and a broadcast: 27 registers

template <int R>
static void vector_rows(const uint16_t* x, long rows, const uint16_t* b, const uint16_t* next,
                        uint16_t* out, long K, long N, long pass, long passes) {
    if (rows == R) return vector_block<R>(x, b, next, out, K, N, pass, passes);
    if constexpr (R > 1) vector_rows<R - 1>(x, rows, b, next, out, K, N, pass, passes);
}

static void vector_linear(const void* x, const void* packed, void* out, long M, long K, long N,
                          int threads) {
    const uint16_t* xs = (const uint16_t*)x;
    const uint16_t* ps = (const uint16_t*)packed;
    uint16_t* os = (uint16_t*)out;
    const long KB = K / 32, stripes = N / 32, passes = (M + VECTOR_ROWS - 1) / VECTOR_ROWS;
    #pragma omp parallel num_threads(threads)
    {
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long s0 = stripes * t / nt, s1 = stripes * (t + 1) / nt;
        for (long s = s0; s < s1; ++s) {
            const uint16_t* b = ps + s * 2 * KB * 512;
            const uint16_t* next = s + 1 < s1 ? b + 2 * KB * 512 : nullptr;
            for (long pass = 0; pass < passes; ++pass) {  // rows split evenly over passes
                const long m0 = M * pass / passes, rows = M * (pass + 1) / passes - m0;
                vector_rows<VECTOR_ROWS>(xs + m0 * K, rows, b, next, os + m0 * N + s * 32, K,
                                         N, pass, passes);
            }
        }
    }
}

extern "C" int tiles_linear_bf16(const void* x, const void* packed, void* out, long M, long K,
                                 long N, int unit, int threads) {
    if (M < 1 || M > TILED_MAX_ROWS || K % 32 != 0 || N % 32 != 0 || unit > best_tile_unit())
        return -1;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (unit == 2) {
        amx_linear(x, packed, out, M, K, N, threads);
        return 0;
    }
#endif
    if (unit != 1) return -1;
    vector_linear(x, packed, out, M, K, N, threads);
    return 0;
}
extern "C" int tiles_linear_max_rows() { return TILED_MAX_ROWS; }
extern "C" int tiles_linear_unit() { return best_tile_unit(); }
#else
extern "C" void tiles_pack_bf16(const void*, void*, long, long) {}
extern "C" int tiles_linear_bf16(const void*, const void*, void*, long, long, long, int, int) {
    return -1;  // no AVX512-BF16 here: the caller keeps oneDNN's matmul
}
extern "C" int tiles_linear_max_rows() { return 0; }
extern "C" int tiles_linear_unit() { return 0; }
#endif

// The matmuls through stripes (stripes.h): dense float32 and bfloat16 weights, and GGUF's
// quantized ones (quant.h); activations float32 or bfloat16, the weights' type for dense ones.
#include "quant_dot.h"

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
// A weight's runs as the C layer halves read them (kernels/quant.py's PackedQuant.runs_table):
// [count, then per run bits, group, superblock, offsets, zero, first column, columns, byte
// offset, dots].
static const long RUN_LONGS = 9;

int quant_rows(const long* runs, const void* packed, const int64_t* ids, long n, float* out,
               long K) {
    std::vector<const long*> run_of(n, nullptr);  // each id's run, all checked first
    for (long i = 0; i < n; ++i)
        for (long r = 0; r < runs[0]; ++r) {
            const long* d = runs + 1 + RUN_LONGS * r;
            if (ids[i] >= d[5] && ids[i] < d[5] + d[6]) run_of[i] = d;
        }
    for (long i = 0; i < n; ++i)
        if (run_of[i] == nullptr || K % run_of[i][2] != 0) return -1;
    int failed = 0;
    #pragma omp parallel for reduction(| : failed) if(n * K >= 65536)
    for (long i = 0; i < n; ++i) {
        const long* d = run_of[i];
        failed |= with_quant_format(int(d[0]), int(d[1]), int(d[2]), int(d[3]), int(d[4]),
                                    [&](auto f) {
                                        quant_column<decltype(f)>((const uint8_t*)packed + d[7],
                                                                  ids[i] - d[5], out + i * K, K);
                                        return 0;
                                    });
    }
    return failed ? -1 : 0;
}
#if defined(__AVX512BF16__)
// GGUF weights against a batch of bfloat16 rows: each 32-column stripe dequantized once into
// the bf16 tiles a dense bf16 weight is packed in (in this thread's scratch, L2-sized), then
// multiplied as that weight is: by AMX where the target has it, else by AVX512-BF16 dot
// products (vector_block). Every weight is the float32 the stripes give, rounded to the
// nearest bf16 (the dense bf16 path's weight); the conversion costs about one pass of the
// stripes kernel, so only batches of QUANT_TILES_MIN_ROWS rows or more pay for it. Sums in one
// order, k ascending, for every row of such a batch.
static const long QUANT_TILES_MIN_ROWS = 8;

// Lanes 2i and 2i + 1 of a tile row: column i's bf16 at the even k, then at the odd one.
alignas(64) static const uint16_t PAIR_LANES[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                                    21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                    11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

static inline void store_pairs(uint16_t* p, const VF& even, const VF& odd) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd.v, even.v);  // low: even, high: odd
    _mm512_storeu_si512(p, _mm512_permutexvar_epi16(_mm512_load_si512(PAIR_LANES), both));
}

// This thread's room for one stripe's tiles.
static inline uint16_t* scratch_tiles(long K) {
    static thread_local std::vector<uint16_t> buffer;
    if (long(buffer.size()) < 2 * K * 16) buffer.resize(2 * K * 16);
    return buffer.data();
}

// One stripe -> tiles [2][K / 32][512] (the columns 0-15 and 16-31 of tiles_pack_bf16's).
template <class F>
static void stripe_to_tiles(const QuantStripe<F>& src, long K, uint16_t* tiles) {
    uint16_t* right = tiles + K / 32 * 512;
    for (long k0 = 0; k0 < K; k0 += F::GROUP) {
        const auto group = src.group(k0);
        for (int kk = 0; kk < F::GROUP; kk += 2) {
            VF e0, e1, o0, o1;
            group.weights(kk, e0, e1);
            group.weights(kk + 1, o0, o1);
            const long k = k0 + kk, at = k / 32 * 512 + k % 32 / 2 * 32;
            store_pairs(tiles + at, e0, o0);
            store_pairs(right + at, e1, o1);
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
static const long AMX_ROWS_IN_L2_BYTES = 1L << 20;  // a chunk's rows of x (bf16 bytes)

// quant_tiles_linear on AMX: the rows in chunks whose x stays in L2, each stripe converted once
// per chunk and multiplied as amx_linear multiplies a dense bf16 weight's tiles.
template <class F>
static void quant_amx_linear(const uint16_t* x, const QuantStripes<F>& stripes, uint16_t* out,
                             long M, long K, long N, long ldo, int threads) {
    const RowBlocks xb(x, M, K);
    const long chunk = std::max(2L, AMX_ROWS_IN_L2_BYTES / (16 * K * 2) / 2 * 2);  // blocks
    #pragma omp parallel num_threads(threads)
    {
        configure_tiles();
        alignas(64) float c[4][16][16];
        uint16_t* tiles = scratch_tiles(K);
        const auto [s0, s1] = thread_share(N / STRIPE);
        for (long b0 = 0; b0 < xb.blocks; b0 += chunk)
            for (long s = s0; s < s1; ++s) {
                stripe_to_tiles(stripes.at(s), K, tiles);
                amx_stripe(xb, b0, std::min(xb.blocks, b0 + chunk), tiles, nullptr,
                           out + s * STRIPE, K, ldo, c);
            }
        _tile_release();
    }
}
#endif

template <class F>
static void quant_tiles_linear(const uint16_t* x, const uint8_t* packed, uint16_t* out, long M,
                               long K, long N, long ldo, int threads) {
    const QuantStripes<F> stripes{packed, K};
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (best_tile_unit() == 2) return quant_amx_linear(x, stripes, out, M, K, N, ldo, threads);
#endif
    const long count = N / STRIPE, passes = (M + VECTOR_ROWS - 1) / VECTOR_ROWS;
    #pragma omp parallel num_threads(threads)
    {
        uint16_t* tiles = scratch_tiles(K);
        const long t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (long s = count * t / nt; s < count * (t + 1) / nt; ++s) {
            stripe_to_tiles(stripes.at(s), K, tiles);
            for (long pass = 0; pass < passes; ++pass) {
                const long m0 = M * pass / passes, rows = M * (pass + 1) / passes - m0;
                vector_rows<VECTOR_ROWS>(x + m0 * K, rows, tiles, nullptr,
                                         out + m0 * ldo + s * STRIPE, K, ldo, pass, passes);
            }
        }
    }
}

static bool quant_tiles_fit(long M, long K, long N) {
    return STRIPE == 32 && M >= QUANT_TILES_MIN_ROWS && K % 32 == 0 && N % STRIPE == 0;
}
#endif

// `dots`: int8 activations and integer dot products (quant_dot.h) where the format has them.
template <typename XT>
static int quant_linear(int bits, int group, int superblock, int offsets, int zero, int dots,
                        const XT* x, const void* packed, XT* out, long M, long K, long N,
                        long ldo, int threads) {
    if (superblock <= 0 || K % superblock != 0) return -1;
    return with_quant_format(bits, group, superblock, offsets, zero, [&](auto f) {
        using F = decltype(f);
        if constexpr (has_dots<F>())
            if (dots)
                return quant_dot_matmul(as_f32(x, M * K, threads),
                                        QuantStripes<F>{(const uint8_t*)packed, K}, out, M, K,
                                        N, ldo, threads);
#if defined(__AVX512BF16__)
        if constexpr (std::is_same<XT, uint16_t>::value)
            if (quant_tiles_fit(M, K, N)) {
                quant_tiles_linear<decltype(f)>(x, (const uint8_t*)packed, out, M, K, N, ldo,
                                                threads);
                return 0;
            }
#endif
        const QuantStripes<decltype(f)> stripes{(const uint8_t*)packed, K};
        return stripes_matmul(x, stripes, out, M, K, N, ldo, threads);
    });
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

// A decode step's layer in two calls instead of nine: the ops above in the order
// LlamaDecoderLayer calls them one by one, through the same kernels (so the same bits), the
// intermediates in this thread's scratch instead of new tensors. Each matmul is the one
// FusedOps.linear picks for a decode batch: for bf16 weights the tiles where the target has
// them, else the stripes; for GGUF weights the quantized stripes, float32 or bf16
// activations. Only for row counts and shapes those take; checked before anything is written
// (-1: the caller goes op by op).
template <typename T>
static T* scratch(long elements) {
    static thread_local std::vector<T> buffer;
    if (long(buffer.size()) < elements) buffer.resize(elements);
    return buffer.data();
}

// A dense weight packed for decode steps, of the activations' type T (float32 or bf16): in
// stripes, or for bf16 on a target with tiles, in tiles (`unit`: what multiplies them).
template <typename T>
struct DenseDecodeMatmul {
    const void* packed;
    int unit;  // stripes have none
    bool fits(long M, long K, long N) const { return M >= 1 && K >= 1 && N % STRIPE == 0; }
    void operator()(const T* x, T* out, long M, long K, long N, int threads) const {
        stripes_matmul(x, DenseStripes<T>{(const T*)packed, K}, out, M, K, N, N, threads);
    }
    int gated(const T*, T*, long, long, long, int) const { return -1; }
};

#if defined(__AVX512BF16__)
template <>
struct DenseDecodeMatmul<uint16_t> {
    const void* packed;
    int unit;
    bool fits(long M, long K, long N) const {
        return M >= 1 && M <= TILED_MAX_ROWS && K % 32 == 0 && N % 32 == 0 && unit >= 1 &&
               unit <= best_tile_unit();
    }
    void operator()(const uint16_t* x, uint16_t* out, long M, long K, long N, int threads) const {
        tiles_linear_bf16(x, packed, out, M, K, N, unit, threads);
    }
    int gated(const uint16_t*, uint16_t*, long, long, long, int) const { return -1; }
};
#endif

// A GGUF weight in quantized stripes, in runs (RUN_LONGS above).
struct QuantDecodeMatmul {
    const long* runs;
    const uint8_t* packed;
    bool fits(long M, long K, long N) const {
        long columns = 0;
        for (long r = 0; r < runs[0]; ++r) {
            const long* d = runs + 1 + RUN_LONGS * r;
            const int ok = with_quant_format(int(d[0]), int(d[1]), int(d[2]), int(d[3]),
                                             int(d[4]), [](auto) { return 0; });
            if (ok != 0 || d[5] != columns || d[6] % STRIPE != 0 || K % d[2] != 0) return false;
            columns += d[6];
        }
        return M >= 1 && columns == N;
    }
    // silu_mul of this weight's output in one pass over it (stripes_gated), the same numbers:
    // where the weight is a gated MLP's 2I columns, gate's then up's, in one run or in a run
    // for each of one format, multiplied in stripes; -1 (nothing written) otherwise.
    template <typename T>
    int gated(const T* x, T* out, long M, long K, long I, int threads) const {
        if (!fits(M, K, 2 * I) || I % STRIPE != 0 || runs[0] > 2) return -1;
        const long *gate = runs + 1, *up = runs[0] == 2 ? gate + RUN_LONGS : gate;
        for (int i = 0; i < 5; ++i)
            if (gate[i] != up[i]) return -1;
        if (gate[8] != 0 || up[8] != 0 || (up != gate && gate[6] != I)) return -1;
#if defined(__AVX512BF16__)
        if (std::is_same<T, uint16_t>::value && quant_tiles_fit(M, K, I)) return -1;
#endif
        return with_quant_format(int(gate[0]), int(gate[1]), int(gate[2]), int(gate[3]),
                                 int(gate[4]), [&](auto f) {
            using F = decltype(f);
            const uint8_t* up_at = up != gate ? packed + up[7]
                                              : packed + gate[7] + I / STRIPE * F::stripe_bytes(K);
            const auto epilogue = [](const T* g, const T* u, T* o) {
                silu_mul_row(g, u, o, STRIPE);
            };
            return stripes_gated(x, QuantStripes<F>{packed + gate[7], K},
                                 QuantStripes<F>{up_at, K}, out, M, K, I, threads, epilogue);
        });
    }
    template <typename T>
    void operator()(const T* x, T* out, long M, long K, long N, int threads) const {
        for (long r = 0; r < runs[0]; ++r) {
            const long* d = runs + 1 + RUN_LONGS * r;
            quant_linear(int(d[0]), int(d[1]), int(d[2]), int(d[3]), int(d[4]), int(d[8]), x,
                         packed + d[7], out + d[5], M, K, d[6], N, threads);
        }
    }
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

#define GATED_ENTRY(SUFFIX, T)                                                                \
    extern "C" int quant_gated_##SUFFIX(const long* runs, const void* packed, const void* x,   \
                                        void* out, long M, long K, long I, int threads) {      \
        return QuantDecodeMatmul{runs, (const uint8_t*)packed}.gated((const T*)x, (T*)out, M,  \
                                                                     K, I, threads);           \
    }
GATED_ENTRY(f32, float)
GATED_ENTRY(bf16, uint16_t)

#define QUANT_HALVES(SUFFIX, T)                                                               \
    extern "C" int attention_inputs_quant_##SUFFIX(                                           \
        const void* x, void* residual, const void* norm, float eps, const long* qkv_runs,    \
        const void* qkv, const float* cos, const float* sin, void* q, void* k, void* v,      \
        long M, long hidden, int heads, int kv_heads, int head_dim, int threads) {           \
        return attention_inputs((const T*)x, (T*)residual, (const T*)norm, eps,              \
                                QuantDecodeMatmul{qkv_runs, (const uint8_t*)qkv}, cos, sin,  \
                                (T*)q, (T*)k, (T*)v, M, hidden, heads, kv_heads, head_dim,   \
                                threads);                                                    \
    }                                                                                         \
    extern "C" int mlp_block_quant_##SUFFIX(                                                  \
        const void* attn, void* residual, const long* o_runs, const void* o,                 \
        const void* norm, float eps, const long* gate_up_runs, const void* gate_up,          \
        const long* down_runs, const void* down, void* out, long M, long hidden,             \
        long q_size, long inter, int threads) {                                              \
        return mlp_block((const T*)attn, (T*)residual,                                       \
                         QuantDecodeMatmul{o_runs, (const uint8_t*)o}, (const T*)norm, eps,  \
                         QuantDecodeMatmul{gate_up_runs, (const uint8_t*)gate_up},           \
                         QuantDecodeMatmul{down_runs, (const uint8_t*)down}, (T*)out, M,     \
                         hidden, q_size, inter, threads);                                    \
    }
QUANT_HALVES(f32, float)
QUANT_HALVES(bf16, uint16_t)

// A decode step's every layer and the final norm in one call: for each layer
// attention_inputs, its attention (a C function the runner gives: decode.cpp's
// step_attention), mlp_block, as LlamaForCausalLM.forward calls them one by one (so the same
// bits), then the final add_rms_norm into out. `table` is [layers][STACK_LONGS]: input norm,
// qkv, post-attention norm, o, gate_up, down, each matmul two longs (quantized: its runs and
// stripes; dense: its tiles or stripes and the tile unit). `residual` holds the embeddings and
// becomes the residual stream. -1 (nothing written) where a layer's matmul does not take this
// shape; 1 where the attention failed (layers before it ran).
static const long STACK_LONGS = 10;
using StackAttention = int (*)(const void*, int, const void*, const void*, const void*, void*);

static QuantDecodeMatmul stack_matmul(const long* at, QuantDecodeMatmul*) {
    return {(const long*)at[0], (const uint8_t*)at[1]};
}
template <typename T>
static DenseDecodeMatmul<T> stack_matmul(const long* at, DenseDecodeMatmul<T>*) {
    return {(const void*)at[0], int(at[1])};
}

template <typename T, class MM>
static int decoder_stack(const long* table, int layers, T* residual, const T* final_norm,
                         float eps, const float* cos, const float* sin, T* out, long M,
                         long hidden, int heads, int kv_heads, int head_dim, long inter,
                         const void* attention, const void* context, int threads) {
    const long q_size = long(heads) * head_dim, kv_size = long(kv_heads) * head_dim;
    const auto mm = [table](int layer, int at) {
        return stack_matmul(table + layer * STACK_LONGS + at, (MM*)nullptr);
    };
    for (int l = 0; l < layers; ++l)
        if (!mm(l, 1).fits(M, hidden, q_size + 2 * kv_size) || !mm(l, 4).fits(M, q_size, hidden) ||
            !mm(l, 6).fits(M, hidden, 2 * inter) || !mm(l, 8).fits(M, inter, hidden))
            return -1;
    if (layers < 1) return -1;
    std::vector<T> buffers(M * (2 * q_size + 2 * kv_size + hidden));
    T* q = buffers.data();
    T* k = q + M * q_size;
    T* v = k + M * kv_size;
    T* attn = v + M * kv_size;
    T* x = attn + M * q_size;  // a layer's output
    const StackAttention attend = (StackAttention)attention;
    for (int l = 0; l < layers; ++l) {
        const long* row = table + l * STACK_LONGS;
        attention_inputs<T>(l == 0 ? nullptr : x, residual, (const T*)row[0], eps, mm(l, 1), cos,
                            sin, q, k, v, M, hidden, heads, kv_heads, head_dim, threads);
        if (attend(context, l, q, k, v, attn) != 0) return 1;
        mlp_block<T>(attn, residual, mm(l, 4), (const T*)row[3], eps, mm(l, 6), mm(l, 8), x, M,
                     hidden, q_size, inter, threads);
    }
    add_rms_norm<T>(x, residual, final_norm, out, M, hidden, eps, threads);
    return 0;
}

#define STACK_ENTRY(NAME, T, MM)                                                              \
    extern "C" int NAME(const long* table, int layers, void* residual, const void* final_norm, \
                        float eps, const float* cos, const float* sin, void* out, long M,     \
                        long hidden, int heads, int kv_heads, int head_dim, long inter,       \
                        const void* attention, const void* context, int threads) {            \
        return decoder_stack<T, MM>(table, layers, (T*)residual, (const T*)final_norm, eps,   \
                                    cos, sin, (T*)out, M, hidden, heads, kv_heads, head_dim,  \
                                    inter, attention, context, threads);                      \
    }
STACK_ENTRY(decoder_stack_quant_f32, float, QuantDecodeMatmul)
STACK_ENTRY(decoder_stack_quant_bf16, uint16_t, QuantDecodeMatmul)
STACK_ENTRY(decoder_stack_dense_f32, float, DenseDecodeMatmul<float>)
STACK_ENTRY(decoder_stack_dense_bf16, uint16_t, DenseDecodeMatmul<uint16_t>)
