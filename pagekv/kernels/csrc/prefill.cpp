// Tile attention: prefill chunks, cascade (shared-prefix) decode and drafted decodes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>
#include "attention_common.h"
#include "bf16.h"
#include "kernels.h"
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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_TILES 1
#else
#define HAVE_TILES 0
#endif
static const int D = 64;          // head dim: two 32-wide halves of a query tile
static const int KEY_TILE = 16;   // keys per score tile (its columns)
static const int PAD = 64;        // keys are packed to a multiple of this (4 score tiles)


// Which unit multiplies the packed operands (best_tile_unit's codes): the best one here, or
// the one prefill_kernel_backend chose.
static int& backend_choice() { static int choice = best_tile_unit(); return choice; }
static inline bool tiles_on() { return HAVE_TILES && backend_choice() == 2; }

// Entered and left once per thread of a parallel region that may use the tiles.
static inline void tiles_begin() {
#if HAVE_TILES
    if (tiles_on()) configure_tiles();
#endif
}
static inline void tiles_end() {
#if HAVE_TILES
    if (tiles_on()) _tile_release();
#endif
}

// 16 x 16 transpose of 32-bit lanes: row j of the result is lane j of r[0..15].
static inline void transpose16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // 128-bit lane L of r[i + m]: lane 4L + m of rows i..i+3
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int m = 0; m < 4; ++m) {  // gather the four 128-bit lanes L of rows 0-3, ..., 12-15
        t[m] = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x88);        // L0, L2 of rows 0-7
        t[4 + m] = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xDD);    // L1, L3
        t[8 + m] = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x88);
        t[12 + m] = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xDD);
    }
    for (int m = 0; m < 4; ++m) {
        r[m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0x88);            // lane 0 + m
        r[8 + m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0xDD);        // lane 8 + m
        r[4 + m] = _mm512_shuffle_i32x4(t[4 + m], t[12 + m], 0x88);   // lane 4 + m
        r[12 + m] = _mm512_shuffle_i32x4(t[4 + m], t[12 + m], 0xDD);  // lane 12 + m
    }
}

