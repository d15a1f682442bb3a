/* Decode attention on a CPU: a few query rows per KV head against that head's dense K / V.
 *
 * q    [bs, kvh, gqa, d]   contiguous (the gqa query heads that share a KV head)
 * k, v [bs, kvh, len, d]   any strides over (bs, kvh, len); d contiguous
 * out  [bs, kvh, gqa, d]   contiguous
 * Request b attends to positions [max(0, lens[b] - window), lens[b]) (window <= 0: all).
 * One task per (request, KV head) streams its K and V once for all gqa rows; scores, softmax
 * and the weighted sum are in fp32 (scores in a per-task buffer). As in SDPA's flash kernel,
 * the unnormalised probabilities enter the weighted sum in the element type (bf16: rounded)
 * while their sum stays fp32: a bf16 model decodes the same text through either kernel (with
 * probabilities kept in fp32, the embedded int4 model stopped answering "Paris"). bf16 values
 * are widened / rounded by bit operations (bf16.h), so both types share one body.
 * Built with -ffast-math (vectorized expf and reductions): nothing here relies on inf or NaN.
 *
 * `NAME_paged` reads K and V in place from a KV pool [rows, kvh, d] (strides over rows and
 * heads): request b's keys are pool rows indices[indptr[b] + l] for l < lens[b], so a decode
 * step needs no dense copy of its KV.
 *
 * With AVX-512 and a head_dim that is a multiple of 16 (up to 256), the dot products and the
 * weighted sum run on explicit 512-bit vectors with the query rows in register blocks: each K
 * and V row is widened once per block of rows, the accumulators stay in registers. Elsewhere
 * (no AVX-512, another head_dim) the portable loops run; both sum in fp32, in other orders.
 * The vector path prefetches: V rows while it computes the scores, K rows PF_AHEAD ahead, and
 * the next task's first K rows (a decode batch's KV is cold: 278 -> 192 us a layer at batch
 * 128 x ~40 positions, bf16, 2 threads, 30 layers' KV cycled).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"

/* scores of a task up to this many floats live on the stack, longer ones on the heap */
#define STACK_SCORES 4096

/* softmax of each of the gqa score rows in place: exp(s - max), rounded through the element
 * type; inv[g] = 1 / the fp32 sum */
#define DEFINE_SOFTMAX(NAME, LOAD, STORE)                                                       \
    static void NAME(float *s, int64_t n, int64_t gqa, float *inv) {                            \
        for (int64_t g = 0; g < gqa; g++) {                                                     \
            float *sg = s + g * n, m = sg[0], sum = 0.0f;                                       \
            for (int64_t l = 1; l < n; l++) m = sg[l] > m ? sg[l] : m;                          \
            for (int64_t l = 0; l < n; l++) {                                                   \
                sg[l] = expf(sg[l] - m);                                                        \
                sum += sg[l];                                                                   \
                sg[l] = LOAD(STORE(sg[l]));                                                     \
            }                                                                                   \
            inv[g] = 1.0f / sum;                                                                \
        }                                                                                       \
    }

DEFINE_SOFTMAX(softmax_f32, F32_LOAD, F32_STORE)
DEFINE_SOFTMAX(softmax_bf16, bf16_to_f32, f32_to_bf16)

/* key l of a task: row ROW(rows, l) of its K / V base (rows NULL: rows 0, 1, ... in order) */
#define ROW(rows, l) ((rows) != NULL ? (rows)[l] : (l))

