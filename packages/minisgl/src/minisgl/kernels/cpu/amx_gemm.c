/* y = x w^T (+ bias) in bf16 on AMX tiles, a row's bits the same at every row count and
 * position (deterministic mode, engine/deterministic.py).
 *
 * oneDNN picks its bf16 GEMM by row count (one row, 2..32 rows on AVX-512, more on AMX tiles,
 * each summing in its own order). Here every row takes one path: x in blocks of 16 rows (a
 * short block zero-padded), each output element's sum over k in tiles of 32 (TDPBF16PS: the
 * element's own pairs of products, added to its own fp32 accumulator), k in ascending order
 * from zero, then the bias in fp32, then one rounding to bf16. Nothing in it depends on the
 * other rows of the call, so a row gets the same bits alone, in a batch, in a chunk.
 *
 * The weights are packed once (`amx_pack` in Python): w [n, k] bf16, n padded to 16, as
 * [n / 16][k / 32][16 pairs of k][16 columns][2]: the B tile of columns 16 t.., k 32 c.. at
 * ((t k / 32 + c) 512) elements, its row p the pair (2 p, 2 p + 1) of 16 columns. A thread
 * takes 32 columns (two B tiles) at a time and every block of rows over them: 2 x 2 tiles of
 * 16 x 16 sums (tiles 0-3), two A tiles (4-5), two B tiles (6-7).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) &&                 \
    defined(__AVX512BF16__) && defined(__AVX512BW__)
#define AMX_GEMM 1
#include <immintrin.h>

#include "amx_tiles.h"
#endif

int prefill_amx_supported(void); /* prefill_amx.c: the process's tile state, granted once */

/* 1 where this object was built with AMX-BF16 and Linux grants the tile state */
int amx_gemm_supported(void) {
#if AMX_GEMM
    return prefill_amx_supported();
#else
    return 0;
#endif
}

#if AMX_GEMM

/* out rows [m0, m0 + mr) x columns [n0, n0 + nc) (nc <= 32) from the fp32 sums (16 x 32, row
 * stride 32 floats) plus the bias, rounded */
static void store_rows(const float *sums, int64_t mr, int64_t nc, const uint16_t *bias, int64_t n0,
                       uint16_t *out, int64_t out_stride) {
    for (int64_t i = 0; i < mr; i++)
        for (int64_t j = 0; j < nc; j++) {
            const float b = bias != NULL ? bf16_to_f32(bias[n0 + j]) : 0.0f;
            out[i * out_stride + n0 + j] = f32_to_bf16(sums[i * 32 + j] + b);
        }
}

/* one block of rows (16 or 32: `two`) over the 32 columns of B tiles t, t + 1 (`b1` NULL when
 * only one is there); a: the rows, 16 a tile, `a_stride` bytes apart */
static void block(const uint16_t *a, int64_t a_stride, int two, const uint16_t *b0,
                  const uint16_t *b1, int64_t ktiles, float *sums) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < ktiles; c++) {
        _tile_loadd(4, a + c * 32, a_stride);
        _tile_loadd(6, b0 + c * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (b1 != NULL) {
            _tile_loadd(7, b1 + c * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two) {
            _tile_loadd(5, (const uint16_t *)((const char *)a + 16 * a_stride) + c * 32, a_stride);
            _tile_dpbf16ps(2, 5, 6);
            if (b1 != NULL) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums, 128);
    if (b1 != NULL) _tile_stored(1, sums + 16, 128);
    if (two) {
        _tile_stored(2, sums + 16 * 32, 128);
        if (b1 != NULL) _tile_stored(3, sums + 16 * 32 + 16, 128);
    }
}
#endif

/* x bf16 [rows, k] (rows x_stride elements apart) times the packed w (n columns, n_pad a
 * multiple of 16) + bias -> out bf16 [rows, n]; 0, or 9 on bad shapes / 3 out of memory / 8
 * without AMX */
int amx_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                  const uint16_t *bias, uint16_t *out, int64_t rows, int64_t n, int64_t n_pad,
                  int64_t k, int threads) {
#if AMX_GEMM
    if (rows < 1 || n < 1 || k < 32 || k % 32 != 0 || n_pad % 16 != 0 || n_pad < n ||
        x_stride < k)
        return 9;
    if (!amx_gemm_supported()) return 8;
    const int64_t ktiles = k / 32, pairs = n_pad / 32 + (n_pad % 32 != 0);
    const int64_t full = rows / 32 * 32, tail = rows - full;
    /* the last rows (< 32), zero-padded to 32 in a buffer of their own */
    uint16_t *pad = NULL;
    if (tail > 0) {
        pad = aligned_alloc(64, (size_t)(32 * k) * sizeof(uint16_t));
        if (pad == NULL) return 3;
        memset(pad, 0, (size_t)(32 * k) * sizeof(uint16_t));
        for (int64_t i = 0; i < tail; i++)
            memcpy(pad + i * k, x + (full + i) * x_stride, (size_t)k * sizeof(uint16_t));
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *sums = aligned_alloc(64, 32 * 32 * sizeof(float));
        if (sums == NULL) {
            failed = 1;
        } else {
            tiles_configure();
#pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++) {
                const int64_t t = 2 * p, n0 = 32 * p;
                const uint16_t *b0 = packed + t * ktiles * 512;
                const uint16_t *b1 = (t + 1) * 16 < n_pad ? b0 + ktiles * 512 : NULL;
                const int64_t nc = n - n0 < 32 ? n - n0 : 32;
                if (nc <= 0) continue;
                for (int64_t m0 = 0; m0 < full; m0 += 32) {
                    block(x + m0 * x_stride, x_stride * 2, 1, b0, b1, ktiles, sums);
                    store_rows(sums, 32, nc, bias, n0, out + m0 * n, n);
                }
                if (tail > 0) {
                    block(pad, k * 2, tail > 16, b0, b1, ktiles, sums);
                    store_rows(sums, tail, nc, bias, n0, out + full * n, n);
                }
            }
            _tile_release();
            free(sums);
        }
    }
    free(pad);
    return failed ? 3 : 0;
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)rows, (void)n, (void)n_pad;
    (void)k, (void)threads;
    return 8;
#endif
}
