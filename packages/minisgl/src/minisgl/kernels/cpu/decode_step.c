/* A decode step of an int4 bf16 Llama-family model in one C call (engine/cpu_decode.py): every
 * decoder layer's norms, int4 GEMVs, RoPE, KV store, attention, SiLU x up and residual adds,
 * then the final norm; and the int4 GEMV alone (the lm_head). No Python, no dispatch between
 * the ops of a layer: on the embedded model a batch-1 decode step through the torch modules
 * spent ~6 ms of its ~14 in per-op dispatch (AMD EPYC, 2 threads).
 *
 * Weights: `Int4Linear`'s codes, uint8 [N, K / 2] (low nibble the even column of a pair), and
 * per group of 32 columns a bf16 scale s and zero z (w = (code - 8) s + z), here row-major
 * [N, gp, 2] (gp = groups rounded up to 4, zero padded). A GEMV quantizes its input rows per
 * group of 32 to int8 (scale d = max |x| / 127, as llama.cpp's Q8 blocks) and multiplies codes
 * by codes: sum_j w_j x_j ~ s d (sum_j code_j q_j - 8 sum_j q_j) + z sum_j x_j, the sums of
 * codes exact in int32 (AVX512-VNNI vpdpbusd: unsigned codes times signed activations, 64 products an
 * instruction), the second from the group's float sum. The activations are split per group
 * into their even and odd columns, so the low and high nibbles of 16 code bytes meet their 16
 * activations without a shuffle. One input row: `dots4`, four weight rows a pass (a stream of
 * the weights, bandwidth-bound). Several: `tile`, a block of up to 4 weight rows by 4 input
 * rows, each weight vector unpacked once for the 4 inputs and each input vector loaded once for
 * the 4 weight rows, its 16 accumulators in registers: the step's cost grows far slower than
 * its rows. With AVX2 alone (no AVX512-VNNI) `dots4_avx2` runs the same arithmetic 2 groups a
 * vector; without AVX2, plain loops.
 *
 * Roundings follow the model's eager bf16 ops (models/layers.py): RMSNorm normalised in fp32,
 * rounded, times the weight, rounded; a linear's output rounded once (bias added before);
 * RoPE's two products and their sum each rounded; SiLU then the product each rounded; every
 * residual add rounded. The activations' int8 codes are this path's own approximation. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "rowops.h"
#include "vexp.h"

#define GROUP 32

/* one int4 matrix: row r's codes at codes + r * k / 2, its scales and zeros interleaved at
 * sz + r * gp * 2 (s of group g at 2 g, z at 2 g + 1) */
typedef struct {
    const uint8_t *codes;
    const uint16_t *sz;
    const uint16_t *bias; /* [n] or NULL */
    int64_t n, k, gp;
} q4mat;

/* one input row quantized per group of 32: its even / odd codes per group (16 each), and per
 * VNNI lane (4 a group) the group's scale d, a quarter of its float sum and 2 d times the sum
 * of its codes (a quarter of 8 d sum q: the codes' term is s d (sum code q - 8 sum q), so the
 * offset of 8 meets the same rounded activations as the codes; only the zeros meet the exact
 * sum, their rounding error otherwise grew with the codes' mean of 7.5 instead of 8 - code) */
typedef struct {
    int8_t *xe, *xo;
    float *d4, *sum4, *q8sum4;
    /* per group g at 2 g, 2 g + 1: -8 d sum q, sum x (the terms of the weights' s and z
     * there, `tile` multiplies them once a row, 8 groups a vector) */
    float *ext;
} qrow;

/* `rows` quantized input rows of up to kmax columns in one 64-aligned buffer (NULL: out of
 * memory; `free(a[0].xe)` then `free(a)` release them) */
static qrow *qrows_new(int64_t rows, int64_t kmax) {
    const int64_t gp = round_up(kmax / GROUP + 1, 16); /* >= the groups rounded up to 8 */
    const int64_t bytes = gp * (16 + 16 + 3 * 4 * sizeof(float) + 2 * sizeof(float));
    qrow *a = malloc((size_t)rows * sizeof(qrow));
    uint8_t *buf = aligned_alloc(64, (size_t)(rows * bytes));
    if (a == NULL || buf == NULL) {
        free(a);
        free(buf);
        return NULL;
    }
    for (int64_t m = 0; m < rows; m++) {
        uint8_t *b = buf + m * bytes;
        a[m].xe = (int8_t *)b;
        a[m].xo = (int8_t *)(b + gp * 16);
        a[m].d4 = (float *)(b + gp * 32);
        a[m].sum4 = a[m].d4 + gp * 4;
        a[m].q8sum4 = a[m].sum4 + gp * 4;
        a[m].ext = a[m].q8sum4 + gp * 4;
    }
    return a;
}

