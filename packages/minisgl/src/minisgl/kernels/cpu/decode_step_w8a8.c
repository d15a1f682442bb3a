/* A decode step of a w8a8 bf16 Llama-family model in one C call (engine/cpu_decode.py), and
 * its int8 GEMM alone. The modules' arithmetic (quantization/w8a8.py), op for op: each linear's
 * input is quantized per row by quant.c's fused pass (RMSNorm, the rows as they are, or
 * SiLU x up with the gate/up GEMM's row scale), the int8 sums are exact in int32, each output
 * is bf16(float(sum) * the channel's scale), then bf16(that * the row's scale) and + bias,
 * each rounded, as `W8A8Linear` / `W8A8MLP` round them; q / k norms, RoPE, the KV store and the
 * paged attention are the int4 step's (rowops.h, decode_attention.c). So the step's residual
 * stream is the modules' to the bit; the final norm and the lm_head (bf16 activations) stay the
 * modules'.
 *
 * The GEMM reads weights repacked once (`w8a8_step.Int8Panels`) into panels of 16 output
 * channels: panel p, bytes [K / 4][16][4], channel j's 4 weights of columns 4c..4c+3 at
 * (c * 16 + j) * 4. One AVX512-VNNI vpdpbusd multiplies a panel's 64 bytes by 4 activation
 * bytes broadcast to every lane: 16 channels' partial sums, no horizontal reduction. The
 * activations go in as u8 (code + 128; vpdpbusd multiplies unsigned by signed) and each
 * channel's sum loses 128 times the sum of its weights (`comp`), as oneDNN's zero point does.
 * A tile: 4 panels (64 channels) by 6 rows, 24 accumulators in registers (`dot_4x6`, in
 * assembly); the threads split the groups of 4 panels by blocks of 6 rows. Measured (AMD EPYC,
 * 2 threads, the embedded model's four GEMMs a layer at 128 rows): 378 GMAC/s, 81% of
 * vpdpbusd's peak (232 a core); the intrinsics' tile of 2 x 8 ran at 229. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"
#include "rowops.h"

#define PANEL 16 /* output channels a panel */
#define HEAD_ROWS 8

/* quant.c: per-row int8 codes of a linear's input, formed as the modules form it */
int quant_rows_bf16(const uint16_t *x, int64_t stride, const uint16_t *w, const float *in_scale,
                    float eps, int kind, int8_t *codes, int64_t cs, int u8, float *scales,
                    int64_t rows, int64_t n, int threads);
enum { Q_ROWS = 0, Q_RMSNORM = 1, Q_SILU_MUL = 2 }; /* quant.c's kinds */

/* one int8 matrix: n channels of k columns (k % 4 == 0) in ceil(n / 16) panels; comp [n16]
 * = 128 sum_k w[j, k]; scales [n16] fp32; bias [n] bf16 or NULL */
typedef struct {
    const int8_t *panels;
    const int32_t *comp;
    const float *scales;
    const uint16_t *bias;
    int64_t n, k;
} i8mat;

/* y = bf16(float(acc) * scale), then bf16(y * row scale) (rs != NULL), then bf16(y + bias) */
static inline float finish(int32_t acc, float scale, const float *rs, const uint16_t *bias, int64_t j) {
    float y = rbf((float)acc * scale);
    if (rs != NULL) y = rbf(y * *rs);
    if (bias != NULL) y = rbf(y + bf16_to_f32(bias[j]));
    return y;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* 16 channels' sums of one row -> bf16 at out (the first `keep` of them): see `finish` */
static inline __attribute__((always_inline)) void finish16(__m512i acc, __m512i comp, __m512 sc,
                                                           const float *rs, int has_bias,
                                                           __m512 bias, __mmask16 keep,
                                                           uint16_t *out) {
    __m512 y = rbf16(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, comp)), sc));
    if (rs != NULL) y = rbf16(_mm512_mul_ps(y, _mm512_set1_ps(*rs)));
    if (has_bias) y = rbf16(_mm512_add_ps(y, bias));
    /* the upper halves of the rounded floats: the bf16 values */
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(y), 16));
    _mm256_mask_storeu_epi16(out, keep, h);
}

