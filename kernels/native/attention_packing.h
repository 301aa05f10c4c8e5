/* A group's keys and values as the tiles take them (attention_tiles.c): read from a bfloat16
 * cache, or widened from an fp8 one, and its values packed as B tiles of P.V. */
#pragma once
#include "attention_tiles.h"

/* Where chunk c of group g's KV head h is packed: in `values`, or at `local` for a group of
 * one tile a KV head (a decode row), whose tile packs each chunk as it weighs it. */
static inline uint16_t *packed_at(const Tiles *a, const Group *g, long h, long c,
                                  uint16_t *local) {
    const long size = a->dim * CHUNK;
    if (g->packed < 0) return local;
    return a->values + ((g->packed + c - g->chunk) * a->kv_heads + h) * size;
}

/* Lanes (a[i], b[i]) for i < 16 of two registers' 32 16-bit lanes, through vpermt2w (add 16 for
 * their high halves). */
#define LOW_HALVES                                                                             \
    _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, \
                     37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0)

/* Token t's KV head h in `cache`, through a row's block `table`. */
static inline const char *head_at(const Tiles *a, const void *cache, const long *table, long h,
                                  long t) {
    const long bs = a->block_size, at = ((table[t / bs] * bs + t % bs) * a->kv_heads + h) * a->dim;
    return (const char *)cache + at * kv_bytes(a->format);
}

/* 32 of the cache's values from `from` on as bfloat16: a bf16 cache's as they are, fp8 codes
 * widened exactly in integers: a normal code's exponent rebased and its mantissa moved up, a
 * subnormal's bits (exponent 0) from `a->tiny`. */
AMX static inline __m512i bf16_values(const Tiles *a, const char *from) {
    if (a->format == KV_BF16) return _mm512_loadu_si512(from);
    const int e4m3 = a->format == KV_E4M3, bias = e4m3 ? 7 : 15, bits = e4m3 ? 3 : 2;
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)from));
    const __m512i magnitude = _mm512_and_si512(x, _mm512_set1_epi16(0x7F));
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 7 - bits),
                                            _mm512_set1_epi16((short)((127 - bias) << 7)));
    const __mmask32 tiny = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(1 << bits));
    const __m512i r = _mm512_mask_permutexvar_epi16(normal, tiny, magnitude, a->tiny);
    return _mm512_ternarylogic_epi32(r, _mm512_slli_epi16(x, 8), _mm512_set1_epi16(-0x8000), 0xF8);
}

/* The bf16 bits of an fp8 format's subnormals, m times its smallest (2^-9, 2^-16), by m. */
AMX static inline __m512i fp8_subnormals(long format) {
    const __m512 m = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0);
    const float smallest = format == KV_E4M3 ? 0x1p-9f : 0x1p-16f;
    const __m512 zero = _mm512_setzero_ps();
    return (__m512i)_mm512_cvtne2ps_pbh(zero, _mm512_mul_ps(m, _mm512_set1_ps(smallest)));
}

/* Dims [begin, end) of chunk c of group g's values of KV head h as B tiles of P.V, [16-dim
 * group][key pair][dim][2]: two keys' values interleaved, zeros for tokens outside the group's. */
AMX static void pack_values(const Tiles *a, const Group *g, long h, long c, long begin, long end,
                            uint16_t *local) {
    const long *table = a->tables + g->lead * a->width;
    const char *value[CHUNK];
    const long slice_bytes = 32 * kv_bytes(a->format);
    for (long j = 0, t = c * CHUNK; j < CHUNK; j++, t++)
        value[j] = t >= g->begin && t < g->end ? head_at(a, a->v_cache, table, h, t) : NULL;
    __m512i *to = (__m512i *)packed_at(a, g, h, c, local);
    const __m512i low = LOW_HALVES, high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (long k = 0; k < CHUNK / 2; k++) {
        const char *first = value[2 * k], *second = value[2 * k + 1];
        for (long slice = begin / 32; slice < end / 32; slice++) { /* 32 dims: groups 2s, 2s+1 */
            const __m512i zero = _mm512_setzero_si512();
            const __m512i x = first ? bf16_values(a, first + slice_bytes * slice) : zero;
            const __m512i y = second ? bf16_values(a, second + slice_bytes * slice) : zero;
            _mm512_store_si512(to + 32 * slice + k, _mm512_permutex2var_epi16(x, low, y));
            _mm512_store_si512(to + 32 * slice + 16 + k, _mm512_permutex2var_epi16(x, high, y));
        }
    }
}

/* Chunk c of group g's keys of KV head h widened from an fp8 cache to `a->keys`, [token][dim],
 * zeros for tokens outside the group's, once a call for every tile of the group's rows. */
AMX static void widen_keys(const Tiles *a, const Group *g, long h, long c) {
    const long *table = a->tables + g->lead * a->width;
    const long slice_bytes = 32 * kv_bytes(a->format);
    __m512i *to = (__m512i *)(a->keys + ((g->packed + c - g->chunk) * a->kv_heads + h) * a->dim *
                                            CHUNK);
    for (long j = 0, t = c * CHUNK; j < CHUNK; j++, t++) {
        const char *key = t >= g->begin && t < g->end ? head_at(a, a->k_cache, table, h, t) : NULL;
        for (long slice = 0; slice < a->dim / 32; slice++)
            *to++ = key ? bf16_values(a, key + slice_bytes * slice) : _mm512_setzero_si512();
    }
}