static void qrows_free(qrow *a) {
    if (a != NULL) free(a[0].xe);
    free(a);
}

/* quantize k floats (k a multiple of 32); the groups up to a multiple of 8 are zeroed */
static void quantize_row(const float *x, int64_t k, qrow *a) {
    const int64_t groups = k / GROUP, gp = round_up(groups, 4);
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * GROUP;
#if defined(__AVX512F__)
        const __m512 v0 = _mm512_loadu_ps(xg), v1 = _mm512_loadu_ps(xg + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
        const __m512 iv = _mm512_set1_ps(id);
        /* rounded to nearest even by the conversion, as lrintf; |v| <= 127 */
        const __m512i qe = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(v0, ev, v1), iv));
        const __m512i qo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(v0, od, v1), iv));
        _mm_store_si128((__m128i *)(a->xe + g * 16), _mm512_cvtsepi32_epi8(qe));
        _mm_store_si128((__m128i *)(a->xo + g * 16), _mm512_cvtsepi32_epi8(qo));
        const int32_t qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qe, qo));
#else
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            const float v = fabsf(xg[j]);
            amax = v > amax ? v : amax;
            sum += xg[j];
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t qsum = 0;
        for (int j = 0; j < GROUP / 2; j++) {
            a->xe[g * 16 + j] = (int8_t)lrintf(xg[2 * j] * id);
            a->xo[g * 16 + j] = (int8_t)lrintf(xg[2 * j + 1] * id);
            qsum += a->xe[g * 16 + j] + a->xo[g * 16 + j];
        }
#endif
        const float d = amax / 127.0f;
        for (int j = 0; j < 4; j++) {
            a->d4[g * 4 + j] = d;
            a->sum4[g * 4 + j] = 0.25f * sum;
            a->q8sum4[g * 4 + j] = 2.0f * d * (float)qsum;
        }
        a->ext[2 * g] = -8.0f * d * (float)qsum;
        a->ext[2 * g + 1] = sum;
    }
    for (int64_t g = groups; g < round_up(groups, 8); g++) {
        if (g < gp) {
            memset(a->xe + g * 16, 0, 16);
            memset(a->xo + g * 16, 0, 16);
            for (int j = 0; j < 4; j++) a->d4[g * 4 + j] = a->sum4[g * 4 + j] = a->q8sum4[g * 4 + j] = 0.0f;
        }
        a->ext[2 * g] = a->ext[2 * g + 1] = 0.0f;
    }
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
/* row n of w . one quantized input row, in plain loops (CPUs without AVX512-VNNI) */
static float row_dot(const q4mat *w, int64_t n, const qrow *a) {
    const int64_t groups = w->k / GROUP;
    const uint8_t *c = w->codes + n * (w->k / 2);
    const uint16_t *sz = w->sz + n * w->gp * 2;
    float out = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const float sg = bf16_to_f32(sz[2 * g]), zg = bf16_to_f32(sz[2 * g + 1]);
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            const uint8_t b = c[g * 16 + j];
            isum += (int32_t)(b & 15) * a->xe[g * 16 + j] + (int32_t)(b >> 4) * a->xo[g * 16 + j];
        }
        out += (float)isum * sg * a->d4[g * 4] + zg * 4.0f * a->sum4[g * 4] - sg * 4.0f * a->q8sum4[g * 4];
    }
    return out;
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* 16-bit lanes that put a group's s (or z) in the upper half of its 4 fp32 lanes (the lower
 * halves are masked to zero): a bf16 widened to fp32 without a conversion */
static const uint16_t S_AT[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 2, 0, 2, 0, 2,
                                  0, 4, 0, 4, 0, 4, 0, 4, 0, 6, 0, 6, 0, 6, 0, 6};
static const uint16_t Z_AT[32] = {0, 1, 0, 1, 0, 1, 0, 1, 0, 3, 0, 3, 0, 3, 0, 3,
                                  0, 5, 0, 5, 0, 5, 0, 5, 0, 7, 0, 7, 0, 7, 0, 7};
