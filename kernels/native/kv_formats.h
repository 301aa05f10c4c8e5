/* The KV cache's formats (simd.h's KV_*), read back as float32 and written from it
 * (kv_formats.c). Every read is exact: a 16-bit value is float16 or bfloat16's bits, and an
 * 8-bit one's are float16's shifted: e5m2 is a float16's top byte, and e4m3's exponent and
 * mantissa, 7 places up, make a float16 of 2^-8 times its value (subnormals too; e4m3's NaN
 * code, which only a NaN stores, reads as 480). */
#pragma once
#include <stdint.h>

#include "simd.h"

/* The bytes a value takes in the cache. */
static inline long kv_bytes(long format) {
    return format == KV_F32 ? 4 : format >= KV_E4M3 ? 1 : 2;
}

/* Eight fp8 codes (KV_E4M3 or KV_E5M2) as float32. */
static inline __m256 widen_fp8(const uint8_t *from, long format) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)from));
    if (format == KV_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(x, 8));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8);
    const __m128i rest = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), 7);
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.0f));
}

/* Eight values of a cache in `format` from value `first` on, as float32. */
static inline __m256 widen_kv(const void *cache, long first, long format) {
    if (format == KV_F32) return _mm256_loadu_ps((const float *)cache + first);
    if (format >= KV_E4M3) return widen_fp8((const uint8_t *)cache + first, format);
    const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)cache + first));
    if (format == KV_F16) return _mm256_cvtph_ps(half);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

void round_kv(const float *from, void *cache, long first, long n, long format);
