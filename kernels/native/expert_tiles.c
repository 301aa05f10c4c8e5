/* A mixture of experts on AMX-BF16 tiles, bfloat16 weights (kernels/expert_tiles.py packs
 * them as B tiles). Each (token, choice) pair is a row, grouped by expert, its input rounded to
 * bf16; gate and up are summed in fp32 in the tiles and leave them with their biases added and
 * the gated activation applied (SiLU, or gpt-oss's clamped SwiGLU), rounded to bf16 as down's
 * input; down's sums leave with its bias, times the pair's router weight, and each token's
 * pairs are summed in choice order. Gate, up and down's outputs never pass through memory in
 * full, and a row's arithmetic is its own (tiles' rows do not mix), so a token's bits do not
 * depend on the tokens beside it in its step. Figures: docs/benchmarks.md. */
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
#include "bf16_tiles.h"
#include "experts.h"

enum { GROUP_ROWS = 256 };

typedef struct {
    const uint16_t *gate_up; /* [experts][inner / 16][hidden / 32][gate, up][TILE_ELEMS] */
    const uint16_t *down;    /* [experts][hidden / 16][inner / 32][TILE_ELEMS] */
    EXPERT_FIELDS
} Experts;

typedef struct {
    const Experts *w;
    const float *weights; /* [pairs] */
    const long *pair;     /* [rows]: each row's (token, choice) */
    uint16_t *x, *act;    /* [rows][hidden], [rows][inner] in bf16 */
    float *out;           /* [pairs][hidden] */
} Rows;

static inline __m512 sigmoid16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    /* e = exp(-|x|), which cannot overflow: 1 / (1 + e) for x >= 0, else e / (1 + e) */
    const __m512 e = exp2_negative16(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-1.44269504f)));
    const __m512 positive = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mask_mul_ps(positive, negative, e, positive);
}

/* One panel of 16 of the gated activation for a group's rows: gate's and up's products, their
 * biases, the activation, rounded to bf16. */
static void gate_up_task(const Rows *r, const Group *g, long panel, float *sums) {
    const Experts *w = r->w;
    const long hidden = w->hidden, inner = w->inner, chunks = hidden / CHUNK;
    const uint16_t *b = w->gate_up + (g->expert * (inner / PANEL) + panel) * chunks * 2 * TILE_ELEMS;
    const float *bias = w->gate_up_bias ? w->gate_up_bias + g->expert * 2 * inner + panel * PANEL
                                        : NULL;
    const __m512 zero = _mm512_setzero_ps();
    const __m512 gate_bias = bias ? _mm512_loadu_ps(bias) : zero;
    const __m512 up_bias = bias ? _mm512_loadu_ps(bias + inner) : zero;
    const __m512 limit = _mm512_set1_ps(w->limit), alpha = _mm512_set1_ps(w->alpha);
    for (long row = g->first; row < g->first + g->real; row += 2 * ROWS) {
        const int two = row + ROWS < g->first + g->real;
        products(r->x + row * hidden, hidden, chunks, two, b, b + TILE_ELEMS, 2 * TILE_ELEMS, sums);
        const long rows = g->first + g->real - row < 2 * ROWS ? g->first + g->real - row : 2 * ROWS;
        for (int j = 0; j < rows; j++) {
            __m512 gate = _mm512_add_ps(_mm512_load_ps(sums + at(j)), gate_bias);
            __m512 up = _mm512_add_ps(_mm512_load_ps(sums + at(j) + 256), up_bias);
            __m512 v;
            if (w->glu == GLU_CLAMPED_SWIGLU) {
                gate = _mm512_min_ps(gate, limit);
                up = _mm512_max_ps(_mm512_min_ps(up, limit), _mm512_sub_ps(zero, limit));
                v = _mm512_mul_ps(gate, sigmoid16(_mm512_mul_ps(gate, alpha)));
                v = _mm512_mul_ps(_mm512_add_ps(up, _mm512_set1_ps(1.0f)), v);
            } else {
                v = _mm512_mul_ps(_mm512_mul_ps(gate, sigmoid16(gate)), up);
            }
            __m256bh half = _mm512_cvtneps_pbh(v);
            memcpy(r->act + (row + j) * inner + panel * PANEL, &half, sizeof half);
        }
    }
}

/* Two panels of 16 of down's outputs for a group's rows: plus its bias, times each row's
 * router weight, into the row's pair of `out`. */