/* one task with the portable loops: q, o [gqa, d]; key l at kb / vb + ROW(rows, l) * stride */
#define DEFINE_TASK(NAME, T, LOAD, STORE, SOFTMAX)                                              \
    static void NAME(const void *q_, const void *kb_, const void *vb_, const int64_t *rows,     \
                     void *o_, int64_t n, int64_t k_sl, int64_t v_sl, int64_t gqa, int64_t d,   \
                     float scale, float *s) {                                                   \
        const T *q = q_, *kb = kb_, *vb = vb_;                                                  \
        T *o = o_;                                                                              \
        float qf[MAX_GQA][MAX_D], acc[MAX_GQA][MAX_D], inv[MAX_GQA];                            \
        for (int64_t g = 0; g < gqa; g++)                                                       \
            for (int64_t i = 0; i < d; i++) qf[g][i] = LOAD(q[g * d + i]) * scale;              \
        for (int64_t l = 0; l < n; l++) {                                                       \
            const T *kr = kb + ROW(rows, l) * k_sl;                                             \
            float kf[MAX_D];                                                                    \
            for (int64_t i = 0; i < d; i++) kf[i] = LOAD(kr[i]);                                \
            for (int64_t g = 0; g < gqa; g++) {                                                 \
                float dot = 0.0f;                                                               \
                _Pragma("omp simd reduction(+ : dot)")                                         \
                for (int64_t i = 0; i < d; i++) dot += qf[g][i] * kf[i];                        \
                s[g * n + l] = dot;                                                             \
            }                                                                                   \
        }                                                                                       \
        SOFTMAX(s, n, gqa, inv);                                                                \
        for (int64_t g = 0; g < gqa; g++)                                                       \
            for (int64_t i = 0; i < d; i++) acc[g][i] = 0.0f;                                   \
        for (int64_t l = 0; l < n; l++) {                                                       \
            const T *vr = vb + ROW(rows, l) * v_sl;                                             \
            float vf[MAX_D];                                                                    \
            for (int64_t i = 0; i < d; i++) vf[i] = LOAD(vr[i]);                                \
            for (int64_t g = 0; g < gqa; g++) {                                                 \
                const float p = s[g * n + l];                                                   \
                _Pragma("omp simd")                                                             \
                for (int64_t i = 0; i < d; i++) acc[g][i] += p * vf[i];                         \
            }                                                                                   \
        }                                                                                       \
        for (int64_t g = 0; g < gqa; g++)                                                       \
            for (int64_t i = 0; i < d; i++) o[g * d + i] = STORE(acc[g][i] * inv[g]);           \
    }

DEFINE_TASK(task_f32, float, F32_LOAD, F32_STORE, softmax_f32)
DEFINE_TASK(task_bf16, uint16_t, bf16_to_f32, f32_to_bf16, softmax_bf16)

typedef void (*task_fn)(const void *, const void *, const void *, const int64_t *, void *,
                        int64_t, int64_t, int64_t, int64_t, int64_t, float, float *);

#if defined(__AVX512F__)
static inline __m512 vload_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 vload_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void vstore_f32(float *p, __m512 x) { _mm512_storeu_ps(p, x); }
static inline void vstore_bf16(uint16_t *p, __m512 x) { /* round to nearest even */
    __m512i u = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

#define PF_AHEAD 16
static inline void prefetch_row(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}
static inline void prefetch_l2(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T1);
}

