/* y = x @ W.T (+ bias) (+ residual) on AMX-BF16 tiles for bf16 weights in gemm.c's panels
 * (`--cpu-bf16-products tiles`): each row of x rounded to bf16, the products summed in fp32 over
 * all of K in the tiles, the bias and residual added as the sums leave them. K a multiple of
 * 32. Tasks (a block of rows x two panels) are shared by the threads; a block's rows are read
 * against its panels from L2. Figures: docs/benchmarks.md. */
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#include <omp.h>

#include "bf16_tiles.h"

#define A_BLOCK_BYTES (256 * 1024) /* the rows a task keeps against its two panels */

typedef struct {
    const uint16_t *x, *w; /* rows [padded M][K]; panels [N / 16][K / 2][16][2] */
    float *y;
    const float *bias, *residual;
    long M, N, K;
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

/* Rows [first, end) against panels `panel` and `panel + 1` (where there is one). */
static void task(const Product *p, long first, long end, long panel, float *sums) {
    const long K = p->K, chunks = K / CHUNK, panels = (p->N + PANEL - 1) / PANEL;
    const uint16_t *b0 = p->w + panel * PANEL * K;
    const int second = panel + 1 < panels;
    for (long row = first; row < end; row += 2 * ROWS) {
        const int rows = end - row < 2 * ROWS ? (int)(end - row) : 2 * ROWS;
        /* one panel: tile 7 multiplies panel 0 again, its sums left unread */
        products(p->x + row * K, K, chunks, rows > ROWS, b0, second ? b0 + PANEL * K : b0,
                 TILE_ELEMS, sums);
        for (int half = 0; half < 1 + second; half++)
            finish(p, row, rows, panel + half, sums + half * ROWS * PANEL);
    }
}

/* -1 where the rows' scratch cannot be allocated. */
int linear_bf16_tiles(const float *x, const uint16_t *w, float *y, const float *bias,
                      const float *residual, long M, long N, long K) {
    if (M == 0) return 0;
    const long padded = (M + ROWS - 1) / ROWS * ROWS;
    uint16_t *rows = (uint16_t *)thread_scratch(2 * padded * K);
    if (!rows) return -1;
    const Product p = {rows, w, y, bias, residual, M, N, K};
    const long panels = (N + PANEL - 1) / PANEL, pairs = (panels + 1) / 2;
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
            if (!failed && first < end) task(&p, first, end, 2 * (t % pairs), sums);
        }
        _tile_release();
        free(sums);
    }
    return failed ? -1 : 0;
}
