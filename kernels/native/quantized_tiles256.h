/* The quantized product's tiles in 256-bit vectors, for every ISA that has them: the includer
 * defines QDOT(BITS, part, w, x), part plus the sums, for 8 features, of 4 codes (unsigned, BITS
 * wide) times 4 activation codes (signed), then expands QPRODUCTS (quantized.h). Partial sums
 * narrower than int32 (AVX2's) define, before the include, QSPAN(BITS), the groups a partial
 * holds, QWIDEN(acc, part), acc plus a partial, and QSTORED(BITS, acc, xsum), the sums of the
 * codes as stored from acc and the activation codes' sum. */
#pragma once
#include <immintrin.h>

#include "quantized.h"

#ifndef QSPAN /* int32 partials (VNNI): widened once a block (6-bit codes: each 16 inputs) */
#define QSPAN(BITS) (BITS == 6 ? 4 : 8)
#define QWIDEN(acc, part) _mm256_add_epi32(acc, part)
#define QSTORED(BITS, acc, xsum) (acc)
#endif

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
static inline __m256i codes_5(const uint8_t *blk, int c, int half) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(FP4_TABLE), codes_4(blk, c, half));
}
static inline __m256i codes_8(const uint8_t *blk, int c, int half) {
    return _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * half));
}

/* ROWS rows against one panel, a half (8 features) at a time, blocks in k order: a half block's
 * codes in registers, then a row at a time its 8 groups, the sums' chain unrolled; the outputs'
 * sums in memory, so that the codes and a row's sums keep the registers. */
#define QTILE(BITS, ROWS)                                                                       \
    static void tile##BITS##_##ROWS(const QProduct *p, long row, long panel) {                  \
        const long blocks = p->K / QBLOCK, bytes = qblock_bytes(BITS);                          \
        const long codes = QPANEL * QBLOCK * QSTORED_BITS(BITS) / 8;                            \
        const long words = p->K / 4; /* a row's, of codes */                                    \
        float tile[ROWS][QPANEL] = {0};                                                         \
        for (long b = 0; b < blocks; b++) {                                                     \
            const uint8_t *blk = p->w + (panel * blocks + b) * bytes;                           \
            _mm_prefetch((const char *)blk + PREFETCH_AHEAD, _MM_HINT_T0);                      \
            const int32_t *xq = (const int32_t *)(p->xq + (row * blocks + b) * QBLOCK);         \
            for (int h = 0; h < 2; h++) {                                                       \
                __m256i w[8];                                                                   \
                for (int c = 0; c < 8; c++) w[c] = codes_##BITS(blk, c, h);                     \
                const __m128i *scales = (const __m128i *)(blk + codes + 16 * h);                \
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(scales));                      \
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(scales + 2));                  \
                for (int j = 0; j < ROWS; j++) {                                                \
                    const long s = (row + j) * blocks + b;                                      \
                    const int32_t *x = xq + j * words;                                          \
                    __m256 out = _mm256_loadu_ps(tile[j] + 8 * h);                              \
                    __m256i acc = _mm256_setzero_si256(), part = _mm256_setzero_si256();        \
                    _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {                       \
                        part = QDOT(BITS, part, w[c], _mm256_set1_epi32(x[c]));                 \
                        if ((c + 1) % QSPAN(BITS)) continue;                                    \
                        acc = QWIDEN(acc, part);                                                \
                        part = _mm256_setzero_si256();                                          \
                        if (BITS != 6 || c != 3) continue;                                      \
                        QFINISH_FIRST(256, BITS, acc, out) /* 6-bit codes' first half */        \
                        acc = _mm256_setzero_si256();                                           \
                    }                                                                           \
                    if (BITS != 6) QFINISH_FIRST(256, BITS, QSTORED(BITS, acc, p->qs[s]), out)  \
                    QFINISH_SECOND(256, BITS, acc, out)                                         \
                    _mm256_storeu_ps(tile[j] + 8 * h, out);                                     \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        qstore_tile(p, row, ROWS, panel * QPANEL, tile[0]);                                     \
    }
