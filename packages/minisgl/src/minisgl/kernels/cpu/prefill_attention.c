/* Prefill attention on a CPU, read in place from the KV pool: for a step's short requests.
 *
 * q, out [T, kvh, gqa, d]   contiguous (a step's new tokens; gqa query heads per KV head)
 * k, v   [rows, kvh, d]     the KV pool: strides over rows and heads, d contiguous
 * Request r's new tokens are q rows [q_starts[r], q_starts[r] + q_lens[r]); its keys are pool
 * rows indices[kv_starts[r] + l], l < kv_lens[r] (cached prefix first, its new tokens last).
 * Its token i (from 0) attends to positions [max(0, e - window), e), e = kv_lens[r] - q_lens[r]
 * + i + 1 (window <= 0: all). Rows of out that no request names are not written.
 *
 * One task per (request, KV head, block of up to ROWS / gqa tokens): the block's query rows
 * share every K / V row, widened to fp32 once a task into tiles of KB keys (K transposed; tiles
 * start at multiples of KB, so a query's tiles do not depend on the block it is in); the
 * scores of RB rows x 2 * LW keys are RB * 2 vector accumulators over d (no horizontal sums),
 * an online softmax runs over the tiles as in flash attention, and the weighted sum takes RB
 * rows x LW lanes at a time. As in the decode kernel and SDPA's flash kernel, unnormalised
 * probabilities enter the weighted sum rounded to the element type; their sums stay fp32.
 * d is padded to a multiple of LW with zeros inside the tiles, so every head_dim takes the
 * same loops: plain C of fixed widths, vectorized by the compiler (-O3 -march=native).
 * Built with -ffast-math: nothing relies on inf or NaN (the running max starts at -FLT_MAX).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "spans.h"

#define ROWS 64 /* query rows of a task at most (whole tokens: ROWS / gqa of them) */
#define KB 128  /* keys of a tile */
#define RB 8    /* query rows of a score / weighted-sum block */
#define LW 16   /* lanes of a vector */

typedef struct {
    float *q;   /* [ROWS][dp], scaled */
    float *acc; /* [ROWS][dp] */
    float *kt;  /* [dp][KB]: K transposed */
    float *vf;  /* [KB][dp] */
    float *s;   /* [ROWS][KB]: scores, then probabilities */
    float m[ROWS], sum[ROWS];
} scratch;

static int scratch_alloc(scratch *w, int64_t dp) {
    w->q = calloc((size_t)(ROWS * dp), sizeof(float));
    w->acc = calloc((size_t)(ROWS * dp), sizeof(float));
    w->kt = calloc((size_t)(dp * KB), sizeof(float)); /* rows d..dp stay zero */
    w->vf = calloc((size_t)(KB * dp), sizeof(float)); /* columns d..dp stay zero */
    w->s = calloc((size_t)(ROWS * KB), sizeof(float));
    return w->q && w->acc && w->kt && w->vf && w->s;
}

static void scratch_free(scratch *w) {
    free(w->q);
    free(w->acc);
    free(w->kt);
    free(w->vf);
    free(w->s);
}

/* portable: s[g][l] = q[g] . kt[:, l] for RB rows and l < nk (a multiple of 2 * LW) */
static void block_scores(const float *q, const float *kt, float *s, int64_t dp, int64_t nk,
                         int rows) {
    (void)rows; /* RB rows: the vector path skips the padding */
    for (int64_t l0 = 0; l0 < nk; l0 += 2 * LW) {
        float a[RB][2 * LW] = {{0}};
        for (int64_t c = 0; c < dp; c++) {
            const float *kc = kt + c * KB + l0;
            for (int g = 0; g < RB; g++) {
                const float qc = q[g * dp + c];
                for (int j = 0; j < 2 * LW; j++) a[g][j] += qc * kc[j];
            }
        }
        for (int g = 0; g < RB; g++) memcpy(s + g * KB + l0, a[g], sizeof a[g]);
    }
}

/* portable: acc[g] += sum over l < n of p[g][l] * vf[l] for RB rows */
static void block_weighted(const float *p, const float *vf, float *acc, int64_t dp, int64_t n,
                           int rows) {
    (void)rows;
    for (int64_t c0 = 0; c0 < dp; c0 += LW) {
        float a[RB][LW];
        for (int g = 0; g < RB; g++) memcpy(a[g], acc + g * dp + c0, sizeof a[g]);
        for (int64_t l = 0; l < n; l++) {
            const float *vl = vf + l * dp + c0;
            for (int g = 0; g < RB; g++) {
                const float pg = p[g * KB + l];
                for (int j = 0; j < LW; j++) a[g][j] += pg * vl[j];
            }
        }
        for (int g = 0; g < RB; g++) memcpy(acc + g * dp + c0, a[g], sizeof a[g]);
    }
}

