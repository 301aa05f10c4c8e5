/* What the kernels multiplying bf16 weights on AMX-BF16 tiles share (expert_tiles.c,
 * bf16_tiles.c): rows rounded to bf16, B tiles of a weight's panel as gemm.c's bf16 panels hold
 * them ([inputs / 2][16 outputs][2], 1 KB a chunk of 32 inputs), and the products of 16 or 32
 * rows against two panels, summed in fp32 over every chunk in the tiles. A tile's rows do not
 * mix, so a row's bits do not depend on the rows beside it. `configure_tiles` first. */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"

enum { ROWS = 16, PANEL = 16, CHUNK = 32, TILE_ELEMS = 512 };

/* `count` float32 values (a multiple of 16) rounded to bf16, to nearest even as torch rounds. */
__attribute__((target("avx512f,avx512bf16"))) static inline void round_bf16(const float *from,
                                                                             uint16_t *to,
                                                                             long count) {
    for (long i = 0; i < count; i += 16) {
        __m256bh half = _mm512_cvtneps_pbh(_mm512_loadu_ps(from + i));
        memcpy(to + i, &half, sizeof half);
    }
}

/* Tiles 0-3 hold sums: rows 0-15 against the first panel, against the second, then rows 16-31
 * against each; row j's sums of the first panel lie at `sums + at(j)`, the second's 256 on. */
static inline long at(int j) { return (j / ROWS) * 2 * ROWS * PANEL + (j % ROWS) * PANEL; }

/* Rows [0, 16 or 32) of A (bf16, `stride` apart) against B tiles b6 and b7 over `chunks`
 * chunks of 32 inputs (`step` values from one chunk's tile to the next), into `sums`. */
__attribute__((target("amx-tile,amx-bf16"))) static inline void products(
    const uint16_t *a, long stride, long chunks, int two, const uint16_t *b6, const uint16_t *b7,
    long step, float *sums) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long c = 0; c < chunks; c++) {
        TILE_LOAD(4, a + c * CHUNK, 2 * stride);
        TILE_LOAD(6, b6 + c * step, 64);
        TILE_LOAD(7, b7 + c * step, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            TILE_LOAD(5, a + ROWS * stride + c * CHUNK, 2 * stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums, 64);
    _tile_stored(1, sums + 256, 64);
    if (two) {
        _tile_stored(2, sums + 512, 64);
        _tile_stored(3, sums + 768, 64);
    }
}
