/* Per-row int8 quantization of a W8A8 linear's input, fused with the op that forms it
 * (quantization/w8a8.py, `quantize_input`): bf16 [rows, n] in (rows `stride` elements apart),
 * int8 codes [rows, n] and fp32 scales [rows] out. The input h of a row, formed as the model's
 * eager bf16 ops form it (every intermediate rounded to bf16, to nearest even):
 *   ROWS:     h = x
 *   RMSNORM:  h = bf16(w * bf16(x / sqrt(mean(x^2) + eps)))          (models.layers.rms_norm)
 *   SILU_MUL: h = bf16(bf16(silu(bf16(s g))) * bf16(s u)), g | u the two halves of a row of 2n
 *             and s = in_scale[r] (the gate/up GEMM's per-row activation scale; 1 without)
 * then scale = max(max |h|, 1e-12) / 127 and code = h * (127 / that max) rounded to nearest
 * even: `quantize_rows` but for the multiply, -ffast-math's order of the sums of squares and
 * SILU_MUL's vector exp (vexp.h), so a code may differ by one where h / scale lies
 * within a rounding of a half. Finite inputs only. Each row is formed once into a buffer of n
 * floats (L1 / L2 here), its maximum taken on the way, then coded: one read of the input.
 * The next row's lines are prefetched while a row is formed: a row of SILU_MUL spans two 4 KB
 * pages, and the hardware prefetcher's streams restarted at each (cold input, 2 threads: 1.93
 * -> 1.49 ms for [2587, 2 x 1536], as fast as from cache). Measured (2 threads, AMX Xeon):
 * SILU_MUL of [2587, 2 x 1536] with in_scale 1.4-1.5 ms, where inductor's fused loop took 2.6
 * (two vector divisions an element); RMSNORM of [2587, 576] 0.3 ms against 0.53-0.65. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "vexp.h"

enum { ROWS = 0, RMSNORM = 1, SILU_MUL = 2 };

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(__AVX512F__)
#include <immintrin.h>

/* to bf16 (nearest even, as f32_to_bf16) and back */
static inline __m512 round_bf16_16(__m512 v) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 elements of silu_mul: h into `h`, returns max |h| so far */
static inline __m512 silu_mul16(const uint16_t *g, const uint16_t *u, __m512 s, float *h,
                                __m512 amax) {
    const __m512 gv = round_bf16_16(_mm512_mul_ps(load_bf16(g), s));
    const __m512 uv = round_bf16_16(_mm512_mul_ps(load_bf16(u), s));
    /* e^-g with -g at most 80: 1 / (1 + e^-g) stays a normal float (a denormal cost a
     * microcode assist an element: a row of large negative gates ran ~10x slower) */
    const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gv);
    const __m512 e = exp16(_mm512_min_ps(neg, _mm512_set1_ps(80.0f)));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
    __m512 r = _mm512_rcp14_ps(d); /* one Newton step: relative error ~2^-28 */
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    const __m512 hv = round_bf16_16(_mm512_mul_ps(round_bf16_16(_mm512_mul_ps(gv, r)), uv));
    _mm512_storeu_ps(h, hv);
    return _mm512_max_ps(amax, _mm512_abs_ps(hv));
}
#endif

/* code the n floats of h: codes (u8: code + 128, the sign bit flipped, as oneDNN's and the C
 * step's VNNI GEMMs take them) and the row's scale */
static inline void code_row(const float *h, float amax, int8_t *codes, int u8, float *scale,
                            int64_t n) {
    const float m = amax > 1e-12f ? amax : 1e-12f;
    const float inv = 127.0f / m;
    const int8_t flip = u8 ? (int8_t)-128 : 0;
    *scale = m / 127.0f;
    int64_t c = 0;
#if defined(__AVX512F__)
    const __m512 iv = _mm512_set1_ps(inv);
    const __m128i fv = _mm_set1_epi8(flip);
    for (; c + 16 <= n; c += 16) { /* rounded to nearest even by the conversion; |v| <= 127 */
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(h + c), iv));
        _mm_storeu_si128((__m128i *)(codes + c), _mm_xor_si128(_mm512_cvtsepi32_epi8(v), fv));
    }
