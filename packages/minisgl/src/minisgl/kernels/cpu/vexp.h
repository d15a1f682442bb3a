/* e^x on 16 fp32 lanes (AVX-512), shared by the prefill softmax (prefill_amx.c) and SiLU
 * (quant.c): 2^k p(r) with k = round(x log2 e), r = x - k ln 2 in two parts, p a degree-7
 * polynomial, scaled by vscalefps. For x <= 88; a lane below -103 gives 0. */
#ifndef MINISGL_VEXP_H
#define MINISGL_VEXP_H

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 exp16(__m512 x) { /* 2^k p(r), |r| <= ln2 / 2 */
    const __m512 low = _mm512_set1_ps(-103.0f);
    const __mmask16 zero = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
    x = _mm512_max_ps(x, low);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps((__mmask16)~zero, p, k);
}
#endif

#endif
