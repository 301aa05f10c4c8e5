/* What the kernels on AMX tiles share: the tiles' configuration, every tile 16 rows of 64
 * bytes (`amx_ready` must have been granted in the process: attention_tiles.c). */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

int amx_ready(void);

/* gcc's _tile_loadd does not tell the compiler that it reads memory, so stores into a buffer
 * only tiles read (a chunk's weights, a row's codes) could be dropped as dead: this does. */
#define TILE_LOAD(tile, base, stride)                                                          \
    do {                                                                                       \
        __asm__ volatile("" : : : "memory");                                                   \
        _tile_loadd(tile, base, stride);                                                       \
    } while (0)

/* On the calling thread: all eight tiles 16 rows x 64 bytes. */
__attribute__((target("amx-tile"))) static inline void configure_tiles(void) {
    TileConfig config = {.palette = 1};
    for (int i = 0; i < 8; i++) config.bytes_per_row[i] = 64, config.rows[i] = 16;
    /* gcc 12 takes _tile_loadconfig to read 8 bytes: the barrier keeps all 64 stored. */
    __asm__ volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

/* 2^z for z <= 0, to about 1.2e-7 relative: the Taylor polynomial of degree 6 of z's fraction
 * in [-0.5, 0.5], scaled by 2 to its integer part (vscalefps). Below -126 it is taken as
 * 2^-126 (simd.h's e^x clamps at e^-87, about the same). */
__attribute__((target("avx512f"))) static inline __m512 exp2_negative16(__m512 z) {
    static const float taylor[] = {1.5403530393e-4f, 1.3333558146e-3f, 9.6181291076e-3f,
                                   5.5504108665e-2f, 2.4022650696e-1f, 6.9314718056e-1f, 1.0f};
    z = _mm512_max_ps(z, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(z, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(z, n);
    __m512 y = _mm512_set1_ps(taylor[0]);
    for (int k = 1; k < 7; k++) y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(taylor[k]));
    return _mm512_scalef_ps(y, n);
}

/* The calling thread's scratch, kept from call to call (fresh pages are faulted and zeroed). */
static inline char *thread_scratch(long bytes) {
    static _Thread_local char *buffer;
    static _Thread_local long size;
    if (bytes > size) {
        free(buffer);
        size = (bytes + 4095) / 4096 * 4096;
        buffer = aligned_alloc(64, size);
        if (!buffer) size = 0;
    }
    return buffer;
}
