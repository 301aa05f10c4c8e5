/* Small AVX2 helpers shared by the native kernels. */
#pragma once
#include <immintrin.h>

/* The KV cache's value formats, numbered as kernels/native_attention.py's CACHE_DTYPES
 * (kv_formats.h reads and writes them). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_E4M3 = 3, KV_E5M2 = 4 };
/* The ISAs the kernels take, numbered as kernels/cpu_native.py's ISAS. */
enum { ISA_AVX2 = 0, ISA_AVX_VNNI = 1, ISA_AVX512_VNNI = 2 };

static inline float sum_lanes(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

static inline float max_lanes(__m256 v) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

static inline float dot(const float *a, const float *b, long dim) {
    __m256 sum = _mm256_setzero_ps();
    for (long d = 0; d < dim; d += 8)
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), sum);
    return sum_lanes(sum);
}

/* e^x for x <= 0 to within 2 ulp: x = n ln2 + r, e^r by its Taylor polynomial (Cephes'
 * coefficients), 2^n put into the exponent bits. Below -87, 0. */
static inline __m256 exp_negative(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    const __m256i exponent = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

/* sigmoid(g) from e = exp(-|g|), which cannot overflow: 1 / (1 + e) for g >= 0, else
 * e / (1 + e). */
static inline __m256 sigmoid8(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp_negative(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));
    const __m256 positive = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 negative = _mm256_div_ps(e, _mm256_add_ps(one, e));
    return _mm256_blendv_ps(positive, negative, g);
}

/* silu(g) * up. */
static inline __m256 silu_times(__m256 g, __m256 up) {
    return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(g)), up);
}

/* A tile's rows of 16 outputs (`width` of them: fewer in a matrix's last panel) stored at
 * y[row + j][first ...] (rows n apart), plus bias[first ...] and residual (laid out as y; may
 * be y itself) where given. */
static inline void store_rows(float *y, const float *bias, const float *residual, long n,
                              long row, int rows, long first, long width, const float *out) {
    for (int j = 0; j < rows; j++, out += 16) {
        float *dst = y + (row + j) * n + first;
        const float *res = residual ? residual + (row + j) * n + first : NULL;
        if (width == 16) {
            for (int h = 0; h < 16; h += 8) {
                __m256 v = _mm256_loadu_ps(out + h);
                if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + first + h));
                if (res) v = _mm256_add_ps(v, _mm256_loadu_ps(res + h));
                _mm256_storeu_ps(dst + h, v);
            }
            continue;
        }
        for (long i = 0; i < width; i++) {
            float v = out[i];
            if (bias) v += bias[first + i];
            if (res) v += res[i];
            dst[i] = v;
        }
    }
}