// Keys of kv head h as score-tile operands: tile (block kb, half dh) holds, in row r, the
// pairs (d = 32 dh + 2r, +1) of keys 16 kb .. 16 kb + 15: [S/16][2][16 rows][16 keys x 2].
// Values as P.V operands: tile (pair block kp, quarter c) holds in row r keys 32 kp + 2r, +1
// of columns 16 c .. 16 c + 15, interleaved: [S/32][4][16 rows][16 cols x 2]. Positions past
// the sequence are zeros. 32 positions at a time: a key tile is a transpose of 16 rows' pairs,
// a value row two rows' columns interleaved.
static void pack_kv(const uint16_t* kc, const uint16_t* vc, const int32_t* table, int seq_len,
                    int padded, int block_size, long token_stride, int h, uint16_t* kp,
                    uint16_t* vp) {
    alignas(64) static const uint16_t zeros[D] = {};
    __m512i even_lo, even_hi;  // permutex2var indices: a[i], b[i] for i in [0, 16) / [16, 32)
    {
        alignas(64) uint16_t lo[32], hi[32];
        for (int i = 0; i < 16; ++i) {
            lo[2 * i] = uint16_t(i), lo[2 * i + 1] = uint16_t(32 + i);
            hi[2 * i] = uint16_t(16 + i), hi[2 * i + 1] = uint16_t(48 + i);
        }
        even_lo = _mm512_load_si512(lo);
        even_hi = _mm512_load_si512(hi);
    }
    const uint16_t* krow[32];
    const uint16_t* vrow[32];
    for (int first = 0; first < padded; first += 32) {
        // the next 32 rows, requested now into L2: blocks lie anywhere in the pool, so the
        // hardware prefetcher loses the stream at every block boundary; into L1 they would hold
        // its few miss buffers and slow the stream
        for (int t = first + 32; t < first + 64 && t < seq_len; ++t) {
            const long slot = long(table[t / block_size]) * block_size + t % block_size;
            const char* k = (const char*)(kc + slot * token_stride + long(h) * D);
            const char* v = (const char*)(vc + slot * token_stride + long(h) * D);
            _mm_prefetch(k, _MM_HINT_T1);
            _mm_prefetch(k + 64, _MM_HINT_T1);
            _mm_prefetch(v, _MM_HINT_T1);
            _mm_prefetch(v + 64, _MM_HINT_T1);
        }
        for (int i = 0; i < 32; ++i) {
            const int t = first + i;
            krow[i] = vrow[i] = zeros;
            if (t < seq_len) {  // (the table has no entry past the sequence)
                const long slot = long(table[t / block_size]) * block_size + t % block_size;
                krow[i] = kc + slot * token_stride + long(h) * D;
                vrow[i] = vc + slot * token_stride + long(h) * D;
            }
        }
        for (int half = 0; half < 2; ++half)  // keys first .. +15, then +16 .. +31
            for (int dh = 0; dh < 2; ++dh) {
                __m512i r[16];
                for (int c = 0; c < 16; ++c)
                    r[c] = _mm512_loadu_si512(krow[16 * half + c] + 32 * dh);
                transpose16x16(r);
                uint16_t* tile = kp + long(first / 16 + half) * 1024 + dh * 512;
                for (int row = 0; row < 16; ++row) _mm512_storeu_si512(tile + row * 32, r[row]);
            }
        uint16_t* tiles = vp + long(first / 32) * 2048;
        for (int row = 0; row < 16; ++row) {
            const uint16_t* a = vrow[2 * row];
            const uint16_t* b = vrow[2 * row + 1];
            for (int dh = 0; dh < 2; ++dh) {  // columns 32 dh .. 32 dh + 31: quarters 2dh, +1
                const __m512i va = _mm512_loadu_si512(a + 32 * dh);
                const __m512i vb = _mm512_loadu_si512(b + 32 * dh);
                _mm512_storeu_si512(tiles + (2 * dh) * 512 + row * 32,
                                    _mm512_permutex2var_epi16(va, even_lo, vb));
                _mm512_storeu_si512(tiles + (2 * dh + 1) * 512 + row * 32,
                                    _mm512_permutex2var_epi16(va, even_hi, vb));
            }
        }
    }
}

// The two products of attend_rows, on either unit. Scores: rows x keys float32 into `scores`
// (row stride `width`), at least the first `keys` of each row. P.V: every row's sum over the
// first `pairs` 32-key blocks of probs x values into acc (rows past `rows` may be skipped).
#if HAVE_TILES
static void scores_tiles(const uint16_t* qbuf, int keys, const uint16_t* kp, float* scores,
                         int width) {
    _tile_loadd(4, qbuf, D * 2);
    _tile_loadd(5, qbuf + 32, D * 2);
    for (int kb = 0; kb * KEY_TILE < keys; kb += 4) {
        const uint16_t* t = kp + long(kb) * 1024;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(6, t, 64);        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, t + 512, 64);  _tile_dpbf16ps(0, 5, 7);
        _tile_loadd(6, t + 1024, 64); _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, t + 1536, 64); _tile_dpbf16ps(1, 5, 7);
        _tile_loadd(6, t + 2048, 64); _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, t + 2560, 64); _tile_dpbf16ps(2, 5, 7);
        _tile_loadd(6, t + 3072, 64); _tile_dpbf16ps(3, 4, 6);
        _tile_loadd(7, t + 3584, 64); _tile_dpbf16ps(3, 5, 7);
        float* s = scores + kb * KEY_TILE;
        _tile_stored(0, s, width * 4);
        _tile_stored(1, s + 16, width * 4);
        _tile_stored(2, s + 32, width * 4);
        _tile_stored(3, s + 48, width * 4);
    }
}

static void pv_tiles(const uint16_t* probs, int pairs, const uint16_t* vp, int width,
                     float (*acc)[D]) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int kb = 0; kb < pairs; ++kb) {
        const uint16_t* t = vp + long(kb) * 2048;
        _tile_loadd(4, probs + kb * 32, width * 2);
        _tile_loadd(6, t, 64);        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, t + 512, 64);  _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, t + 1024, 64); _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, t + 1536, 64); _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, acc[0], D * 4);
    _tile_stored(1, acc[0] + 16, D * 4);
    _tile_stored(2, acc[0] + 32, D * 4);
    _tile_stored(3, acc[0] + 48, D * 4);
}
#else
static void scores_tiles(const uint16_t*, int, const uint16_t*, float*, int) {}
static void pv_tiles(const uint16_t*, int, const uint16_t*, int, float (*)[D]) {}
#endif