/* A tile: rows m0 .. m0 + MR - 1 (mr of them) by panels p .. p + np - 1 (np <= 4), the
 * mr x np accumulators named (c<row><panel>) so that they live in registers (as an array gcc
 * kept them on the stack, stored back every step: the GEMM ran at half the VNNI peak). Each
 * step of 4 columns: np panel loads, one broadcast of 4 activation bytes a row, mr x np
 * vpdpbusd. mr and np are constants where it is inlined. */
#define TILE_ROWS 6
#define TILE_PANELS 4
static inline __attribute__((always_inline)) void tile(const i8mat *w, int64_t p, int np,
                                                       const uint8_t *xu, int64_t xs, int mr,
                                                       const float *rs, uint16_t *out, int64_t os) {
    const int64_t k4 = w->k / 4, pstride = k4 * 64;
    const int8_t *wp = w->panels + p * pstride;
    const __m512i z = _mm512_setzero_si512();
    __m512i c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;
    __m512i c20 = z, c21 = z, c22 = z, c23 = z, c30 = z, c31 = z, c32 = z, c33 = z;
    __m512i c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z, c52 = z, c53 = z;
    for (int64_t c = 0; c < k4; c++) {
        const int8_t *wc = wp + c * 64;
        const __m512i b0 = _mm512_loadu_si512((const void *)wc);
        const __m512i b1 = np > 1 ? _mm512_loadu_si512((const void *)(wc + pstride)) : z;
        const __m512i b2 = np > 2 ? _mm512_loadu_si512((const void *)(wc + 2 * pstride)) : z;
        const __m512i b3 = np > 3 ? _mm512_loadu_si512((const void *)(wc + 3 * pstride)) : z;
#define ROW(m)                                                                                      \
    if (mr > m) {                                                                                   \
        int32_t four;                                                                               \
        memcpy(&four, xu + m * xs + 4 * c, sizeof four);                                            \
        const __m512i a = _mm512_set1_epi32(four);                                                  \
        c##m##0 = _mm512_dpbusd_epi32(c##m##0, a, b0);                                              \
        if (np > 1) c##m##1 = _mm512_dpbusd_epi32(c##m##1, a, b1);                                  \
        if (np > 2) c##m##2 = _mm512_dpbusd_epi32(c##m##2, a, b2);                                  \
        if (np > 3) c##m##3 = _mm512_dpbusd_epi32(c##m##3, a, b3);                                  \
    }
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
    }
#define PANEL_OUT(q)                                                                                \
    if (np > q) {                                                                                   \
        const int64_t j0 = (p + q) * PANEL, left = w->n - j0;                                       \
        const __mmask16 keep = left >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);   \
        const __m512i comp = _mm512_loadu_si512((const void *)(w->comp + j0));                      \
        const __m512 sc = _mm512_loadu_ps(w->scales + j0);                                          \
        __m512 bias = _mm512_setzero_ps();                                                          \
        if (w->bias != NULL)                                                                        \
            bias = _mm512_castsi512_ps(_mm512_slli_epi32(                                           \
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, w->bias + j0)), 16));          \
        const int hb = w->bias != NULL;                                                             \
        finish16(c0##q, comp, sc, rs, hb, bias, keep, out + j0);                                    \
        if (mr > 1) finish16(c1##q, comp, sc, rs ? rs + 1 : NULL, hb, bias, keep, out + os + j0);   \
        if (mr > 2) finish16(c2##q, comp, sc, rs ? rs + 2 : NULL, hb, bias, keep, out + 2 * os + j0); \
        if (mr > 3) finish16(c3##q, comp, sc, rs ? rs + 3 : NULL, hb, bias, keep, out + 3 * os + j0); \
        if (mr > 4) finish16(c4##q, comp, sc, rs ? rs + 4 : NULL, hb, bias, keep, out + 4 * os + j0); \
        if (mr > 5) finish16(c5##q, comp, sc, rs ? rs + 5 : NULL, hb, bias, keep, out + 5 * os + j0); \
    }
    PANEL_OUT(0) PANEL_OUT(1) PANEL_OUT(2) PANEL_OUT(3)
#undef PANEL_OUT
}

/* The 4 x 6 tile's sums in assembly: 24 accumulators in zmm8-31, 4 panels' 64 bytes in
 * zmm0-3, each row's 4 bytes broadcast into zmm4 / zmm5; per step of 4 columns 4 panel loads,
 * 6 broadcasts, 24 vpdpbusd (AT&T order: weights, activations, accumulator). With intrinsics
 * gcc 12 kept most accumulators on the stack, a store and a load each per step: 149 GMAC/s
 * (2 threads, AMD EPYC) against 232 a core for vpdpbusd alone. acc [6][4]: row-major sums. */
static void dot_4x6(const int8_t *w, int64_t ps, const uint8_t *x, int64_t xs, int64_t k4,
                    __m512i *acc) {
    const int8_t *w3 = w + 3 * ps;
    const uint8_t *x3 = x + 3 * xs;
    __asm__ volatile(
        "vpxord %%zmm8, %%zmm8, %%zmm8\n\t"
        "vmovdqa64 %%zmm8, %%zmm9\n\t vmovdqa64 %%zmm8, %%zmm10\n\t vmovdqa64 %%zmm8, %%zmm11\n\t"
        "vmovdqa64 %%zmm8, %%zmm12\n\t vmovdqa64 %%zmm8, %%zmm13\n\t vmovdqa64 %%zmm8, %%zmm14\n\t"
        "vmovdqa64 %%zmm8, %%zmm15\n\t vmovdqa64 %%zmm8, %%zmm16\n\t vmovdqa64 %%zmm8, %%zmm17\n\t"
        "vmovdqa64 %%zmm8, %%zmm18\n\t vmovdqa64 %%zmm8, %%zmm19\n\t vmovdqa64 %%zmm8, %%zmm20\n\t"
        "vmovdqa64 %%zmm8, %%zmm21\n\t vmovdqa64 %%zmm8, %%zmm22\n\t vmovdqa64 %%zmm8, %%zmm23\n\t"
        "vmovdqa64 %%zmm8, %%zmm24\n\t vmovdqa64 %%zmm8, %%zmm25\n\t vmovdqa64 %%zmm8, %%zmm26\n\t"
        "vmovdqa64 %%zmm8, %%zmm27\n\t vmovdqa64 %%zmm8, %%zmm28\n\t vmovdqa64 %%zmm8, %%zmm29\n\t"
        "vmovdqa64 %%zmm8, %%zmm30\n\t vmovdqa64 %%zmm8, %%zmm31\n\t"
        "test %[k4], %[k4]\n\t"
        "jle 2f\n\t"
        "1:\n\t"
        "vmovdqu64 (%[w]), %%zmm0\n\t"
        "vmovdqu64 (%[w], %[ps], 1), %%zmm1\n\t"
        "vmovdqu64 (%[w], %[ps], 2), %%zmm2\n\t"
        "vmovdqu64 (%[w3]), %%zmm3\n\t"
        "vpbroadcastd (%[x]), %%zmm4\n\t"
        "vpbroadcastd (%[x], %[xs], 1), %%zmm5\n\t"
        "vpdpbusd %%zmm0, %%zmm4, %%zmm8\n\t vpdpbusd %%zmm1, %%zmm4, %%zmm9\n\t"
        "vpdpbusd %%zmm2, %%zmm4, %%zmm10\n\t vpdpbusd %%zmm3, %%zmm4, %%zmm11\n\t"
        "vpbroadcastd (%[x], %[xs], 2), %%zmm4\n\t"
        "vpdpbusd %%zmm0, %%zmm5, %%zmm12\n\t vpdpbusd %%zmm1, %%zmm5, %%zmm13\n\t"
        "vpdpbusd %%zmm2, %%zmm5, %%zmm14\n\t vpdpbusd %%zmm3, %%zmm5, %%zmm15\n\t"
        "vpbroadcastd (%[x3]), %%zmm5\n\t"
        "vpdpbusd %%zmm0, %%zmm4, %%zmm16\n\t vpdpbusd %%zmm1, %%zmm4, %%zmm17\n\t"
        "vpdpbusd %%zmm2, %%zmm4, %%zmm18\n\t vpdpbusd %%zmm3, %%zmm4, %%zmm19\n\t"
        "vpbroadcastd (%[x], %[xs], 4), %%zmm4\n\t"
        "vpdpbusd %%zmm0, %%zmm5, %%zmm20\n\t vpdpbusd %%zmm1, %%zmm5, %%zmm21\n\t"
        "vpdpbusd %%zmm2, %%zmm5, %%zmm22\n\t vpdpbusd %%zmm3, %%zmm5, %%zmm23\n\t"
        "vpbroadcastd (%[x3], %[xs], 2), %%zmm5\n\t"
        "vpdpbusd %%zmm0, %%zmm4, %%zmm24\n\t vpdpbusd %%zmm1, %%zmm4, %%zmm25\n\t"
        "vpdpbusd %%zmm2, %%zmm4, %%zmm26\n\t vpdpbusd %%zmm3, %%zmm4, %%zmm27\n\t"
        "vpdpbusd %%zmm0, %%zmm5, %%zmm28\n\t vpdpbusd %%zmm1, %%zmm5, %%zmm29\n\t"
        "vpdpbusd %%zmm2, %%zmm5, %%zmm30\n\t vpdpbusd %%zmm3, %%zmm5, %%zmm31\n\t"
        "add $64, %[w]\n\t add $64, %[w3]\n\t add $4, %[x]\n\t add $4, %[x3]\n\t"
        "dec %[k4]\n\t"
        "jnz 1b\n\t"
        "2:\n\t"
        "vmovdqu64 %%zmm8, 0(%[acc])\n\t vmovdqu64 %%zmm9, 64(%[acc])\n\t"
        "vmovdqu64 %%zmm10, 128(%[acc])\n\t vmovdqu64 %%zmm11, 192(%[acc])\n\t"
        "vmovdqu64 %%zmm12, 256(%[acc])\n\t vmovdqu64 %%zmm13, 320(%[acc])\n\t"
        "vmovdqu64 %%zmm14, 384(%[acc])\n\t vmovdqu64 %%zmm15, 448(%[acc])\n\t"
        "vmovdqu64 %%zmm16, 512(%[acc])\n\t vmovdqu64 %%zmm17, 576(%[acc])\n\t"
        "vmovdqu64 %%zmm18, 640(%[acc])\n\t vmovdqu64 %%zmm19, 704(%[acc])\n\t"
        "vmovdqu64 %%zmm20, 768(%[acc])\n\t vmovdqu64 %%zmm21, 832(%[acc])\n\t"
        "vmovdqu64 %%zmm22, 896(%[acc])\n\t vmovdqu64 %%zmm23, 960(%[acc])\n\t"
        "vmovdqu64 %%zmm24, 1024(%[acc])\n\t vmovdqu64 %%zmm25, 1088(%[acc])\n\t"
        "vmovdqu64 %%zmm26, 1152(%[acc])\n\t vmovdqu64 %%zmm27, 1216(%[acc])\n\t"
        "vmovdqu64 %%zmm28, 1280(%[acc])\n\t vmovdqu64 %%zmm29, 1344(%[acc])\n\t"
        "vmovdqu64 %%zmm30, 1408(%[acc])\n\t vmovdqu64 %%zmm31, 1472(%[acc])\n\t"
        : [w] "+r"(w), [w3] "+r"(w3), [x] "+r"(x), [x3] "+r"(x3), [k4] "+r"(k4)
        : [ps] "r"(ps), [xs] "r"(xs), [acc] "r"(acc)
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm8", "xmm9", "xmm10",
          "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20",
          "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30",
          "xmm31");
}

/* rows m0 .. m0 + 5 by panels p .. p + 3 through `dot_4x6`, then `finish16` */
static void tile_4x6(const i8mat *w, int64_t p, const uint8_t *xu, int64_t xs, const float *rs,
                     uint16_t *out, int64_t os) {
    const int64_t k4 = w->k / 4, pstride = k4 * 64;
    __m512i acc[24];
    dot_4x6(w->panels + p * pstride, pstride, xu, xs, k4, acc);
    for (int q = 0; q < TILE_PANELS; q++) {
        const int64_t j0 = (p + q) * PANEL, left = w->n - j0;
        const __mmask16 keep = left >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512i comp = _mm512_loadu_si512((const void *)(w->comp + j0));
        const __m512 sc = _mm512_loadu_ps(w->scales + j0);
        __m512 bias = _mm512_setzero_ps();
        if (w->bias != NULL)
            bias = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, w->bias + j0)), 16));
        for (int m = 0; m < TILE_ROWS; m++)
            finish16(acc[m * TILE_PANELS + q], comp, sc, rs != NULL ? rs + m : NULL,
                     w->bias != NULL, bias, keep, out + m * os + j0);
    }
}
#endif