#define UPPER_HALVES 0xAAAAAAAAu

/* out[0..4) = rows n .. n + 3 of w . the one quantized input row (single-stream decode): the
 * activations' vectors are loaded once for the four rows, the four sums reduced together */
static void dots4(const q4mat *w, int64_t n, const qrow *a, float *out) {
    const int64_t groups = w->k / GROUP, half = w->k / 2, sstride = w->gp * 2;
    const uint8_t *c = w->codes + n * half;
    const uint16_t *sz = w->sz + n * sstride;
    const __m512i s_at = _mm512_loadu_si512((const void *)S_AT);
    const __m512i z_at = _mm512_loadu_si512((const void *)Z_AT);
    const __m512i nib = _mm512_set1_epi8(0x0F);
    __m512 acc[4], accz[4];
    for (int r = 0; r < 4; r++) acc[r] = accz[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 4) {
        const int64_t left = groups - g;
        const __mmask64 mask = left >= 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * left)) - 1);
        const __m512i xe = _mm512_load_si512((const void *)(a->xe + g * 16));
        const __m512i xo = _mm512_load_si512((const void *)(a->xo + g * 16));
        const __m512 d4 = _mm512_load_ps(a->d4 + g * 4);
        const __m512 q8 = _mm512_load_ps(a->q8sum4 + g * 4);
        const __m512 sum4 = _mm512_load_ps(a->sum4 + g * 4);
        /* the next block of rows (contiguous after this one), 256 bytes of codes a step: the
         * hardware prefetcher alone left four interleaved row streams cold (down_proj, 12
         * steps a block: 1.36 -> 0.66 ms a token over 30 layers, AMD EPYC, 2 threads) */
        const uint8_t *next = c + 4 * half + g * 64;
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(next + 64 * l), _MM_HINT_T0);
        _mm_prefetch((const char *)(sz + 4 * sstride + g * 16), _MM_HINT_T0);
        for (int r = 0; r < 4; r++) {
            const __m512i v = _mm512_maskz_loadu_epi8(mask, c + r * half + g * 16);
            const __m512i lo = _mm512_and_si512(v, nib);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            const __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(sz + r * sstride + 2 * g)));
            const __m512 sv = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(UPPER_HALVES, s_at, raw));
            const __m512 zv = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(UPPER_HALVES, z_at, raw));
            __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe);
            isum = _mm512_dpbusd_epi32(isum, hi, xo);
            acc[r] = _mm512_fmadd_ps(sv, _mm512_fmsub_ps(_mm512_cvtepi32_ps(isum), d4, q8), acc[r]);
            accz[r] = _mm512_fmadd_ps(zv, sum4, accz[r]);
        }
    }
    /* four horizontal sums at once: halves, then pairs of rows, then lanes */
    __m256 h[4];
    for (int r = 0; r < 4; r++) {
        const __m512 t = _mm512_add_ps(acc[r], accz[r]);
        h[r] = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
    }
    const __m256 h01 = _mm256_hadd_ps(h[0], h[1]), h23 = _mm256_hadd_ps(h[2], h[3]);
    const __m256 h4 = _mm256_hadd_ps(h01, h23); /* [r0 r1 r2 r3 | r0 r1 r2 r3] partial sums */
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h4), _mm256_extractf128_ps(h4, 1)));
}

/* out[m * nr + r] = row n + r of w . input row m, for r < nr (1, 2 or 4), m < mr (1 to 4; 5 to 8
 * with nr <= 2). Inlined with constant nr, mr: the loops unroll and the nr x mr accumulators
 * (16 at most) stay in registers with the unpacked codes. Per 4
 * groups a weight row's codes are unpacked and its scales widened once for the mr inputs, an
 * input's codes and scales loaded once for the nr rows: the codes' term s d sum code q only;
 * the terms of -8 d sum q and of the zeros, s (-8 d sum q) + z sum x, once per 8 groups after
 * (`qrow.ext` against the interleaved s, z: one FMA a row pair), into the same accumulators. */
