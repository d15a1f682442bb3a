/* Element types of the CPU attention kernels: fp32, and bf16 widened / rounded (to nearest
 * even) by bit operations, so both types share one kernel body. */
#ifndef MINISGL_BF16_H
#define MINISGL_BF16_H

#include <stdint.h>
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

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)

#define MAX_D 256
#define MAX_GQA 16

#endif