/* the sums of a[0..4) in the four lanes of one vector */
static inline __m128 reduce4(const __m512 a[4]) {
    /* in each 128-bit lane: [a0, a1] halves summed, then the [a0, a1, a2, a3] sums */
    __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* one task on 512-bit vectors, NC = d / 16 chunks a row, query rows in blocks of RB (the RB x
 * NC accumulators of the weighted sum stay in registers) */
#define DEFINE_TASK_V(NAME, T, VLOAD, VSTORE, SOFTMAX, NC, RB)                                  \
    static void NAME(const void *q_, const void *kb_, const void *vb_, const int64_t *rows,     \
                     void *o_, int64_t n, int64_t k_sl, int64_t v_sl, int64_t gqa, int64_t d,   \
                     float scale, float *s) {                                                   \
        const T *q = q_, *kb = kb_, *vb = vb_;                                                  \
        T *o = o_;                                                                              \
        float inv[MAX_GQA];                                                                     \
        const __m512 sc = _mm512_set1_ps(scale);                                                \
        for (int64_t g0 = 0; g0 < gqa; g0 += RB) {                                              \
            const int64_t gn = gqa - g0 < RB ? gqa - g0 : RB;                                   \
            __m512 qv[RB][NC];                                                                  \
            for (int64_t g = 0; g < RB; g++)                                                    \
                for (int c = 0; c < NC; c++)                                                    \
                    qv[g][c] = g < gn ? _mm512_mul_ps(VLOAD(q + (g0 + g) * d + 16 * c), sc)     \
                                      : _mm512_setzero_ps();                                    \
            int64_t l = 0;                                                                      \
            for (; l + 4 <= n; l += 4) { /* four keys, widened once, reduced together */       \
                __m512 kf[4][NC];                                                               \
                for (int j = 0; j < 4; j++) {                                                   \
                    const T *kr = kb + ROW(rows, l + j) * k_sl;                                 \
                    for (int c = 0; c < NC; c++) kf[j][c] = VLOAD(kr + 16 * c);                 \
                    if (g0 == 0) {                                                              \
                        prefetch_row(vb + ROW(rows, l + j) * v_sl, NC * 16 * sizeof(T));        \
                        if (l + j + PF_AHEAD < n)                                               \
                            prefetch_row(kb + ROW(rows, l + j + PF_AHEAD) * k_sl,               \
                                         NC * 16 * sizeof(T));                                  \
                    }                                                                           \
                }                                                                               \
                for (int64_t g = 0; g < gn; g++) {                                              \
                    __m512 a[4];                                                                \
                    for (int j = 0; j < 4; j++) {                                               \
                        a[j] = _mm512_mul_ps(qv[g][0], kf[j][0]);                               \
                        for (int c = 1; c < NC; c++) a[j] = _mm512_fmadd_ps(qv[g][c], kf[j][c], a[j]); \
                    }                                                                           \
                    _mm_storeu_ps(s + (g0 + g) * n + l, reduce4(a));                            \
                }                                                                               \
            }                                                                                   \
            for (; l < n; l++) {                                                                \
                const T *kr = kb + ROW(rows, l) * k_sl;                                         \
                __m512 kv[NC];                                                                  \
                for (int c = 0; c < NC; c++) kv[c] = VLOAD(kr + 16 * c);                        \
                for (int64_t g = 0; g < gn; g++) {                                              \
                    __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);                                  \
                    for (int c = 1; c < NC; c++) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);       \
                    s[(g0 + g) * n + l] = _mm512_reduce_add_ps(a);                              \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        SOFTMAX(s, n, gqa, inv);                                                                \
        for (int64_t g0 = 0; g0 < gqa; g0 += RB) {                                              \
            const int64_t gn = gqa - g0 < RB ? gqa - g0 : RB;                                   \
            __m512 acc[RB][NC];                                                                 \
            for (int64_t g = 0; g < RB; g++)                                                    \
                for (int c = 0; c < NC; c++) acc[g][c] = _mm512_setzero_ps();                   \
            for (int64_t l = 0; l < n; l++) {                                                   \
                const T *vr = vb + ROW(rows, l) * v_sl;                                         \
                __m512 vv[NC];                                                                  \
                for (int c = 0; c < NC; c++) vv[c] = VLOAD(vr + 16 * c);                        \
                for (int64_t g = 0; g < gn; g++) {                                              \
                    const __m512 p = _mm512_set1_ps(s[(g0 + g) * n + l]);                       \
                    for (int c = 0; c < NC; c++) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]); \
                }                                                                               \
            }                                                                                   \
            for (int64_t g = 0; g < gn; g++) {                                                  \
                const __m512 w = _mm512_set1_ps(inv[g0 + g]);                                   \
                for (int c = 0; c < NC; c++)                                                    \
                    VSTORE(o + (g0 + g) * d + 16 * c, _mm512_mul_ps(acc[g][c], w));             \
            }                                                                                   \
        }                                                                                       \
    }

