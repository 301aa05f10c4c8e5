/* y = x @ W.T (+ bias) (+ residual) for float32 activations and float32 or bfloat16 weights,
 * on x86-64 with AVX2 and FMA.
 *
 * W is stored in panels of 16 output features, each panel [K][16] in float32, [K / 2][16][2] in
 * bf16 (see `pack_weight` in kernels/cpu_native.py): the inner loop reads one contiguous
 * stream, which the hardware prefetcher keeps ahead of, so a matrix-vector product (decode of
 * one sequence) runs near memory bandwidth, and one panel stays in L2 while every row of x
 * passes over it, so the larger products run near the FMA units' rate. bf16 weights are
 * widened to fp32 in registers: half the bytes to stream, fp32 arithmetic. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PANEL 16

/* A panel's rows of inputs: a bf16 panel's K padded to whole pairs. */
#define PANEL_K(WT, K) (sizeof(WT) == 2 ? ((K) + 1) / 2 * 2 : (K))

/* Input k's weights of a panel's 16 outputs. float32 panels are [K][16]. */
static inline void load_f32(const float *panel, long k, __m256 *lo, __m256 *hi) {
    *lo = _mm256_loadu_ps(panel + k * PANEL);
    *hi = _mm256_loadu_ps(panel + k * PANEL + 8);
}

/* bf16 panels are [K / 2][16][2], the layout of AMX-BF16's B tiles: inputs k and k + 1 of an
 * output side by side in a 32-bit lane. Shifting the lanes up gives input k's fp32 values,
 * masking off their low halves input k + 1's: cheap ops on a port the FMAs leave free. The
 * loads of a pair's two inputs read the same lines, from L1 the second time. */
static inline void load_bf16(const uint16_t *panel, long k, __m256 *lo, __m256 *hi) {
    const uint16_t *pairs = panel + (k >> 1) * 2 * PANEL;
    const __m256i low = _mm256_loadu_si256((const __m256i *)pairs);
    const __m256i high = _mm256_loadu_si256((const __m256i *)(pairs + PANEL));
    if (k & 1) {
        const __m256i mask = _mm256_set1_epi32((int)0xFFFF0000u);
        *lo = _mm256_castsi256_ps(_mm256_and_si256(low, mask));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(high, mask));
    } else {
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(low, 16));
        *hi = _mm256_castsi256_ps(_mm256_slli_epi32(high, 16));
    }
}

typedef struct {
    const float *x;        /* [M][K] */
    float *y;              /* [M][N] */
    const float *bias;     /* [N] or NULL */
    const float *residual; /* [M][N] or NULL; may be y itself */
    long M, N, K;
} Product;

/* Writes `rows` rows of one panel's outputs (fewer than 16 in a last, partial panel), adding
 * bias and residual. Kept out of line: the accumulators leave registers once, here, rather than
 * the compiler keeping a memory copy of them updated through the whole inner loop. */
static __attribute__((noinline)) void store_tile(const Product *p, long row, int rows, long first,
                                                 const float *out) {
    const long width = p->N - first < PANEL ? p->N - first : PANEL;
    store_rows(p->y, p->bias, p->residual, p->N, row, rows, first, width, out);
}

/* How far ahead of the loads a tile that streams its panel from memory prefetches it, in steps
 * of k: 2 KB of a bf16 panel, 4 KB of a float32 one (past the panel's end, into the next panel,
 * which the same thread usually takes). The hardware prefetcher alone ramps up anew at every
 * matrix and every share of one. Ad hoc, over the model's 120 layer matrices with cold caches
 * (median of 9, four runs): 1 row 0-16% faster, 2-4 rows 14-26%, 16 rows 5-9%, 47 rows and
 * more unchanged. */
#define PREFETCH_AHEAD 64

/* ROWS rows of x against PANELS consecutive panels: 2 * ROWS * PANELS accumulators, each weight
 * loaded once per k. Row j's k-th input is x[j * ROW_STEP + k * K_STEP]: rows of x as they
 * are, or a packed tile. PREFETCH: whether this tile is the first over its panels, so reads
 * them from memory. A sum is one chain of dependent FMAs, in k order whatever the tile, so a
 * row's result does not depend on the rows beside it; a tile of few rows takes several panels
 * so that enough chains are in flight to cover the FMA's latency. */
