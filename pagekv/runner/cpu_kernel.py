"""A small C++ kernel for paged decode attention on CPU, compiled on first use, loaded by ctypes.

Owns the kernel's source, its build (g++, cached under ``~/.cache/pagekv/kernels`` by a hash of
source, flags and CPU) and the ctypes call. Why not torch ops: a decode row reads its whole
history, and gathering that history through the block table into new tensors costs a copy of
every K/V byte per layer per step; this kernel reads each cached K/V row in place, once. Why
ctypes and not ``torch.utils.cpp_extension``: no torch headers or pybind11, so the build takes
about a second instead of a minute.

``load()`` returns None (and the caller falls back to torch ops) when there is no compiler, the
build fails, or ``PAGEKV_CPU_KERNEL=0``. Must not import ``pagekv.core``, ``models`` or ``server``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("pagekv")

DISABLE_ENV = "PAGEKV_CPU_KERNEL"
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

# Per (sequence, kv head): scores of the G query heads sharing that kv head against every cached
# key (read in place through the block table), softmax in float32, then one pass over the values.
# K and V rows are each read once; the G query heads reuse every row they load.
_SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

static inline float load(float x) { return x; }
static inline float load(uint16_t x) {  // bfloat16 -> float32 is exact: the high 16 bits
    uint32_t bits = uint32_t(x) << 16; float f; std::memcpy(&f, &bits, 4); return f;
}

// exp(x) for x <= 0 (scores minus their max), Cephes' expf polynomial, rel. error ~2e-7.
// Inline and branch-free so the softmax loop vectorizes; libm's expf is a scalar call.
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = std::floor(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = (int32_t(n) + 127) << 23;
    float scale; std::memcpy(&scale, &bits, 4);
    return p * scale;
}

struct Shape { int num_heads, kv_heads, group, block_size; long token_stride; };

// Row primitives over D elements: dot(q, k) and acc += p * v. Written with AVX-512 intrinsics
// where available (the K/V row is converted to float32 in registers once, and the compiler's
// auto-vectorizer misses the bf16 widening); plain loops elsewhere.
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
static inline __m512 load16(const uint16_t* x) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <int D, typename KV>
static inline void dot_group(const float* q, const KV* k, int group, float scale, float* s,
                             long s_stride) {
    __m512 kr[D / 16];
    for (int i = 0; i < D / 16; ++i) kr[i] = load16(k + 16 * i);
    for (int g = 0; g < group; ++g) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), kr[0]);
        for (int i = 1; i < D / 16; ++i)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * i), kr[i], acc);
        s[g * s_stride] = _mm512_reduce_add_ps(acc) * scale;
    }
}
#if defined(__AVX512BF16__)
// bfloat16 keys: multiply pairs in hardware (vdpbf16ps) against the query rounded to bf16,
// which is exact because the query came from a bf16 model. Accumulates in float32.
template <int D>
static inline void dot_group(const float* q, const uint16_t* k, int group, float scale,
                             float* s, long s_stride) {
    __m512bh kr[D / 32];
    for (int i = 0; i < D / 32; ++i) kr[i] = (__m512bh)_mm512_loadu_si512(k + 32 * i);
    for (int g = 0; g < group; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < D / 32; ++i) {
            const float* qi = q + g * D + 32 * i;
            const __m512bh qb = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qi + 16),
                                                    _mm512_loadu_ps(qi));
            acc = _mm512_dpbf16_ps(acc, qb, kr[i]);
        }
        s[g * s_stride] = _mm512_reduce_add_ps(acc) * scale;
    }
}
#endif
template <int D, typename KV>
static inline void axpy_rows(const float* p, const KV* v, long v_stride, int count, float* out) {
    __m512 acc[D / 16];
    for (int i = 0; i < D / 16; ++i) acc[i] = _mm512_loadu_ps(out + 16 * i);
    for (int t = 0; t < count; ++t) {
        const __m512 pt = _mm512_set1_ps(p[t]);
        for (int i = 0; i < D / 16; ++i)
            acc[i] = _mm512_fmadd_ps(pt, load16(v + t * v_stride + 16 * i), acc[i]);
    }
    for (int i = 0; i < D / 16; ++i) _mm512_storeu_ps(out + 16 * i, acc[i]);
}
#else
template <int D, typename KV>
static inline void dot_group(const float* q, const KV* k, int group, float scale, float* s,
                             long s_stride) {
    for (int g = 0; g < group; ++g) {
        float acc = 0.f;
        for (int d = 0; d < D; ++d) acc += q[g * D + d] * load(k[d]);
        s[g * s_stride] = acc * scale;
    }
}
template <int D, typename KV>
static inline void axpy_rows(const float* p, const KV* v, long v_stride, int count, float* out) {
    for (int t = 0; t < count; ++t)
        for (int d = 0; d < D; ++d) out[d] += p[t] * load(v[t * v_stride + d]);
}
#endif

// Blocks sit anywhere in the pool, so the hardware prefetcher loses the stream at every block
// boundary; ask for the next block's rows (these heads only) while this one is computed.
template <typename KV, int D>
static inline void prefetch_block(const KV* rows, long token_stride, int count) {
    for (int t = 0; t < count; ++t)
        for (long byte = 0; byte < long(sizeof(KV)) * D; byte += 64)
            __builtin_prefetch((const char*)(rows + t * token_stride) + byte);
}

static inline void softmax_rows(float* scores, int rows, int len) {
    for (int h = 0; h < rows; ++h) {
        float* x = scores + long(h) * len;
        float m = x[0], sum = 0.f;
        #pragma omp simd reduction(max:m)
        for (int pos = 1; pos < len; ++pos) m = x[pos] > m ? x[pos] : m;
        #pragma omp simd reduction(+:sum)
        for (int pos = 0; pos < len; ++pos) {
            x[pos] = exp_nonpositive(x[pos] - m);
            sum += x[pos];
        }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int pos = 0; pos < len; ++pos) x[pos] *= inv;
    }
}

// One sequence, kv heads [h0, h1): scores [heads, S] in `scores`, softmax, then the weighted
// sum of values. Blocks are the outer loop so each block's K (then V) rows for these heads are
// read once, contiguously, and reused by every query head of their group while in cache.
template <typename KV, int D>
static void one_sequence(const float* q, const KV* kc, const KV* vc, const int32_t* table,
                         int seq_len, const Shape& sh, int h0, int h1, float scale,
                         float* scores, float* v_rows, float* out) {
    const int heads = (h1 - h0) * sh.group;
    const int num_blocks = (seq_len + sh.block_size - 1) / sh.block_size;
    for (int blk = 0; blk < num_blocks; ++blk) {
        const long base = long(table[blk]) * sh.block_size;
        const int first = blk * sh.block_size;
        const int count = seq_len - first < sh.block_size ? seq_len - first : sh.block_size;
        if (blk + 1 < num_blocks)
            for (int kvh = h0; kvh < h1; ++kvh)
                prefetch_block<KV, D>(kc + long(table[blk + 1]) * sh.block_size * sh.token_stride
                                      + long(kvh) * D, sh.token_stride, sh.block_size);
        for (int t = 0; t < count; ++t)
            for (int kvh = h0; kvh < h1; ++kvh)
                dot_group<D>(q + long(kvh) * sh.group * D,
                             kc + (base + t) * sh.token_stride + long(kvh) * D, sh.group, scale,
                             scores + long(kvh - h0) * sh.group * seq_len + first + t, seq_len);
    }
    softmax_rows(scores, heads, seq_len);
    float* acc = out + long(h0) * sh.group * D;  // [heads, D]: these heads' output rows
    std::memset(acc, 0, sizeof(float) * heads * D);
    for (int blk = 0; blk < num_blocks; ++blk) {
        const long base = long(table[blk]) * sh.block_size;
        const int first = blk * sh.block_size;
        const int count = seq_len - first < sh.block_size ? seq_len - first : sh.block_size;
        if (blk + 1 < num_blocks)
            for (int kvh = h0; kvh < h1; ++kvh)
                prefetch_block<KV, D>(vc + long(table[blk + 1]) * sh.block_size * sh.token_stride
                                      + long(kvh) * D, sh.token_stride, sh.block_size);
        for (int kvh = h0; kvh < h1; ++kvh) {
            const KV* v = vc + base * sh.token_stride + long(kvh) * D;
            for (int t = 0; t < count; ++t)  // widen once; the group's heads reuse it
                for (int d = 0; d < D; ++d) v_rows[t * D + d] = load(v[t * sh.token_stride + d]);
            for (int g = 0; g < sh.group; ++g) {
                const int h = (kvh - h0) * sh.group + g;
                axpy_rows<D>(scores + long(h) * seq_len + first, v_rows, D, count,
                             acc + long(h) * D);
            }
        }
    }
}

template <typename KV, int D>
static void decode(const float* q, const KV* kc, const KV* vc, const int32_t* tables,
                   const int32_t* seq_lens, float* out, int num_seqs, int table_stride,
                   int num_heads, int kv_heads, int block_size, int max_seq_len, float scale,
                   int num_threads) {
    const Shape sh{num_heads, kv_heads, num_heads / kv_heads, block_size, long(kv_heads) * D};
    // Whole sequences per task stream each block contiguously; with fewer sequences than
    // threads, split by kv head so every thread has work.
    const int split = num_seqs < num_threads ? kv_heads : 1;
    #pragma omp parallel num_threads(num_threads)
    {
        float* scores = (float*)std::malloc(sizeof(float) * num_heads * (max_seq_len + 1));
        float* v_rows = (float*)std::malloc(sizeof(float) * block_size * D);
        #pragma omp for schedule(dynamic)
        for (long task = 0; task < long(num_seqs) * split; ++task) {
            const int b = int(task / split), part = int(task % split);
            const int h0 = part * kv_heads / split, h1 = (part + 1) * kv_heads / split;
            one_sequence<KV, D>(q + long(b) * num_heads * D, kc, vc,
                                tables + long(b) * table_stride, seq_lens[b], sh, h0, h1,
                                scale, scores, v_rows, out + long(b) * num_heads * D);
        }
        std::free(scores);
        std::free(v_rows);
    }
}

#define ENTRY(NAME, KV, D)                                                                   \
    extern "C" void NAME(const float* q, const void* kc, const void* vc,                     \
                         const int32_t* tables, const int32_t* seq_lens, float* out,         \
                         int num_seqs, int table_stride, int num_heads, int kv_heads,        \
                         int block_size, int max_seq_len, float scale, int num_threads) {    \
        decode<KV, D>(q, (const KV*)kc, (const KV*)vc, tables, seq_lens, out, num_seqs,      \
                      table_stride, num_heads, kv_heads, block_size, max_seq_len, scale,     \
                      num_threads);                                                          \
    }
ENTRY(decode_f32_d64, float, 64)
ENTRY(decode_bf16_d64, uint16_t, 64)
ENTRY(decode_f32_d128, float, 128)
ENTRY(decode_bf16_d128, uint16_t, 128)
"""

