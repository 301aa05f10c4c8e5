/* The quantized product's tiles on AVX2 (CPUs without VNNI): vpmaddubsw multiplies codes by
 * activation codes into pairs of int16, summed in int16 for as many groups as it holds (8 of
 * 4-bit codes' at 2 * 15 * 127 a pair, 4 of MXFP4's at 2 * 24 * 127, 2 of 6-bit's at
 * 2 * 63 * 127), then into int32 by one
 * vpmaddwd. An 8-bit code times an int8 could overflow a pair: it is multiplied as the int8 it
 * was (code - 128; |w| times x with w's sign, as llama.cpp) and 128 times the activation codes'
 * sum added back. The same integer sums as AVX-512's, so the results are the same bits. */
#define QSPAN(BITS) (BITS == 4 ? 8 : BITS == QFP4 ? 4 : BITS == 6 ? 2 : 1)
#define QWIDEN(acc, part) _mm256_add_epi32(acc, _mm256_madd_epi16(part, _mm256_set1_epi16(1)))
#define QSTORED(BITS, acc, xsum) \
    (BITS == 8 ? _mm256_add_epi32(acc, _mm256_set1_epi32(128 * (xsum))) : (acc))
#include "quantized_tiles256.h"

static inline __m256i signed_pairs(__m256i w, __m256i x) {
    const __m256i v = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(x, v));
}

#define QDOT(BITS, part, w, x) \
    _mm256_add_epi16(part, BITS == 8 ? signed_pairs(w, x) : _mm256_maddubs_epi16(w, x))

QPRODUCTS(qproduct_avx2)
