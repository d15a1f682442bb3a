/* The AMX tile setup the AMX kernels share (prefill_amx.c, amx_gemm.c): include where the AMX
 * and AVX-512 macros are defined, after <immintrin.h>. */
#ifndef MINISGL_AMX_TILES_H
#define MINISGL_AMX_TILES_H

#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* this thread's 8 tiles, each 16 rows x 64 bytes (which tile holds what is the kernel's) */
static inline void tiles_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.rows[i] = 16, c.colsb[i] = 64;
    _tile_loadconfig(&c);
}

#endif