static inline __attribute__((always_inline)) void tile(const q4mat *w, int64_t n, const qrow *a,
                                                       const int nr, const int mr, float *out) {
    const int64_t groups = w->k / GROUP, half = w->k / 2, sstride = w->gp * 2;
    const uint8_t *c = w->codes + n * half;
    const uint16_t *sz = w->sz + n * sstride;
    const __m512i s_at = _mm512_loadu_si512((const void *)S_AT);
    const __m512i nib = _mm512_set1_epi8(0x0F);
    __m512 acc[4][8];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 4) {
        const int64_t left = groups - g;
        const __mmask64 mask = left >= 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * left)) - 1);
        __m512i lo[4], hi[4];
        __m512 sv[4];
        for (int r = 0; r < nr; r++) {
            const __m512i v = _mm512_maskz_loadu_epi8(mask, c + r * half + g * 16);
            lo[r] = _mm512_and_si512(v, nib);
            hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            const __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(sz + r * sstride + 2 * g)));
            sv[r] = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(UPPER_HALVES, s_at, raw));
        }
        for (int m = 0; m < mr; m++) {
            const __m512i xe = _mm512_load_si512((const void *)(a[m].xe + g * 16));
            const __m512i xo = _mm512_load_si512((const void *)(a[m].xo + g * 16));
            const __m512 d4 = _mm512_load_ps(a[m].d4 + g * 4);
            for (int r = 0; r < nr; r++) {
                /* vpdpbusd: the unsigned codes (0..15) times the signed activations, 4 products
                 * summed into each int32 lane: exact */
                __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], xe);
                isum = _mm512_dpbusd_epi32(isum, hi[r], xo);
                acc[r][m] = _mm512_fmadd_ps(sv[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), d4), acc[r][m]);
            }
        }
    }
    /* 8 groups a vector: s, z of a row (16 bf16 widened, masked past its gp groups) against the
     * input's -8 d sum q, sum x (zero past its groups) */
    for (int64_t g = 0; g < groups; g += 8) {
        const int64_t left = w->gp - g;
        const __mmask16 mask = left >= 8 ? (__mmask16)0xFFFF : (__mmask16)((1u << (2 * left)) - 1);
        __m512 szf[4];
        for (int r = 0; r < nr; r++)
            szf[r] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, sz + r * sstride + 2 * g)), 16));
        for (int m = 0; m < mr; m++) {
            const __m512 e = _mm512_load_ps(a[m].ext + 2 * g);
            for (int r = 0; r < nr; r++) acc[r][m] = _mm512_fmadd_ps(szf[r], e, acc[r][m]);
        }
    }
    for (int m = 0; m < mr; m++) {
        if (nr == 4) { /* four horizontal sums at once, as dots4 */
            __m256 h[4];
            for (int r = 0; r < 4; r++)
                h[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][m]), _mm512_extractf32x8_ps(acc[r][m], 1));
            const __m256 h4 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
            _mm_storeu_ps(out + m * 4, _mm_add_ps(_mm256_castps256_ps128(h4), _mm256_extractf128_ps(h4, 1)));
        } else if (nr == 2) { /* two rows of a block of 4, each summed in nr == 4's order */
            const __m256 h0 = _mm256_add_ps(_mm512_castps512_ps256(acc[0][m]), _mm512_extractf32x8_ps(acc[0][m], 1));
            const __m256 h1 = _mm256_add_ps(_mm512_castps512_ps256(acc[1][m]), _mm512_extractf32x8_ps(acc[1][m], 1));
            const __m256 h01 = _mm256_hadd_ps(h0, h1);
            const __m256 h2 = _mm256_hadd_ps(h01, h01); /* [r0 r1 r0 r1 | r0 r1 r0 r1] */
            const __m128 t = _mm_add_ps(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1));
            out[m * 2] = _mm_cvtss_f32(t);
            out[m * 2 + 1] = _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1));
        } else {
            for (int r = 0; r < nr; r++) out[m * nr + r] = _mm512_reduce_add_ps(acc[r][m]);
        }
    }
}

/* weight rows a thread takes at a time in `gemm` (their codes stay in L1 / L2 while every
 * block of 4 input rows passes over them) */
#define GEMM_CHUNK 32

/* y[m0 + m, n0 + r] = o[m * nr + r] + bias, rounded to bf16 */
static inline void store_tile(const q4mat *w, const float *o, int64_t n0, int nr, int64_t m0, int64_t mr,
                              float *y) {
    for (int r = 0; r < nr; r++) {
        const float b = w->bias != NULL ? bf16_to_f32(w->bias[n0 + r]) : 0.0f;
        for (int64_t m = 0; m < mr; m++) y[(m0 + m) * w->n + n0 + r] = rbf(o[m * nr + r] + b);
    }
}

