/* Row max and argmax of a [rows, n] matrix (fp32 or bf16, rows `stride` elements apart), with
 * torch.max(dim=-1)'s semantics: the first index of the largest value (-0 equal to +0); a row
 * that holds a NaN gives that NaN and the index of its first NaN. Values compare as integers
 * (IEEE bits mapped to their order: magnitude, negated when the sign is set), so -ffast-math
 * cannot change a result. Two passes a row: the largest key and a NaN flag (vectorized), then
 * the first position of that key, found 64 elements at a time. */
#include <stdint.h>

#define BLOCK 64

/* bits -> (order key, NaN) for each element type */
#define F32_MAG(u) ((u) & 0x7fffffffu)
#define F32_KEY(u) ((u) & 0x80000000u ? -(int32_t)F32_MAG(u) : (int32_t)(u))
#define F32_NAN(u) (F32_MAG(u) > 0x7f800000u)
#define BF16_MAG(u) ((u) & 0x7fffu)
#define BF16_KEY(u) ((u) & 0x8000u ? -(int32_t)BF16_MAG(u) : (int32_t)(u))
#define BF16_NAN(u) (BF16_MAG(u) > 0x7f80u)

#define DEFINE_ROW_MAX(NAME, T, KEY, ISNAN)                                                     \
    int NAME(const T *x, T *values, int64_t *indices, int64_t rows, int64_t n, int64_t stride,  \
             int threads) {                                                                     \
        if (n < 1) return 2;                                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t r = 0; r < rows; r++) {                                                    \
            const T *row = x + r * stride;                                                      \
            int32_t best = INT32_MIN;                                                           \
            int nan = 0;                                                                        \
            for (int64_t l = 0; l < n; l++) {                                                   \
                const int32_t k = KEY(row[l]);                                                  \
                best = k > best ? k : best;                                                     \
                nan |= ISNAN(row[l]);                                                           \
            }                                                                                   \
            int64_t at = 0;                                                                     \
            for (int64_t b = 0; b < n; b += BLOCK) {                                            \
                const int64_t e = b + BLOCK < n ? b + BLOCK : n;                                \
                int hit = 0;                                                                    \
                for (int64_t l = b; l < e; l++)                                                 \
                    hit |= nan ? ISNAN(row[l]) : KEY(row[l]) == best;                           \
                if (!hit) continue;                                                             \
                for (at = b; !(nan ? ISNAN(row[at]) : KEY(row[at]) == best); at++) {            \
                }                                                                               \
                break;                                                                          \
            }                                                                                   \
            values[r] = row[at];                                                                \
            indices[r] = at;                                                                    \
        }                                                                                       \
        return 0;                                                                               \
    }

DEFINE_ROW_MAX(row_max_f32, uint32_t, F32_KEY, F32_NAN)
DEFINE_ROW_MAX(row_max_bf16, uint16_t, BF16_KEY, BF16_NAN)
