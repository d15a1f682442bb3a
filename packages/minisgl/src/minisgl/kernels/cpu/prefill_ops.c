/* The elementwise ops around a bf16 step's GEMMs on CPU, each one pass, rounded as the torch
 * ops round them (every product and sum in fp32, rounded to bf16 to nearest even):
 *   scale_rows_bf16: y = bf16(float(y) * s[r]) in place, a w8a8 GEMM's per-row activation
 *                    scale (`(y.float() * s).to(bf16)`: two fp32 copies and three passes);
 *   rope_bf16:       each head of q and k: bf16(bf16(h * cos) + bf16(swap_halves(h) * sin)),
 *                    the model's signed sin table (models/layers.py, `apply_rope`: a flip,
 *                    four products and two sums, each a pass).
 * Measured on a w8a8 prefill of 2,586 tokens (AMD EPYC, 2 threads): the torch ops ~0.1 s of
 * ~0.94. Finite inputs (a NaN's payload may round differently). */
#include <stdint.h>

#include "bf16.h"
#include "rowops.h"

/* y [rows, n] bf16, rows ys apart, in place; s [rows] fp32 */
int scale_rows_bf16(uint16_t *y, int64_t ys, const float *s, int64_t rows, int64_t n,
                    int threads) {
    if (rows < 0 || n < 1 || ys < n) return 9;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *yr = y + r * ys;
        const float sr = s[r];
        int64_t c = 0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        const __m512 sv = _mm512_set1_ps(sr);
        for (; c + 16 <= n; c += 16)
            bf16x16_store(yr + c, rbf16(_mm512_mul_ps(bf16x16_load(yr + c), sv)), 0xFFFF);
#endif
        for (; c < n; c++) yr[c] = f32_to_bf16(bf16_to_f32(yr[c]) * sr);
    }
    return 0;
}

/* one head of d values: out = bf16(bf16(h * cos) + bf16(swap_halves(h) * sin)) */
static inline void rope_head(const uint16_t *h, const uint16_t *cos, const uint16_t *sin,
                             uint16_t *out, int64_t d) {
    const int64_t half = d / 2;
    int64_t i = 0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    if (half % 16 == 0) {
        for (; i < d; i += 16) {
            const int64_t j = i < half ? i + half : i - half;
            const __m512 a = rbf16(_mm512_mul_ps(bf16x16_load(h + i), bf16x16_load(cos + i)));
            const __m512 b = rbf16(_mm512_mul_ps(bf16x16_load(h + j), bf16x16_load(sin + i)));
            bf16x16_store(out + i, rbf16(_mm512_add_ps(a, b)), 0xFFFF);
        }
        return;
    }
#endif
    for (; i < d; i++) {
        const float sw = bf16_to_f32(h[i < half ? i + half : i - half]);
        const float a = rbf(bf16_to_f32(h[i]) * bf16_to_f32(cos[i]));
        out[i] = f32_to_bf16(a + rbf(sw * bf16_to_f32(sin[i])));
    }
}

/* q [t, nh, d] (tokens qs apart, heads d apart), k [t, kvh, d] (tokens ks apart); cos / sin
 * [t, d]; qo [t, nh, d] and ko [t, kvh, d] contiguous; d even */
int rope_bf16(const uint16_t *q, int64_t qs, int64_t nh, const uint16_t *k, int64_t ks,
              int64_t kvh, const uint16_t *cos, const uint16_t *sin, uint16_t *qo, uint16_t *ko,
              int64_t t, int64_t d, int threads) {
    if (t < 0 || nh < 1 || kvh < 0 || d < 2 || d % 2 || qs < nh * d || (kvh > 0 && ks < kvh * d))
        return 9;
#pragma omp parallel for schedule(static) num_threads(threads) if (t * (nh + kvh) * d >= 65536)
    for (int64_t m = 0; m < t; m++) {
        const uint16_t *cm = cos + m * d, *sm = sin + m * d;
        for (int64_t h = 0; h < nh; h++) rope_head(q + m * qs + h * d, cm, sm, qo + (m * nh + h) * d, d);
        for (int64_t h = 0; h < kvh; h++)
            rope_head(k + m * ks + h * d, cm, sm, ko + (m * kvh + h) * d, d);
    }
    return 0;
}
