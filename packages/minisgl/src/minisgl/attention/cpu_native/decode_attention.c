/* Decode attention on a CPU: a few query rows per KV head against that head's dense K / V.
 *
 * q    [bs, kvh, gqa, d]   contiguous (the gqa query heads that share a KV head)
 * k, v [bs, kvh, len, d]   any strides over (bs, kvh, len); d contiguous
 * out  [bs, kvh, gqa, d]   contiguous
 * Request b attends to positions [max(0, lens[b] - window), lens[b]) (window <= 0: all).
 * One task per (request, KV head) streams its K and V once for all gqa rows; scores, softmax
 * and the weighted sum are in fp32 (scores in a per-task heap buffer). As in SDPA's flash kernel,
 * the unnormalised probabilities enter the weighted sum in the element type (bf16: rounded)
 * while their sum stays fp32: a bf16 model decodes the same text through either kernel (with
 * probabilities kept in fp32, the embedded int4 model stopped answering "Paris"). bf16 values
 * are widened / rounded (to nearest even) by bit operations, so both types share one body.
 * Built with -ffast-math (vectorized expf and reductions): nothing here relies on inf or NaN.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* dst[0..d) = src[0..d) widened to fp32 */
#define LOAD_ROW(dst, src, d, LOAD)                                                             \
    for (int64_t i_ = 0; i_ < (d); i_++) (dst)[i_] = LOAD((src)[i_])

#define MAX_D 256
#define MAX_GQA 16

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                     \
    int NAME(const T *q, const T *k, const T *v, T *out, const int64_t *lens,                   \
             int64_t bs, int64_t kvh, int64_t gqa, int64_t d, int64_t lmax, int64_t k_sb,        \
             int64_t k_sh, int64_t k_sl, int64_t v_sb, int64_t v_sh, int64_t v_sl,               \
             int64_t window, float scale, int threads) {                                        \
        if (d > MAX_D || gqa > MAX_GQA) return 1;                                               \
        int failed = 0;                                                                         \
        for (int64_t b = 0; b < bs; b++)                                                        \
            if (lens[b] < 1 || lens[b] > lmax) return 2;                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t t = 0; t < bs * kvh; t++) {                                                \
            const int64_t b = t / kvh, h = t % kvh;                                             \
            const int64_t end = lens[b];                                                        \
            const int64_t start = (window > 0 && end > window) ? end - window : 0;             \
            const int64_t n = end - start;                                                      \
            const T *kb = k + b * k_sb + h * k_sh + start * k_sl;                               \
            const T *vb = v + b * v_sb + h * v_sh + start * v_sl;                               \
            float *s = malloc(sizeof(float) * (size_t)(gqa * n));                               \
            if (s == NULL) {                                                                    \
                _Pragma("omp atomic write") failed = 1;                                         \
                continue;                                                                       \
            }                                                                                   \
            float qf[MAX_GQA][MAX_D];                                                           \
            float acc[MAX_GQA][MAX_D];                                                          \
            for (int64_t g = 0; g < gqa; g++) {                                                 \
                const T *qr = q + (t * gqa + g) * d;                                            \
                for (int64_t i = 0; i < d; i++) qf[g][i] = LOAD(qr[i]) * scale;                 \
            }                                                                                   \
            for (int64_t l = 0; l < n; l++) {                                                   \
                const T *kr = kb + l * k_sl;                                                    \
                float kf[MAX_D];                                                                \
                LOAD_ROW(kf, kr, d, LOAD);                                                      \
                for (int64_t g = 0; g < gqa; g++) {                                             \
                    float dot = 0.0f;                                                           \
                    _Pragma("omp simd reduction(+ : dot)")                                     \
                    for (int64_t i = 0; i < d; i++) dot += qf[g][i] * kf[i];                    \
                    s[g * n + l] = dot;                                                      \
                }                                                                               \
            }                                                                                   \
            float inv[MAX_GQA];                                                                 \
            for (int64_t g = 0; g < gqa; g++) {                                                 \
                float *sg = s + g * n, m = sg[0], sum = 0.0f;                                   \
                for (int64_t l = 1; l < n; l++) m = sg[l] > m ? sg[l] : m;                      \
                for (int64_t l = 0; l < n; l++) {                                               \
                    sg[l] = expf(sg[l] - m);                                                    \
                    sum += sg[l];                                                               \
                    sg[l] = LOAD(STORE(sg[l]));                                                 \
                }                                                                               \
                inv[g] = 1.0f / sum;                                                            \
                for (int64_t i = 0; i < d; i++) acc[g][i] = 0.0f;                               \
            }                                                                                   \
            for (int64_t l = 0; l < n; l++) {                                                   \
                const T *vr = vb + l * v_sl;                                                    \
                float vf[MAX_D];                                                                \
                LOAD_ROW(vf, vr, d, LOAD);                                                      \
                for (int64_t g = 0; g < gqa; g++) {                                             \
                    const float p = s[g * n + l];                                            \
                    _Pragma("omp simd")                                                         \
                    for (int64_t i = 0; i < d; i++) acc[g][i] += p * vf[i];                     \
                }                                                                               \
            }                                                                                   \
            for (int64_t g = 0; g < gqa; g++) {                                                 \
                T *o = out + (t * gqa + g) * d;                                                 \
                for (int64_t i = 0; i < d; i++) o[i] = STORE(acc[g][i] * inv[g]);               \
            }                                                                                   \
            free(s);                                                                            \
        }                                                                                       \
        return failed ? 3 : 0;                                                                  \
    }

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)

DEFINE_KERNEL(decode_attention_f32, float, F32_LOAD, F32_STORE)
DEFINE_KERNEL(decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
