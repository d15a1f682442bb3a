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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define VECTOR_TILES 1
/* A tile's sums in assembly: 4 panels (64 output channels) by 6 rows, 24 accumulators in
 * zmm8-31, the panels' 64 bytes of a step in zmm0-3, each row's 4 bytes broadcast into zmm4 /
 * zmm5; a step: 4 panel loads, 6 broadcasts, 24 of INSN (AT&T order: weights, activations,
 * accumulator). INSN vpdpbusd: 4 u8 activations x 4 s8 weights into int32; vdpbf16ps: 2 bf16
 * pairs into fp32. Missing rows / panels of an edge tile point at real ones (their sums are
 * dropped). With intrinsics gcc 12 kept most accumulators on the stack, a store and a load
 * each per step: the int8 GEMM ran at 149-229 GMAC/s (2 threads, AMD EPYC) against 232 a core
 * for vpdpbusd alone. acc [6][4]: row-major. */
#define DOT_4X6(NAME, INSN)                                                                        \
    static void NAME(const void *w0, const void *w1, const void *w2, const void *w3,               \
                     const void *x0, const void *x1, const void *x2, const void *x3,               \
                     const void *x4, const void *x5, int64_t steps, void *acc) {                   \
        __asm__ volatile(                                                                          \
            "vpxord %%zmm8, %%zmm8, %%zmm8\n\t"                                                    \
            "vmovdqa64 %%zmm8, %%zmm9\n\t vmovdqa64 %%zmm8, %%zmm10\n\t"                           \
            "vmovdqa64 %%zmm8, %%zmm11\n\t vmovdqa64 %%zmm8, %%zmm12\n\t"                          \
            "vmovdqa64 %%zmm8, %%zmm13\n\t vmovdqa64 %%zmm8, %%zmm14\n\t"                          \
            "vmovdqa64 %%zmm8, %%zmm15\n\t vmovdqa64 %%zmm8, %%zmm16\n\t"                          \
            "vmovdqa64 %%zmm8, %%zmm17\n\t vmovdqa64 %%zmm8, %%zmm18\n\t"                          \
            "vmovdqa64 %%zmm8, %%zmm19\n\t vmovdqa64 %%zmm8, %%zmm20\n\t"                          \
            "vmovdqa64 %%zmm8, %%zmm21\n\t vmovdqa64 %%zmm8, %%zmm22\n\t"                          \
            "vmovdqa64 %%zmm8, %%zmm23\n\t vmovdqa64 %%zmm8, %%zmm24\n\t"                          \
            "vmovdqa64 %%zmm8, %%zmm25\n\t vmovdqa64 %%zmm8, %%zmm26\n\t"                          \
            "vmovdqa64 %%zmm8, %%zmm27\n\t vmovdqa64 %%zmm8, %%zmm28\n\t"                          \
            "vmovdqa64 %%zmm8, %%zmm29\n\t vmovdqa64 %%zmm8, %%zmm30\n\t"                          \
            "vmovdqa64 %%zmm8, %%zmm31\n\t"                                                        \
            "test %[n], %[n]\n\t"                                                                  \
            "jle 2f\n\t"                                                                           \
            "1:\n\t"                                                                               \
            "vmovdqu64 (%[w0]), %%zmm0\n\t vmovdqu64 (%[w1]), %%zmm1\n\t"                          \
            "vmovdqu64 (%[w2]), %%zmm2\n\t vmovdqu64 (%[w3]), %%zmm3\n\t"                          \
            "vpbroadcastd (%[x0]), %%zmm4\n\t vpbroadcastd (%[x1]), %%zmm5\n\t"                    \
            INSN " %%zmm0, %%zmm4, %%zmm8\n\t " INSN " %%zmm1, %%zmm4, %%zmm9\n\t"                 \
            INSN " %%zmm2, %%zmm4, %%zmm10\n\t " INSN " %%zmm3, %%zmm4, %%zmm11\n\t"               \
            "vpbroadcastd (%[x2]), %%zmm4\n\t"                                                     \
            INSN " %%zmm0, %%zmm5, %%zmm12\n\t " INSN " %%zmm1, %%zmm5, %%zmm13\n\t"               \
            INSN " %%zmm2, %%zmm5, %%zmm14\n\t " INSN " %%zmm3, %%zmm5, %%zmm15\n\t"               \
            "vpbroadcastd (%[x3]), %%zmm5\n\t"                                                     \
            INSN " %%zmm0, %%zmm4, %%zmm16\n\t " INSN " %%zmm1, %%zmm4, %%zmm17\n\t"               \
            INSN " %%zmm2, %%zmm4, %%zmm18\n\t " INSN " %%zmm3, %%zmm4, %%zmm19\n\t"               \
            "vpbroadcastd (%[x4]), %%zmm4\n\t"                                                     \
            INSN " %%zmm0, %%zmm5, %%zmm20\n\t " INSN " %%zmm1, %%zmm5, %%zmm21\n\t"               \
            INSN " %%zmm2, %%zmm5, %%zmm22\n\t " INSN " %%zmm3, %%zmm5, %%zmm23\n\t"               \
            "vpbroadcastd (%[x5]), %%zmm5\n\t"                                                     \
            INSN " %%zmm0, %%zmm4, %%zmm24\n\t " INSN " %%zmm1, %%zmm4, %%zmm25\n\t"               \
            INSN " %%zmm2, %%zmm4, %%zmm26\n\t " INSN " %%zmm3, %%zmm4, %%zmm27\n\t"               \
            INSN " %%zmm0, %%zmm5, %%zmm28\n\t " INSN " %%zmm1, %%zmm5, %%zmm29\n\t"               \
            INSN " %%zmm2, %%zmm5, %%zmm30\n\t " INSN " %%zmm3, %%zmm5, %%zmm31\n\t"               \
            "add $64, %[w0]\n\t add $64, %[w1]\n\t add $64, %[w2]\n\t add $64, %[w3]\n\t"          \
            "add $4, %[x0]\n\t add $4, %[x1]\n\t add $4, %[x2]\n\t add $4, %[x3]\n\t"              \
            "add $4, %[x4]\n\t add $4, %[x5]\n\t"                                                  \
            "dec %[n]\n\t"                                                                         \
            "jnz 1b\n\t"                                                                           \
            "2:\n\t"                                                                               \
            "vmovdqu64 %%zmm8, 0(%[acc])\n\t vmovdqu64 %%zmm9, 64(%[acc])\n\t"                     \
            "vmovdqu64 %%zmm10, 128(%[acc])\n\t vmovdqu64 %%zmm11, 192(%[acc])\n\t"                \
            "vmovdqu64 %%zmm12, 256(%[acc])\n\t vmovdqu64 %%zmm13, 320(%[acc])\n\t"                \
            "vmovdqu64 %%zmm14, 384(%[acc])\n\t vmovdqu64 %%zmm15, 448(%[acc])\n\t"                \
            "vmovdqu64 %%zmm16, 512(%[acc])\n\t vmovdqu64 %%zmm17, 576(%[acc])\n\t"                \
            "vmovdqu64 %%zmm18, 640(%[acc])\n\t vmovdqu64 %%zmm19, 704(%[acc])\n\t"                \
            "vmovdqu64 %%zmm20, 768(%[acc])\n\t vmovdqu64 %%zmm21, 832(%[acc])\n\t"                \
            "vmovdqu64 %%zmm22, 896(%[acc])\n\t vmovdqu64 %%zmm23, 960(%[acc])\n\t"                \
            "vmovdqu64 %%zmm24, 1024(%[acc])\n\t vmovdqu64 %%zmm25, 1088(%[acc])\n\t"              \
            "vmovdqu64 %%zmm26, 1152(%[acc])\n\t vmovdqu64 %%zmm27, 1216(%[acc])\n\t"              \
            "vmovdqu64 %%zmm28, 1280(%[acc])\n\t vmovdqu64 %%zmm29, 1344(%[acc])\n\t"              \
            "vmovdqu64 %%zmm30, 1408(%[acc])\n\t vmovdqu64 %%zmm31, 1472(%[acc])\n\t"              \
            : [w0] "+r"(w0), [w1] "+r"(w1), [w2] "+r"(w2), [w3] "+r"(w3), [x0] "+r"(x0),           \
              [x1] "+r"(x1), [x2] "+r"(x2), [x3] "+r"(x3), [x4] "+r"(x4), [x5] "+r"(x5),           \
              [n] "+r"(steps)                                                                      \
            : [acc] "r"(acc)                                                                       \
            : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm8", "xmm9",       \
              "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18",      \
              "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27",      \
              "xmm28", "xmm29", "xmm30", "xmm31");                                                 \
    }
DOT_4X6(dot_i8_4x6, "vpdpbusd")
DOT_4X6(dot_bf16_4x6, "vdpbf16ps")
#undef DOT_4X6

#define TILE_ROWS 6
#define TILE_PANELS 4

/* a tile's sums: rows m0 .. m0 + mr - 1 of x (rows xs bytes apart) by panels p .. p + np - 1
 * (pbytes apart), `steps` of 4 bytes a row and 64 a panel */
static void tile_sums(int bf16, const char *panels, int64_t pbytes, int64_t p, int np,
                      const char *x, int64_t xs, int mr, int64_t steps, void *acc) {
    const char *w[TILE_PANELS], *xr[TILE_ROWS];
    for (int q = 0; q < TILE_PANELS; q++) w[q] = panels + (p + (q < np ? q : 0)) * pbytes;
    for (int m = 0; m < TILE_ROWS; m++) xr[m] = x + (m < mr ? m : 0) * xs;
    (bf16 ? dot_bf16_4x6 : dot_i8_4x6)(w[0], w[1], w[2], w[3], xr[0], xr[1], xr[2], xr[3], xr[4],
                                       xr[5], steps, acc);
}

/* 16 channels' int32 sums of one row -> bf16 at out (the first `keep` of them): see `finish` */
static inline void finish16(__m512i acc, __m512i comp, __m512 sc, const float *rs, int has_bias,
                            __m512 bias, __mmask16 keep, uint16_t *out) {
    __m512 y = rbf16(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, comp)), sc));
    if (rs != NULL) y = rbf16(_mm512_mul_ps(y, _mm512_set1_ps(*rs)));
    if (has_bias) y = rbf16(_mm512_add_ps(y, bias));
    bf16x16_store(out, y, keep);
}

