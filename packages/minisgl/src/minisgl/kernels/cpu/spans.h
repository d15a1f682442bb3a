/* The checks both prefill kernels make of a step's spans (error codes as cpu_native's
 * _ERRORS): lengths, q rows inside q, KV ranges inside the indices, indices inside the pool. */
#ifndef MINISGL_SPANS_H
#define MINISGL_SPANS_H

#include <stdint.h>

static inline int check_spans(const int64_t *indices, int64_t num_indices,
                              const int64_t *q_starts, const int64_t *q_lens,
                              const int64_t *kv_starts, const int64_t *kv_lens, int64_t num_reqs,
                              int64_t num_q, int64_t num_rows) {
    for (int64_t r = 0; r < num_reqs; r++) {
        if (q_lens[r] < 1 || q_lens[r] > kv_lens[r]) return 2;
        if (q_starts[r] < 0 || q_starts[r] + q_lens[r] > num_q) return 6;
        if (kv_starts[r] < 0 || kv_starts[r] + kv_lens[r] > num_indices) return 7;
        for (int64_t l = 0; l < kv_lens[r]; l++)
            if (indices[kv_starts[r] + l] < 0 || indices[kv_starts[r] + l] >= num_rows) return 4;
    }
    return 0;
}

#endif
