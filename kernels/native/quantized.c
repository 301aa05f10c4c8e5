/* y = x @ W.T (+ bias) (+ residual) with W in quantized panels (quantized.h): the activations
 * quantized once a call, then tiles of rows against panels on the ISA the caller names. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "quantized.h"
#include "simd.h"

/* 256-bit VNNI in the encoding this CPU has: AVX-VNNI's, else AVX512-VL's. */
Product qproduct_for(int isa) {
    if (isa == ISA_AVX512_VNNI) return qproduct_avx512;
    if (isa != ISA_AVX_VNNI) return qproduct_avx2;
    return __builtin_cpu_supports("avxvnni") ? qproduct_avx_vnni : qproduct_avx512vl_vnni;
}

static inline int sum_ints(__m256i v) {
    __m128i total = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    total = _mm_hadd_epi32(total, total);
    return _mm_cvtsi128_si32(_mm_hadd_epi32(total, total));
}

/* Per block of 32: dx = max|x| / 127, codes round(x / dx) (to nearest even, as torch.round),
 * and dx times their sum, and times each half's, which the weights' offsets multiply; the sum
 * itself for AVX2's 8-bit tiles (quantized_avx2.c). */
void qquantize_rows(const float *x, long M, long K, int8_t *xq, float *dx, float *sx, float *sh,
                    int32_t *qs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for if (M >= 16)
    for (long s = 0; s < M * (K / QBLOCK); s++) {
        const float *v = x + s * QBLOCK;
        __m256 part[4], top = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            part[i] = _mm256_loadu_ps(v + 8 * i);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, part[i]));
        }
        const float d = max_lanes(top) / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
        __m256i q[4];
        for (int i = 0; i < 4; i++) {
            __m256 scaled = _mm256_mul_ps(part[i], _mm256_set1_ps(inverse));
            q[i] = _mm256_cvtps_epi32(
                _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        /* int32 to int8 in order: the packs interleave 128-bit lanes, the permute undoes it. */
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                           _mm256_packs_epi32(q[2], q[3]));
        bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + s * QBLOCK), bytes);
        const int first = sum_ints(_mm256_add_epi32(q[0], q[1]));
        const int second = sum_ints(_mm256_add_epi32(q[2], q[3]));
        dx[s] = d;
        qs[s] = first + second;
        sx[s] = d * (float)(first + second);
        sh[2 * s] = d * (float)first;
        sh[2 * s + 1] = d * (float)second;
    }
}

void qstore_tile(const QProduct *p, long row, int rows, long first, const float *out) {
    const long width = p->N - first < QPANEL ? p->N - first : QPANEL;
    store_rows(p->y, p->bias, p->residual, p->ldy, row, rows, first, width, out);
}

#define TILE_ROWS 6
#define BLOCK_CODES 65536 /* bytes of activation codes in a block of rows (16-128 KB tried) */

/* A tile, its output rows (and their residual) asked for at its start: its products take long
 * enough to hide the misses, which a column of 64-byte pieces of rows otherwise waits on. */
static void tile(const QProduct *p, Product product, long row, int rows, long panel) {
    for (long j = row; j < row + rows; j++) {
        const long at = j * p->ldy + panel * QPANEL;
        if (p->residual) _mm_prefetch((const char *)(p->residual + at), _MM_HINT_T0);
        __builtin_prefetch(p->y + at, 1);
    }
    product(p, row, rows, panel);
}

/* Rows of y (and of the residual) `ldy` apart: a part of a stacked weight fills its columns.
 * Returns -1 where the activations' codes cannot be allocated. */
int linear_quantized(const float *x, const uint8_t *w, float *y, const float *bias,
                     const float *residual, long M, long N, long K, long ldy, int bits, int isa) {
    const long blocks = K / QBLOCK;
    int8_t *xq = malloc(M * K);
    float *scales = malloc(sizeof(float) * 5 * M * blocks); /* dx, sx, sh (two a block), qs */
    if (!xq || !scales) {
        free(xq);
        free(scales);
        return -1;
    }
    float *sx = scales + M * blocks, *sh = sx + M * blocks;
    int32_t *qs = (int32_t *)(sh + 2 * M * blocks);
    qquantize_rows(x, M, K, xq, scales, sx, sh, qs);
    QProduct p = {xq, scales, sx, sh, qs, w, y, bias, residual, M, N, K, ldy, bits};
    const Product product = qproduct_for(isa);
    const long panels = (N + QPANEL - 1) / QPANEL, full = M / TILE_ROWS * TILE_ROWS;
    long block_rows = BLOCK_CODES / K / TILE_ROWS * TILE_ROWS;
    block_rows = block_rows < TILE_ROWS ? TILE_ROWS : block_rows;
    const long row_blocks = full > 4 * block_rows ? (full + block_rows - 1) / block_rows : 1;
    const int rest = (int)(M - full);
#pragma omp parallel
    {
        /* As gemm.c: with fewer rows than a tile, a contiguous share per thread streams. */
        const long threads = omp_get_num_threads();
        const long chunk = full ? 1 : (panels + threads - 1) / threads;
        /* Many rows: a block of them against every panel, then the next, so that their codes
         * stay in the core's caches while the weights stream (docs/benchmarks.md). */
#pragma omp for schedule(dynamic, chunk)
        for (long t = 0; t < row_blocks * panels; t++) {
            const long q = t % panels, first = t / panels * block_rows;
            const long end = t / panels == row_blocks - 1 ? full : first + block_rows;
            for (long row = first; row < end; row += TILE_ROWS)
                tile(&p, product, row, TILE_ROWS, q);
            if (rest && end == full) tile(&p, product, full, rest, q);
        }
    }
    free(xq);
    free(scales);
    return 0;
}
