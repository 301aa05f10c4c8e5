/* The 256-bit tiles on AVX-VNNI (CPUs with VNNI and no AVX-512): one vpdpbusd does the work of
 * AVX2's vpmaddubsw, vpmaddwd and vpaddd, 8-bit codes whole. The same integer sums as every other
 * ISA's, so the same bits. */
#pragma GCC target("avxvnni,avx2,fma,f16c")
#include "quantized_tiles256.h"

#define QDOT(BITS, acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)

QPRODUCTS(qproduct_avx_vnni)