/* out [rows, n] bf16 (os apart) = the u8 codes xu [rows, k] (xs apart) times w^T, scaled: see
 * `finish` (rs: a scale per row, or NULL). The work: groups of 4 panels by blocks of 6 rows,
 * group-major, split into equal runs over the threads (a thread's groups stay in its L2; at
 * most one group shared). */
static void i8_gemm(const i8mat *w, const uint8_t *xu, int64_t xs, int64_t rows, const float *rs,
                    uint16_t *out, int64_t os, int threads) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const int64_t panels = (w->n + PANEL - 1) / PANEL;
    const int64_t groups = (panels + TILE_PANELS - 1) / TILE_PANELS;
    const int64_t blocks = (rows + TILE_ROWS - 1) / TILE_ROWS, items = groups * blocks;
#pragma omp parallel num_threads(threads) if (items > 1)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = items * t / nt, hi = items * (t + 1) / nt;
        for (int64_t it = lo; it < hi; it++) {
            const int64_t g = it / blocks, m0 = (it % blocks) * TILE_ROWS, p = g * TILE_PANELS;
            const int np = panels - p < TILE_PANELS ? (int)(panels - p) : TILE_PANELS;
            const int mr = rows - m0 < TILE_ROWS ? (int)(rows - m0) : TILE_ROWS;
            const float *r = rs != NULL ? rs + m0 : NULL;
            const uint8_t *x = xu + m0 * xs;
            uint16_t *o = out + m0 * os;
            if (np == TILE_PANELS) {
                switch (mr) { /* constant shapes: `tile` inlined for each */
                case 6: tile_4x6(w, p, x, xs, r, o, os); break;
                case 5: tile(w, p, 4, x, xs, 5, r, o, os); break;
                case 4: tile(w, p, 4, x, xs, 4, r, o, os); break;
                case 3: tile(w, p, 4, x, xs, 3, r, o, os); break;
                case 2: tile(w, p, 4, x, xs, 2, r, o, os); break;
                default: tile(w, p, 4, x, xs, 1, r, o, os); break;
                }
            } else {
                for (int m = 0; m < mr; m++) {
                    const float *rm = r != NULL ? r + m : NULL;
                    switch (np) {
                    case 3: tile(w, p, 3, x + m * xs, xs, 1, rm, o + m * os, os); break;
                    case 2: tile(w, p, 2, x + m * xs, xs, 1, rm, o + m * os, os); break;
                    default: tile(w, p, 1, x + m * xs, xs, 1, rm, o + m * os, os); break;
                    }
                }
            }
        }
    }