/* RB x NC accumulators plus NC row chunks within the 32 vector registers */
#define DEFINE_TASKS_V(SUFFIX, T, VLOAD, VSTORE, SOFTMAX)                                       \
    DEFINE_TASK_V(task_v1_##SUFFIX, T, VLOAD, VSTORE, SOFTMAX, 1, 8)                            \
    DEFINE_TASK_V(task_v2_##SUFFIX, T, VLOAD, VSTORE, SOFTMAX, 2, 8)                            \
    DEFINE_TASK_V(task_v4_##SUFFIX, T, VLOAD, VSTORE, SOFTMAX, 4, 4)                            \
    DEFINE_TASK_V(task_v8_##SUFFIX, T, VLOAD, VSTORE, SOFTMAX, 8, 2)                            \
    DEFINE_TASK_V(task_v16_##SUFFIX, T, VLOAD, VSTORE, SOFTMAX, 16, 1)                          \
    static task_fn vector_task_##SUFFIX(int64_t d) {                                            \
        switch (d) {                                                                            \
        case 16: return task_v1_##SUFFIX;                                                       \
        case 32: return task_v2_##SUFFIX;                                                       \
        case 64: return task_v4_##SUFFIX;                                                       \
        case 128: return task_v8_##SUFFIX;                                                      \
        case 256: return task_v16_##SUFFIX;                                                     \
        default: return NULL;                                                                   \
        }                                                                                       \
    }

DEFINE_TASKS_V(f32, float, vload_f32, vstore_f32, softmax_f32)
DEFINE_TASKS_V(bf16, uint16_t, vload_bf16, vstore_bf16, softmax_bf16)
#define VECTOR_TASK(SUFFIX, d) vector_task_##SUFFIX(d)
/* the next task's rows: its first PF_AHEAD K rows into L1, all its K and V rows into L2
 * (`krow` / `vrow(b, h, l)`: the address of K / V row l of (b, h)). A decode step's KV rows lie
 * scattered over the pool (page_size 1: each step appends one row a request, and the free
 * pages come back in any order), every row a DRAM miss: with the L1 prefetch alone 2-4x slower
 * than rows in order; the L2 prefetch of a whole task ahead cut it 29-33% (AMD EPYC, 2
 * threads, 30 layers cold, rows spread over a pool 8x the step's KV: 16 x 192 positions
 * 9.2 -> 6.5 ms, 128 x 80 31.1 -> 20.8 ms), and 4-16% with the rows in order. */
#define PREFETCH_NEXT(t, krow, vrow)                                                            \
    if ((t) < bs * kvh) {                                                                       \
        const int64_t b_ = (t) / kvh, h_ = (t) % kvh, e_ = lens[b_];                            \
        const int64_t s_ = (window > 0 && e_ > window) ? e_ - window : 0;                       \
        const int64_t m_ = e_ - s_ < PF_AHEAD ? e_ - s_ : PF_AHEAD;                             \
        for (int64_t l_ = 0; l_ < m_; l_++) prefetch_row(krow(b_, h_, s_ + l_), d * sizeof(*k)); \
        for (int64_t l_ = m_; l_ < e_ - s_; l_++) prefetch_l2(krow(b_, h_, s_ + l_), d * sizeof(*k)); \
        for (int64_t l_ = 0; l_ < e_ - s_; l_++) prefetch_l2(vrow(b_, h_, s_ + l_), d * sizeof(*v)); \
    }
#else
#define PREFETCH_NEXT(t, krow, vrow)
#define VECTOR_TASK(SUFFIX, d) ((task_fn)NULL)
#endif

/* every (request, KV head) task of a step; `KB(b, h)` / `VB(b, h)` the base of its K / V rows,
 * `ROWS(b)` its row list (NULL: dense), `KROW` / `VROW(b, h, l)` the address of K / V row l */
#define RUN_TASKS(T, SUFFIX, KB, VB, ROWS, KROW, VROW)                                                \
    task_fn task = VECTOR_TASK(SUFFIX, d);                                                      \
    if (task == NULL) task = task_##SUFFIX;                                                     \
    int failed = 0;                                                                             \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                         \
    for (int64_t t = 0; t < bs * kvh; t++) {                                                    \
        const int64_t b = t / kvh, h = t % kvh;                                                 \
        const int64_t end = lens[b];                                                            \
        const int64_t start = (window > 0 && end > window) ? end - window : 0;                 \
        const int64_t n = end - start;                                                          \
        float stack[STACK_SCORES];                                                              \
        float *s = gqa * n <= STACK_SCORES ? stack : malloc(sizeof(float) * (size_t)(gqa * n)); \
        if (s == NULL) {                                                                        \
            _Pragma("omp atomic write") failed = 1;                                             \
            continue;                                                                           \
        }                                                                                       \
        PREFETCH_NEXT(t + 1, KROW, VROW);                                                       \
        const int64_t *rows = ROWS(b);                                                          \
        task(q + t * gqa * d, KB(b, h) + (rows ? 0 : start * k_sl),                             \
             VB(b, h) + (rows ? 0 : start * v_sl), rows ? rows + start : NULL, out + t * gqa * d, \
             n, k_sl, v_sl, gqa, d, scale, s);                                                  \
        if (s != stack) free(s);                                                                \
    }                                                                                           \
    return failed ? 3 : 0;

/* dense: K row l of (b, h) at k + b * k_sb + h * k_sh + l * k_sl */
#define DENSE_KB(b, h) (k + (b) * k_sb + (h) * k_sh)
#define DENSE_VB(b, h) (v + (b) * v_sb + (h) * v_sh)
#define DENSE_ROWS(b) ((const int64_t *)NULL)
#define DENSE_KROW(b, h, l) (DENSE_KB(b, h) + (l) * k_sl)
#define DENSE_VROW(b, h, l) (DENSE_VB(b, h) + (l) * v_sl)
/* paged: K row l of (b, h) at k + indices[indptr[b] + l] * k_sl + h * k_sh (a KV pool) */
#define PAGED_KB(b, h) (k + (h) * k_sh)
#define PAGED_VB(b, h) (v + (h) * v_sh)
#define PAGED_ROWS(b) (indices + indptr[b])
#define PAGED_KROW(b, h, l) (PAGED_KB(b, h) + indices[indptr[b] + (l)] * k_sl)
#define PAGED_VROW(b, h, l) (PAGED_VB(b, h) + indices[indptr[b] + (l)] * v_sl)

#define DEFINE_KERNEL(NAME, T, SUFFIX)                                                          \
    int NAME(const T *q, const T *k, const T *v, T *out, const int64_t *lens, int64_t bs,       \
             int64_t kvh, int64_t gqa, int64_t d, int64_t lmax, int64_t k_sb, int64_t k_sh,     \
             int64_t k_sl, int64_t v_sb, int64_t v_sh, int64_t v_sl, int64_t window,            \
             float scale, int threads) {                                                        \
        if (d > MAX_D || gqa > MAX_GQA) return 1;                                               \
        for (int64_t b = 0; b < bs; b++)                                                        \
            if (lens[b] < 1 || lens[b] > lmax) return 2;                                        \
        RUN_TASKS(T, SUFFIX, DENSE_KB, DENSE_VB, DENSE_ROWS, DENSE_KROW, DENSE_VROW)                        \
    }                                                                                           \
    /* request b's keys: pool rows indices[indptr[b] + l], l < lens[b] <= indptr[b+1] - indptr[b] */ \
    int NAME##_paged(const T *q, const T *k, const T *v, T *out, const int64_t *indices,        \
                     int64_t num_indices, const int64_t *indptr, const int64_t *lens, int64_t bs, \
                     int64_t kvh, int64_t gqa, int64_t d, int64_t num_rows, int64_t k_sh,       \
                     int64_t k_sl, int64_t v_sh, int64_t v_sl, int64_t window, float scale,     \
                     int threads) {                                                             \
        if (d > MAX_D || gqa > MAX_GQA) return 1;                                               \
        for (int64_t b = 0; b < bs; b++) {                                                      \
            if (indptr[b] < 0 || indptr[b + 1] > num_indices) return 5;                         \
            if (lens[b] < 1 || lens[b] > indptr[b + 1] - indptr[b]) return 2;                   \
            for (int64_t l = 0; l < lens[b]; l++)                                               \
                if (indices[indptr[b] + l] < 0 || indices[indptr[b] + l] >= num_rows) return 4; \
        }                                                                                       \
        RUN_TASKS(T, SUFFIX, PAGED_KB, PAGED_VB, PAGED_ROWS, PAGED_KROW, PAGED_VROW)                        \
    }

DEFINE_KERNEL(decode_attention_f32, float, f32)
DEFINE_KERNEL(decode_attention_bf16, uint16_t, bf16)
