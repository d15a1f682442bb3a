/* The per-row work of a decoder layer that both C decode steps share (decode_step.c: int4,
 * decode_step_w8a8.c: w8a8), rounded as the model's eager bf16 ops round it
 * (models/layers.py): RMSNorm normalised in fp32, rounded, times the weight, rounded; RoPE's
 * two products and their sum each rounded; the heads' K / V stored as bf16 into the pool. */
#ifndef MINISGL_ROWOPS_H
#define MINISGL_ROWOPS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"

static inline float rbf(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(__AVX512F__)
/* 16 floats rounded to bf16 (nearest even, as f32_to_bf16) and widened back */
static inline __m512 rbf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* 16 bf16 at p widened to floats (exact) */
static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* the first `keep` of 16 floats already rounded (rbf16) stored as bf16: their upper halves */
static inline void bf16x16_store(uint16_t *p, __m512 v, __mmask16 keep) {
    _mm256_mask_storeu_epi16(p, keep,
                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
#endif

static inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* out = bf16(w * bf16(x / sqrt(mean(x^2) + eps))), x already bf16 values */
static void rms_norm(const float *x, const uint16_t *w, float eps, int64_t n, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = rbf(bf16_to_f32(w[i]) * rbf(x[i] * r));
}

/* head of d values in place: q * cos + swap_halves(q) * sin (sin signed, as the model's table) */
static void rope(float *q, const uint16_t *cos, const uint16_t *sin, int64_t d) {
    float t[MAX_D];
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        const float sw = q[i < half ? i + half : i - half];
        t[i] = rbf(rbf(q[i] * bf16_to_f32(cos[i])) + rbf(sw * bf16_to_f32(sin[i])));
    }
    memcpy(q, t, (size_t)d * sizeof(float));
}

/* One token's QKV output y (nh + 2 kvh heads of d, bf16 values as floats, changed in place):
 * q and k normed per head (q_norm / k_norm, NULL: none) and rotated at the token's cos / sin,
 * q stored to qb, k and v to the pool rows kr, vr (bf16). */
static void heads_to_pool(float *y, const uint16_t *q_norm, const uint16_t *k_norm, float eps,
                                 const uint16_t *cos, const uint16_t *sin, int64_t nh, int64_t kvh,
                                 int64_t d, uint16_t *qb, uint16_t *kr, uint16_t *vr) {
    const int64_t qn = nh * d, kvn = kvh * d;
    for (int64_t hd = 0; hd < nh + kvh; hd++) {
        float *head = y + hd * d;
        if (q_norm != NULL) {
            float t[MAX_D];
            rms_norm(head, hd < nh ? q_norm : k_norm, eps, d, t);
            memcpy(head, t, (size_t)d * sizeof(float));
        }
        rope(head, cos, sin, d);
    }
    for (int64_t i = 0; i < qn; i++) qb[i] = f32_to_bf16(y[i]);
    for (int64_t i = 0; i < kvn; i++) {
        kr[i] = f32_to_bf16(y[qn + i]);
        vr[i] = f32_to_bf16(y[qn + kvn + i]);
    }
}

/* the paged decode attention kernel (decode_attention.c) */
int decode_attention_bf16_paged(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                const int64_t *indices, int64_t num_indices, const int64_t *indptr,
                                const int64_t *lens, int64_t bs, int64_t kvh, int64_t gqa, int64_t d,
                                int64_t num_rows, int64_t k_sh, int64_t k_sl, int64_t v_sh,
                                int64_t v_sl, int64_t window, float scale, int threads);

/* the per-row work between the GEMMs (norms, quantization, RoPE, SiLU): rows split over the
 * threads from 4 rows (fewer: not worth a fork) */
#define ROWS_PARALLEL _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows >= 4)")

#endif
