/* The quantized product's tiles in 256-bit vectors, for every ISA that has them: the includer
 * defines QDOT(BITS, acc, w, x), acc plus the int32 sums, for 8 features, of 4 codes (unsigned,
 * BITS wide) times 4 activation codes (signed), then expands QPRODUCTS (quantized.h). */
#pragma once
#include <immintrin.h>

#include "quantized.h"

#define PREFETCH_AHEAD 1024

/* Group c's codes for features 0-7 (half 0) or 8-15 (half 1). */
static inline __m256i codes_4(const uint8_t *blk, int c, int half) {
    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * (c & 3) + 32 * half));
    if (c >= 4) v = _mm256_srli_epi16(v, 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}
static inline __m256i codes_6(const uint8_t *blk, int c, int half) {
    __m256i high = _mm256_loadu_si256((const __m256i *)(blk + 256 + 64 * (c >> 2) + 32 * half));
    __m256i two = _mm256_and_si256(_mm256_srli_epi16(high, 2 * (c & 3)), _mm256_set1_epi8(3));
    return _mm256_or_si256(codes_4(blk, c, half), _mm256_slli_epi16(two, 4));
}
static inline __m256i codes_8(const uint8_t *blk, int c, int half) {
    return _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * half));
}

/* ROWS rows against one panel, a half (8 features) at a time, blocks in k order. */
#define QTILE(BITS, ROWS)                                                                       \
    static void tile##BITS##_##ROWS(const QProduct *p, long row, long panel) {                  \
        const long blocks = p->K / QBLOCK, bytes = qblock_bytes(BITS);                          \
        const long codes = QPANEL * QBLOCK * BITS / 8;                                          \
        __m256 out[ROWS][2];                                                                    \
        for (int j = 0; j < ROWS; j++) out[j][0] = out[j][1] = _mm256_setzero_ps();             \
        for (long b = 0; b < blocks; b++) {                                                     \
            const uint8_t *blk = p->w + (panel * blocks + b) * bytes;                           \
            _mm_prefetch((const char *)blk + PREFETCH_AHEAD, _MM_HINT_T0);                      \
            const int32_t *xq = (const int32_t *)(p->xq + (row * blocks + b) * QBLOCK);         \
            for (int h = 0; h < 2; h++) {                                                       \
                __m256i w[8];                                                                   \
                for (int c = 0; c < 8; c++) w[c] = codes_##BITS(blk, c, h);                     \
                const __m128i *scales = (const __m128i *)(blk + codes + 16 * h);                \
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(scales));                            \
                __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(scales + 2));                        \
                __m256i acc[2][ROWS]; /* the second: 6-bit codes' second half */              \
                for (int j = 0; j < ROWS; j++) acc[0][j] = acc[1][j] = _mm256_setzero_si256();  \
                for (int c = 0; c < 8; c++) {                                                   \
                    const int k = BITS == 6 && c >= 4;                                          \
                    for (int j = 0; j < ROWS; j++)                                              \
                        acc[k][j] = QDOT(BITS, acc[k][j], w[c],                                 \
                                         _mm256_set1_epi32(xq[j * p->K / 4 + c]));              \
                }                                                                               \
                for (int j = 0; j < ROWS; j++) {                                                \
                    const long s = (row + j) * blocks + b;                                      \
                    QFINISH(256, BITS, acc[0][j], acc[1][j], out[j][h])                         \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        float tile[ROWS][QPANEL];                                                               \
        for (int j = 0; j < ROWS; j++) {                                                        \
            _mm256_storeu_ps(tile[j], out[j][0]);                                               \
            _mm256_storeu_ps(tile[j] + 8, out[j][1]);                                           \
        }                                                                                       \
        qstore_tile(p, row, ROWS, panel * QPANEL, tile[0]);                                     \
    }

