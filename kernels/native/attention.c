/* Paged decode attention for float32 on x86-64 with AVX2 and FMA: one query token per row
 * against that row's cached K and V, read in place through its block table.
 *
 * The torch path gathers every row's blocks into a contiguous copy (per layer, K and V) before
 * one batched SDPA; here each (row, KV head) task reads its blocks where they are, scores the
 * group's query heads against each key once, and sums V weighted by the softmax. Cache layout
 * as in kernels/reference.py: [blocks][block_size][kv_heads][head_dim]. */
#include <math.h>
#include <stdlib.h>

#include "simd.h"


/* In place: s[0..len) becomes exp((s - max) * scale), padded with zeros to a multiple of 8;
 * returns the sum. */
static float softmax_numerators(float *s, long len, float scale) {
    float top = -INFINITY;
    for (long t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
    long padded = (len + 7) & ~7L;
    for (long t = len; t < padded; t++) s[t] = -INFINITY;
    __m256 sum = _mm256_setzero_ps(), shift = _mm256_set1_ps(top), factor = _mm256_set1_ps(scale);
    for (long t = 0; t < padded; t += 8) {
        __m256 e = exp_negative(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift), factor));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, sum);
    for (int i = 0; i < 8; i++) total += lanes[i];
    return total;
}

/* A head's vector is a few cache lines, one token's apart from the next: a stride the hardware
 * prefetcher does not follow well, so ask for the vector AHEAD tokens on. Past the end of a
 * block that is another block's data: a wasted fetch, never a wrong result. */
#define AHEAD 4

static inline void prefetch(const float *vector, long dim) {
    for (long d = 0; d < dim; d += 16) _mm_prefetch((const char *)(vector + d), _MM_HINT_T0);
}

typedef struct {
    const float *k_cache, *v_cache;
    const long *block_tables, *seq_lens;
    long width, heads, kv_heads, dim, block_size;
    float scale;
} Decode;

/* [sum(v[0]), ..., sum(v[7])]: eight dot products' lanes reduced at once. */
static inline __m256 sum_lanes8(const __m256 v[8]) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* scores[t] = q . key(t) for the `count` tokens from `key` on, `token_stride` apart: eight
 * tokens at a time, so eight independent FMA chains are in flight instead of one. */
static void score_tokens(const float *q, const float *key, long count, long token_stride,
                         long dim, float *scores) {
    long t = 0;
    for (; t + 8 <= count; t += 8, key += 8 * token_stride) {
        prefetch(key + AHEAD * token_stride, dim);
        __m256 sums[8];
        for (int i = 0; i < 8; i++) sums[i] = _mm256_setzero_ps();
        for (long d = 0; d < dim; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            for (int i = 0; i < 8; i++)
                sums[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(key + i * token_stride + d), sums[i]);
        }
        _mm256_storeu_ps(scores + t, sum_lanes8(sums));
    }
    for (; t < count; t++, key += token_stride) scores[t] = dot(q, key, dim);
}

/* out[0..dim) = sum over the row's tokens of weight[t] * value(t), 64 dims at a time held in
 * registers across all tokens. */
static void weigh_values(const Decode *a, const long *table, long h, long len,
                         const float *weight, float *out) {
    const long dim = a->dim, token_stride = a->kv_heads * dim, bs = a->block_size;
    for (long d0 = 0; d0 < dim; d0 += 64) {
        const long lanes = (dim - d0 < 64 ? dim - d0 : 64) / 8;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (long t = 0, b = 0; t < len; b++) {
            const float *value = a->v_cache + (table[b] * bs * a->kv_heads + h) * dim + d0;
            for (long end = t + bs < len ? t + bs : len; t < end; t++, value += token_stride) {
                prefetch(value + AHEAD * token_stride, lanes * 8);
                __m256 w = _mm256_set1_ps(weight[t]);
                for (int i = 0; i < lanes; i++)
                    acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(value + 8 * i), acc[i]);
            }
        }
        for (int i = 0; i < lanes; i++) _mm256_storeu_ps(out + d0 + 8 * i, acc[i]);
    }
}

/* The query heads of KV head h in one row. `scores` holds group x stride floats. */
static void attend_group(const Decode *a, const float *q, float *out, long row, long h,
                         float *scores, long stride) {
    const long group = a->heads / a->kv_heads, len = a->seq_lens[row], dim = a->dim;
    const long token_stride = a->kv_heads * dim, bs = a->block_size;
    const long *table = a->block_tables + row * a->width;
    const float *q_group = q + (row * a->heads + h * group) * dim;
    float *out_group = out + (row * a->heads + h * group) * dim;
    for (long t = 0, b = 0; t < len; t += bs, b++) {
        const float *key = a->k_cache + (table[b] * bs * a->kv_heads + h) * dim;
        long count = len - t < bs ? len - t : bs;
        for (long g = 0; g < group; g++)
            score_tokens(q_group + g * dim, key, count, token_stride, dim, scores + g * stride + t);
    }
    for (long g = 0; g < group; g++) {
        float *weight = scores + g * stride, *o = out_group + g * dim;
        float inverse = 1.0f / softmax_numerators(weight, len, a->scale);
        weigh_values(a, table, h, len, weight, o);
        for (long d = 0; d < dim; d++) o[d] *= inverse;
    }
}

/* q and out: [rows][heads][head_dim]; head_dim a multiple of 8. Returns 0, or -1 when out of
 * memory for the scores. */
int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const long *block_tables, long width, const long *seq_lens,
                               float *out, long rows, long heads, long kv_heads, long dim,
                               long block_size, float scale) {
    Decode a = {k_cache, v_cache, block_tables, seq_lens, width,
                heads, kv_heads, dim, block_size, scale};
    long stride = 8;  /* a row of scores, rounded up to whole vectors */
    for (long r = 0; r < rows; r++) stride = seq_lens[r] + 7 > stride ? seq_lens[r] + 7 : stride;
    stride &= ~7L;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (heads / kv_heads) * stride);
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 4) collapse(2)
        for (long r = 0; r < rows; r++)
            for (long h = 0; h < kv_heads; h++)
                if (scores) attend_group(&a, q, out, r, h, scores, stride);
        free(scores);
    }
    return failed ? -1 : 0;
}