/* y [rows, n] (floats rounded to bf16) = the quantized rows times w^T (+ bias), rows >= 2. The
 * input rows go in blocks of up to 8: a block of 1 to 4 meets each block of 4 weight rows in one
 * tile; 5 to 8 (a speculative verify step of one request at k = 4..7, an odd batch) in two tiles
 * of 2 weight rows, each weight vector unpacked once for all of them where 4 + the rest unpacked
 * it twice (intel-amx, 2 threads, interleaved A/B, medians of 15: 5 rows 6-12% faster, the
 * lm_head's [49152 x 576] 1.41 -> 1.25 ms, [1536 x 576] 53 -> 49 us; 6 rows 3-9%; 8 and 16 rows
 * 0-5%). Every tile
 * shape runs a (weight row, input row) sum in the same order, reduced in the order of the weight
 * row's position (a block of 4, or a tail row alone): a row's bits do not depend on the others. */
static void gemm(const q4mat *w, const qrow *a, int64_t rows, float *y, int threads) {
    const int64_t n = w->n, chunks = (n + GEMM_CHUNK - 1) / GEMM_CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t ch = 0; ch < chunks; ch++) {
        const int64_t n_hi = n < (ch + 1) * GEMM_CHUNK ? n : (ch + 1) * GEMM_CHUNK;
        for (int64_t m0 = 0; m0 < rows;) {
            const int64_t mr = rows - m0 < 8 ? rows - m0 : 8;
            for (int64_t n0 = ch * GEMM_CHUNK; n0 < n_hi;) {
                const int nr = n_hi - n0 >= 4 ? 4 : 1;
                float o[32];
                switch (nr * 16 + (int)mr) { /* constant shapes: `tile` inlined for each */
                case 68: tile(w, n0, a + m0, 4, 4, o); break;
                case 67: tile(w, n0, a + m0, 4, 3, o); break;
                case 66: tile(w, n0, a + m0, 4, 2, o); break;
                case 65: tile(w, n0, a + m0, 4, 1, o); break;
                case 72: tile(w, n0, a + m0, 2, 8, o); tile(w, n0 + 2, a + m0, 2, 8, o + 16); break;
                case 71: tile(w, n0, a + m0, 2, 7, o); tile(w, n0 + 2, a + m0, 2, 7, o + 16); break;
                case 70: tile(w, n0, a + m0, 2, 6, o); tile(w, n0 + 2, a + m0, 2, 6, o + 16); break;
                case 69: tile(w, n0, a + m0, 2, 5, o); tile(w, n0 + 2, a + m0, 2, 5, o + 16); break;
                case 24: tile(w, n0, a + m0, 1, 8, o); break;
                case 23: tile(w, n0, a + m0, 1, 7, o); break;
                case 22: tile(w, n0, a + m0, 1, 6, o); break;
                case 21: tile(w, n0, a + m0, 1, 5, o); break;
                case 20: tile(w, n0, a + m0, 1, 4, o); break;
                case 19: tile(w, n0, a + m0, 1, 3, o); break;
                case 18: tile(w, n0, a + m0, 1, 2, o); break;
                default: tile(w, n0, a + m0, 1, 1, o); break;
                }
                if (nr == 4 && mr > 4) { /* two tiles of 2 weight rows */
                    store_tile(w, o, n0, 2, m0, mr, y);
                    store_tile(w, o + 16, n0 + 2, 2, m0, mr, y);
                } else {
                    store_tile(w, o, n0, nr, m0, mr, y);
                }
                n0 += nr;
            }
            m0 += mr;
        }
    }
}
#define HAVE_DOTS4 1
#else
#define HAVE_DOTS4 0
#endif

#if !HAVE_DOTS4 && defined(__AVX2__) && defined(__FMA__)
/* AVX2 without AVX512-VNNI (the x86-avx2 kind): dots4's arithmetic 8 lanes (2 groups) at a
 * time. `vpmaddubsw` multiplies the unsigned codes (0..15) by the signed activations and adds
 * pairs into int16 (at most 2 * 15 * 127: exact, no saturation), `vpmaddwd` by ones sums 4
 * products into each int32 lane, the layout `vpdpbusd` gives; each lane then meets its group's
 * d, s, z and a quarter of its sums as in dots4. The plain loops ran the embedded model's
 * single stream at 38 tok/s on an AMD EPYC without AVX-512 (2 threads). */
