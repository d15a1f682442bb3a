/* int8 and int4 weights to bf16 for the de-quantized GEMM of large batches
 * (quantization/linear.py).
 *
 * int8: out[r][c] = q[r][c] * scale[r], the int8 value exact in bf16 and the product rounded
 * once to bf16, as torch's `q * scale` in bf16.
 *
 * int4: out[r][c] = (code(r, c) - 8) * scale + zero of the column's group,
 * codes two per byte (the low nibble the even column), scales and zeros bf16 [groups][n][2]
 * (the packed int4 kernel's own). (code - 8) * scale is exact in fp32 (a 4-bit integer times a
 * bf16), so the one rounding of "+ zero" and the rounding to bf16 equal torch's separate ops,
 * fused or not. With AVX512-BF16, 32 columns a group in two 16-lane steps. */
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* 16 codes (bytes, one per column) to 16 bf16 weights: (code - 8) * s + z, rounded to nearest
 * even by the conversion instruction, as f32_to_bf16 does. */
static inline void dequant16(__m128i codes, __m512 s, __m512 z, uint16_t *out) {
    __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(codes),
                                                   _mm512_set1_epi32(8)));
    __m512 w = _mm512_add_ps(_mm512_mul_ps(q, s), z);
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(w));
}

/* A group of 32 columns: 16 bytes, low nibbles the even columns. */
static inline void dequant_group32(const uint8_t *c, float sf, float zf, uint16_t *o) {
    const __m128i b = _mm_loadu_si128((const __m128i *)c);
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m512 s = _mm512_set1_ps(sf), z = _mm512_set1_ps(zf);
    dequant16(_mm_unpacklo_epi8(lo, hi), s, z, o);
    dequant16(_mm_unpackhi_epi8(lo, hi), s, z, o + 16);
}

/* 16 int8 weights times a scale, rounded to bf16. */
static inline void scale16(const int8_t *q, __m512 s, uint16_t *out) {
    __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(w, s)));
}
#endif

int dequant_int8_bf16(const int8_t *q, const uint16_t *scales, uint16_t *out, int64_t n,
                      int64_t k, int threads) {
    if (n < 1 || k < 1) return 10;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * k >= 65536)
    for (int64_t r = 0; r < n; r++) {
        const int8_t *qr = q + r * k;
        uint16_t *o = out + r * k;
        const float s = bf16_to_f32(scales[r]);
        int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        const __m512 sv = _mm512_set1_ps(s);
        for (; c + 16 <= k; c += 16) scale16(qr + c, sv, o + c);
#endif
        for (; c < k; c++) o[c] = f32_to_bf16((float)qr[c] * s);
    }
    return 0;
}

int dequant_int4_bf16(const uint8_t *codes, const uint16_t *sz, uint16_t *out, int64_t n,
                      int64_t k, int64_t group, int threads) {
    if (n < 1 || k < 1) return 10;
    if (k < 2 || group < 2 || group % 2 || k % group) return 9;
    const int64_t groups = k / group;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * k >= 65536)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *c = codes + r * (k / 2);
        uint16_t *o = out + r * k;
        for (int64_t g = 0; g < groups; g++) {
            const float s = bf16_to_f32(sz[(g * n + r) * 2]);
            const float z = bf16_to_f32(sz[(g * n + r) * 2 + 1]);
            const uint8_t *cg = c + g * group / 2;
            uint16_t *og = o + g * group;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            if (group % 32 == 0) {
                for (int64_t j = 0; j < group; j += 32) dequant_group32(cg + j / 2, s, z, og + j);
                continue;
            }
#endif
            for (int64_t j = 0; j < group / 2; j++) {
                og[2 * j] = f32_to_bf16((float)((int)(cg[j] & 15) - 8) * s + z);
                og[2 * j + 1] = f32_to_bf16((float)((int)(cg[j] >> 4) - 8) * s + z);
            }
        }
    }
    return 0;
}
