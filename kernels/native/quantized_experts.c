/* A mixture of experts on weights kept in their GGUF blocks (quantized.h's panels; packed by
 * kernels/quantized_experts.py). Each token's input is quantized to int8 once; each (token,
 * choice) pair is a row, grouped by expert, through gate and up (the quantized products of
 * quantized.c on the ISA asked for), their biases, the gated activation (SiLU, or gpt-oss's
 * clamped SwiGLU), quantized again for down; down's outputs with its bias, times the pair's
 * router weight, and each token's pairs summed in choice order. A row's arithmetic is its own,
 * so a token's bits do not depend on the tokens beside it in its step. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "experts.h"
#include "quantized.h"
#include "simd.h"

enum { GROUP_ROWS = 48 }; /* the rows of one expert a task takes: 8 tiles of 6 */
enum { TILE = 6 };

typedef struct {
    const uint8_t *gate, *up, *down; /* each expert's panels, the next `*_bytes` on */
    long gate_bytes, up_bytes, down_bytes;
    long gate_bits, up_bits, down_bits;
    EXPERT_FIELDS
} QExperts;

/* Rows of activations quantized per block of 32, as a QProduct reads them. */
typedef struct {
    int8_t *q;
    float *dx, *sx, *sh;
    int32_t *qs;
} Codes;

/* Carves 64-byte aligned pieces out of one allocation. */
static void *carve(char **at, long bytes) {
    void *piece = *at;
    *at += (bytes + 63) / 64 * 64;
    return piece;
}

static long codes_bytes(long rows, long k) {
    return (rows * k + 63) / 64 * 64 + 5 * ((4 * rows * (k / QBLOCK) + 63) / 64 * 64);
}

static Codes codes_in(char **at, long rows, long k) {
    const long blocks = rows * (k / QBLOCK);
    Codes c;
    c.q = carve(at, rows * k);
    c.dx = carve(at, 4 * blocks);
    c.sx = carve(at, 4 * blocks);
    c.sh = carve(at, 8 * blocks);
    c.qs = carve(at, 4 * blocks);
    return c;
}

static void quantize(const float *x, long rows, long k, Codes c) {
    qquantize_rows(x, rows, k, c.q, c.dx, c.sx, c.sh, c.qs);
}

/* Row `to` of `into` is row `from` of `c`. */
static void copy_codes(Codes c, long from, Codes into, long to, long k) {
    const long blocks = k / QBLOCK;
    memcpy(into.q + to * k, c.q + from * k, k);
    memcpy(into.dx + to * blocks, c.dx + from * blocks, 4 * blocks);
    memcpy(into.sx + to * blocks, c.sx + from * blocks, 4 * blocks);
    memcpy(into.sh + 2 * to * blocks, c.sh + 2 * from * blocks, 8 * blocks);
    memcpy(into.qs + to * blocks, c.qs + from * blocks, 4 * blocks);
}

/* A group's rows against one panel of a matrix. */
static void panel_rows(Codes c, const uint8_t *w, long bits, float *y, const float *bias, long n,
                       long k, long ldy, const Group *g, long panel, Product product) {
    const QProduct p = {c.q, c.dx, c.sx, c.sh, c.qs, w, y, bias, NULL, 0, n, k, ldy, (int)bits};
    for (long row = g->first; row < g->first + g->real; row += TILE) {
        const long left = g->first + g->real - row;
        product(&p, row, left < TILE ? (int)left : TILE, panel);
    }
}

/* gate and up (`gu`'s two halves) into the gated activation, a row. */
static void gated(const QExperts *w, const float *gu, float *act) {
    const long inner = w->inner;
    const __m256 limit = _mm256_set1_ps(w->limit), alpha = _mm256_set1_ps(w->alpha);
    const __m256 one = _mm256_set1_ps(1.0f), low = _mm256_set1_ps(-w->limit);
    for (long i = 0; i < inner; i += 8) {
        __m256 gate = _mm256_loadu_ps(gu + i), up = _mm256_loadu_ps(gu + inner + i);
        if (w->glu == GLU_CLAMPED_SWIGLU) {
            gate = _mm256_min_ps(gate, limit);
            up = _mm256_max_ps(_mm256_min_ps(up, limit), low);
            const __m256 v = _mm256_mul_ps(gate, sigmoid8(_mm256_mul_ps(gate, alpha)));
            _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_add_ps(up, one), v));
        } else {
            _mm256_storeu_ps(act + i, silu_times(gate, up));
        }
    }
}

/* y[t] = sum over t's top_k choices c of weights[t, c] * expert_c(x[t]), for `tokens` rows of
 * x [tokens][hidden] (float32); chosen and weights [tokens][top_k]; the products on the ISA
 * numbered `isa` (simd.h). 0, -1 where the scratch cannot be allocated, -2 for a chosen expert
 * out of range. */
