/* One query row's arithmetic against a run of cached tokens: its scores, their softmax
 * numerators, the values they weigh. A row goes through these in the same order whether it is
 * alone or scored beside other rows, so its bits never depend on the step it is in. */
#pragma once
#include <math.h>

#include "simd.h"

/* In place: s[0..len) becomes exp((s - top) * scale), padded with zeros to a multiple of 8;
 * returns the sum and sets *top to the largest score. */
static float softmax_numerators(float *s, long len, float scale, float *top_out) {
    long padded = (len + 7) & ~7L;
    for (long t = len; t < padded; t++) s[t] = -INFINITY;
    __m256 most = _mm256_set1_ps(-INFINITY);
    for (long t = 0; t < padded; t += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(s + t));
    const float top = max_lanes(most);
    __m256 sum = _mm256_setzero_ps(), shift = _mm256_set1_ps(top), factor = _mm256_set1_ps(scale);
    for (long t = 0; t < padded; t += 8) {
        const __m256 shifted = _mm256_sub_ps(_mm256_loadu_ps(s + t), shift);
        __m256 e = exp_negative(_mm256_mul_ps(shifted, factor));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, sum);
    for (int i = 0; i < 8; i++) total += lanes[i];
    *top_out = top;
    return total;
}

/* [sum(v[0]), ..., sum(v[7])]: eight dot products' lanes reduced at once. */
static inline __m256 sum_lanes8(const __m256 v[8]) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* The most query heads that read one key or value head together: their sums then take 24 of
 * the 32 registers AVX-512 gives (AVX2 has 16, so it takes one head at a time). */
#define MOST_HEADS 3
_Static_assert(MOST_HEADS <= 3, "score_group and weigh_group take a rest of 2 or 1 heads");
#define INLINE static inline __attribute__((always_inline))

/* scores[j * score_stride + t] = q_j . key(t) for the n query heads from q on (dim apart) that
 * share this key head, for the `count` tokens from `key` on, `token_stride` apart: eight tokens
 * at a time, so eight independent FMA chains a head are in flight, each key loaded once for
 * the n heads. A head's scores are the same bits for any n (n a constant once inlined). */
INLINE void score_heads(const float *q, const int n, const float *key, long count,
                        long token_stride, long dim, float *scores, long score_stride) {
    long t = 0;
    for (; t + 8 <= count; t += 8, key += 8 * token_stride) {
        __m256 sums[MOST_HEADS][8];
        for (int j = 0; j < n; j++)
            for (int i = 0; i < 8; i++) sums[j][i] = _mm256_setzero_ps();
        for (long d = 0; d < dim; d += 8) {
            __m256 qd[MOST_HEADS];
            for (int j = 0; j < n; j++) qd[j] = _mm256_loadu_ps(q + j * dim + d);
            for (int i = 0; i < 8; i++) {
                const __m256 k = _mm256_loadu_ps(key + i * token_stride + d);
                for (int j = 0; j < n; j++) sums[j][i] = _mm256_fmadd_ps(qd[j], k, sums[j][i]);
            }
        }
        for (int j = 0; j < n; j++)
            _mm256_storeu_ps(scores + j * score_stride + t, sum_lanes8(sums[j]));
    }
    for (; t < count; t++, key += token_stride)
        for (int j = 0; j < n; j++) scores[j * score_stride + t] = dot(q + j * dim, key, dim);
}

/* out_j[0..8 * lanes) += sum over `count` tokens of weight_j[t] * value(t) for n heads (outs
 * dim apart, weights weight_stride apart), held in registers: a value loaded once for the n
 * heads, each head's sums in the same order for any n. */
