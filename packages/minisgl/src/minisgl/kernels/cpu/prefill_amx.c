/* Prefill attention in bf16 on AMX tiles: every request of a step in one call, any length.
 *
 * The layout, spans and masking rule are prefill_attention.c's (see there); this path takes
 * bf16 with head_dim a multiple of 32 (<= MAX_D) on CPUs with AMX-BF16, where the scores and
 * the weighted sum are tile products (bf16 x bf16 summed in fp32) instead of fp32 vector FMAs.
 *
 * Two phases. First, per (request, KV head), K and V are gathered from the pool once into the
 * tile layouts (zero past the request's keys): K for scores = q . K^T, 16 keys x 32 dims a
 * tile, each tile row one pair of dims over the 16 keys; V for out = p . V, 32 keys x 16 dims
 * a tile, each row one pair of keys over the 16 dims. Then one task per (request, KV head,
 * block of 16 tokens), all gqa query heads of the block in turn: the scores of 16 rows over
 * the keys the block sees (fp32, from the tiles), an exact two-pass softmax per row (scaled,
 * masked to the row's positions), the unnormalised probabilities rounded to bf16 as in SDPA's
 * flash kernel (their sum kept in fp32), their product with V, divided by the sum, rounded.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "spans.h"
#include "vexp.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) &&                 \
    defined(__AVX512BF16__) && defined(__AVX512BW__)
#define AMX_PREFILL 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TOK 16 /* tokens of a task block, rows of a tile */
#endif

/* Linux grants a process the AMX tile state on request (once; oneDNN asks the same); 0 where
 * this object was built without AMX */
int prefill_amx_supported(void) {
#if AMX_PREFILL
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
#else
    return 0;
#endif
}

#if AMX_PREFILL
/* tiles 0-3 fp32 accumulators, 4 A (q or p), 6-7 B (K or V) */

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* K rows [n][d] (pool rows idx[l], head offset) -> kp[n_pad / 16][d / 32][16][16][2] */
static void pack_k(const uint16_t *k, const int64_t *idx, int64_t n, int64_t n_pad, int64_t d,
                   int64_t sl, int64_t off, uint16_t *kp) {
    const int64_t chunks = d / 32;
    memset(kp, 0, sizeof(uint16_t) * (size_t)(n_pad * d));
    for (int64_t l = 0; l < n; l++) {
        const uint32_t *row = (const uint32_t *)(k + idx[l] * sl + off); /* pairs of dims */
        const int64_t kb = l / 16, j = l % 16;
        for (int64_t c = 0; c < chunks; c++) {
            uint32_t *tile = (uint32_t *)(kp + (kb * chunks + c) * 512);
            for (int64_t p = 0; p < 16; p++) tile[p * 16 + j] = row[c * 16 + p];
        }
    }
}

/* V rows [n][d] -> vp[n_pad / 32][d / 16][16][16][2]: row p of a tile interleaves keys 2p and
 * 2p + 1 over 16 dims */