#else
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < w->n; j++) {
        const int8_t *pj = w->panels + (j / PANEL) * (w->k / 4) * 64 + (j % PANEL) * 4;
        for (int64_t m = 0; m < rows; m++) {
            const uint8_t *x = xu + m * xs;
            int32_t acc = 0;
            for (int64_t c = 0; c < w->k / 4; c++)
                for (int i = 0; i < 4; i++) acc += (int32_t)x[4 * c + i] * pj[c * 64 + i];
            const float y = finish(acc - w->comp[j], w->scales[j], rs != NULL ? rs + m : NULL, w->bias, j);
            out[m * os + j] = f32_to_bf16(y);
        }
    }
#endif
}

static int check_i8(const i8mat *w) {
    return w->panels != NULL && w->comp != NULL && w->scales != NULL && w->n > 0 && w->k > 0 &&
           w->k % 4 == 0;
}

/* int8 codes -> u8 (code + 128: the sign bit flipped), n bytes */
static void to_u8(const int8_t *codes, uint8_t *xu, int64_t n) {
    for (int64_t i = 0; i < n; i++) xu[i] = (uint8_t)codes[i] ^ 0x80u;
}

/* the GEMM alone: xq int8 [rows, k] (rows xs apart) -> out bf16 [rows, n] = bf16(float(xq w^T)
 * * scale), no row scale, no bias (the modules' `w8a8.int8_gemm` in bf16) */