/* rows m0 .. m0 + mr - 1 by panels p .. p + np - 1 of the int8 GEMM */
static void tile(const i8mat *w, int64_t p, int np, const uint8_t *xu, int64_t xs, int mr,
                 const float *rs, uint16_t *out, int64_t os) {
    const int64_t k4 = w->k / 4;
    __m512i acc[TILE_ROWS * TILE_PANELS];
    tile_sums(0, (const char *)w->panels, k4 * 64, p, np, (const char *)xu, xs, mr, k4, acc);
    for (int q = 0; q < np; q++) {
        const int64_t j0 = (p + q) * PANEL, left = w->n - j0;
        const __mmask16 keep = left >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512i comp = _mm512_loadu_si512((const void *)(w->comp + j0));
        const __m512 sc = _mm512_loadu_ps(w->scales + j0);
        __m512 bias = _mm512_setzero_ps();
        if (w->bias != NULL)
            bias = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, w->bias + j0)), 16));
        for (int m = 0; m < mr; m++)
            finish16(acc[m * TILE_PANELS + q], comp, sc, rs != NULL ? rs + m : NULL,
                     w->bias != NULL, bias, keep, out + m * os + j0);
    }
}

/* the work of a GEMM of `rows` rows by `panels` panels: tiles of 4 panels by 6 rows, group
 * major, split into equal runs over the threads (a thread's panels stay in its L2; at most
 * one group shared); `fn(p, np, m0, mr)` each */