_ENTRIES = {
    (torch.float32, 64): "decode_f32_d64",
    (torch.bfloat16, 64): "decode_bf16_d64",
    (torch.float32, 128): "decode_f32_d128",
    (torch.bfloat16, 128): "decode_bf16_d128",
}


@dataclass(frozen=True)
class DecodeBatch:
    """The decode rows of a step, one query token each, as the kernel reads them."""

    block_tables: torch.Tensor  # int32 [B, max_blocks], contiguous; padding is never read
    seq_lens: torch.Tensor  # int32 [B], history length including this step's token
    max_seq_len: int  # max(seq_lens), as a python int so the call needs no sync


class DecodeKernel:
    """The loaded library. ``supports`` says which (cache dtype, head dim) pairs it has."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {}
        for key, name in _ENTRIES.items():
            fn = getattr(library, name)
            fn.restype = None
            fn.argtypes = (
                [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_int]
            )
            self._functions[key] = fn

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return (dtype, head_dim) in self._functions

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
    ) -> torch.Tensor:
        """q float32 [B, H, D]; caches [num_blocks, block_size, KVH, D] (float32 or bfloat16)
        -> float32 [B, H, D]. All contiguous on CPU; only positions < seq_len are read.

        With bfloat16 caches, q is rounded to bfloat16 for the Q.K products (exact for the
        queries of a bf16 model, which is the only way such caches are filled).
        """
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        out = torch.empty_like(q)  # [B, H, D] float32
        fn = self._functions[(k_cache.dtype, head_dim)]
        fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            batch.block_tables.data_ptr(),
            batch.seq_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            batch.block_tables.stride(0),
            num_heads,
            num_kv_heads,
            block_size,
            batch.max_seq_len,
            scale,
            torch.get_num_threads(),
        )
        return out


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pagekv" / "kernels"


def _cpu_identity() -> str:
    """-march=native binaries are only valid on a CPU with the same features."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()}|{flags}"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "decode.cpp"
        source.write_text(_SOURCE, encoding="utf-8")
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *CXX_FLAGS, str(source), "-o", str(built)],
            check=True,
            capture_output=True,
            timeout=300,
        )
        os.replace(built, target)  # atomic: a concurrent process sees all or nothing


@functools.cache
def load() -> DecodeKernel | None:
    """The compiled kernel, built once per machine and cached; None if unavailable."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        logger.info("no C++ compiler found; paged decode attention uses torch ops")
        return None
    key = hashlib.blake2b(digest_size=8)
    for part in (_SOURCE, " ".join(CXX_FLAGS), compiler, _cpu_identity()):
        key.update(part.encode())
    target = _cache_dir() / f"decode_{key.hexdigest()}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        return DecodeKernel(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning(
            "paged decode kernel unavailable (%s %s); using torch ops",
            exc,
            detail.decode(errors="replace")[-500:],
        )
        return None