INLINE void weigh_lanes(const float *value, const int n, long count, long token_stride, long dim,
                        const float *weight, long weight_stride, float *out, const int lanes) {
    __m256 acc[MOST_HEADS][8];
    for (int j = 0; j < n; j++)
        for (int i = 0; i < lanes; i++) acc[j][i] = _mm256_loadu_ps(out + j * dim + 8 * i);
    for (long t = 0; t < count; t++, value += token_stride) {
        __m256 w[MOST_HEADS];
        for (int j = 0; j < n; j++) w[j] = _mm256_set1_ps(weight[j * weight_stride + t]);
        for (int i = 0; i < lanes; i++) {
            const __m256 v = _mm256_loadu_ps(value + 8 * i);
            for (int j = 0; j < n; j++) acc[j][i] = _mm256_fmadd_ps(w[j], v, acc[j][i]);
        }
    }
    for (int j = 0; j < n; j++)
        for (int i = 0; i < lanes; i++) _mm256_storeu_ps(out + j * dim + 8 * i, acc[j][i]);
}

/* weigh_lanes over all of dim: 64 dims at a time (8 registers a head), then 8. */
INLINE void weigh_heads(const float *value, const int n, long count, long token_stride, long dim,
                        const float *weight, long weight_stride, float *out) {
    long d = 0;
    for (; d + 64 <= dim; d += 64)
        weigh_lanes(value + d, n, count, token_stride, dim, weight, weight_stride, out + d, 8);
    for (; d < dim; d += 8)
        weigh_lanes(value + d, n, count, token_stride, dim, weight, weight_stride, out + d, 1);
}

/* One KV head's `group` query heads against `count` of its keys, or weighing its values (the
 * functions below). */
typedef void (*Scorer)(const float *q, long group, const float *key, long count, long token_stride,
                       long dim, float *scores, long stride);
typedef void (*Weigher)(const float *value, long group, long count, long token_stride, long dim,
                        const float *weight, long stride, float *out);

/* A KV head's query heads `most` at a time (then the rest), each key or value loaded once for
 * them: `most` a constant, so that each call below compiles to its own register plan. */
INLINE void score_group(const int most, const float *q, long group, const float *key, long count,
                        long token_stride, long dim, float *scores, long stride) {
    long j = 0;
    for (; j + most <= group; j += most)
        score_heads(q + j * dim, most, key, count, token_stride, dim, scores + j * stride, stride);
    if (group - j == 2)
        score_heads(q + j * dim, 2, key, count, token_stride, dim, scores + j * stride, stride);
    else if (group - j == 1)
        score_heads(q + j * dim, 1, key, count, token_stride, dim, scores + j * stride, stride);
}

INLINE void weigh_group(const int most, const float *value, long group, long count,
                        long token_stride, long dim, const float *weight, long stride, float *out) {
    long j = 0;
    for (; j + most <= group; j += most)
        weigh_heads(value, most, count, token_stride, dim, weight + j * stride, stride,
                    out + j * dim);
    if (group - j == 2)
        weigh_heads(value, 2, count, token_stride, dim, weight + j * stride, stride, out + j * dim);
    else if (group - j == 1)
        weigh_heads(value, 1, count, token_stride, dim, weight + j * stride, stride, out + j * dim);
}

/* AVX2: one head at a time (its 8 sums fill half of the 16 registers). */
static void score_narrow(const float *q, long group, const float *key, long count,
                         long token_stride, long dim, float *scores, long stride) {
    score_group(1, q, group, key, count, token_stride, dim, scores, stride);
}

static void weigh_narrow(const float *value, long group, long count, long token_stride, long dim,
                         const float *weight, long stride, float *out) {
    weigh_group(1, value, group, count, token_stride, dim, weight, stride, out);
}

/* AVX-512's 32 registers: MOST_HEADS heads at a time, in the same 256-bit arithmetic, so the
 * same bits as on AVX2. */
__attribute__((target("avx512f,avx512vl"))) static void score_wide(
    const float *q, long group, const float *key, long count, long token_stride, long dim,
    float *scores, long stride) {
    score_group(MOST_HEADS, q, group, key, count, token_stride, dim, scores, stride);
}

__attribute__((target("avx512f,avx512vl"))) static void weigh_wide(
    const float *value, long group, long count, long token_stride, long dim, const float *weight,
    long stride, float *out) {
    weigh_group(MOST_HEADS, value, group, count, token_stride, dim, weight, stride, out);
}
