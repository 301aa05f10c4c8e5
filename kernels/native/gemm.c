/* y = x @ W.T (+ bias) (+ residual) for float32 activations and float32 or bfloat16 weights,
 * on x86-64 with AVX2 and FMA.
 *
 * W is stored in panels of 16 output features, each panel [K][16] (see `pack_weight` in
 * kernels/cpu_native.py): the inner loop reads one contiguous stream, which the hardware
 * prefetcher keeps ahead of, so a matrix-vector product (decode of one sequence) runs near
 * memory bandwidth, and one panel stays in L2 while every row of x passes over it, so the
 * larger products run near the FMA units' rate. bf16 weights are widened to fp32 in registers:
 * half the bytes to stream, fp32 arithmetic. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16

static inline __m256 load_f32(const float *w) { return _mm256_loadu_ps(w); }

static inline __m256 load_bf16(const uint16_t *w) {
    __m128i halves = _mm_loadu_si128((const __m128i *)w);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
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
    long width = p->N - first < PANEL ? p->N - first : PANEL;
    for (int j = 0; j < rows; j++, out += PANEL) {
        float *dst = p->y + (row + j) * p->N + first;
        const float *res = p->residual ? p->residual + (row + j) * p->N + first : NULL;
        for (long i = 0; i < width; i++) {
            float v = out[i];
            if (p->bias) v += p->bias[first + i];
            if (res) v += res[i];
            dst[i] = v;
        }
    }
}

/* ROWS rows of x against one panel: 2 * ROWS accumulators, the weight loaded once per k. */
#define TILE(NAME, WT, LOAD, ROWS)                                                             \
    static inline __attribute__((always_inline)) void NAME(const Product *p, const WT *panel, \
                                                           long first, long row) {            \
        __m256 lo[ROWS], hi[ROWS];                                                             \
        for (int j = 0; j < ROWS; j++) lo[j] = hi[j] = _mm256_setzero_ps();                    \
        const long K = p->K;                                                                   \
        const float *x = p->x + row * K;                                                       \
        for (long k = 0; k < K; k++) {                                                         \
            __m256 w_lo = LOAD(panel + k * PANEL), w_hi = LOAD(panel + k * PANEL + 8);         \
            for (int j = 0; j < ROWS; j++) {                                                   \
                __m256 xk = _mm256_broadcast_ss(x + j * K + k);                                \
                lo[j] = _mm256_fmadd_ps(w_lo, xk, lo[j]);                                      \
                hi[j] = _mm256_fmadd_ps(w_hi, xk, hi[j]);                                      \
            }                                                                                  \
        }                                                                                      \
        float out[ROWS][PANEL];                                                                \
        for (int j = 0; j < ROWS; j++) {                                                       \
            _mm256_storeu_ps(out[j], lo[j]);                                                   \
            _mm256_storeu_ps(out[j] + 8, hi[j]);                                               \
        }                                                                                      \
        store_tile(p, row, ROWS, first, out[0]);                                               \
    }

#define PRODUCT(SUFFIX, WT, LOAD)                                                              \
    TILE(tile1_##SUFFIX, WT, LOAD, 1)                                                          \
    TILE(tile2_##SUFFIX, WT, LOAD, 2)                                                          \
    TILE(tile3_##SUFFIX, WT, LOAD, 3)                                                          \
    TILE(tile4_##SUFFIX, WT, LOAD, 4)                                                          \
    TILE(tile5_##SUFFIX, WT, LOAD, 5)                                                          \
    TILE(tile6_##SUFFIX, WT, LOAD, 6)                                                          \
    void linear_##SUFFIX(const float *x, const WT *w, float *y, const float *bias,             \
                         const float *residual, long M, long N, long K) {                      \
        Product p = {x, y, bias, residual, M, N, K};                                           \
        long panels = (N + PANEL - 1) / PANEL;                                                 \
        _Pragma("omp parallel for schedule(static)") for (long t = 0; t < panels; t++) {       \
            const WT *panel = w + t * PANEL * K;                                               \
            long first = t * PANEL, row = 0;                                                   \
            for (; M - row >= 6; row += 6) tile6_##SUFFIX(&p, panel, first, row);              \
            switch (M - row) {                                                                 \
            case 5: tile5_##SUFFIX(&p, panel, first, row); break;                              \
            case 4: tile4_##SUFFIX(&p, panel, first, row); break;                              \
            case 3: tile3_##SUFFIX(&p, panel, first, row); break;                              \
            case 2: tile2_##SUFFIX(&p, panel, first, row); break;                              \
            case 1: tile1_##SUFFIX(&p, panel, first, row); break;                              \
            }                                                                                  \
        }                                                                                      \
    }

PRODUCT(f32, float, load_f32)
PRODUCT(bf16, uint16_t, load_bf16)
