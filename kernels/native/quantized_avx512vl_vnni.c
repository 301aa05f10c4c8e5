/* The same 256-bit VNNI tiles in AVX-512's encoding of vpdpbusd (AVX512-VL): a CPU with
 * AVX512-VNNI and not AVX-VNNI (the AMD EPYC they were written on) runs them, and the tests
 * check them, as this. */
#pragma GCC target("avx512vl,avx512vnni,avx2,fma,f16c")
#include "quantized_tiles256.h"

#define QDOT(BITS, acc, w, x) _mm256_dpbusd_epi32(acc, w, x)

QPRODUCTS(qproduct_avx512vl_vnni)
