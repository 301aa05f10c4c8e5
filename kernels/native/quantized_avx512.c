/* The quantized product's tiles on AVX-512 with VNNI: one vpdpbusd multiplies 16 features'
 * codes (unsigned) by 4 broadcast activation codes (signed) and adds the 4 products into 16
 * int32 sums, 64 multiply-adds where an fp32 FMA does 16. See quantized.h for the layout. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")
#include <immintrin.h>

#include "quantized.h"

#define PREFETCH_AHEAD 1024 /* bytes: a few blocks ahead, as gemm.c's streams */

#define LOAD_CODES_4(blk, w)                                                         \
    for (int c = 0; c < 4; c++) {                                                    \
        __m512i v = _mm512_loadu_si512(blk + 64 * c);                                \
        w[c] = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));                          \
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); \
    }
#define LOAD_CODES_5(blk, w)                                                                 \
    LOAD_CODES_4(blk, w)                                                                     \
    for (int c = 0; c < 8; c++) w[c] = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(FP4_TABLE), w[c]);
#define LOAD_CODES_8(blk, w) \
    for (int c = 0; c < 8; c++) w[c] = _mm512_loadu_si512(blk + 64 * c);
#define LOAD_CODES_6(blk, w)                                                                  \
    LOAD_CODES_4(blk, w)                                                                      \
    for (int v = 0; v < 2; v++) {                                                             \
        __m512i high = _mm512_loadu_si512(blk + 256 + 64 * v);                                \
        for (int s = 0; s < 4; s++) {                                                         \
            __m512i two = _mm512_and_si512(_mm512_srli_epi16(high, 2 * s), _mm512_set1_epi8(3)); \
            w[4 * v + s] = _mm512_or_si512(w[4 * v + s], _mm512_slli_epi16(two, 4));          \
        }                                                                                     \
    }

/* ROWS rows against one panel, blocks in k order: a row's sums do not depend on its tile. */
#define QTILE(BITS, ROWS)                                                                       \
    static void tile##BITS##_##ROWS(const QProduct *p, long row, long panel) {                  \
        const long blocks = p->K / QBLOCK, bytes = qblock_bytes(BITS);                          \
        const long codes = QPANEL * QBLOCK * QSTORED_BITS(BITS) / 8;                            \
        __m512 out[ROWS];                                                                       \
        for (int j = 0; j < ROWS; j++) out[j] = _mm512_setzero_ps();                            \
        for (long b = 0; b < blocks; b++) {                                                     \
            const uint8_t *blk = p->w + (panel * blocks + b) * bytes;                           \
            _mm_prefetch((const char *)blk + PREFETCH_AHEAD, _MM_HINT_T0);                      \
            __m512i w[8];                                                                       \
            LOAD_CODES_##BITS(blk, w);                                                          \
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + codes)));     \
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + codes + 32))); \
            /* The rows' sums side by side: ROWS chains of vpdpbusd in flight, not one. */     \
            __m512i acc[2][ROWS]; /* the second: 6-bit codes' second half */                  \
            for (int j = 0; j < ROWS; j++) acc[0][j] = acc[1][j] = _mm512_setzero_si512();      \
            const int32_t *xq = (const int32_t *)(p->xq + (row * blocks + b) * QBLOCK);         \
            for (int c = 0; c < 8; c++) {                                                       \
                const int h = BITS == 6 && c >= 4;                                              \
                for (int j = 0; j < ROWS; j++)                                                  \
                    acc[h][j] = _mm512_dpbusd_epi32(acc[h][j], w[c],                            \
                                                    _mm512_set1_epi32(xq[j * p->K / 4 + c]));   \
            }                                                                                   \
            for (int j = 0; j < ROWS; j++) {                                                    \
                const long s = (row + j) * blocks + b;                                          \
                QFINISH(512, BITS, acc[0][j], acc[1][j], out[j])                                \
            }                                                                                   \
        }                                                                                       \
        float tile[ROWS][QPANEL];                                                               \
        for (int j = 0; j < ROWS; j++) _mm512_storeu_ps(tile[j], out[j]);                       \
        qstore_tile(p, row, ROWS, panel * QPANEL, tile[0]);                                     \
    }

QPRODUCTS(qproduct_avx512)
