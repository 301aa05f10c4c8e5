/* What the kernels on AMX tiles share: the tiles' configuration, every tile 16 rows of 64
 * bytes (`amx_ready` must have been granted in the process: attention_tiles.c). */
#pragma once
#include <immintrin.h>
#include <stdint.h>

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
