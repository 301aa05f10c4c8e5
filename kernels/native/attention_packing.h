/* A group's keys and values as the tiles take them (attention_tiles.c): read from a bfloat16
 * cache, or widened from an fp8 one, and its values packed as B tiles of P.V. */
#pragma once
#include <string.h>

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

/* The tables of `format` (KV_E4M3 or KV_E5M2), its values exactly as torch reads them. */
AMX static Fp8 fp8_tables(long format) {
    const int bits = format == KV_E4M3 ? 3 : 2, bias = format == KV_E4M3 ? 7 : 15;
    uint8_t low[128], high[128], keys[64], values[64];
    for (int m = 0; m < 128; m++) {
        const int e = m >> bits, mantissa = m & ((1 << bits) - 1), top = 0x7F >> bits;
        float v = e ? ldexpf(1.0f + ldexpf((float)mantissa, -bits), e - bias)
                    : ldexpf((float)mantissa, 1 - bias - bits);
        if (format == KV_E4M3 && m == 0x7F) v = NAN;
        if (format == KV_E5M2 && e == top) v = mantissa ? NAN : INFINITY;
        uint32_t u;
        memcpy(&u, &v, 4);
        low[m] = (uint8_t)(u >> 16), high[m] = (uint8_t)(u >> 24); /* exact: few mantissa bits */
    }
    /* Unpacking pairs the low bytes, then the high bytes, of each 128-bit lane: byte p lands in
     * word q. `keys` moves a run's code q to p; `values` the q-th code of two 32-code runs
     * interleaved (the first's q / 2 for even q, the second's for odd). */
    for (int p = 0; p < 64; p++) {
        const int q = p % 16 < 8 ? p / 16 * 8 + p % 16 : 32 + p / 16 * 8 + p % 16 - 8;
        keys[p] = (uint8_t)q, values[p] = (uint8_t)(q % 2 * 32 + q / 2);
    }
    Fp8 f;
    for (int i = 0; i < 2; i++)
        f.low[i] = _mm512_loadu_si512(low + 64 * i), f.high[i] = _mm512_loadu_si512(high + 64 * i);
    f.keys = _mm512_loadu_si512(keys), f.values = _mm512_loadu_si512(values);
    return f;
}

/* 64 codes, placed by `order`, as bf16: the first 32 places' words, then the last 32's. */
AMX static inline void widen64(const Fp8 *f, __m512i codes, __m512i order, __m512i out[2]) {
    codes = _mm512_permutexvar_epi8(order, codes);
    const __m512i low = _mm512_permutex2var_epi8(f->low[0], codes, f->low[1]);
    __m512i high = _mm512_permutex2var_epi8(f->high[0], codes, f->high[1]);
    high = _mm512_ternarylogic_epi32(high, codes, _mm512_set1_epi8((char)0x80), 0xF8); /* | sign */
    out[0] = _mm512_unpacklo_epi8(low, high), out[1] = _mm512_unpackhi_epi8(low, high);
}

/* A run of `slices` 32-value slices of fp8 codes from `from` on as bf16, a slice a register. */
AMX static inline void widen_run(const Tiles *a, const char *from, long slices, __m512i *to) {
    for (long i = 0; i < slices; i += 2) {
        __m512i two[2];
        const void *at = from + 32 * i;
        const __m512i codes = i + 1 < slices ? _mm512_loadu_si512(at)
                                             : _mm512_zextsi256_si512(_mm256_loadu_si256(at));
        widen64(&a->fp8, codes, a->fp8.keys, two);
        to[i] = two[0];
        if (i + 1 < slices) to[i + 1] = two[1];
    }
}

/* Dims [begin, end) of chunk c of group g's values of KV head h as B tiles of P.V, [16-dim
 * group][key pair][dim][2]: two keys' values interleaved, zeros for tokens outside the group's. */
AMX static void pack_values(const Tiles *a, const Group *g, long h, long c, long begin, long end,
                            uint16_t *local) {
    const long *table = a->tables + g->lead * a->width;
    const long stride = a->kv_heads * a->dim * kv_bytes(a->format);
    const char *value[CHUNK];
    for (long half = 0; half < CHUNK; half += 16) { /* 16 tokens of one block: one lookup */
        const long t = c * CHUNK + half, seen = t > g->begin ? t : g->begin;
        const char *at = seen < g->end && seen < t + 16 ? head_at(a, a->v_cache, table, h, seen)
                                                        : NULL;
        for (long j = 0; j < 16; j++)
            value[half + j] = at && t + j >= seen && t + j < g->end ? at + (t + j - seen) * stride
                                                                    : NULL;
    }
    __m512i *to = (__m512i *)packed_at(a, g, h, c, local);
    const __m512i low = LOW_HALVES, high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    const __m512i zero = _mm512_setzero_si512();
    for (long k = 0; k < CHUNK / 2; k++) {
        const char *first = value[2 * k], *second = value[2 * k + 1];
        for (long slice = begin / 32; slice < end / 32; slice++) { /* 32 dims: groups 2s, 2s+1 */
            __m512i pairs[2];
            if (a->format == KV_BF16) {
                const __m512i x = first ? _mm512_loadu_si512(first + 64 * slice) : zero;
                const __m512i y = second ? _mm512_loadu_si512(second + 64 * slice) : zero;
                pairs[0] = _mm512_permutex2var_epi16(x, low, y);
                pairs[1] = _mm512_permutex2var_epi16(x, high, y);
            } else { /* fp8: the two keys' codes side by side, interleaved as they widen */
                const __m256i none = _mm256_setzero_si256();
                const void *x_at = first + 32 * slice, *y_at = second + 32 * slice;
                const __m256i x = first ? _mm256_loadu_si256(x_at) : none;
                const __m256i y = second ? _mm256_loadu_si256(y_at) : none;
                const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1);
                widen64(&a->fp8, both, a->fp8.values, pairs);
            }
            _mm512_store_si512(to + 32 * slice + k, pairs[0]);
            _mm512_store_si512(to + 32 * slice + 16 + k, pairs[1]);
        }
    }
}

/* Chunk c of group g's keys of KV head h widened from an fp8 cache to `a->keys`, [token][dim],
 * zeros for tokens outside the group's, once a call for every tile of the group's rows. */
AMX static void widen_keys(const Tiles *a, const Group *g, long h, long c) {
    const long *table = a->tables + g->lead * a->width, slices = a->dim / 32;
    __m512i *to = (__m512i *)(a->keys + ((g->packed + c - g->chunk) * a->kv_heads + h) * a->dim *
                                            CHUNK);
    for (long j = 0, t = c * CHUNK; j < CHUNK; j++, t++, to += slices) {
        if (t >= g->begin && t < g->end)
            widen_run(a, head_at(a, a->k_cache, table, h, t), slices, to);
        else
            for (long i = 0; i < slices; i++) to[i] = _mm512_setzero_si512();
    }
}