static void down_task(const Rows *r, const Group *g, long pair_of_panels, float *sums) {
    const Experts *w = r->w;
    const long hidden = w->hidden, inner = w->inner, chunks = inner / CHUNK;
    const long first = 2 * pair_of_panels * PANEL;
    const uint16_t *b = w->down + (g->expert * (hidden / PANEL) + 2 * pair_of_panels) * chunks *
                                      TILE_ELEMS;
    const float *bias = w->down_bias ? w->down_bias + g->expert * hidden + first : NULL;
    const __m512 zero = _mm512_setzero_ps();
    const __m512 bias_lo = bias ? _mm512_loadu_ps(bias) : zero;
    const __m512 bias_hi = bias ? _mm512_loadu_ps(bias + PANEL) : zero;
    for (long row = g->first; row < g->first + g->real; row += 2 * ROWS) {
        const int two = row + ROWS < g->first + g->real;
        products(r->act + row * inner, inner, chunks, two, b, b + chunks * TILE_ELEMS, TILE_ELEMS,
                 sums);
        const long rows = g->first + g->real - row < 2 * ROWS ? g->first + g->real - row : 2 * ROWS;
        for (int j = 0; j < rows; j++) {
            const long pair = r->pair[row + j];
            const __m512 weight = _mm512_set1_ps(r->weights[pair]);
            float *to = r->out + pair * hidden + first;
            _mm512_storeu_ps(to, _mm512_mul_ps(_mm512_add_ps(_mm512_load_ps(sums + at(j)),
                                                             bias_lo), weight));
            _mm512_storeu_ps(to + PANEL, _mm512_mul_ps(_mm512_add_ps(
                                             _mm512_load_ps(sums + at(j) + 256), bias_hi), weight));
        }
    }
}

/* y[t] = sum over t's top_k choices c of weights[t, c] * expert_c(x[t]), for `tokens` rows of
 * x [tokens][hidden] (float32); chosen and weights [tokens][top_k]. 0, -1 where the scratch
 * cannot be allocated, -2 for a chosen expert out of range. */
int expert_tiles(const Experts *w, const float *x, long tokens, long top_k,
                 const int64_t *chosen, const float *weights, float *y) {
    const long experts = w->experts, hidden = w->hidden, inner = w->inner;
    const long pairs = tokens * top_k;
    for (long p = 0; p < pairs; p++)
        if (chosen[p] < 0 || chosen[p] >= experts) return -2;
    const long most_rows = pairs + experts * (ROWS - 1), most_groups = pairs / GROUP_ROWS + experts;
    const long bytes = sizeof(long) * (2 * experts + most_rows) + sizeof(Group) * most_groups +
                       2 * most_rows * (hidden + inner) + sizeof(float) * pairs * hidden;
    char *memory = thread_scratch(bytes);
    if (!memory) return -1;
    long *count = (long *)memory, *start = count + experts, *pair = start + experts;
    Group *groups = (Group *)(pair + most_rows);
    uint16_t *xb = (uint16_t *)(groups + most_groups), *act = xb + most_rows * hidden;
    float *out = (float *)(act + most_rows * inner);

    /* Each expert's rows padded to a tile's 16. */
    long group_count;
    const long rows = group_pairs(chosen, pairs, experts, ROWS, GROUP_ROWS, count, start, pair,
                                  groups, &group_count);
    const Rows r = {w, weights, pair, xb, act, out};
    const long gate_up_tasks = group_count * (inner / PANEL);
    const long down_tasks = group_count * (hidden / (2 * PANEL));
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *sums = aligned_alloc(64, sizeof(float) * 4 * ROWS * PANEL);
        failed = !sums;
        configure_tiles();
#pragma omp for schedule(static)
        for (long i = 0; i < rows; i++) {
            uint16_t *to = xb + i * hidden;
            if (pair[i] < 0) { /* padding: zeros, whose products no row keeps */
                memset(to, 0, 2 * hidden);
                continue;
            }
            round_bf16(x + pair[i] / top_k * hidden, to, hidden);
        }
#pragma omp for schedule(dynamic)
        for (long t = 0; t < gate_up_tasks; t++)
            if (!failed) gate_up_task(&r, &groups[t / (inner / PANEL)], t % (inner / PANEL), sums);
#pragma omp for schedule(dynamic)
        for (long t = 0; t < down_tasks; t++)
            if (!failed)
                down_task(&r, &groups[t / (hidden / (2 * PANEL))], t % (hidden / (2 * PANEL)),
                          sums);
#pragma omp for schedule(static)
        for (long token = 0; token < tokens; token++) {
            for (long h = 0; h < hidden; h += 16) {
                const float *from = out + token * top_k * hidden + h;
                __m512 sum = _mm512_loadu_ps(from);
                for (long c = 1; c < top_k; c++)
                    sum = _mm512_add_ps(sum, _mm512_loadu_ps(from + c * hidden));
                _mm512_storeu_ps(y + token * hidden + h, sum);
            }
        }
        _tile_release();
        free(sums);
    }
    return failed ? -1 : 0;
}
