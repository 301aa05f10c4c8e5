/* Projections on AMX-INT8 tiles (`--cpu-products tiles`; kernels/int8_tiles.py packs them):
 * y = x @ W.T (+ bias) (+ residual). W is requantized at load to int8 with one scale a feature,
 * stored as B tiles [16 quads of inputs][16 features][4]; each row of x is quantized to 16 bits
 * with one scale, q = 256 hi + lo (hi signed, lo unsigned bytes), so a row's product is two
 * integer sums over all of K that stay in the tiles: y = (256 S_hi + S_lo) (sx sw) in float.
 * (GGUF's scales per 32 inputs take the sums out of the tiles every block, which did not pay:
 * docs/benchmarks.md.) A row's arithmetic is its own, so its bits do not depend on its batch.
 * A gate-up product can end in silu(gate) * up (`gated_int8_tiles`), gate and up never stored. */
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,fma")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "simd.h"

enum { ROWS = 16, PANEL = 16, QUAD_BYTES = 64, TILE_BYTES = 1024 };
#define A_BLOCK_BYTES (256 * 1024) /* the rows' codes a task keeps against its two panels */

/* Each row to 16-bit codes, round(x / sx) with sx = max|x| / 32767, split into bytes. */
static void quantize_rows(const float *x, long M, long K, long padded_k, int8_t *hi, uint8_t *lo,
                          float *sx) {
#pragma omp parallel for if (M >= 16)
    for (long r = 0; r < M; r++) {
        const float *row = x + r * K;
        __m512 top = _mm512_setzero_ps();
        for (long i = 0; i < K; i += 16)
            top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
        const float s = _mm512_reduce_max_ps(top) / 32767.0f;
        const __m512 inverse = _mm512_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
        const __m512i most = _mm512_set1_epi32(32767), least = _mm512_set1_epi32(-32767);
        for (long i = 0; i < K; i += 16) {
            __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(row + i), inverse);
            __m512i q = _mm512_cvt_roundps_epi32(scaled,
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_max_epi32(_mm512_min_epi32(q, most), least);
            __m128i high = _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 8));
            __m128i low = _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(255)));
            _mm_storeu_si128((__m128i *)(hi + r * padded_k + i), high);
            _mm_storeu_si128((__m128i *)(lo + r * padded_k + i), low);
        }
        memset(hi + r * padded_k + K, 0, padded_k - K);
        memset(lo + r * padded_k + K, 0, padded_k - K);
        sx[r] = s;
    }
}

typedef struct {
    const int8_t *hi;
    const uint8_t *lo; /* [rows padded to 16][padded K] */
    const float *sx;
    const int8_t *w; /* [panels][padded K / 64][TILE_BYTES] */
    const float *sw; /* [panels * 16] */
    float *y;
    const float *bias, *residual;
    long M, N, quads, ldy;
    long gated; /* y = silu(gate) * up of panels t and t + gated; 0: a plain product */
} Product;

/* Row j's 16 values of a panel from its sums (tiles: [S_hi, S_lo]), before bias and residual. */
static inline __m512 value(const Product *p, long row, int j, const int32_t *sums, __m512 sw) {
    const int32_t *s_hi = sums + j * PANEL, *s_lo = s_hi + ROWS * PANEL;
    const __m512 total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s_hi)),
                                         _mm512_set1_ps(256.0f),
                                         _mm512_cvtepi32_ps(_mm512_load_si512(s_lo)));
    return _mm512_mul_ps(total, _mm512_mul_ps(_mm512_set1_ps(p->sx[row + j]), sw));
}

/* Sums of a panel to y for `rows` rows of 16 features, with the bias and then the residual
 * added as store_rows adds them. */
static void finish(const Product *p, long row, int rows, long first, const int32_t *sums) {
    const long width = p->N - first < PANEL ? p->N - first : PANEL;
    const __mmask16 lanes = (__mmask16)((1u << width) - 1);
    const __m512 sw = _mm512_loadu_ps(p->sw + first);
    const __m512 zero = _mm512_setzero_ps();
    const __m512 bias = p->bias ? _mm512_maskz_loadu_ps(lanes, p->bias + first) : zero;
    for (int j = 0; j < rows; j++) {
        __m512 v = value(p, row, j, sums, sw);
        if (p->bias) v = _mm512_add_ps(v, bias);
        const long at = (row + j) * p->ldy + first;
        if (p->residual) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, p->residual + at));
        _mm512_mask_storeu_ps(p->y + at, lanes, v);
    }
}

/* silu(gate) * up for `rows` rows of 16 features, gate's sums then up's: the values and
 * decode_layer.c's silu_and_multiply in the same arithmetic, so the same bits. */
static void finish_gated(const Product *p, long row, int rows, long first, const int32_t *sums) {
    const __m512 sw_gate = _mm512_loadu_ps(p->sw + first);
    const __m512 sw_up = _mm512_loadu_ps(p->sw + first + p->gated * PANEL);
    for (int j = 0; j < rows; j++) {
        const __m512 gate = value(p, row, j, sums, sw_gate);
        const __m512 up = value(p, row, j, sums + 2 * ROWS * PANEL, sw_up);
        float *to = p->y + (row + j) * p->ldy + first;
        _mm256_storeu_ps(to, silu_times(_mm512_castps512_ps256(gate), _mm512_castps512_ps256(up)));
        _mm256_storeu_ps(to + 8, silu_times(_mm512_extractf32x8_ps(gate, 1),
                                            _mm512_extractf32x8_ps(up, 1)));
    }
}