#define RUN_TILES(panels, rows, threads, fn)                                                       \
    do {                                                                                           \
        const int64_t groups_ = ((panels) + TILE_PANELS - 1) / TILE_PANELS;                        \
        const int64_t blocks_ = ((rows) + TILE_ROWS - 1) / TILE_ROWS, items_ = groups_ * blocks_;  \
        _Pragma("omp parallel num_threads(threads) if (items_ > 1)") {                            \
            const int64_t nt_ = omp_get_num_threads(), t_ = omp_get_thread_num();                 \
            for (int64_t it = items_ * t_ / nt_; it < items_ * (t_ + 1) / nt_; it++) {             \
                const int64_t p_ = (it / blocks_) * TILE_PANELS, m0_ = (it % blocks_) * TILE_ROWS; \
                const int np_ = (panels) - p_ < TILE_PANELS ? (int)((panels) - p_) : TILE_PANELS;  \
                const int mr_ = (rows) - m0_ < TILE_ROWS ? (int)((rows) - m0_) : TILE_ROWS;        \
                fn(p_, np_, m0_, mr_);                                                             \
            }                                                                                      \
        }                                                                                          \
    } while (0)
#endif

/* out [rows, n] bf16 (os apart) = the u8 codes xu [rows, k] (xs apart) times w^T, scaled: see
 * `finish` (rs: a scale per row, or NULL) */