#define HAVE_DOTS4_AVX2 1

/* out[0..4) = rows n .. n + 3 of w . one quantized input row */
static void dots4_avx2(const q4mat *w, int64_t n, const qrow *a, float *out) {
    const int64_t groups = w->k / GROUP, half = w->k / 2, sstride = w->gp * 2;
    const uint8_t *c = w->codes + n * half;
    const uint16_t *sz = w->sz + n * sstride;
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i s_at = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    const __m256i z_at = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g += 2) {
        /* an odd last group: its 16 code bytes alone (the next 16 are another row's, or past
         * the matrix); the activations, d and sums past `groups` are zero (`quantize_row`) */
        const int last = groups - g < 2;
        const __m256i xe = _mm256_load_si256((const __m256i *)(a->xe + g * 16));
        const __m256i xo = _mm256_load_si256((const __m256i *)(a->xo + g * 16));
        const __m256 d4 = _mm256_load_ps(a->d4 + g * 4);
        const __m256 q8 = _mm256_load_ps(a->q8sum4 + g * 4);
        const __m256 sum4 = _mm256_load_ps(a->sum4 + g * 4);
        const uint8_t *next = c + 4 * half + g * 64; /* the next block of rows, as dots4 */
        _mm_prefetch((const char *)next, _MM_HINT_T0);
        _mm_prefetch((const char *)(next + 64), _MM_HINT_T0);
        for (int r = 0; r < 4; r++) {
            const uint8_t *cr = c + r * half + g * 16;
            const __m256i v = last ? _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                             _mm_loadu_si128((const __m128i *)cr), 0)
                                   : _mm256_loadu_si256((const __m256i *)cr);
            const __m256i lo = _mm256_and_si256(v, nib);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
            const __m256i isum = _mm256_madd_epi16(pairs, ones);
            /* s, z of groups g and g + 1 (zero padded past the groups: gp >= groups + 1 here) */
            const __m128i raw = _mm_loadl_epi64((const __m128i *)(sz + r * sstride + 2 * g));
            const __m256 f = _mm256_castps128_ps256(_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(raw), 16)));
            const __m256 sv = _mm256_permutevar8x32_ps(f, s_at), zv = _mm256_permutevar8x32_ps(f, z_at);
            acc[r] = _mm256_fmadd_ps(sv, _mm256_fmsub_ps(_mm256_cvtepi32_ps(isum), d4, q8), acc[r]);
            acc[r] = _mm256_fmadd_ps(zv, sum4, acc[r]);
        }
    }
    /* four horizontal sums at once: pairs of rows, then lanes, then halves */
    const __m256 h4 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h4), _mm256_extractf128_ps(h4, 1)));
}
#else
#define HAVE_DOTS4_AVX2 0
#endif

/* y [rows, n] (floats rounded to bf16) = the quantized rows times w^T (+ bias). `invariant`
 * (deterministic mode): one row through `gemm`'s tiles too, so a row's bits are the same at
 * every row count (the single-stream `dots4` accumulates in another order: ~18% more time for a
 * one-row step of the embedded model, intel-amx) */
static void gemv(const q4mat *w, const qrow *a, int64_t rows, float *y, int threads, int invariant) {
    const int64_t n = w->n;
#if HAVE_DOTS4
    if (rows == 1 && n % 4 == 0 && !invariant) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < n; r += 4) {
            float o[4];
            dots4(w, r, a, o);
            for (int j = 0; j < 4; j++)
                y[r + j] = rbf(o[j] + (w->bias != NULL ? bf16_to_f32(w->bias[r + j]) : 0.0f));
        }
    } else {
        gemm(w, a, rows, y, threads);
    }
#else
#if HAVE_DOTS4_AVX2
    if (n % 4 == 0) { /* each block of 4 weight rows stays in L1 while every input passes */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < n; r += 4)
            for (int64_t m = 0; m < rows; m++) {
                float o[4];
                dots4_avx2(w, r, &a[m], o);
                for (int j = 0; j < 4; j++)
                    y[m * n + r + j] = rbf(o[j] + (w->bias != NULL ? bf16_to_f32(w->bias[r + j]) : 0.0f));
            }
        return;
    }
