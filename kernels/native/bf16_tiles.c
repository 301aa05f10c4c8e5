/* y = x @ W.T (+ bias) (+ residual) on AMX-BF16 tiles for bf16 weights in gemm.c's panels
 * (`--cpu-bf16-products tiles`): each row of x rounded to bf16, the products summed in fp32 over
 * all of K in the tiles, the bias and residual added as the sums leave them. K a multiple of
 * 32. Tasks (a block of rows x two panels) are shared by the threads; a block's rows are read
 * against its panels from L2. A gate-up product can end in silu(gate) * up
 * (`gated_bf16_tiles`), gate and up never stored. Figures: docs/benchmarks.md. */
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
#include <omp.h>

#include "bf16_tiles.h"
#include "simd.h"

#define A_BLOCK_BYTES (256 * 1024) /* the rows a task keeps against its two panels */

typedef struct {
    const uint16_t *x, *w; /* rows [padded M][K]; panels [N / 16][K / 2][16][2] */
    float *y;
    const float *bias, *residual;
    long M, N, K;
    long gated; /* y = silu(gate) * up of panels t and t + gated, rows N / 2 apart; 0: plain */
} Product;

/* Panel `panel`'s 16 outputs (fewer in a last, partial panel) of `rows` rows from `row`. */
static void finish(const Product *p, long row, int rows, long panel, const float *sums) {
    const long first = panel * PANEL, width = p->N - first < PANEL ? p->N - first : PANEL;
    const __mmask16 lanes = (__mmask16)((1u << width) - 1);
    const __m512 bias = p->bias ? _mm512_maskz_loadu_ps(lanes, p->bias + first)
                                : _mm512_setzero_ps();
    for (int j = 0; j < rows; j++) {
        __m512 v = _mm512_add_ps(_mm512_load_ps(sums + at(j)), bias);
        const long to = (row + j) * p->N + first;
        if (p->residual) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, p->residual + to));
        _mm512_mask_storeu_ps(p->y + to, lanes, v);
    }
}

/* silu(gate) * up for `rows` rows of 16 features: silu_and_multiply's arithmetic (lora.c),
 * so the same bits as the product stored and then gated. */
static void finish_gated(const Product *p, long row, int rows, long panel, const float *sums) {
    for (int j = 0; j < rows; j++) {
        const float *gate = sums + at(j), *up = gate + ROWS * PANEL;
        float *to = p->y + (row + j) * (p->N / 2) + panel * PANEL;
        for (int h = 0; h < PANEL; h += 8)
            _mm256_storeu_ps(to + h, silu_times(_mm256_load_ps(gate + h), _mm256_load_ps(up + h)));
    }
}

/* Rows [first, end) against panels `panel` and `panel + 1` (where there is one), or, gated,
 * gate panel `panel` and its up panel. */
static void task(const Product *p, long first, long end, long panel, float *sums) {
    const long K = p->K, chunks = K / CHUNK, panels = (p->N + PANEL - 1) / PANEL;
    const uint16_t *b0 = p->w + panel * PANEL * K;
    const long other = p->gated ? panel + p->gated : panel + 1;
    const int second = other < panels;
    /* one panel: tile 7 multiplies it again, its sums left unread */
    const uint16_t *b1 = p->w + (second ? other : panel) * PANEL * K;
    for (long row = first; row < end; row += 2 * ROWS) {
        const int rows = end - row < 2 * ROWS ? (int)(end - row) : 2 * ROWS;
        products(p->x + row * K, K, chunks, rows > ROWS, b0, b1, TILE_ELEMS, sums);
        if (p->gated) {
            finish_gated(p, row, rows, panel, sums);
            continue;
        }
        for (int half = 0; half < 1 + second; half++)
            finish(p, row, rows, panel + half, sums + half * ROWS * PANEL);
    }
}

/* The rows rounded, then the product's tasks; -1 where the rows' scratch cannot be allocated. */
static int run(const float *x, Product p) {
    const long M = p.M, K = p.K;
    const long padded = (M + ROWS - 1) / ROWS * ROWS;
    uint16_t *rows = (uint16_t *)thread_scratch(2 * padded * K);
    if (!rows) return -1;
    p.x = rows;
    const long panels = (p.N + PANEL - 1) / PANEL;
    const long pairs = p.gated ? p.gated : (panels + 1) / 2;
    /* Blocks of rows of equal size, whole tiles of 32 (a statically shared rest would idle
     * the other threads). */
    const long most = A_BLOCK_BYTES / (2 * K) / (2 * ROWS) * (2 * ROWS);
    const long blocks = most < 2 * ROWS ? (M + 2 * ROWS - 1) / (2 * ROWS) : (M + most - 1) / most;
    const long block_rows = ((M + blocks - 1) / blocks + 2 * ROWS - 1) / (2 * ROWS) * (2 * ROWS);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *sums = aligned_alloc(64, sizeof(float) * 4 * ROWS * PANEL);
        failed = !sums;
        configure_tiles();
#pragma omp for schedule(static)
        for (long r = 0; r < padded; r++) {
            if (r < M) round_bf16(x + r * K, rows + r * K, K);
            else memset(rows + r * K, 0, 2 * K); /* a last tile's rows past M: zeros */
        }
#pragma omp for schedule(static)
        for (long t = 0; t < blocks * pairs; t++) {
            const long first = t / pairs * block_rows;
            const long end = first + block_rows < M ? first + block_rows : M;
            const long panel = p.gated ? t % pairs : 2 * (t % pairs);
            if (!failed && first < end) task(&p, first, end, panel, sums);
        }
        _tile_release();
        free(sums);
    }
    return failed ? -1 : 0;
}

/* -1 where the rows' scratch cannot be allocated. */
int linear_bf16_tiles(const float *x, const uint16_t *w, float *y, const float *bias,
                      const float *residual, long M, long N, long K) {
    if (M == 0) return 0;
    return run(x, (Product){NULL, w, y, bias, residual, M, N, K, 0});
}

/* act = silu(gate) * up for W = [gate | up], each n features (n a multiple of 16), act's rows
 * n apart: SiLU as the sums leave the tiles, gate and up never stored. -1 as above. */
int gated_bf16_tiles(const float *x, const uint16_t *w, float *act, long M, long n, long K) {
    if (M == 0) return 0;
    return run(x, (Product){NULL, w, act, NULL, NULL, M, 2 * n, K, n / PANEL});
}