int w8a8_gemm_bf16(const int8_t *xq, int64_t xs, const int8_t *panels, const int32_t *comp,
                   const float *scales, uint16_t *out, int64_t rows, int64_t n, int64_t k,
                   int threads) {
    const i8mat w = {panels, comp, scales, NULL, n, k};
    if (!check_i8(&w) || rows < 1 || xs < k) return 9;
    uint8_t *xu = aligned_alloc(64, (size_t)round_up(rows * k, 64));
    if (xu == NULL) return 3;
    for (int64_t m = 0; m < rows; m++) to_u8(xq + m * xs, xu + m * k, k);
    i8_gemm(&w, xu, k, rows, NULL, out, n, threads);
    free(xu);
    return 0;
}

/* The weight-only int8 lm_head of a w8a8 model (bf16 activations, the logits' quality): its
 * int8 weights widened once to bf16 (exact) in panels of 16 channels, [K / 2][16][2] (channel
 * j's columns 2c, 2c + 1 together), so AVX512-BF16 vdpbf16ps multiplies a panel's 32 values by
 * a broadcast pair of activations, products exact in fp32 and summed there; then
 * bf16(sum * scale). The modules' kernel (`_weight_int8pack_mm`) sums the same products in
 * another order: the logits may differ by a bf16 rounding. Measured on the embedded model at
 * 16 rows (AMD EPYC, 2 threads): ~12 ms a step through the module, the C step's largest piece. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static inline __attribute__((always_inline)) void head_tile(const uint16_t *panels, const float *scales,
                                                            int64_t n, int64_t k, int64_t p, int np,
                                                            const uint16_t *x, int64_t xs, int mr,
                                                            uint16_t *out, int64_t os) {
    const int64_t k2 = k / 2, pstride = k2 * 32;
    const uint16_t *w0 = panels + p * pstride, *w1 = w0 + pstride;
    __m512 acc[2][HEAD_ROWS];
    for (int q = 0; q < np; q++)
        for (int m = 0; m < mr; m++) acc[q][m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k2; c++) {
        const __m512bh a = (__m512bh)_mm512_loadu_si512((const void *)(w0 + c * 32));
        const __m512bh b = np == 2 ? (__m512bh)_mm512_loadu_si512((const void *)(w1 + c * 32)) : a;
        for (int m = 0; m < mr; m++) {
            int32_t two;
            memcpy(&two, x + m * xs + 2 * c, sizeof two);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(two);
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], xv, a);
            if (np == 2) acc[1][m] = _mm512_dpbf16_ps(acc[1][m], xv, b);
        }
    }
    for (int q = 0; q < np; q++) {
        const int64_t j0 = (p + q) * PANEL, left = n - j0;
        const __mmask16 keep = left >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 sc = _mm512_loadu_ps(scales + j0);
        for (int m = 0; m < mr; m++) {
            const __m512 y = rbf16(_mm512_mul_ps(acc[q][m], sc));
            const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(y), 16));
            _mm256_mask_storeu_epi16(out + m * os + j0, keep, h);
        }
    }
}
#endif

/* out [rows, n] bf16 = bf16((x [rows, k] bf16, xs apart) . w_j * scale_j); k even */
int int8_head_bf16(const uint16_t *x, int64_t xs, const uint16_t *panels, const float *scales,
                   uint16_t *out, int64_t rows, int64_t n, int64_t k, int threads) {
    if (panels == NULL || scales == NULL || rows < 1 || n < 1 || k < 2 || k % 2 || xs < k) return 9;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const int64_t np_all = (n + PANEL - 1) / PANEL;
    const int64_t pairs = (np_all + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t pp = 0; pp < pairs; pp++) {
        const int64_t p = 2 * pp;
        const int np = p + 1 < np_all ? 2 : 1;
        for (int64_t m0 = 0; m0 < rows; m0 += HEAD_ROWS) {
            const int mr = rows - m0 < HEAD_ROWS ? (int)(rows - m0) : HEAD_ROWS;
            const uint16_t *xm = x + m0 * xs;
            uint16_t *o = out + m0 * n;
            if (np == 2 && mr == HEAD_ROWS) {
                head_tile(panels, scales, n, k, p, 2, xm, xs, HEAD_ROWS, o, n);
            } else {
                for (int m = 0; m < mr; m++) head_tile(panels, scales, n, k, p, np, xm + m * xs, xs, 1, o + m * n, n);
            }
        }
    }
#else
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *pj = panels + (j / PANEL) * (k / 2) * 32 + (j % PANEL) * 2;
        for (int64_t m = 0; m < rows; m++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < k / 2; c++)
                for (int i = 0; i < 2; i++) acc += bf16_to_f32(x[m * xs + 2 * c + i]) * bf16_to_f32(pj[c * 32 + i]);
            out[m * n + j] = f32_to_bf16(acc * scales[j]);
        }
    }