#endif
    (void)invariant; /* every row by itself on these paths */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) {
        const float b = w->bias != NULL ? bf16_to_f32(w->bias[r]) : 0.0f;
        for (int64_t m = 0; m < rows; m++) y[m * n + r] = rbf(row_dot(w, r, &a[m]) + b);
    }
#endif
}

static int check_mat(const q4mat *w) {
    return w->codes != NULL && w->sz != NULL && w->k % GROUP == 0 && w->n > 0 &&
           w->gp >= round_up(w->k / GROUP, 4) && w->gp % 4 == 0;
}

/* the int4 GEMV alone: x bf16 [rows, k] (rows x_stride apart) -> out bf16 [rows, n] */
int int4_gemv_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *codes, const uint16_t *sz,
                   const uint16_t *bias, uint16_t *out, int64_t rows, int64_t n, int64_t k, int64_t gp,
                   int threads, int invariant) {
    const q4mat w = {codes, sz, bias, n, k, gp};
    if (!check_mat(&w)) return 9;
    if (rows < 1) return 9;
    qrow *a = qrows_new(rows, k);
    float *xf = malloc((size_t)k * sizeof(float));
    float *y = malloc((size_t)(rows * n) * sizeof(float));
    int ok = xf != NULL && y != NULL && a != NULL;
    if (ok) {
        for (int64_t m = 0; m < rows; m++) {
            for (int64_t i = 0; i < k; i++) xf[i] = bf16_to_f32(x[m * x_stride + i]);
            quantize_row(xf, k, &a[m]);
        }
        gemv(&w, a, rows, y, threads, invariant);
        for (int64_t i = 0; i < rows * n; i++) out[i] = f32_to_bf16(y[i]);
    }
    qrows_free(a);
    free(xf);
    free(y);
    return ok ? 0 : 3;
}

/* one decoder layer's weights and KV pools */
typedef struct {
    q4mat qkv, o, gate_up, down;
    const uint16_t *in_norm, *post_norm; /* [h] */
    const uint16_t *q_norm, *k_norm;     /* [d] each, or NULL (no q/k norm) */
    uint16_t *k_pool, *v_pool;           /* [num_rows, kvh, d], rows row_stride apart */
} layer_w;

/* h[i] = bf16(bf16(silu(g[i])) * u[i]) for n values (g, u already bf16 values) */
static void silu_mul(const float *g, const float *u, float *h, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        /* -g at most 80: 1 + e^-g stays a normal float (quant.c's reason) */
        const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(80.0f)));
        const __m512 sg = rbf16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        _mm512_storeu_ps(h + i, rbf16(_mm512_mul_ps(sg, _mm512_loadu_ps(u + i))));
    }
#endif
    for (; i < n; i++) h[i] = rbf(rbf(g[i] / (1.0f + expf(-g[i]))) * u[i]);
}

/* The decoder layers of `rows` decode tokens: x [rows, h] bf16 (the embeddings) is the residual
 * stream, updated in place; out [rows, h] its final RMSNorm. cos / sin [rows, d] (the tokens'
 * positions already looked up), out_loc [rows] the pool rows their K / V go to; attention reads
 * pool rows indices[indptr[b] + l], l < lens[b] (decode_attention.c's paged kernel). */