#if defined(__AVX512F__)
/* block_scores on explicit vectors: `rows` (<= RB) x 2 accumulators in registers; each row's
 * sums are its own, the same whatever `rows` (a decode token has gqa rows, not RB) */
static inline __attribute__((always_inline)) void scores_rows(const float *q, const float *kt,
                                                              float *s, int64_t dp, int64_t nk,
                                                              const int rows) {
    for (int64_t l0 = 0; l0 < nk; l0 += 2 * LW) {
        __m512 a[RB][2];
        for (int g = 0; g < rows; g++) a[g][0] = a[g][1] = _mm512_setzero_ps();
        for (int64_t c = 0; c < dp; c++) {
            const __m512 k0 = _mm512_loadu_ps(kt + c * KB + l0);
            const __m512 k1 = _mm512_loadu_ps(kt + c * KB + l0 + LW);
            for (int g = 0; g < rows; g++) {
                const __m512 qc = _mm512_set1_ps(q[g * dp + c]);
                a[g][0] = _mm512_fmadd_ps(qc, k0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(qc, k1, a[g][1]);
            }
        }
        for (int g = 0; g < rows; g++) {
            _mm512_storeu_ps(s + g * KB + l0, a[g][0]);
            _mm512_storeu_ps(s + g * KB + l0 + LW, a[g][1]);
        }
    }
}

/* block_weighted on explicit vectors: `rows` (<= RB) x 2 * LW lanes of accumulators */
static inline __attribute__((always_inline)) void weighted_rows(const float *p, const float *vf,
                                                                float *acc, int64_t dp, int64_t n,
                                                                const int rows) {
    for (int64_t c0 = 0; c0 < dp; c0 += 2 * LW) {
        const int two = c0 + 2 * LW <= dp; /* else one chunk of LW lanes */
        __m512 a[RB][2];
        for (int g = 0; g < rows; g++) {
            a[g][0] = _mm512_loadu_ps(acc + g * dp + c0);
            a[g][1] = two ? _mm512_loadu_ps(acc + g * dp + c0 + LW) : _mm512_setzero_ps();
        }
        for (int64_t l = 0; l < n; l++) {
            const __m512 v0 = _mm512_loadu_ps(vf + l * dp + c0);
            const __m512 v1 = two ? _mm512_loadu_ps(vf + l * dp + c0 + LW) : _mm512_setzero_ps();
            for (int g = 0; g < rows; g++) {
                const __m512 pg = _mm512_set1_ps(p[g * KB + l]);
                a[g][0] = _mm512_fmadd_ps(pg, v0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(pg, v1, a[g][1]);
            }
        }
        for (int g = 0; g < rows; g++) {
            _mm512_storeu_ps(acc + g * dp + c0, a[g][0]);
            if (two) _mm512_storeu_ps(acc + g * dp + c0 + LW, a[g][1]);
        }
    }
}

/* the two above with a constant row count each (the loops unroll, the accumulators stay in
 * registers) */
#define ROWS_SWITCH(CALL)                                                                       \
    switch (rows) {                                                                             \
    case 1: CALL(1); break;                                                                     \
    case 2: CALL(2); break;                                                                     \
    case 3: CALL(3); break;                                                                     \
    case 4: CALL(4); break;                                                                     \
    case 5: CALL(5); break;                                                                     \
    case 6: CALL(6); break;                                                                     \
    case 7: CALL(7); break;                                                                     \
    default: CALL(RB); break;                                                                   \
    }

static void block_scores_v(const float *q, const float *kt, float *s, int64_t dp, int64_t nk,
                           int rows) {
#define SCORES(R) scores_rows(q, kt, s, dp, nk, R)
    ROWS_SWITCH(SCORES)
#undef SCORES
}

static void block_weighted_v(const float *p, const float *vf, float *acc, int64_t dp, int64_t n,
                             int rows) {
#define WEIGHTED(R) weighted_rows(p, vf, acc, dp, n, R)
    ROWS_SWITCH(WEIGHTED)
#undef WEIGHTED
}
#define VECTOR(d) ((d) % LW == 0)
#else
#define block_scores_v block_scores
#define block_weighted_v block_weighted
#define VECTOR(d) 0
#endif

/* K rows idx[0..n) (head offset `off`, rows `sl` apart) widened into kt[c][KB] (transposed):
 * the same values whatever the path, only the data movement differs */
static void kt_fill_f32(float *kt, const float *k, const int64_t *idx, int64_t n, int64_t sl,
                        int64_t off, int64_t d) {
    for (int64_t l = 0; l < n; l++)
        for (int64_t c = 0; c < d; c++) kt[c * KB + l] = k[idx[l] * sl + off + c];
}

#if defined(__AVX512F__)
/* a 16 x 16 float transpose in registers: r[i] lane j -> r[j] lane i */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    /* r[4b + m] now holds, per 128-bit lane L, column 4L + m' of rows 4b..4b+3 (m' = m order:
     * 0, 1, 2, 3 -> columns 0, 1, 2, 3 of the lane) */
    for (int i = 0; i < 4; i++) {
        const __m512 a = r[i], b = r[4 + i], c = r[8 + i], e = r[12 + i];
        const __m512 ab_lo = _mm512_shuffle_f32x4(a, b, 0x44), ab_hi = _mm512_shuffle_f32x4(a, b, 0xEE);
        const __m512 ce_lo = _mm512_shuffle_f32x4(c, e, 0x44), ce_hi = _mm512_shuffle_f32x4(c, e, 0xEE);
        t[i] = _mm512_shuffle_f32x4(ab_lo, ce_lo, 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(ab_lo, ce_lo, 0xDD);
        t[8 + i] = _mm512_shuffle_f32x4(ab_hi, ce_hi, 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(ab_hi, ce_hi, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}
#endif

static void kt_fill_bf16(float *kt, const uint16_t *k, const int64_t *idx, int64_t n, int64_t sl,
                         int64_t off, int64_t d) {
    int64_t l0 = 0;
#if defined(__AVX512F__)
    if (d % 16 == 0) {
        for (; l0 + 16 <= n; l0 += 16)
            for (int64_t c0 = 0; c0 < d; c0 += 16) {
                __m512 r[16];
                for (int i = 0; i < 16; i++) {
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(k + idx[l0 + i] * sl + off + c0));
                    r[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                }
                transpose16(r);
                for (int j = 0; j < 16; j++) _mm512_storeu_ps(kt + (c0 + j) * KB + l0, r[j]);
            }
    }
#endif
    for (int64_t l = l0; l < n; l++)
        for (int64_t c = 0; c < d; c++) kt[c * KB + l] = bf16_to_f32(k[idx[l] * sl + off + c]);
}

/* one row's scores over tile keys [0, n) -> probabilities, keys outside [lo, hi) zero; the
 * row's running max / sum / accumulator rescaled as in flash attention */
#define DEFINE_ROW_SOFTMAX(NAME, LOAD, STORE)                                                   \
    static void NAME(float *s, int64_t n, int64_t lo, int64_t hi, float *m, float *sum,         \
                     float *acc, int64_t dp) {                                                  \
        if (lo >= hi) {                                                                         \
            memset(s, 0, sizeof(float) * (size_t)n);                                            \
            return;                                                                             \
        }                                                                                       \
        float mx = *m;                                                                          \
        for (int64_t l = lo; l < hi; l++) mx = s[l] > mx ? s[l] : mx;                           \
        float add = 0.0f;                                                                       \
        const int64_t n16 = (n + LW - 1) / LW * LW; /* whole vectors: no scalar expf tail */     \
        for (int64_t l = 0; l < n16; l++) { /* outside [lo, hi): exp of <= 0, then dropped */  \
            const float x = s[l] - mx, p = expf(x < 0.0f ? x : 0.0f);                           \
            const float keep = (l >= lo && l < hi) ? p : 0.0f;                                  \
            add += keep;                                                                        \
            s[l] = LOAD(STORE(keep));                                                           \
        }                                                                                       \
        if (*m != -FLT_MAX && mx != *m) { /* a later tile raised the max: rescale */            \
            const float alpha = expf(*m - mx);                                                  \
            for (int64_t c = 0; c < dp; c++) acc[c] *= alpha;                                   \
            *sum *= alpha;                                                                      \
        }                                                                                       \
        *sum += add;                                                                            \
        *m = mx;                                                                                \
    }

DEFINE_ROW_SOFTMAX(row_softmax_f32, F32_LOAD, F32_STORE)
DEFINE_ROW_SOFTMAX(row_softmax_bf16, bf16_to_f32, f32_to_bf16)

/* the positions [start, end) token i of a request sees */
#define TOKEN_END(i) (prefix + (i) + 1)
#define TOKEN_START(i) (window > 0 && TOKEN_END(i) > window ? TOKEN_END(i) - window : 0)
/* the tile's keys [0, m) that the RB rows from r0 see: up to the block's last token */
#define BLOCK_LAST(r0) (i0 + ((r0) + RB - 1 < nr ? (r0) + RB - 1 : nr - 1) / gqa)
/* the query rows of the block from r0 that exist (the last block of a task may be short) */
#define BLOCK_ROWS(r0) ((int)(nr - (r0) < RB ? nr - (r0) : RB))
#define BLOCK_KEYS(r0)                                                                          \
    (TOKEN_END(BLOCK_LAST(r0)) - t0 < n ? TOKEN_END(BLOCK_LAST(r0)) - t0 : n)

#define DEFINE_TASK(NAME, T, LOAD, STORE, ROW_SOFTMAX, KT_FILL)                                          \
    static void NAME(const T *q, const T *k, const T *v, T *out, const int64_t *idx,            \
                     int64_t q0, int64_t prefix, int64_t i0, int64_t i1, int64_t h, int64_t kvh, \
                     int64_t gqa, int64_t d, int64_t dp, int64_t k_sh, int64_t k_sl,            \
                     int64_t v_sh, int64_t v_sl, int64_t window, float scale, scratch *w) {     \
        const int vec = VECTOR(d);                                                              \
        const int64_t nr = (i1 - i0) * gqa, nrb = (nr + RB - 1) / RB * RB;                      \
        for (int64_t r = 0; r < nr; r++) {                                                      \
            const T *qr = q + ((q0 + i0 + r / gqa) * kvh + h) * gqa * d + (r % gqa) * d;        \
            for (int64_t c = 0; c < d; c++) w->q[r * dp + c] = LOAD(qr[c]) * scale;             \
            memset(w->acc + r * dp, 0, sizeof(float) * (size_t)dp);                             \
            w->m[r] = -FLT_MAX;                                                                 \
            w->sum[r] = 0.0f;                                                                   \
        }                                                                                       \
        memset(w->q + nr * dp, 0, sizeof(float) * (size_t)((nrb - nr) * dp));                   \
        const int64_t ks = TOKEN_START(i0), ke = TOKEN_END(i1 - 1);                             \
        for (int64_t t0 = ks / KB * KB; t0 < ke; t0 += KB) { /* tiles at multiples of KB */   \
            const int64_t n = ke - t0 < KB ? ke - t0 : KB, nk = (n + 2 * LW - 1) / (2 * LW) * 2 * LW; \
            KT_FILL(w->kt, k, idx + t0, n, k_sl, h * k_sh, d);                                  \
            for (int64_t l = 0; l < n; l++) {                                                   \
                const T *vr = v + idx[t0 + l] * v_sl + h * v_sh;                                \
                for (int64_t c = 0; c < d; c++) w->vf[l * dp + c] = LOAD(vr[c]);                \
            }                                                                                   \
            for (int64_t c = 0; c < d; c++)                                                     \
                for (int64_t l = n; l < nk; l++) w->kt[c * KB + l] = 0.0f;                      \
            for (int64_t r0 = 0; r0 < nrb; r0 += RB) {                                          \
                const int64_t m = BLOCK_KEYS(r0);                                               \
                const int64_t mk = m > 0 ? (m + 2 * LW - 1) / (2 * LW) * 2 * LW : 0;            \
                (vec ? block_scores_v : block_scores)(w->q + r0 * dp, w->kt, w->s + r0 * KB, dp, mk, BLOCK_ROWS(r0)); \
            }                                                                                   \
            for (int64_t r = 0; r < nr; r++) {                                                  \
                const int64_t i = i0 + r / gqa, st = TOKEN_START(i), e = TOKEN_END(i);          \
                const int64_t lo = (st > t0 ? st : t0) - t0, hi = (e < t0 + n ? e : t0 + n) - t0; \
                ROW_SOFTMAX(w->s + r * KB, n, lo, hi, &w->m[r], &w->sum[r], w->acc + r * dp, dp); \
            }                                                                                   \
            for (int64_t r = nr; r < nrb; r++) memset(w->s + r * KB, 0, sizeof(float) * KB);    \
            for (int64_t r0 = 0; r0 < nrb; r0 += RB) {                                          \
                const int64_t m = BLOCK_KEYS(r0);                                               \
                (vec ? block_weighted_v : block_weighted)(w->s + r0 * KB, w->vf, w->acc + r0 * dp, dp, m, BLOCK_ROWS(r0)); \
            }                                                                                   \
        }                                                                                       \
        for (int64_t r = 0; r < nr; r++) {                                                      \
            T *orow = out + ((q0 + i0 + r / gqa) * kvh + h) * gqa * d + (r % gqa) * d;          \
            const float inv = 1.0f / w->sum[r];                                                 \
            for (int64_t c = 0; c < d; c++) orow[c] = STORE(w->acc[r * dp + c] * inv);          \
        }                                                                                       \
    }

DEFINE_TASK(task_f32, float, F32_LOAD, F32_STORE, row_softmax_f32, kt_fill_f32)
DEFINE_TASK(task_bf16, uint16_t, bf16_to_f32, f32_to_bf16, row_softmax_bf16, kt_fill_bf16)

#define DEFINE_KERNEL(NAME, T, TASK)                                                            \
    int NAME(const T *q, const T *k, const T *v, T *out, const int64_t *indices,                \
             int64_t num_indices, const int64_t *q_starts, const int64_t *q_lens,               \
             const int64_t *kv_starts, const int64_t *kv_lens, int64_t num_reqs, int64_t num_q, \
             int64_t kvh, int64_t gqa, int64_t d, int64_t num_rows, int64_t k_sh, int64_t k_sl, \
             int64_t v_sh, int64_t v_sl, int64_t window, float scale, int threads) {            \
        if (d > MAX_D || gqa > MAX_GQA) return 1;                                               \
        const int64_t per = ROWS / gqa; /* tokens a task */                                     \
        const int rc = check_spans(indices, num_indices, q_starts, q_lens, kv_starts, kv_lens,  \
                                   num_reqs, num_q, num_rows);                                  \
        if (rc != 0) return rc;                                                                 \
        int64_t ntasks = 0;                                                                     \
        for (int64_t r = 0; r < num_reqs; r++) ntasks += (q_lens[r] + per - 1) / per;           \
        int64_t *blocks = malloc(sizeof(int64_t) * 2 * (size_t)(ntasks > 0 ? ntasks : 1));      \
        if (blocks == NULL) return 3;                                                           \
        for (int64_t r = 0, t = 0; r < num_reqs; r++) /* (request, first token) a block */     \
            for (int64_t i = 0; i < q_lens[r]; i += per, t++) blocks[2 * t] = r, blocks[2 * t + 1] = i; \
        const int64_t dp = (d + LW - 1) / LW * LW;                                              \
        int failed = 0;                                                                         \
        _Pragma("omp parallel num_threads(threads)") {                                         \
            scratch w;                                                                          \
            const int ok = scratch_alloc(&w, dp);                                               \
            if (!ok) {                                                                          \
                _Pragma("omp atomic write") failed = 1;                                         \
            }                                                                                   \
            _Pragma("omp for schedule(dynamic, 1)")                                             \
            for (int64_t t = 0; t < ntasks * kvh; t++) {                                        \
                if (!ok) continue;                                                              \
                const int64_t b = t / kvh, h = t % kvh, r = blocks[2 * b], i0 = blocks[2 * b + 1]; \
                const int64_t i1 = i0 + per < q_lens[r] ? i0 + per : q_lens[r];                \
                TASK(q, k, v, out, indices + kv_starts[r], q_starts[r], kv_lens[r] - q_lens[r], \
                     i0, i1, h, kvh, gqa, d, dp, k_sh, k_sl, v_sh, v_sl, window, scale, &w);    \
            }                                                                                   \
            scratch_free(&w);                                                                   \
        }                                                                                       \
        free(blocks);                                                                           \
        return failed ? 3 : 0;                                                                  \
    }

DEFINE_KERNEL(prefill_attention_f32, float, task_f32)
DEFINE_KERNEL(prefill_attention_bf16, uint16_t, task_bf16)
