/* The quantized product's tiles on AVX2 (CPUs without VNNI): vpmaddubsw multiplies
 * codes by activation codes into pairs of int16, vpmaddwd sums the pairs into int32. 8-bit codes
 * go in as two nibbles (16 * high + low), as one byte's product with an int8 could overflow
 * int16; the sums are the same integers as AVX-512's, so the results are the same bits. */
#include "quantized_tiles256.h"

/* The int32 sums, for 8 features, of 4 codes times 4 activation codes. */
static inline __m256i dot4_4(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
static inline __m256i dot4_8(__m256i w, __m256i x) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i high = dot4_4(_mm256_and_si256(_mm256_srli_epi16(w, 4), low), x);
    return _mm256_add_epi32(_mm256_slli_epi32(high, 4), dot4_4(_mm256_and_si256(w, low), x));
}

#define dot4_6 dot4_4 /* 63 * 127 * 2 fits an int16 */
#define QDOT(BITS, acc, w, x) _mm256_add_epi32(acc, dot4_##BITS(w, x))

QPRODUCTS(qproduct_avx2)