static inline __m512bh pair_of(const uint16_t* x) {  // x[0], x[1] in each 32-bit lane
    int32_t bits;
    std::memcpy(&bits, x, 4);
    return (__m512bh)_mm512_set1_epi32(bits);
}

// A tile product as vector ones: a key tile row (16 keys x one pair of dims) meets the same
// pair of every query row, 16 keys at a time, 16 rows of sums in registers.
static void scores_vector(const uint16_t* qbuf, int keys, const uint16_t* kp, float* scores,
                          int width) {
    for (int kb = 0; kb * KEY_TILE < keys; ++kb) {
        const uint16_t* t = kp + long(kb) * 1024;  // both halves: pair p of d at row p
        __m512 s[16];
        for (int m = 0; m < 16; ++m) s[m] = _mm512_setzero_ps();
        for (int p = 0; p < D / 2; ++p) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(t + p * 32);
            for (int m = 0; m < 16; ++m)
                s[m] = _mm512_dpbf16_ps(s[m], pair_of(qbuf + m * D + 2 * p), k);
        }
        for (int m = 0; m < 16; ++m)
            _mm512_storeu_ps(scores + long(m) * width + kb * KEY_TILE, s[m]);
    }
}

// P.V four rows at a time: a value tile row (two keys x 16 columns) meets those keys'
// probabilities in each row; all 64 columns of four rows in registers.
static void pv_vector(const uint16_t* probs, int rows, int pairs, const uint16_t* vp, int width,
                      float (*acc)[D]) {
    for (int m0 = 0; m0 < rows; m0 += 4) {
        __m512 a[4][4];
        for (int m = 0; m < 4; ++m)
            for (int c = 0; c < 4; ++c) a[m][c] = _mm512_setzero_ps();
        for (int kb = 0; kb < pairs; ++kb) {
            const uint16_t* t = vp + long(kb) * 2048;
            for (int r = 0; r < 16; ++r) {
                __m512bh v[4];
                for (int c = 0; c < 4; ++c)
                    v[c] = (__m512bh)_mm512_loadu_si512(t + c * 512 + r * 32);
                for (int m = 0; m < 4; ++m) {
                    const __m512bh pm = pair_of(probs + long(m0 + m) * width + kb * 32 + 2 * r);
                    for (int c = 0; c < 4; ++c) a[m][c] = _mm512_dpbf16_ps(a[m][c], pm, v[c]);
                }
            }
        }
        for (int m = 0; m < 4; ++m)
            for (int c = 0; c < 4; ++c) _mm512_store_ps(acc[m0 + m] + 16 * c, a[m][c]);
    }
}

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

extern "C" int prefill_attention_bf16_d64(const void* q, const void* kc, const void* vc,
                                          void* out, const int64_t* chunk_info, int num_chunks,
                                          const int32_t* tables, int num_heads, int kv_heads,
                                          int block_size, float scale, int threads) {
    if (num_heads % kv_heads != 0) return -1;
    const Chunk* chunks = (const Chunk*)chunk_info;
    const long token_stride = long(kv_heads) * D, row_stride = long(num_heads) * D;
    const PrefillWork work(chunks, num_chunks, num_heads, kv_heads, PAD, D);
    if (long(packed.size()) < work.packed_size()) packed.resize(work.packed_size());
    uint16_t* tiles = packed.data();
    const uint16_t* qs = (const uint16_t*)q;
    uint16_t* os = (uint16_t*)out;
    #pragma omp parallel num_threads(threads)
    {
        tiles_begin();
        #pragma omp for schedule(dynamic)
        for (long task = 0; task < long(num_chunks) * kv_heads; ++task) {
            const int c = int(task / kv_heads), h = int(task % kv_heads);
            uint16_t* kp = tiles + work.pack_at(c, h);
            pack_kv((const uint16_t*)kc, (const uint16_t*)vc, tables + chunks[c].table_offset,
                    int(chunks[c].seq_len), work.padded(c), block_size, token_stride, h, kp,
                    kp + long(work.padded(c)) * D);
        }
        std::vector<float> scores(16L * work.width);
        std::vector<uint16_t> probs(16L * work.width);
        #pragma omp for schedule(dynamic)
        for (long i = 0; i < work.items(); ++i) {
            const PrefillWork::Item it = work.item(i);
            const uint16_t* kp = tiles + it.pack;
            const long at = it.first_row * row_stride + it.head * D;
            attend_block(qs + at, os + at, row_stride, it.rows, it.first_visible, kp,
                         kp + long(work.padded(it.chunk)) * D, scale, scores.data(),
                         probs.data(), work.width);
        }
        tiles_end();
    }
    return 0;
}

