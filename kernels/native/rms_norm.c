/* RMSNorm, torch's formula: x * rsqrt(mean(x^2) + eps) * weight, for each row. The squares are
 * summed in 32 lanes (four vectors of eight, added pairwise at the end): a sum carried in one
 * register waits on each add, 4 cycles an element (a tenth of a bf16 prompt step on the fused
 * layers: docs/benchmarks.md). AVX2 only, so the same bits on any CPU. Rows in parallel: a
 * serial part leaves the other threads spinning. */
#include <immintrin.h>
#include <math.h>

static float squares(const float *row, long n) {
    __m256 sum[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    long i = 0;
    for (; i + 32 <= n; i += 32)
        for (int v = 0; v < 4; v++) {
            const __m256 x = _mm256_loadu_ps(row + i + 8 * v);
            sum[v] = _mm256_fmadd_ps(x, x, sum[v]);
        }
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(row + i);
        sum[0] = _mm256_fmadd_ps(x, x, sum[0]);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(sum[0], sum[1]),
                                          _mm256_add_ps(sum[2], sum[3])));
    float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                  ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; i < n; i++) total += row[i] * row[i];
    return total;
}

/* x, out: [rows][n] (out may be x); weight: [n]. */
void rms_norm_rows(const float *x, const float *weight, float *out, long rows, long n,
                   float eps) {
#pragma omp parallel for if (rows >= 8)
    for (long r = 0; r < rows; r++) {
        const float *row = x + r * n;
        float *to = out + r * n;
        const float inverse = 1.0f / sqrtf(squares(row, n) / n + eps);
        for (long i = 0; i < n; i++) to[i] = row[i] * inverse * weight[i];
    }
}