static void pack_v(const uint16_t *v, const int64_t *idx, int64_t n, int64_t n_pad, int64_t d,
                   int64_t sl, int64_t off, uint16_t *vp) {
    const int64_t cols = d / 16;
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t l = 0; l < n_pad; l += 2) {
        const int64_t kb = l / 32, p = (l % 32) / 2;
        for (int64_t c = 0; c < d; c += 32) {
            const __m512i a = l < n ? _mm512_loadu_si512(v + idx[l] * sl + off + c)
                                    : _mm512_setzero_si512();
            const __m512i b = l + 1 < n ? _mm512_loadu_si512(v + idx[l + 1] * sl + off + c)
                                        : _mm512_setzero_si512();
            uint16_t *t0 = vp + ((kb * cols + c / 16) * 16 + p) * 32;
            uint16_t *t1 = vp + ((kb * cols + c / 16 + 1) * 16 + p) * 32;
            _mm512_storeu_si512(t0, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(t1, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

static inline __mmask16 lanes(int64_t from, int64_t lo, int64_t hi) { /* from + j in [lo, hi) */
    const int64_t a = lo - from > 0 ? lo - from : 0, b = hi - from < 16 ? hi - from : 16;
    if (b <= a) return 0;
    return (__mmask16)((b - a >= 16 ? 0xffffu : ((1u << (b - a)) - 1u)) << a);
}

/* a row's scores -> p rounded to bf16 over keys [lo, hi), 0 elsewhere in [from, to) (from a
 * multiple of 16, [lo, hi) inside); returns the fp32 sum of p */
static float row_softmax(const float *s, uint16_t *p, int64_t from, int64_t to, int64_t lo,
                         int64_t hi, float scale) {
    __m512 mx = _mm512_set1_ps(-3.4e38f);
    for (int64_t j = lo / 16 * 16; j < hi; j += 16)
        mx = _mm512_mask_max_ps(mx, lanes(j, lo, hi), mx, _mm512_loadu_ps(s + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale), sc = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = from; j < to; j += 16) {
        const __mmask16 keep = lanes(j, lo, hi);
        __m512 e = _mm512_setzero_ps();
        if (keep) e = _mm512_maskz_mov_ps(keep, exp16(_mm512_fmsub_ps(
                                                       _mm512_loadu_ps(s + j), sc, m)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return _mm512_reduce_add_ps(sum);
}

typedef struct {
    uint16_t *q; /* [TOK][d] a partial block's rows of one query head, zero past its tokens */
    float *s;    /* [TOK][n_max]: scores */
    uint16_t *p; /* [TOK][n_max]: probabilities */
    float *o;    /* [TOK][d] */
} amx_scratch;

/* one (request, KV head, block of TOK tokens): all gqa heads */
static void amx_task(const uint16_t *q, uint16_t *out, const uint16_t *kp, const uint16_t *vp,
                     int64_t q0, int64_t prefix, int64_t i0, int64_t i1, int64_t h, int64_t kvh,
                     int64_t gqa, int64_t d, int64_t n_pad, int64_t window, float scale,
                     amx_scratch *w) {
    const int64_t nt = i1 - i0, chunks = d / 32, cols = d / 16;
    const int64_t end = prefix + i1, start = window > 0 && prefix + i0 + 1 > window
                                                 ? prefix + i0 + 1 - window : 0; /* keys seen */
    const int64_t kb0 = start / 32 * 32, kb1 = round_up(end, 32);               /* key range */
    float sums[TOK];
    for (int64_t g = 0; g < gqa; g++) {
        /* a whole block's rows straight from q, a last partial one through zero padding */
        const uint16_t *qa = q + ((q0 + i0) * kvh + h) * gqa * d + g * d;
        int64_t qs = 2 * kvh * gqa * d;
        if (nt < TOK) {
            for (int64_t i = 0; i < TOK; i++) {
                uint16_t *dst = w->q + i * d;
                if (i < nt) memcpy(dst, qa + i * kvh * gqa * d, 2 * (size_t)d);
                else memset(dst, 0, 2 * (size_t)d);
            }
            qa = w->q, qs = 2 * d;
        }
        for (int64_t kb = kb0; kb < kb1; kb += 32) { /* scores, 2 x 16 keys at a time */
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t c = 0; c < chunks; c++) {
                _tile_loadd(4, qa + c * 32, qs);
                _tile_loadd(6, kp + ((kb / 16) * chunks + c) * 512, 64);
                _tile_loadd(7, kp + ((kb / 16 + 1) * chunks + c) * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
            _tile_stored(0, w->s + kb, 4 * n_pad);
            _tile_stored(1, w->s + kb + 16, 4 * n_pad);
        }
        for (int64_t i = 0; i < TOK; i++) {
            const int64_t e = prefix + i0 + i + 1, st = window > 0 && e > window ? e - window : 0;
            uint16_t *p = w->p + i * n_pad + kb0;
            if (i < nt) sums[i] = row_softmax(w->s + i * n_pad, w->p + i * n_pad, kb0, kb1, st, e, scale);
            else memset(p, 0, 2 * (size_t)(kb1 - kb0));
        }
        for (int64_t c0 = 0; c0 < cols; c0 += 4) { /* out = p . V, 4 x 16 dims at a time */
            const int64_t nc = cols - c0 < 4 ? cols - c0 : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = kb0; kb < kb1; kb += 32) {
                const uint16_t *vt = vp + ((kb / 32) * cols + c0) * 512;
                _tile_loadd(4, w->p + kb, 2 * n_pad);
                _tile_loadd(6, vt, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (nc > 1) {
                    _tile_loadd(7, vt + 512, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (nc > 2) {
                    _tile_loadd(6, vt + 1024, 64);
                    _tile_dpbf16ps(2, 4, 6);
                }
                if (nc > 3) {
                    _tile_loadd(7, vt + 1536, 64);
                    _tile_dpbf16ps(3, 4, 7);
                }
            }
            _tile_stored(0, w->o + c0 * 16, 4 * d);
            if (nc > 1) _tile_stored(1, w->o + (c0 + 1) * 16, 4 * d);
            if (nc > 2) _tile_stored(2, w->o + (c0 + 2) * 16, 4 * d);
            if (nc > 3) _tile_stored(3, w->o + (c0 + 3) * 16, 4 * d);
        }
        for (int64_t i = 0; i < nt; i++) {
            uint16_t *orow = out + ((q0 + i0 + i) * kvh + h) * gqa * d + g * d;
            const __m512 inv = _mm512_set1_ps(1.0f / sums[i]);
            for (int64_t c = 0; c < d; c += 16)
                _mm256_storeu_si256((__m256i *)(orow + c), (__m256i)_mm512_cvtneps_pbh(
                                        _mm512_mul_ps(_mm512_loadu_ps(w->o + i * d + c), inv)));
        }
    }
}

#endif

int prefill_attention_bf16_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                               uint16_t *out, const int64_t *indices, int64_t num_indices,
                               const int64_t *q_starts, const int64_t *q_lens,
                               const int64_t *kv_starts, const int64_t *kv_lens, int64_t num_reqs,
                               int64_t num_q, int64_t kvh, int64_t gqa, int64_t d,
                               int64_t num_rows, int64_t k_sh, int64_t k_sl, int64_t v_sh,
                               int64_t v_sl, int64_t window, float scale, int threads) {
    if (d > MAX_D || d % 32 != 0 || gqa > MAX_GQA) return 1;
    if (!prefill_amx_supported()) return 8;
#if AMX_PREFILL
    const int rc = check_spans(indices, num_indices, q_starts, q_lens, kv_starts, kv_lens,
                               num_reqs, num_q, num_rows);
    if (rc != 0) return rc;
    /* per request: keys padded to 32, the offset of its packed K / V, its first task */
    int64_t *at = malloc(sizeof(int64_t) * 3 * (size_t)(num_reqs + 1));
    if (at == NULL) return 3;
    int64_t *pad = at, *base = at + num_reqs + 1, *first = at + 2 * (num_reqs + 1);
    int64_t n_max = 32;
    base[0] = first[0] = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        pad[r] = round_up(kv_lens[r], 32);
        n_max = pad[r] > n_max ? pad[r] : n_max;
        base[r + 1] = base[r] + kvh * pad[r] * d;
        first[r + 1] = first[r] + (q_lens[r] + TOK - 1) / TOK * kvh;
    }
    uint16_t *kp = malloc(sizeof(uint16_t) * (size_t)(base[num_reqs] > 0 ? base[num_reqs] : 1));
    uint16_t *vp = malloc(sizeof(uint16_t) * (size_t)(base[num_reqs] > 0 ? base[num_reqs] : 1));
    int failed = kp == NULL || vp == NULL;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < num_reqs * kvh; t++) {
                const int64_t r = t / kvh, h = t % kvh, off = base[r] + h * pad[r] * d;
                const int64_t *idx = indices + kv_starts[r];
                pack_k(k, idx, kv_lens[r], pad[r], d, k_sl, h * k_sh, kp + off);
                pack_v(v, idx, kv_lens[r], pad[r], d, v_sl, h * v_sh, vp + off);
            }
            amx_scratch w;
            w.q = malloc(sizeof(uint16_t) * TOK * (size_t)d);
            w.s = malloc(sizeof(float) * TOK * (size_t)n_max);
            w.p = malloc(sizeof(uint16_t) * TOK * (size_t)n_max);
            w.o = malloc(sizeof(float) * TOK * (size_t)d);
            const int ok = w.q && w.s && w.p && w.o;
            if (!ok) {
#pragma omp atomic write
                failed = 1;
            }
            tiles_configure();
            int64_t r = 0;
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < first[num_reqs]; t++) {
                if (!ok) continue;
                while (r > 0 && first[r] > t) r--;
                while (first[r + 1] <= t) r++;
                const int64_t b = (t - first[r]) / kvh, h = (t - first[r]) % kvh;
                const int64_t i0 = b * TOK, i1 = i0 + TOK < q_lens[r] ? i0 + TOK : q_lens[r];
                const int64_t off = base[r] + h * pad[r] * d;
                amx_task(q, out, kp + off, vp + off, q_starts[r], kv_lens[r] - q_lens[r], i0, i1,
                         h, kvh, gqa, d, pad[r], window, scale, &w);
            }
            _tile_release();
            free(w.q), free(w.s), free(w.p), free(w.o);
        }
    }
    free(kp), free(vp), free(at);
    return failed ? 3 : 0;
#else
    return 8;
#endif
}
