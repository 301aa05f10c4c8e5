/* Greedy sampling: the index of each row's largest logit, answered as torch.argmax answers it
 * (the first index of the largest value; the first NaN's, if a row has one). torch's CPU
 * reduction carries an index beside every value on one thread, about 60 us a row of 49,152
 * logits here, a millisecond a step of 16 rows; this compares eight lanes at a time. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static long first_nan(const float *x, long n) {
    for (long i = 0; i < n; i++)
        if (x[i] != x[i]) return i;
    return -1;
}

static long argmax_row(const float *x, long n) {
    /* Each lane keeps the first index of its largest value (only a strictly greater value
     * replaces it; a row of -inf keeps index 0); the lanes' tie goes to the smaller index. */
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    __m256i index = _mm256_setr_epi32(-8, -7, -6, -5, -4, -3, -2, -1);
    __m256i where = _mm256_setzero_si256();
    const __m256i eight = _mm256_set1_epi32(8);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        index = _mm256_add_epi32(index, eight);
        const __m256 greater = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
        top = _mm256_blendv_ps(top, v, greater);
        where = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(where),
                                                     _mm256_castsi256_ps(index), greater));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (!_mm256_testz_ps(nan, nan)) return first_nan(x, n);
    float values[8];
    int32_t indices[8];
    _mm256_storeu_ps(values, top);
    _mm256_storeu_si256((__m256i *)indices, where);
    long best = indices[0];
    float best_value = values[0];
    for (int lane = 1; lane < 8; lane++)
        if (values[lane] > best_value || (values[lane] == best_value && indices[lane] < best)) {
            best = indices[lane];
            best_value = values[lane];
        }
    for (; i < n; i++) {
        if (x[i] != x[i]) return first_nan(x, n);
        if (x[i] > best_value) {
            best = i;
            best_value = x[i];
        }
    }
    return best;
}

/* logits: [rows][n]; out: [rows]. */
void argmax_rows(const float *logits, long rows, long n, int64_t *out) {
#pragma omp parallel for if (rows >= 4)
    for (long r = 0; r < rows; r++) out[r] = argmax_row(logits + r * n, n);
}
