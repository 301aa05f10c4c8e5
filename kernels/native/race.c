/* Random sampling: each row's token wins an exponential race, argmax p_i / E_i with
 * E_i = -log(u_i) and u_i hashed from (the row's seed, i) exactly as sampler.hashed_uniform
 * hashes it. A token can beat the leader's key only where p_i > key * (1 - u_i), because
 * -log(u) >= 1 - u: a hash, a multiply and a compare reject nearly every token, and the log
 * is taken for the few that pass (some twenty a row: docs/benchmarks.md), not for every token
 * as torch's race does. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define GOLDEN 0x9E3779B9u
/* Rejects only tokens whose key is certainly below the leader's, float32 rounding included. */
#define MARGIN 0.999f

static inline uint32_t mix(uint32_t x) { /* murmur3's finalizer */
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    return x ^ (x >> 16);
}

static inline __m256i mix8(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x85EBCA6Bu));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0xC2B2AE35u));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* Inside (0, 1): the hash's top 23 bits and a half, exact in float32. */
static inline float uniform(uint32_t seed, long i) {
    return ((float)(mix(seed + (uint32_t)(i + 1) * GOLDEN) >> 9) + 0.5f) * 0x1p-23f;
}

typedef struct {
    long best;
    float key;
} Lead;

static inline void enter(Lead *lead, const float *p, uint32_t seed, long i) {
    const float key = p[i] / -logf(uniform(seed, i));
    if (key > lead->key) { /* a tie keeps the first index, as torch's argmax does */
        lead->key = key;
        lead->best = i;
    }
}

static long race_row(const float *p, long n, uint32_t seed) {
    Lead lead = {0, 0.0f}; /* a row of zeros or NaNs answers 0, as torch's argmax does */
    const __m256 half = _mm256_set1_ps(0.5f), scale = _mm256_set1_ps(0x1p-23f);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256i step = _mm256_set1_epi32((int)(8u * GOLDEN));
    const __m256i lanes = _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 8);
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32((int)seed),
                                 _mm256_mullo_epi32(lanes, _mm256_set1_epi32((int)GOLDEN)));
    long i = 0;
    for (; i + 8 <= n; i += 8, x = _mm256_add_epi32(x, step)) {
        const __m256i bits = _mm256_srli_epi32(mix8(x), 9);
        const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(bits), half), scale);
        const __m256 margin = _mm256_set1_ps(lead.key * MARGIN);
        const __m256 bound = _mm256_mul_ps(margin, _mm256_sub_ps(one, u));
        int passed = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), bound, _CMP_GT_OQ));
        for (; passed; passed &= passed - 1) enter(&lead, p, seed, i + __builtin_ctz(passed));
    }
    for (; i < n; i++) enter(&lead, p, seed, i);
    return lead.best;
}

/* probs: [rows][n], each row's probabilities (any positive scale); seeds: [rows], below 2**32;
 * out: [rows]. */
void race_rows(const float *probs, long rows, long n, const int64_t *seeds, int64_t *out) {
#pragma omp parallel for if (rows >= 4)
    for (long r = 0; r < rows; r++) out[r] = race_row(probs + r * n, n, (uint32_t)seeds[r]);
}