/* Rows [row, row + 16) against panel `panel` and panel `second` (where `two`): tiles 0-1 the
 * first panel's S_hi and S_lo, 2-3 the second's; 4-5 A (hi, lo); 6-7 B. */
static void run_rows(const Product *p, long row, long panel, long second, int two,
                     int32_t *sums) {
    const long k = p->quads * QUAD_BYTES;
    const int8_t *hi = p->hi + row * k, *b0 = p->w + panel * p->quads * TILE_BYTES;
    const uint8_t *lo = p->lo + row * k;
    const int8_t *b1 = p->w + second * p->quads * TILE_BYTES;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    /* Each load waits only on products issued a while before: tiles are not renamed. */
    for (long q = 0; q < p->quads; q++) {
        TILE_LOAD(4, hi + q * QUAD_BYTES, k);
        TILE_LOAD(6, b0 + q * TILE_BYTES, 64);
        _tile_dpbssd(0, 4, 6);
        if (two) {
            TILE_LOAD(7, b1 + q * TILE_BYTES, 64);
            _tile_dpbssd(2, 4, 7);
        }
        TILE_LOAD(5, lo + q * QUAD_BYTES, k);
        _tile_dpbusd(1, 5, 6);
        if (two) _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, sums, 64);
    _tile_stored(1, sums + 256, 64);
    _tile_stored(2, sums + 512, 64);
    _tile_stored(3, sums + 768, 64);
    const int rows = p->M - row < ROWS ? (int)(p->M - row) : ROWS;
    if (p->gated) return finish_gated(p, row, rows, panel * PANEL, sums);
    finish(p, row, rows, panel * PANEL, sums);
    if (two) finish(p, row, rows, second * PANEL, sums + 512);
}

/* The product's rows quantized, then its tasks (blocks of rows x pairs of panels) shared by the
 * threads: pairs of adjacent panels, or, gated, gate panel t with up panel t + gated. */
static int run(const float *x, Product p, long K) {
    const long quads = p.quads, padded_k = quads * QUAD_BYTES, M = p.M;
    const long padded = (M + ROWS - 1) / ROWS * ROWS;
    int8_t *codes = (int8_t *)thread_scratch(2 * padded * padded_k + sizeof(float) * padded);
    if (!codes) return -1;
    float *sx = (float *)(codes + 2 * padded * padded_k);
    int8_t *hi = codes;
    uint8_t *lo = (uint8_t *)codes + padded * padded_k;
    memset(hi + M * padded_k, 0, (padded - M) * padded_k);
    memset(lo + M * padded_k, 0, (padded - M) * padded_k);
    quantize_rows(x, M, K, padded_k, hi, lo, sx);
    p.hi = hi, p.lo = lo, p.sx = sx;
    const long panels = (p.N + PANEL - 1) / PANEL;
    const long pairs = p.gated ? p.gated : (panels + 1) / 2;
    /* Blocks of rows of equal size (a statically shared rest would idle the other threads). */
    const long most = A_BLOCK_BYTES / (2 * padded_k) / ROWS * ROWS;
    const long row_blocks = most < ROWS ? padded / ROWS : (padded + most - 1) / most;
    const long block_rows = (padded / ROWS + row_blocks - 1) / row_blocks * ROWS;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        int32_t *sums = aligned_alloc(64, sizeof(int32_t) * 4 * ROWS * PANEL);
        failed = !sums;
        configure_tiles();
#pragma omp for schedule(static)
        for (long t = 0; t < row_blocks * pairs; t++) {
            const long pair = t % pairs, first = t / pairs * block_rows;
            const long panel = p.gated ? pair : 2 * pair;
            const long second = p.gated ? pair + p.gated : panel + 1;
            for (long row = first; !failed && row < first + block_rows && row < M; row += ROWS)
                run_rows(&p, row, panel, second, second < panels, sums);
        }
        _tile_release();
        free(sums);
    }
    return failed ? -1 : 0;
}

/* y = x @ W.T (+ bias) (+ residual), rows of y `ldy` apart; -1 where a buffer cannot be
 * allocated. */
int linear_int8_tiles(const float *x, const int8_t *w, const float *sw, float *y,
                      const float *bias, const float *residual, long M, long N, long K, long ldy) {
    if (M == 0) return 0; /* (a step's logits for no row) */
    const long quads = (K + QUAD_BYTES - 1) / QUAD_BYTES;
    return run(x, (Product){NULL, NULL, NULL, w, sw, y, bias, residual, M, N, quads, ldy, 0}, K);
}

/* act = silu(gate) * up for W = [gate | up], each n features (n a multiple of 16), act's rows
 * n apart: SiLU in the product's finish, so gate and up never leave it. -1 as above. */
int gated_int8_tiles(const float *x, const int8_t *w, const float *sw, float *act, long M,
                     long n, long K) {
    if (M == 0) return 0;
    const long quads = (K + QUAD_BYTES - 1) / QUAD_BYTES;
    const Product p = {NULL, NULL, NULL, w, sw, act, NULL, NULL, M, 2 * n, quads, n, n / PANEL};
    return run(x, p, K);
}
