// Tiled matmul, bfloat16: out [M, N] = x [M, K] @ w [N, K]^T for decode batches (1 to
// TILED_MAX_ROWS rows), with w packed once at load (tiles_pack) into AMX's tiles:
// [N/16][K/32] tiles, each 16 k-pairs x 16 columns x 2 (the VNNI layout). What multiplies them
// is the target's (arch/): AMX tiles, two 16-row blocks a pass, or, on CPUs with AVX512-BF16
// and no AMX (AMD Zen 4/5), vdpbf16ps with up to 12 rows x 32 columns of sums in registers;
// each thread owns a range of 32-column stripes and streams their tiles once. Every output row
// is summed in one order, k ascending, whatever M is, so a row's numbers do not depend on the
// batch it is in. Targets without either decline, and the caller keeps oneDNN's matmul.
#pragma once
#include <cstdint>
#include "vec.h"

static const int TILED_MAX_ROWS = 256;  // about even with oneDNN here; above, oneDNN's turn

// w [N, K] -> its tiles (N and K multiples of 32).
static void tiles_pack(const uint16_t* ws, uint16_t* ps, long N, long K) {
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

// Whether the tiles take x [M, K] @ w [N, K]^T multiplied by `unit` (isa.TILE_UNITS' codes).
static inline bool tiles_fit(long M, long K, long N, int unit) {
    return M >= 1 && M <= TILED_MAX_ROWS && K % 32 == 0 && N % 32 == 0 && unit >= 1 &&
           unit <= best_tile_unit();
}

// Where no unit multiplies tiles: declined (-1).
static inline int tiles_multiply(Portable, const uint16_t*, const uint16_t*, uint16_t*, long,
                                 long, long, int, int) {
    return -1;
}

// out [M, N] = x @ the tiles `packed` by `unit`; 0, or -1 for a call it declines.
static int tiles_linear(const uint16_t* x, const uint16_t* packed, uint16_t* out, long M, long K,
                        long N, int unit, int threads) {
    if (!tiles_fit(M, K, N, unit)) return -1;
    return tiles_multiply(Native{}, x, packed, out, M, K, N, unit, threads);
}