#endif
    for (; c < n; c++) {
        float v = rintf(h[c] * inv);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        codes[c] = (int8_t)((int8_t)v ^ flip);
    }
}

/* kind ROWS / RMSNORM: x [rows, n] (rows `stride` apart); w [n] (RMSNORM); in_scale unused.
 * kind SILU_MUL: x [rows, 2n]; in_scale [rows] or NULL. codes [rows, n], rows cs apart (u8:
 * code + 128). */
int quant_rows_bf16(const uint16_t *x, int64_t stride, const uint16_t *w, const float *in_scale,
                    float eps, int kind, int8_t *codes, int64_t cs, int u8, float *scales,
                    int64_t rows, int64_t n, int threads) {
    if (rows < 0 || n < 1 || cs < n || kind < ROWS || kind > SILU_MUL) return 10;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows * n >= 32768)
    {
        float *h = malloc((size_t)n * sizeof(float));
        if (h == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (h == NULL) continue;
            const uint16_t *xr = x + r * stride;
            float amax = 0.0f;
#if defined(__AVX512F__)
            if (kind != SILU_MUL) /* the next row's lines (SILU_MUL: as it goes, below) */
                for (int64_t c = 0; c < n; c += 32)
                    _mm_prefetch((const char *)(xr + stride + c), _MM_HINT_T0);
#endif
            if (kind == ROWS) {
                for (int64_t c = 0; c < n; c++) {
                    h[c] = bf16_to_f32(xr[c]);
                    amax = fmaxf(amax, fabsf(h[c]));
                }
            } else if (kind == RMSNORM) {
                float ss = 0.0f;
                for (int64_t c = 0; c < n; c++) {
                    const float v = bf16_to_f32(xr[c]);
                    ss += v * v;
                }
                const float inv_rms = 1.0f / sqrtf(ss / (float)n + eps);
                for (int64_t c = 0; c < n; c++) {
                    const float v = round_bf16(bf16_to_f32(xr[c]) * inv_rms);
                    h[c] = round_bf16(bf16_to_f32(w[c]) * v);
                    amax = fmaxf(amax, fabsf(h[c]));
                }
            } else {
                const float s = in_scale != NULL ? in_scale[r] : 1.0f;
                const uint16_t *ur = xr + n;
                int64_t c = 0;
#if defined(__AVX512F__)
                __m512 m = _mm512_setzero_ps();
                const __m512 sv = _mm512_set1_ps(s);
                for (; c + 32 <= n; c += 32) { /* the next row's lines, one row ahead */
                    _mm_prefetch((const char *)(xr + stride + c), _MM_HINT_T0);
                    _mm_prefetch((const char *)(ur + stride + c), _MM_HINT_T0);
                    m = silu_mul16(xr + c, ur + c, sv, h + c, m);
                    m = silu_mul16(xr + c + 16, ur + c + 16, sv, h + c + 16, m);
                }
                for (; c + 16 <= n; c += 16) m = silu_mul16(xr + c, ur + c, sv, h + c, m);
                amax = _mm512_reduce_max_ps(m);
#endif
                for (; c < n; c++) {
                    float g = bf16_to_f32(xr[c]), u = bf16_to_f32(ur[c]);
                    g = round_bf16(g * s), u = round_bf16(u * s);
                    /* e^-g clamped as in silu_mul16: -ffast-math assumes no infinity, and
                     * g / (1 + inf) for a gate of -90 or below came out as NaN (code -127) */
                    h[c] = round_bf16(round_bf16(g / (1.0f + expf(fminf(-g, 80.0f)))) * u);
                    amax = fmaxf(amax, fabsf(h[c]));
                }
            }
            code_row(h, amax, codes + r * cs, u8, scales + r, n);
        }
        free(h);
    }
    return failed ? 3 : 0;
}