int decode_layers_bf16(const layer_w *layers, int64_t num_layers, uint16_t *x, const uint16_t *final_norm,
                       uint16_t *out, const uint16_t *cos, const uint16_t *sin, const int64_t *out_loc,
                       const int64_t *indices, int64_t num_indices, const int64_t *indptr,
                       const int64_t *lens, int64_t rows, int64_t h, int64_t nh, int64_t kvh,
                       int64_t d, int64_t inter, int64_t num_rows, int64_t row_stride, int64_t window,
                       float eps, int threads, int invariant) {
    if (rows < 1 || d > MAX_D || d % 2 || nh % kvh) return 9;
    for (int64_t l = 0; l < num_layers; l++) {
        const layer_w *L = &layers[l];
        if (!check_mat(&L->qkv) || !check_mat(&L->o) || !check_mat(&L->gate_up) || !check_mat(&L->down))
            return 9;
        if (L->qkv.k != h || L->qkv.n != (nh + 2 * kvh) * d || L->o.k != nh * d || L->o.n != h ||
            L->gate_up.k != h || L->gate_up.n != 2 * inter || L->down.k != inter || L->down.n != h)
            return 9;
    }
    for (int64_t m = 0; m < rows; m++)
        if (out_loc[m] < 0 || out_loc[m] >= num_rows) return 4;
    const int64_t qn = nh * d, kvn = kvh * d, nqkv = qn + 2 * kvn;
    int64_t kmax = h > qn ? h : qn;
    kmax = kmax > inter ? kmax : inter;
    int64_t ymax = nqkv > 2 * inter ? nqkv : 2 * inter;
    qrow *a = qrows_new(rows, kmax);
    float *xf = malloc((size_t)(rows * h) * sizeof(float));
    float *hb = malloc((size_t)(rows * kmax) * sizeof(float)); /* a row's norm or SiLU x up */
    float *y = malloc((size_t)(rows * ymax) * sizeof(float));
    uint16_t *qb = malloc((size_t)(rows * qn) * sizeof(uint16_t));
    uint16_t *ob = malloc((size_t)(rows * qn) * sizeof(uint16_t));
    int rc = (xf && hb && y && qb && ob && a) ? 0 : 3;
    const float scale = 1.0f / sqrtf((float)d);
    for (int64_t i = 0; rc == 0 && i < rows * h; i++) xf[i] = bf16_to_f32(x[i]);
    for (int64_t l = 0; rc == 0 && l < num_layers; l++) {
        const layer_w *L = &layers[l];
        /* attention: norm, QKV, q / k norms, RoPE, KV store */
        ROWS_PARALLEL
        for (int64_t m = 0; m < rows; m++) {
            rms_norm(xf + m * h, L->in_norm, eps, h, hb + m * kmax);
            quantize_row(hb + m * kmax, h, &a[m]);
        }
        gemv(&L->qkv, a, rows, y, threads, invariant);
        ROWS_PARALLEL
        for (int64_t m = 0; m < rows; m++)
            heads_to_pool(y + m * nqkv, L->q_norm, L->k_norm, eps, cos + m * d, sin + m * d, nh, kvh,
                          d, qb + m * qn, L->k_pool + out_loc[m] * row_stride,
                          L->v_pool + out_loc[m] * row_stride);
        rc = decode_attention_bf16_paged(qb, L->k_pool, L->v_pool, ob, indices, num_indices, indptr,
                                         lens, rows, kvh, nh / kvh, d, num_rows, d, row_stride, d,
                                         row_stride, window, scale, threads);
        if (rc != 0) break;
        /* o_proj and the residual */
        ROWS_PARALLEL
        for (int64_t m = 0; m < rows; m++) {
            float *hm = hb + m * kmax;
            for (int64_t i = 0; i < qn; i++) hm[i] = bf16_to_f32(ob[m * qn + i]);
            quantize_row(hm, qn, &a[m]);
        }
        gemv(&L->o, a, rows, y, threads, invariant);
        /* the residual, then the MLP: norm, gate / up, SiLU x up, down, the residual */
        ROWS_PARALLEL
        for (int64_t m = 0; m < rows; m++) {
            for (int64_t i = m * h; i < (m + 1) * h; i++) xf[i] = rbf(xf[i] + y[i]);
            rms_norm(xf + m * h, L->post_norm, eps, h, hb + m * kmax);
            quantize_row(hb + m * kmax, h, &a[m]);
        }
        gemv(&L->gate_up, a, rows, y, threads, invariant);
        ROWS_PARALLEL
        for (int64_t m = 0; m < rows; m++) {
            const float *g = y + m * 2 * inter;
            silu_mul(g, g + inter, hb + m * kmax, inter);
            quantize_row(hb + m * kmax, inter, &a[m]);
        }
        gemv(&L->down, a, rows, y, threads, invariant);
        ROWS_PARALLEL
        for (int64_t i = 0; i < rows * h; i++) xf[i] = rbf(xf[i] + y[i]);
    }
    if (rc == 0) {
        ROWS_PARALLEL
        for (int64_t m = 0; m < rows; m++) {
            float *hm = hb + m * kmax;
            rms_norm(xf + m * h, final_norm, eps, h, hm);
            for (int64_t i = 0; i < h; i++) {
                out[m * h + i] = f32_to_bf16(hm[i]);
                x[m * h + i] = f32_to_bf16(xf[m * h + i]);
            }
        }
    }
    qrows_free(a);
    free(xf);
    free(hb);
    free(y);
    free(qb);
    free(ob);
    return rc;
}
