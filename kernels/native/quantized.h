/* Projections on weights kept in their GGUF blocks (see kernels/quantized_weights.py): each
 * weight is `d * code + m` with one scale d and offset m (fp16) per block of 32 inputs of an
 * output feature, and codes of 4 or 8 bits; or (6 bits, Q6_K) d per 16 inputs and m = -32 d;
 * or MXFP4's e2m1 codes in 4 bits, read through a table (QFP4 below).
 * The activations are quantized per block of 32 to int8 (`qquantize_rows`, llama.cpp's way), so
 * a block's dot product is one integer sum (two for 6-bit codes, one a half):
 *   sum_k w_k x_k ~= d * dx * sum_k code_k xq_k + m * dx * sum_k xq_k.
 * Weights are stored in panels of 16 output features; in a panel, each block is its codes in
 * 8 groups of 4 inputs, a group's 16 features x 4 inputs in one 64-byte vector (4-bit codes:
 * groups c and c + 4 share a vector, low and high nibbles; 6-bit: so, then two vectors whose
 * bytes hold the 2 high bits of groups 4v to 4v + 3), then the 16 d, then the 16 m (6-bit:
 * the 16 d of the block's first half, then of its second). */
#pragma once
#include <stdint.h>

#define QPANEL 16
#define QBLOCK 32
/* MXFP4's e2m1 codes: stored as 4-bit codes are, read through a table as 2 e2m1 + 12 (0-24),
 * with d half the block's power of two and m = -12 d. */
#define QFP4 5
#define QSTORED_BITS(bits) ((bits) == QFP4 ? 4 : (bits))
/* e2m1 code (sign, two exponent bits, one mantissa bit) -> 2 e2m1 + 12, for vpshufb. */
#define FP4_TABLE _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)

/* One block of a panel: codes, then d and m as fp16. */
static inline long qblock_bytes(int bits) {
    return QPANEL * QBLOCK * QSTORED_BITS(bits) / 8 + 2 * QPANEL * 2;
}

typedef struct {
    const int8_t *xq;      /* [M][K] the activations' codes */
    const float *dx;       /* [M][K / 32] their scales */
    const float *sx;       /* [M][K / 32] dx * the sum of a block's codes */
    const float *sh;       /* [M][K / 16] dx * the sum of each half block's codes */
    const int32_t *qs;     /* [M][K / 32] the sum of a block's codes */
    const uint8_t *w;      /* the panels */
    float *y;              /* [M][N] */
    const float *bias;     /* [N] or NULL */
    const float *residual; /* [M][N] or NULL; may be y itself */
    long M, N, K;
    long ldy;              /* y's and the residual's row stride: N, or more for a part's columns */
    int bits;
} QProduct;

typedef void (*Product)(const QProduct *, long, int, long);

void qstore_tile(const QProduct *p, long row, int rows, long first, const float *out);
/* `M` rows of x [M][K] quantized per block of 32 (quantized.c): codes, dx, sx, sh, qs. */
void qquantize_rows(const float *x, long M, long K, int8_t *xq, float *dx, float *sx, float *sh,
                    int32_t *qs);
/* The tiles of the ISA numbered `isa` (simd.h), as this CPU encodes them. */
Product qproduct_for(int isa);
/* Rows [row, row + rows) (at most 6) against one panel. */
void qproduct_avx2(const QProduct *p, long row, int rows, long panel);
void qproduct_avx_vnni(const QProduct *p, long row, int rows, long panel);
void qproduct_avx512vl_vnni(const QProduct *p, long row, int rows, long panel);
void qproduct_avx512(const QProduct *p, long row, int rows, long panel);

/* A row's block sums into OUT, in vectors of V bits (256 or 512) of output features: `d`, `m`
 * (the block's scales), `p` and `s` (the row's block) in scope; LO and HI the integer sums, HI
 * of the second half block (6-bit codes: one sum a half, each with its scale). One macro for
 * every ISA: the same float steps, so the same bits. In two steps, the first of LO alone, for a
 * tile that finishes the first half of 6-bit codes before it sums the second. */
#define QFINISH_FIRST(V, BITS, LO, OUT)                                                       \
    if (BITS == 6) {                                                                          \
        __m##V lo = _mm##V##_fmadd_ps(_mm##V##_cvtepi32_ps(LO), _mm##V##_set1_ps(p->dx[s]),   \
                                      _mm##V##_set1_ps(-32.0f * p->sh[2 * s]));               \
        OUT = _mm##V##_fmadd_ps(d, lo, OUT);                                                  \
    } else {                                                                                  \
        __m##V dd = _mm##V##_mul_ps(d, _mm##V##_set1_ps(p->dx[s]));                           \
        OUT = _mm##V##_fmadd_ps(_mm##V##_cvtepi32_ps(LO), dd, OUT);                           \
    }
#define QFINISH_SECOND(V, BITS, HI, OUT)                                                      \
    if (BITS == 6) {                                                                          \
        __m##V hi = _mm##V##_fmadd_ps(_mm##V##_cvtepi32_ps(HI), _mm##V##_set1_ps(p->dx[s]),   \
                                      _mm##V##_set1_ps(-32.0f * p->sh[2 * s + 1]));           \
        OUT = _mm##V##_fmadd_ps(m, hi, OUT);                                                  \
    } else {                                                                                  \
        OUT = _mm##V##_fmadd_ps(m, _mm##V##_set1_ps(p->sx[s]), OUT);                          \
    }
#define QFINISH(V, BITS, LO, HI, OUT) \
    QFINISH_FIRST(V, BITS, LO, OUT)   \
    QFINISH_SECOND(V, BITS, HI, OUT)

/* Each ISA's file defines QTILE(BITS, ROWS), a tile function tileBITS_ROWS(p, row, panel) over
 * one panel, then expands QPRODUCTS(name): every tile, and `name`, which picks one by rows.
 * Tiles over several panels for few rows (as gemm.c's) measured slower here: their codes and
 * sums spill out of the registers. */
#define QTILES(BITS)                                                                           \
    QTILE(BITS, 1) QTILE(BITS, 2) QTILE(BITS, 3) QTILE(BITS, 4) QTILE(BITS, 5) QTILE(BITS, 6)  \
    static void product##BITS(const QProduct *p, long row, int rows, long panel) {             \
        switch (rows) {                                                                        \
        case 6: tile##BITS##_6(p, row, panel); break;                                          \
        case 5: tile##BITS##_5(p, row, panel); break;                                          \
        case 4: tile##BITS##_4(p, row, panel); break;                                          \
        case 3: tile##BITS##_3(p, row, panel); break;                                          \
        case 2: tile##BITS##_2(p, row, panel); break;                                          \
        case 1: tile##BITS##_1(p, row, panel); break;                                          \
        }                                                                                      \
    }

#define QPRODUCTS(NAME)                                                                      \
    QTILES(4)                                                                                \
    QTILES(5)                                                                                \
    QTILES(6)                                                                                \
    QTILES(8)                                                                                \
    void NAME(const QProduct *p, long row, int rows, long panel) {                           \
        if (p->bits == 4) product4(p, row, rows, panel);                                     \
        else if (p->bits == QFP4) product5(p, row, rows, panel);                             \
        else if (p->bits == 6) product6(p, row, rows, panel);                                \
        else product8(p, row, rows, panel);                                                  \
    }