#define TILE(NAME, WT, LOAD, ROWS, PANELS, ROW_STEP, K_STEP, PREFETCH)                         \
    static inline __attribute__((always_inline)) void NAME(const Product *p, const WT *panel, \
                                                           const float *x, long first,        \
                                                           long row) {                        \
        __m256 lo[PANELS][ROWS], hi[PANELS][ROWS];                                             \
        for (int q = 0; q < PANELS; q++)                                                       \
            for (int j = 0; j < ROWS; j++) lo[q][j] = hi[q][j] = _mm256_setzero_ps();          \
        const long K = p->K;                                                                   \
        _Pragma("GCC unroll 4") for (long k = 0; k < K; k++) {                                 \
            for (int q = 0; q < PANELS; q++) {                                                 \
                const WT *w = panel + q * PANEL * PANEL_K(WT, K);                              \
                __m256 w_lo, w_hi;                                                             \
                if (PREFETCH)                                                                  \
                    _mm_prefetch((const char *)(w + (k + PREFETCH_AHEAD) * PANEL), _MM_HINT_T0); \
                LOAD(w, k, &w_lo, &w_hi);                                                      \
                for (int j = 0; j < ROWS; j++) {                                               \
                    __m256 xk = _mm256_broadcast_ss(x + j * (ROW_STEP) + k * (K_STEP));        \
                    lo[q][j] = _mm256_fmadd_ps(w_lo, xk, lo[q][j]);                            \
                    hi[q][j] = _mm256_fmadd_ps(w_hi, xk, hi[q][j]);                            \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int q = 0; q < PANELS; q++) {                                                     \
            float out[ROWS][PANEL];                                                            \
            for (int j = 0; j < ROWS; j++) {                                                   \
                _mm256_storeu_ps(out[j], lo[q][j]);                                            \
                _mm256_storeu_ps(out[j] + 8, hi[q][j]);                                        \
            }                                                                                  \
            store_tile(p, row, ROWS, first + q * PANEL, out[0]);                               \
        }                                                                                      \
    }

/* Six rows of x at a time, each tile copied to [K][6]: the six inputs of a k side by side in one
 * stream instead of six rows apart, which alone makes the large products ~20% faster. */
#define TILE_ROWS 6

static void pack_tiles(const Product *p, float *tiles, long count) {
    const long K = p->K;
#pragma omp for schedule(static)
    for (long t = 0; t < count; t++) {
        const float *x = p->x + t * TILE_ROWS * K;
        float *tile = tiles + t * TILE_ROWS * K;
        for (long k = 0; k < K; k++)
            for (int j = 0; j < TILE_ROWS; j++) tile[k * TILE_ROWS + j] = x[j * K + k];
    }
}

/* Panels a thread takes at a time: enough that the rows left over after the full tiles keep
 * eight chains of FMAs in flight (an FMA's latency is four cycles, and two issue a cycle). */
static long group_for(long rest) { return rest == 1 ? 4 : rest == 2 ? 2 : 1; }

#define PRODUCT(SUFFIX, WT, LOAD)                                                              \
    /* A remainder tile is the first over its panels when there are fewer rows than a tile; \
     * after full tiles its prefetches hit L2, at the cost of one tile in many. */         \
    TILE(tile1x4_##SUFFIX, WT, LOAD, 1, 4, K, 1, 1)                                            \
    TILE(tile2x2_##SUFFIX, WT, LOAD, 2, 2, K, 1, 1)                                            \
    TILE(tile1_##SUFFIX, WT, LOAD, 1, 1, K, 1, 1)                                              \
    TILE(tile2_##SUFFIX, WT, LOAD, 2, 1, K, 1, 1)                                              \
    TILE(tile3_##SUFFIX, WT, LOAD, 3, 1, K, 1, 1)                                              \
    TILE(tile4_##SUFFIX, WT, LOAD, 4, 1, K, 1, 1)                                              \
    TILE(tile5_##SUFFIX, WT, LOAD, 5, 1, K, 1, 1)                                              \
    TILE(tile6_##SUFFIX, WT, LOAD, 6, 1, K, 1, 1)                                              \
    TILE(first_packed6_##SUFFIX, WT, LOAD, 6, 1, 1, TILE_ROWS, 1)                              \
    TILE(packed6_##SUFFIX, WT, LOAD, 6, 1, 1, TILE_ROWS, 0)                                    \
    /* The rows after the full tiles, against `count` panels from `panel` (a whole group takes \
     * the wide tile; the last, partial group of a matrix one panel at a time). */           \
    static void rest_##SUFFIX(const Product *p, const WT *panel, const float *rest, long first, \
                              long row, long count) {                                          \
        const long K = p->K, rows = p->M - row;                                                \
        if (rows == 1 && count == 4) { tile1x4_##SUFFIX(p, panel, rest, first, row); return; }  \
        if (rows == 2 && count == 2) { tile2x2_##SUFFIX(p, panel, rest, first, row); return; }  \
        for (long q = 0; q < count; q++, panel += PANEL * PANEL_K(WT, K), first += PANEL) {    \
            switch (rows) {                                                                    \
            case 5: tile5_##SUFFIX(p, panel, rest, first, row); break;                         \
            case 4: tile4_##SUFFIX(p, panel, rest, first, row); break;                         \
            case 3: tile3_##SUFFIX(p, panel, rest, first, row); break;                         \
            case 2: tile2_##SUFFIX(p, panel, rest, first, row); break;                         \
            case 1: tile1_##SUFFIX(p, panel, rest, first, row); break;                         \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    void linear_##SUFFIX(const float *x, const WT *w, float *y, const float *bias,             \
                         const float *residual, long M, long N, long K) {                      \
        Product p = {x, y, bias, residual, M, N, K};                                           \
        const long panels = (N + PANEL - 1) / PANEL, full = M / TILE_ROWS;                     \
        const long group = group_for(M - full * TILE_ROWS);                                    \
        const long groups = (panels + group - 1) / group;                                      \
        /* Without the memory to pack into, the tiles are read where they are. */              \
        float *tiles = full ? malloc(sizeof(float) * full * TILE_ROWS * K) : NULL;             \
        _Pragma("omp parallel") {                                                              \
            if (tiles) pack_tiles(&p, tiles, full);                                            \
            /* Panels handed out a group at a time, so a thread the OS preempts (another      \
             * process of the server needing the CPU) holds up one group, not a static share;  \
             * but with fewer rows than a tile the product streams its weights at memory      \
             * speed, where one contiguous share per thread keeps each on one prefetched      \
             * stream. */                                                                      \
            const long threads = omp_get_num_threads();                                        \
            const long chunk = full ? 1 : (groups + threads - 1) / threads;                    \
            _Pragma("omp for schedule(dynamic, chunk)") for (long g = 0; g < groups; g++) {    \
                const long first_panel = g * group;                                            \
                const long count = panels - first_panel < group ? panels - first_panel : group; \
                for (long q = 0; q < count; q++) {                                             \
                    const WT *panel = w + (first_panel + q) * PANEL * PANEL_K(WT, K);          \
                    const long first = (first_panel + q) * PANEL;                              \
                    for (long row = 0; row < full * TILE_ROWS; row += TILE_ROWS) {             \
                        if (tiles && row == 0) first_packed6_##SUFFIX(&p, panel, tiles, first, 0); \
                        else if (tiles) packed6_##SUFFIX(&p, panel, tiles + row * K, first, row); \
                        else tile6_##SUFFIX(&p, panel, x + row * K, first, row);               \
                    }                                                                          \
                }                                                                              \
                const long row = full * TILE_ROWS;                                             \
                rest_##SUFFIX(&p, w + first_panel * PANEL * PANEL_K(WT, K), x + row * K,       \
                              first_panel * PANEL, row, count);                                \
            }                                                                                  \
        }                                                                                      \
        free(tiles);                                                                           \
    }

PRODUCT(f32, float, load_f32)
PRODUCT(bf16, uint16_t, load_bf16)