// Decode rows whose sequences begin with the same `prefix_len` positions (the same blocks,
// `table`): each row's attention over that prefix, merged into `out` (float32 [B, H, D]) and
// `lse` ([B, H]), which hold its attention over the rest of its sequence (normalized) and that
// part's log-sum-exp. Per kv head the prefix is packed once and every row of every sequence
// that reads it goes through the tiles: 16 (sequence, query head) rows at a time, where the
// decode kernel would read the prefix once per sequence.
extern "C" int shared_prefix_attention_bf16_d64(const void* q, const void* kc, const void* vc,
                                                const int32_t* table, int prefix_len,
                                                int num_seqs, int num_heads, int kv_heads,
                                                int block_size, float scale, float* out,
                                                const float* lse, int threads) {
    if (num_heads % kv_heads != 0 || prefix_len < 1) return -1;
    const int group = num_heads / kv_heads;
    const int padded = (prefix_len + PAD - 1) / PAD * PAD;
    const long per_head = long(padded) * D * 2, rows_per_head = long(num_seqs) * group;
    const long blocks_per_head = (rows_per_head + 15) / 16;
    if (long(packed.size()) < per_head * kv_heads) packed.resize(per_head * kv_heads);
    uint16_t* tiles = packed.data();
    const uint16_t* qs = (const uint16_t*)q;
    #pragma omp parallel num_threads(threads)
    {
        tiles_begin();
        #pragma omp for
        for (int h = 0; h < kv_heads; ++h)
            pack_kv((const uint16_t*)kc, (const uint16_t*)vc, table, prefix_len, padded,
                    block_size, long(kv_heads) * D, h, tiles + h * per_head,
                    tiles + h * per_head + long(padded) * D);
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
            const uint16_t* kp = tiles + h * per_head;
            int visible[16];
            for (int r = 0; r < 16; ++r) visible[r] = prefix_len;
            attend_rows(qbuf, rows, visible, kp, kp + long(padded) * D, scale, scores.data(),
                        probs.data(), padded, acc, tops, sums);
            for (int r = 0; r < rows; ++r) {  // weigh the two parts by their sums of exp
                float* o = out + index[r] * D;
                const float rest = lse[index[r]];
                const float top = tops[r] > rest ? tops[r] : rest;
                const float here = std::exp(tops[r] - top), there = std::exp(rest - top);
                const __m512 a = _mm512_set1_ps(here / (sums[r] * here + there));
                const __m512 b = _mm512_set1_ps(there / (sums[r] * here + there));
                for (int c = 0; c < D; c += 16)
                    _mm512_storeu_ps(o + c, _mm512_add_ps(
                        _mm512_mul_ps(_mm512_load_ps(acc[r] + c), a),
                        _mm512_mul_ps(_mm512_loadu_ps(o + c), b)));
            }
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
extern "C" int decode_attention_bf16_d64(const void* q, const void* kc, const void* vc, void* out,
                                         const int32_t* tables, int table_stride,
                                         const int32_t* seq_lens, const int32_t* query_lens,
                                         int num_seqs, int num_heads, int kv_heads,
                                         int block_size, int max_seq_len, float scale,
                                         int threads) {
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
        std::vector<uint16_t> tiles(long(width) * D * 2);  // one (sequence, kv head): K, V
        std::vector<float> scores(16L * width);
        std::vector<uint16_t> probs(16L * width);
        #pragma omp for schedule(dynamic)
        for (long task = 0; task < long(num_seqs) * kv_heads; ++task) {
            const int b = int(task / kv_heads), h = int(task % kv_heads);
            const int seq_len = seq_lens[b], qlen = int(first_row[b + 1] - first_row[b]);
            const int padded = (seq_len + PAD - 1) / PAD * PAD;
            uint16_t* kp = tiles.data();
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
extern "C" int prefill_kernel_backend(int request) {
    if (request == 1 || (request == 2 && best_tile_unit() == 2)) backend_choice() = request;
    return backend_choice();
}
#else
extern "C" int prefill_kernel_backend(int) { return 0; }
extern "C" int shared_prefix_attention_bf16_d64(const void*, const void*, const void*,
                                                const int32_t*, int, int, int, int, int, float,
                                                float*, const float*, int) {
    return -1;
}
extern "C" int prefill_attention_bf16_d64(const void*, const void*, const void*, void*,
                                          const int64_t*, int, const int32_t*, int, int, int,
                                          float, int) {
    return -1;  // no AMX here: the caller keeps SDPA
}
extern "C" int decode_attention_bf16_d64(const void*, const void*, const void*, void*,
                                         const int32_t*, int, const int32_t*, const int32_t*,
                                         int, int, int, int, int, float, int) {
    return -1;
}
#endif

// Float32 prefill attention on the vector layer (every target): the same work as the tile
// kernel with float32 FMAs. Per (chunk, kv head) the keys are packed once transposed in blocks
// of KB = VF::W keys ([S/KB][D][KB]: dim d of KB keys in one vector) and the values in panels
// of the dims one P.V pass reads ([D/PANEL][S][PANEL]: each pass streams contiguous memory),
// both as float32 (bfloat16 K/V are widened here, once). Per (chunk, query head, block of 16
// queries): the scores, SCORE_ROWS rows x SCORE_BLOCKS key blocks of sums in registers, one FMA
// per key block and dim with the query's number broadcast; the softmax; the sum of values,
// PV_ROWS rows x a panel in registers. All in float32, as torch's SDPA keeps them; outputs are
// rounded to the inputs' type once. Only the order of the sums differs from SDPA's. The tiles
// keep the loads (vectors and broadcasts) at about two per three FMAs, so that the FMAs set
// the pace; in_register stops the compiler from folding a vector's load into every FMA that
// reads it (a load per FMA again).
namespace f32 {
// Every function is a template on the head size D (one of PAGEKV_HEAD_DIMS, each a multiple of
// PANEL).
static const int KB = VF::W;                        // keys per packed block
static const int SCORE_ROWS = VF::REGS >= 32 ? 8 : 6;  // scores: query rows x key blocks of
static const int SCORE_BLOCKS = VF::REGS >= 32 ? 3 : 2;  // sums in registers at a time
static const int PV_COLS = VF::REGS >= 32 ? 64 / VF::W : 2;  // P.V: output vectors per pass
static const int PV_ROWS = 6;                                 // P.V: rows per pass
static const int PANEL = PV_COLS * VF::W;                     // P.V: dims per pass

template <int D, typename T>
static void pack_kv(const T* kc, const T* vc, const int32_t* table, int seq_len, int padded,
                    int block_size, long token_stride, int h, float* kt, float* vp) {
    for (int t = 0; t < padded; ++t) {
        float* tile = kt + long(t / KB) * KB * D + t % KB;  // column t % KB of its block
        const auto value = [vp, padded, t](int d) -> float& {  // dim d of value t, in its panel
            return vp[(long(d / PANEL) * padded + t) * PANEL + d % PANEL];
        };
        if (t < seq_len) {
            const long slot = long(table[t / block_size]) * block_size + t % block_size;
            const T* k = kc + slot * token_stride + long(h) * D;
            const T* vs = vc + slot * token_stride + long(h) * D;
            for (int d = 0; d < D; ++d) tile[d * KB] = load(k[d]);
            for (int d = 0; d < D; ++d) value(d) = load(vs[d]);
        } else {  // past the sequence: zeros (never weighted, but read by the last block)
            for (int d = 0; d < D; ++d) tile[d * KB] = 0.f;
            for (int d = 0; d < D; ++d) value(d) = 0.f;
        }
    }
}

// Scores of query rows [0, N) of qbuf against key blocks [0, B) of kt (KB keys each), N x B
// vectors of sums in registers, stored at `scores` (rows `width` apart); each score one chain
// of FMAs over the dims. `rows` and `blocks` beyond N and B take N and B; below, the first.
template <int D, int N, int B>
static inline void score_tile(int rows, int blocks, const float (*qbuf)[D], const float* kt,
                              float* scores, int width) {
    if constexpr (N > 1)
        if (rows < N) return score_tile<D, N - 1, B>(rows, blocks, qbuf, kt, scores, width);
    if constexpr (B > 1)
        if (blocks < B) return score_tile<D, N, B - 1>(rows, blocks, qbuf, kt, scores, width);
    VF s[N][B];
    for (int m = 0; m < N; ++m)
        for (int b = 0; b < B; ++b) s[m][b] = VF::zero();
    for (int d = 0; d < D; ++d) {
        VF k[B];
        for (int b = 0; b < B; ++b) {
            k[b] = VF::load(kt + long(b) * KB * D + d * KB);
            k[b].in_register();
        }
        for (int m = 0; m < N; ++m) {
            const VF qm = VF::set1(qbuf[m][d]);
            for (int b = 0; b < B; ++b) s[m][b] = fma(qm, k[b], s[m][b]);
        }
    }
    for (int m = 0; m < N; ++m)
        for (int b = 0; b < B; ++b) s[m][b].store(scores + long(m) * width + b * KB);
}

// Rows [0, N) of out = their probabilities (rows of p, width apart) . the values of keys
// [0, reach) (panels of PANEL dims, `panel_floats` apart), divided by each row's sum; a panel
// (C vectors) of each row at a time. The row count is a template argument so that the sums
// stay in registers (`count` below N: the first count rows). Each output is one chain of FMAs,
// keys ascending.
template <int D, int N, typename T>
static inline void pv_rows(int count, const float* p, int width, int reach, const float* vp,
                           long panel_floats, const float* sums, T* out, long row_stride) {
    if constexpr (N > 1)
        if (count < N)
            return pv_rows<D, N - 1>(count, p, width, reach, vp, panel_floats, sums, out,
                                  row_stride);
    constexpr int C = PV_COLS;
    for (int c0 = 0; c0 < D / VF::W; c0 += C) {
        VF a[N][C];
        for (int m = 0; m < N; ++m)
            for (int c = 0; c < C; ++c) a[m][c] = VF::zero();
        for (int t = 0; t < reach; ++t) {
            const float* v = vp + c0 / C * panel_floats + long(t) * PANEL;
            VF vv[C];
            for (int c = 0; c < C; ++c) {
                vv[c] = VF::load(v + c * VF::W);
                vv[c].in_register();
            }
            for (int m = 0; m < N; ++m) {
                const VF pm = VF::set1(p[long(m) * width + t]);
                for (int c = 0; c < C; ++c) a[m][c] = fma(pm, vv[c], a[m][c]);
            }
        }
        for (int m = 0; m < N; ++m) {
            const VF inv = VF::set1(1.f / sums[m]);
            T* o = out + m * row_stride + c0 * VF::W;
            for (int c = 0; c < C; ++c) (a[m][c] * inv).store(o + c * VF::W);
        }
    }
}

// Up to 16 query rows of one head (at q, row_stride apart): row r sees keys
// [0, first_visible + r). Writes their outputs. `scores`: 16 x width floats of scratch.
template <int D, typename T>
static void attend_block(const T* q, T* out, long row_stride, int rows, int first_visible,
                         const float* kt, const float* vp, int padded, float scale,
                         float* scores, int width) {
    alignas(64) float qbuf[16][D];
    for (int r = 0; r < 16; ++r)
        for (int d = 0; d < D; ++d) qbuf[r][d] = r < rows ? load(q[r * row_stride + d]) : 0.f;
    const int keys = first_visible + rows - 1;  // the most any row sees
    const int blocks = (keys + KB - 1) / KB;
    // the rows in passes of at most SCORE_ROWS, split evenly (16: 6, 5, 5 rather than 6, 6, 4)
    const int passes = (rows + SCORE_ROWS - 1) / SCORE_ROWS;
    for (int kb = 0; kb < blocks; kb += SCORE_BLOCKS)
        for (int pass = 0; pass < passes; ++pass) {
            const int m0 = rows * pass / passes, m1 = rows * (pass + 1) / passes;
            score_tile<D, SCORE_ROWS, SCORE_BLOCKS>(m1 - m0, blocks - kb, qbuf + m0,
                                                 kt + long(kb) * KB * D,
                                                 scores + long(m0) * width + kb * KB, width);
        }
    float sums[16];
    for (int r = 0; r < rows; ++r) {  // in place: the numerators over the scores, in float32
        float* x = scores + long(r) * width;
        const auto store = [x](int k, VF e) { e.store(x + k); };
        exp_row(x, first_visible + r, blocks * KB, scale, store, sums + r);
    }
    const int pv_passes = (rows + PV_ROWS - 1) / PV_ROWS;  // P.V: rows split as above
    for (int pass = 0; pass < pv_passes; ++pass) {
        const int m0 = rows * pass / pv_passes, m1 = rows * (pass + 1) / pv_passes;
        const int reach = first_visible + m1 - 1;  // keys any of these rows sees
        pv_rows<D, PV_ROWS>(m1 - m0, scores + long(m0) * width, width, reach, vp,
                         long(padded) * PANEL, sums + m0, out + m0 * row_stride, row_stride);
    }
}

static thread_local std::vector<float> packed;  // the caller's: K/V of every (chunk, kv head)

template <int D, typename T>
static void prefill(const T* qs, const T* kc, const T* vc, T* os, const Chunk* chunks,
                   int num_chunks, const int32_t* tables, int num_heads, int kv_heads,
                   int block_size, float scale, int threads) {
    const long token_stride = long(kv_heads) * D, row_stride = long(num_heads) * D;
    const PrefillWork work(chunks, num_chunks, num_heads, kv_heads, 16, D);
    if (long(packed.size()) < work.packed_size()) packed.resize(work.packed_size());
    float* tiles = packed.data();
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(dynamic)
        for (long task = 0; task < long(num_chunks) * kv_heads; ++task) {
            const int c = int(task / kv_heads), h = int(task % kv_heads);
            float* kt = tiles + work.pack_at(c, h);
            pack_kv<D>(kc, vc, tables + chunks[c].table_offset, int(chunks[c].seq_len),
                    work.padded(c), block_size, token_stride, h, kt,
                    kt + long(work.padded(c)) * D);
        }
        std::vector<float> scores(16L * work.width);
        #pragma omp for schedule(dynamic)
        for (long i = 0; i < work.items(); ++i) {
            const PrefillWork::Item it = work.item(i);
            const float* kt = tiles + it.pack;
            const long at = it.first_row * row_stride + it.head * D;
            const int padded = work.padded(it.chunk);
            attend_block<D>(qs + at, os + at, row_stride, it.rows, it.first_visible, kt,
                         kt + long(padded) * D, padded, scale, scores.data(), work.width);
        }
    }
}

template <typename T>
static int prefill_any(const void* q, const void* kc, const void* vc, void* out,
                       const int64_t* chunk_info, int num_chunks, const int32_t* tables,
                       int num_heads, int kv_heads, int block_size, int head_dim, float scale,
                       int threads) {
    if (num_heads % kv_heads != 0) return -1;
    return with_head_dim(head_dim, [&](auto d) {
        prefill<decltype(d)::value>((const T*)q, (const T*)kc, (const T*)vc, (T*)out,
                                    (const Chunk*)chunk_info, num_chunks, tables, num_heads,
                                    kv_heads, block_size, scale, threads);
    });
}
}  // namespace f32

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