#endif
    return 0;
}

/* one w8a8 decoder layer's weights and KV pools */
typedef struct {
    i8mat qkv, o, gate_up, down;
    const uint16_t *in_norm, *post_norm; /* [h] */
    const uint16_t *q_norm, *k_norm;     /* [d] each, or NULL (no q/k norm) */
    uint16_t *k_pool, *v_pool;           /* [num_rows, kvh, d], rows row_stride apart */
} layer_w8;

/* x [rows, h] bf16, the residual stream, updated in place through every layer (x + attention,
 * then + MLP, each add rounded); cos / sin [rows, d] at the tokens' positions; K / V of token m
 * to pool row out_loc[m]; attention over pool rows indices[indptr[b] + l], l < lens[b]. */
int decode_layers_w8a8_bf16(const layer_w8 *layers, int64_t num_layers, uint16_t *x,
                            const uint16_t *cos, const uint16_t *sin, const int64_t *out_loc,
                            const int64_t *indices, int64_t num_indices, const int64_t *indptr,
                            const int64_t *lens, int64_t rows, int64_t h, int64_t nh, int64_t kvh,
                            int64_t d, int64_t inter, int64_t num_rows, int64_t row_stride,
                            int64_t window, float eps, int threads) {
    if (rows < 1 || d > MAX_D || d % 2 || nh % kvh) return 9;
    const int64_t qn = nh * d, kvn = kvh * d, nqkv = qn + 2 * kvn;
    for (int64_t l = 0; l < num_layers; l++) {
        const layer_w8 *L = &layers[l];
        if (!check_i8(&L->qkv) || !check_i8(&L->o) || !check_i8(&L->gate_up) || !check_i8(&L->down))
            return 9;
        if (L->qkv.k != h || L->qkv.n != nqkv || L->o.k != qn || L->o.n != h ||
            L->gate_up.k != h || L->gate_up.n != 2 * inter || L->down.k != inter || L->down.n != h)
            return 9;
    }
    for (int64_t m = 0; m < rows; m++)
        if (out_loc[m] < 0 || out_loc[m] >= num_rows) return 4;
    int64_t kmax = h > qn ? h : qn;
    kmax = round_up(kmax > inter ? kmax : inter, 64);
    const int64_t ymax = nqkv > 2 * inter ? nqkv : 2 * inter;
    uint8_t *xu = aligned_alloc(64, (size_t)(rows * kmax));
    float *sx = malloc((size_t)rows * sizeof(float)), *sh = malloc((size_t)rows * sizeof(float));
    uint16_t *y = malloc((size_t)(rows * ymax) * sizeof(uint16_t));
    uint16_t *qb = malloc((size_t)(rows * qn) * sizeof(uint16_t));
    uint16_t *ob = malloc((size_t)(rows * qn) * sizeof(uint16_t));
    float *yf = malloc((size_t)(rows * nqkv) * sizeof(float)); /* a QKV row's heads as floats */
    int rc = (xu && sx && sh && y && qb && ob && yf) ? 0 : 3;
    const float scale = 1.0f / sqrtf((float)d);
    /* quant.c's pass of rows [rows, n] (stride apart) into the u8 codes, kmax apart */
#define QUANT(src, stride, w, ins, kind, n, scales)                                                 \
    rc = quant_rows_bf16((src), (stride), (w), (ins), eps, (kind), (int8_t *)xu, kmax, 1, (scales), \
                         rows, (n), threads)
    for (int64_t l = 0; rc == 0 && l < num_layers; l++) {
        const layer_w8 *L = &layers[l];
        /* attention: the normed input's codes, QKV, q / k norms, RoPE, KV store, attention */
        QUANT(x, h, L->in_norm, NULL, Q_RMSNORM, h, sx);
        if (rc != 0) break;
        i8_gemm(&L->qkv, xu, kmax, rows, sx, y, nqkv, threads);
        ROWS_PARALLEL
        for (int64_t m = 0; m < rows; m++) {
            float *ym = yf + m * nqkv;
            for (int64_t i = 0; i < nqkv; i++) ym[i] = bf16_to_f32(y[m * nqkv + i]);
            heads_to_pool(ym, L->q_norm, L->k_norm, eps, cos + m * d, sin + m * d, nh, kvh, d,
                          qb + m * qn, L->k_pool + out_loc[m] * row_stride,
                          L->v_pool + out_loc[m] * row_stride);
        }
        rc = decode_attention_bf16_paged(qb, L->k_pool, L->v_pool, ob, indices, num_indices, indptr,
                                         lens, rows, kvh, nh / kvh, d, num_rows, d, row_stride, d,
                                         row_stride, window, scale, threads);
        if (rc != 0) break;
        /* o_proj of the attention output's codes, the residual */
        QUANT(ob, qn, NULL, NULL, Q_ROWS, qn, sx);
        if (rc != 0) break;
        i8_gemm(&L->o, xu, kmax, rows, sx, y, h, threads);
        ROWS_PARALLEL
        for (int64_t i = 0; i < rows * h; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
        /* the MLP: the normed input's codes, gate/up (its row scale left to the SiLU x up pass),
         * SiLU x up's codes, down, the residual */
        QUANT(x, h, L->post_norm, NULL, Q_RMSNORM, h, sx);
        if (rc != 0) break;
        i8_gemm(&L->gate_up, xu, kmax, rows, NULL, y, 2 * inter, threads);
        QUANT(y, 2 * inter, NULL, sx, Q_SILU_MUL, inter, sh);
        if (rc != 0) break;
        i8_gemm(&L->down, xu, kmax, rows, sh, y, h, threads);
        ROWS_PARALLEL
        for (int64_t i = 0; i < rows * h; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
    }
#undef QUANT
    free(xu);
    free(sx);
    free(sh);
    free(y);
    free(qb);
    free(ob);
    free(yf);
    return rc;
}
