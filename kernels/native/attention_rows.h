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
        __m256 e = exp_negative(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift), factor));
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

/* scores[t] = q . key(t) for the `count` tokens from `key` on, `token_stride` apart: eight
 * tokens at a time, so eight independent FMA chains are in flight instead of one. */
static void score_tokens(const float *q, const float *key, long count, long token_stride,
                         long dim, float *scores) {
    long t = 0;
    for (; t + 8 <= count; t += 8, key += 8 * token_stride) {
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

/* out[0..8 * lanes) += sum over `count` tokens of weight[t] * value(t), held in registers:
 * inlined with a constant `lanes`, which a loop bound the compiler cannot see would spill. */
static inline __attribute__((always_inline)) void weigh_lanes(const float *value, long count,
                                                              long token_stride,
                                                              const float *weight, float *out,
                                                              const int lanes) {
    __m256 acc[8];
    for (int i = 0; i < lanes; i++) acc[i] = _mm256_loadu_ps(out + 8 * i);
    for (long t = 0; t < count; t++, value += token_stride) {
        __m256 w = _mm256_set1_ps(weight[t]);
        for (int i = 0; i < lanes; i++)
            acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(value + 8 * i), acc[i]);
    }
    for (int i = 0; i < lanes; i++) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

/* out[0..dim) += sum over `count` tokens of weight[t] * value(t): 64 dims at a time, then 8. */
static void weigh_values(const float *value, long count, long token_stride, long dim,
                         const float *weight, float *out) {
    long d = 0;
    for (; d + 64 <= dim; d += 64) weigh_lanes(value + d, count, token_stride, weight, out + d, 8);
    for (; d < dim; d += 8) weigh_lanes(value + d, count, token_stride, weight, out + d, 1);
}
