/* LoRA adapters on the fused decode layers' rows (decode_layer.c): a row that runs an adapter
 * gets B (A x) added to a projection's output. A is [rank][in] and B is stored transposed,
 * [rank][out], float32, the adapter's scaling folded in. The rank is tens, so a row's share is
 * two thin products, vectorized along `in` and `out`. Only rows with an adapter are touched:
 * the other rows' bits are those of a step without adapters. */
#include <stdlib.h>
#include <string.h>

#include "simd.h"

typedef struct Weight Weight;
int linear_weight(const float *x, const Weight *w, float *y, const float *bias,
                  const float *residual, long M, long N, long K, long isa);
void silu_and_multiply(const float *gate_up, float *act, long rows, long n);

/* One adapter's pair for one projection; `a` NULL where it does not adapt it. */
typedef struct LoraPair {
    const float *a, *bt;
    long rank;
} LoraPair;

static float dot_any(const float *a, const float *b, long n) {
    __m256 sum = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8)
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum);
    float total = sum_lanes(sum);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

static int adapts(const LoraPair *pairs, long adapter) {
    return adapter >= 0 && pairs[adapter].a != NULL && pairs[adapter].rank > 0;
}

/* y[r] (rows `ldy` apart) += its adapter's pair on x[r] (rows `in` apart), for each row whose
 * adapter (`adapters[r]`, -1: none) adapts this projection. */
void lora_add(const float *x, float *y, long rows, long in, long out, long ldy,
              const long *adapters, const LoraPair *pairs) {
#pragma omp parallel for if (rows >= 8)
    for (long r = 0; r < rows; r++) {
        if (!adapts(pairs, adapters[r])) continue;
        const LoraPair *p = pairs + adapters[r];
        float t[p->rank];
        for (long k = 0; k < p->rank; k++) t[k] = dot_any(p->a + k * in, x + r * in, in);
        float *to = y + r * ldy;
        for (long k = 0; k < p->rank; k++) {
            const float *b = p->bt + k * out;
            const __m256 tk = _mm256_set1_ps(t[k]);
            long j = 0;
            for (; j + 8 <= out; j += 8)
                _mm256_storeu_ps(to + j, _mm256_fmadd_ps(tk, _mm256_loadu_ps(b + j),
                                                         _mm256_loadu_ps(to + j)));
            for (; j < out; j++) to[j] += t[k] * b[j];
        }
    }
}

/* Where SiLU was taken inside gate-up's product (gated_int8_tiles), the rows whose adapter
 * adapts gate or up are computed again: their gate-up product, the pair added, SiLU, into
 * `act`. -1 where a buffer could not be allocated. */
int lora_gated(const float *x, const Weight *gate_up, float *act, long rows, long hidden,
               long intermediate, const long *adapters, const LoraPair *pairs, long isa) {
    long n = 0;
    for (long r = 0; r < rows; r++) n += adapts(pairs, adapters[r]);
    if (!n) return 0;
    float *xs = malloc(sizeof(float) * n * (hidden + 3 * intermediate));
    long *which = malloc(sizeof(long) * n * 2);
    if (!xs || !which) {
        free(xs);
        free(which);
        return -1;
    }
    float *gu = xs + n * hidden, *out = gu + n * 2 * intermediate;
    long *own = which + n;
    for (long r = 0, i = 0; r < rows; r++)
        if (adapts(pairs, adapters[r])) {
            memcpy(xs + i * hidden, x + r * hidden, sizeof(float) * hidden);
            which[i] = r;
            own[i++] = adapters[r];
        }
    int failed = linear_weight(xs, gate_up, gu, NULL, NULL, n, 2 * intermediate, hidden, isa);
    if (!failed) {
        lora_add(xs, gu, n, hidden, 2 * intermediate, 2 * intermediate, own, pairs);
        silu_and_multiply(gu, out, n, intermediate);
        for (long i = 0; i < n; i++)
            memcpy(act + which[i] * intermediate, out + i * intermediate,
                   sizeof(float) * intermediate);
    }
    free(xs);
    free(which);
    return failed ? -1 : 0;
}