int quantized_experts(const QExperts *w, const float *x, long tokens, long top_k,
                      const int64_t *chosen, const float *weights, float *y, long isa) {
    const long experts = w->experts, hidden = w->hidden, inner = w->inner;
    const long pairs = tokens * top_k, most_groups = pairs / GROUP_ROWS + experts;
    for (long p = 0; p < pairs; p++)
        if (chosen[p] < 0 || chosen[p] >= experts) return -2;
    const long bytes = 64 * 8 + 8 * (2 * experts + 2 * pairs) + sizeof(Group) * most_groups +
                       codes_bytes(tokens, hidden) + codes_bytes(pairs, hidden) +
                       codes_bytes(pairs, inner) + 4 * pairs * (3 * inner + hidden);
    char *memory = malloc(bytes), *at = memory;
    if (!memory) return -1;
    long *count = carve(&at, 8 * experts), *start = carve(&at, 8 * experts);
    long *row_of = carve(&at, 8 * pairs), *pair_of = carve(&at, 8 * pairs);
    Group *groups = carve(&at, sizeof(Group) * most_groups);
    const Codes xc = codes_in(&at, tokens, hidden), rc = codes_in(&at, pairs, hidden);
    const Codes ac = codes_in(&at, pairs, inner);
    float *gu = carve(&at, 4 * pairs * 2 * inner), *act = carve(&at, 4 * pairs * inner);
    float *out = carve(&at, 4 * pairs * hidden);

    long group_count;
    group_pairs(chosen, pairs, experts, 1, GROUP_ROWS, count, start, pair_of, groups, &group_count);
    for (long r = 0; r < pairs; r++) row_of[pair_of[r]] = r;
    const Product product = qproduct_for((int)isa);
    const long inner_panels = inner / QPANEL, hidden_panels = hidden / QPANEL;
    quantize(x, tokens, hidden, xc);
    /* Few rows: each thread a contiguous share of the tasks, its weights read as one stream
     * (quantized.c's way); many: one task at a time, as experts' rows differ. */
    const int few = pairs < 4 * TILE;
#pragma omp parallel
    {
        const long threads = omp_get_num_threads();
        const long gate_up_chunk = few ? (group_count * inner_panels + threads - 1) / threads : 1;
#pragma omp for schedule(static)
        for (long r = 0; r < pairs; r++) copy_codes(xc, pair_of[r] / top_k, rc, r, hidden);
#pragma omp for schedule(dynamic, gate_up_chunk)
        for (long t = 0; t < group_count * inner_panels; t++) {
            const Group *g = &groups[t / inner_panels];
            const long e = g->expert, panel = t % inner_panels;
            const float *bias = w->gate_up_bias ? w->gate_up_bias + e * 2 * inner : NULL;
            panel_rows(rc, w->gate + e * w->gate_bytes, w->gate_bits, gu, bias, inner, hidden,
                       2 * inner, g, panel, product);
            panel_rows(rc, w->up + e * w->up_bytes, w->up_bits, gu + inner,
                       bias ? bias + inner : NULL, inner, hidden, 2 * inner, g, panel, product);
        }
#pragma omp for schedule(static)
        for (long r = 0; r < pairs; r++) gated(w, gu + r * 2 * inner, act + r * inner);
    }
    quantize(act, pairs, inner, ac);
#pragma omp parallel
    {
        const long threads = omp_get_num_threads();
        const long down_chunk = few ? (group_count * hidden_panels + threads - 1) / threads : 1;
#pragma omp for schedule(dynamic, down_chunk)
        for (long t = 0; t < group_count * hidden_panels; t++) {
            const Group *g = &groups[t / hidden_panels];
            const long e = g->expert;
            const float *bias = w->down_bias ? w->down_bias + e * hidden : NULL;
            panel_rows(ac, w->down + e * w->down_bytes, w->down_bits, out, bias, hidden, inner,
                       hidden, g, t % hidden_panels, product);
        }
#pragma omp for schedule(static)
        for (long token = 0; token < tokens; token++) {
            for (long h = 0; h < hidden; h += 8) {
                __m256 sum = _mm256_setzero_ps();
                for (long c = 0; c < top_k; c++) {
                    const long p = token * top_k + c;
                    const __m256 v = _mm256_loadu_ps(out + row_of[p] * hidden + h);
                    sum = _mm256_add_ps(sum, _mm256_mul_ps(v, _mm256_set1_ps(weights[p])));
                }
                _mm256_storeu_ps(y + token * hidden + h, sum);
            }
        }
    }
    free(memory);
    return 0;
}