static void i8_gemm(const i8mat *w, const uint8_t *xu, int64_t xs, int64_t rows, const float *rs,
                    uint16_t *out, int64_t os, int threads) {
#if defined(VECTOR_TILES)
    const int64_t panels = (w->n + PANEL - 1) / PANEL;
#define I8_TILE(p, np, m0, mr)                                                                     \
    tile(w, p, np, xu + (m0) * xs, xs, mr, rs != NULL ? rs + (m0) : NULL, out + (m0) * os, os)
    RUN_TILES(panels, rows, threads, I8_TILE);
#undef I8_TILE
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
#if defined(VECTOR_TILES)
/* rows m0 .. m0 + mr - 1 by panels p .. p + np - 1 of the head: bf16(sum * scale) */
static void head_tile(const uint16_t *panels, const float *scales, int64_t n, int64_t k, int64_t p,
                      int np, const uint16_t *x, int64_t xs, int mr, uint16_t *out, int64_t os) {
    const int64_t k2 = k / 2;
    __m512 acc[TILE_ROWS * TILE_PANELS];
    tile_sums(1, (const char *)panels, k2 * 64, p, np, (const char *)x, xs * 2, mr, k2, acc);
    for (int q = 0; q < np; q++) {
        const int64_t j0 = (p + q) * PANEL, left = n - j0;
        const __mmask16 keep = left >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 sc = _mm512_loadu_ps(scales + j0);
        for (int m = 0; m < mr; m++)
            bf16x16_store(out + m * os + j0, rbf16(_mm512_mul_ps(acc[m * TILE_PANELS + q], sc)), keep);
    }
}
#endif

/* out [rows, n] bf16 = bf16((x [rows, k] bf16, xs apart) . w_j * scale_j); k even */
int int8_head_bf16(const uint16_t *x, int64_t xs, const uint16_t *panels, const float *scales,
                   uint16_t *out, int64_t rows, int64_t n, int64_t k, int threads) {
    if (panels == NULL || scales == NULL || rows < 1 || n < 1 || k < 2 || k % 2 || xs < k) return 9;
#if defined(VECTOR_TILES)
    const int64_t np_all = (n + PANEL - 1) / PANEL;
#define HEAD_TILE(p, np, m0, mr)                                                                   \
    head_tile(panels, scales, n, k, p, np, x + (m0) * xs, xs, mr, out + (m0) * n, n)
    RUN_TILES(np_all, rows, threads, HEAD_TILE);
#undef HEAD_TILE
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
