/* Writing the KV cache in its format (kv_formats.h) as torch rounds: to nearest, ties to even,
 * so the native layers and the torch path leave the same cache. */
#include "kv_formats.h"

/* Eight float32 as bfloat16 (a NaN stays a NaN) or float16 (whose overflow is inf). */
static __m128i to_half(__m256 x, long format) {
    if (format == KV_F16) return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i u = _mm256_castps_si256(x), one = _mm256_set1_epi32(1);
    __m256i even = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), even)), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
    /* 32-bit lanes to 16: the pack interleaves 128-bit lanes, the permute undoes it. */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    return _mm256_castsi256_si128(packed);
}

/* Eight float32 as fp8 codes, in the low 8 bytes. A value beyond the format's largest (e4m3:
 * 448, e5m2: 57344) saturates to it, as vLLM's fp8 kernels and torch's e4m3 do (the torch
 * path clamps e5m2's first); below the smallest normal, a multiple of the smallest subnormal. */
static __m128i to_fp8(__m256 x, long format) {
    const int bits = format == KV_E4M3 ? 3 : 2, bias = format == KV_E4M3 ? 7 : 15;
    const int shift = 23 - bits, largest = format == KV_E4M3 ? 0x7E : 0x7B;
    const __m256i u = _mm256_castps_si256(x);
    const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(magnitude, shift), _mm256_set1_epi32(1));
    __m256i normal = _mm256_add_epi32(magnitude, _mm256_set1_epi32((1 << (shift - 1)) - 1));
    normal = _mm256_srli_epi32(_mm256_add_epi32(normal, odd), shift);
    normal = _mm256_sub_epi32(normal, _mm256_set1_epi32((127 - bias) << bits));
    normal = _mm256_min_epi32(normal, _mm256_set1_epi32(largest));
    /* Subnormals: the value in units of the smallest subnormal, rounded as MXCSR (to even). */
    const __m256 units = _mm256_set1_ps((float)(1 << (bias - 1 + bits)));
    const __m256i tiny = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(magnitude), units));
    const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32((128 - bias) << 23), magnitude);
    __m256i code = _mm256_blendv_epi8(normal, tiny, below);
    const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000));
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), nan);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
    code = _mm256_or_si256(code, sign);
    /* Each lane's low byte: four a 128-bit half, then the halves side by side. */
    const __m256i low = _mm256_shuffle_epi8(
        code, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4,
                               8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
}

/* n float32 values (n a multiple of 8) into a cache in `format` from value `first` on. */
void round_kv(const float *from, void *cache, long first, long n, long format) {
    for (long i = 0; i < n; i += 8) {
        const __m256 x = _mm256_loadu_ps(from + i);
        if (format == KV_F32) _mm256_storeu_ps((float *)cache + first + i, x);
        else if (format >= KV_E4M3)
            _mm_storel_epi64((__m128i *)((uint8_t *)cache + first + i), to_fp8(x, format));
        else _mm_storeu_si128((__m128i *)((uint16_t *)cache + first + i), to_half(x, format));
    }
}
