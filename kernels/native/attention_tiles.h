/* What attention_tiles.c puts together: the runs of rows that read the same blocks (groups), the
 * 16 x 16 transpose that puts a chunk's weights in A tiles, the tiles by number, a tile's rows
 * and their queries, exp in 512-bit registers. Their keys and values: attention_packing.h. */
#pragma once
#include <math.h>
#include <stdint.h>

#include "amx.h"
#include "kv_formats.h"

#define AMX \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16")))
enum { TILE = 16, CHUNK = 32, DIMS_A_PASS = 64 }; /* rows a tile; keys a chunk; outputs a pass */
/* An fp8 cache's codes as bf16, by table: each code's 7 magnitude bits look up its bf16's low
 * byte and high byte (vpermi2b, 128 bytes in two registers each), the sign goes back in, and
 * the bytes pair into words (vpunpck[lh]bw, which pair within 128-bit lanes: `keys` and
 * `values` put a run's codes, or two runs' interleaved, where the pairing leaves them in turn). */
typedef struct {
    __m512i low[2], high[2], keys, values;
} Fp8;

typedef struct {
    const void *k_cache, *v_cache; /* bfloat16 or fp8 values (`format`) */
    const long *tables, *lens;
    long width, heads, kv_heads, dim, block_size, window;
    float scale, softcap;
    uint16_t *values; /* packed (`pack_values`): [chunk of a group][kv head][dim * CHUNK] */
    uint16_t *keys;   /* an fp8 cache's, widened (`widen_keys`): as `values`, [CHUNK][dim] */
    long per_head;    /* query heads a KV head */
    long format;      /* KV_BF16, KV_E4M3 or KV_E5M2 (simd.h) */
    Fp8 fp8;          /* an fp8 format's tables (`fp8_tables`) */
    const float *sinks; /* [heads] a logit a head in its softmax's total (gpt-oss); or NULL */
} Tiles;

/* Rows [first, first + rows) read the same blocks over tokens [begin, end), through `lead`'s
 * table (the longest row's): chunks [chunk, chunk + chunks), packed in `values` (and an fp8
 * cache's keys in `keys`) from chunk `packed` on, or by their one tile's task where they fill
 * one tile a KV head (`packed` -1). */
typedef struct {
    long first, rows, lead, begin, end, chunk, chunks, packed;
} Group;

static inline long first_visible(long len, long window) {
    return window > 0 && len > window ? len - window : 0;
}

static int agree(const Tiles *a, long x, long y, long begin, long end) {
    const long *p = a->tables + x * a->width, *q = a->tables + y * a->width;
    for (long b = begin / a->block_size; b * a->block_size < end; b++)
        if (p[b] != q[b]) return 0;
    return 1;
}

/* Consecutive rows whose tables agree over their tokens, as groups; returns their count. */
static long group_rows(const Tiles *a, long rows, Group *groups) {
    long count = 0, packed = 0;
    for (long r = 0, n; r < rows; r = n) {
        Group g = {r, 0, r, first_visible(a->lens[r], a->window), a->lens[r]};
        for (n = r + 1; n < rows; n++) {
            const long begin = first_visible(a->lens[n], a->window), len = a->lens[n];
            const long from = begin < g.begin ? begin : g.begin;
            if (!agree(a, g.lead, n, from, len < g.end ? len : g.end)) break;
            g.begin = from;
            if (len > g.end) g.end = len, g.lead = n;
        }
        g.rows = n - r;
        g.chunk = g.begin / CHUNK;
        g.chunks = (g.end + CHUNK - 1) / CHUNK - g.chunk;
        g.packed = g.rows * a->per_head > TILE ? packed : -1;
        packed += g.packed < 0 ? 0 : g.chunks;
        groups[count++] = g;
    }
    return count;
}

/* The 32 16-bit lanes of a and b's first 16 as pairs (a[i], b[i]), through vpermw. */
#define INTERLEAVE                                                                             \
    _mm512_setr_epi32(0x100000, 0x110001, 0x120002, 0x130003, 0x140004, 0x150005, 0x160006,   \
                      0x170007, 0x180008, 0x190009, 0x1a000a, 0x1b000b, 0x1c000c, 0x1d000d,   \
                      0x1e000e, 0x1f000f)

/* r[j] becomes column j of the 16 x 16 matrix of 32-bit values whose rows are r[0..16). */
AMX static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[4i + c], 128-bit lane L: column 4L + c, rows 4i.. */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) { /* then the four u[4i + c] as a 4 x 4 of 128-bit lanes */
        const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
        const __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
        const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
}

/* Tiles are named by immediates: these take their numbers at run time. */
enum { QUERY_TILES = 4 }; /* the queries' 32-dim slices that stay in tiles while scoring */
#define TILE_CASE(n, op) \
    case n: op(n); break;
#define EACH_TILE(i, op) \
    switch (i) { TILE_CASE(0, op) TILE_CASE(1, op) TILE_CASE(2, op) TILE_CASE(3, op) \
                 TILE_CASE(4, op) TILE_CASE(5, op) TILE_CASE(6, op) TILE_CASE(7, op) }

AMX static inline void load_tile(long i, const void *from, long stride) {
#define LOAD(n) TILE_LOAD(n, from, stride)
    EACH_TILE(i, LOAD)
#undef LOAD
}

AMX static inline void store_tile(long i, float *to) {
#define STORE(n) _tile_stored(n, to, 64)
    EACH_TILE(i, STORE)
#undef STORE
}

AMX static inline void zero_tile(long i) { EACH_TILE(i, _tile_zero) }

/* Tile c += tile a . tile b, for the triples the scores and P.V use. */
AMX static inline void dot_tiles(long c, long a, long b) {
#define DOT(c, a, b) \
    case c * 64 + a * 8 + b: _tile_dpbf16ps(c, a, b); break;
    switch (c * 64 + a * 8 + b) {
        DOT(4, 6, 0) DOT(4, 7, 1) DOT(4, 6, 2) DOT(4, 7, 3) DOT(5, 6, 0) DOT(5, 7, 1) DOT(5, 6, 2)
        DOT(5, 7, 3) DOT(0, 6, 4) DOT(1, 6, 5) DOT(2, 6, 4) DOT(3, 6, 5) DOT(0, 6, 5) DOT(1, 6, 4)
        DOT(2, 6, 5) DOT(3, 6, 4) DOT(0, 7, 4) DOT(1, 7, 5) DOT(2, 7, 4) DOT(3, 7, 5) DOT(0, 7, 5)
        DOT(1, 7, 4) DOT(2, 7, 5) DOT(3, 7, 4)
    default: __builtin_trap(); /* a triple left out here would drop its product silently */
    }
#undef DOT
}

/* A tile's lanes: (row, query head) pairs of `heads` KV heads from `kv` on, each KV head's in
 * turn. Their queries as B tiles of Q.K^T, [KV head][32-dim slice][dim pair][lane][2], each
 * KV head's tiles zero in the other heads' lanes, so that summing every head's products gives
 * each lane its own head's scores, exactly; and the tokens each lane sees. */
enum { SPAN_TILES = 16 }; /* query tiles a tile's KV heads may fill: 16 KB */
typedef struct {
    uint32_t queries[SPAN_TILES * 256] __attribute__((aligned(64)));
    long row[TILE], head[TILE], rows, lo, hi, kv, heads;
    __m512i begin, end;
    __mmask16 valid, of[TILE]; /* of[j]: the lanes of KV head kv + j */
    int full_from, full_to;    /* tokens every lane sees */
} Rows;

/* KV heads a tile of a decode group's lanes takes at once (exp, the weights' transpose and
 * their stores then run once for them), within a tile's 16 lanes and SPAN_TILES. */
static inline long span(const Tiles *a, const Group *g) {
    const long lanes = TILE / (g->rows * a->per_head), tiles = SPAN_TILES / (a->dim / 32);
    const long most = lanes < tiles ? lanes : tiles;
    return most < a->kv_heads ? most : a->kv_heads;
}

/* The lanes of the tile that see token t. */
AMX static inline __mmask16 seeing(const Rows *r, long t) {
    if (t >= r->full_from && t < r->full_to) return r->valid;
    const __m512i key = _mm512_set1_epi32((int)t);
    return _mm512_mask_cmple_epi32_mask(r->valid, r->begin, key) &
           _mm512_cmplt_epi32_mask(key, r->end);
}

/* Lanes [first, first + 16) (fewer at the end) of group g's (row, query head) pairs of KV
 * heads [kv, kv + heads). */
AMX static void tile_rows(const Tiles *a, const float *q, const Group *g, long kv, long heads,
                          long first, Rows *r) {
    const long dim = a->dim, pairs = g->rows * a->per_head, left = heads * pairs - first;
    uint32_t flat[TILE * 256 / 2] __attribute__((aligned(64)));
    int begin[TILE], end[TILE];
    r->rows = left < TILE ? left : TILE, r->kv = kv, r->heads = heads;
    r->lo = g->end, r->hi = 0, r->full_from = 0, r->full_to = (int)g->end;
    for (long j = 0; j < heads; j++) r->of[j] = 0;
    for (long m = 0; m < TILE; m++) {
        const long lane = first + (m < r->rows ? m : 0), j = lane / pairs, pair = lane % pairs;
        r->of[j] |= (__mmask16)(1u << m);
        r->row[m] = g->first + pair / a->per_head;
        r->head[m] = (kv + j) * a->per_head + pair % a->per_head;
        const float *from = q + (r->row[m] * a->heads + r->head[m]) * dim;
        for (long d = 0; d < dim; d += 16) {
            const __m256bh x = _mm256_cvtne2ps_pbh(_mm256_loadu_ps(from + d + 8),
                                                   _mm256_loadu_ps(from + d));
            _mm256_store_si256((__m256i *)(flat + (m * dim + d) / 2), (__m256i)x);
        }
        const long len = a->lens[r->row[m]], seen = first_visible(len, a->window);
        begin[m] = (int)seen, end[m] = m < r->rows ? (int)len : 0;
        if (m >= r->rows) continue;
        r->lo = seen < r->lo ? seen : r->lo, r->hi = len > r->hi ? len : r->hi;
        r->full_from = seen > r->full_from ? (int)seen : r->full_from;
        r->full_to = len < r->full_to ? (int)len : r->full_to;
    }
    r->begin = _mm512_loadu_si512(begin), r->end = _mm512_loadu_si512(end);
    r->valid = (__mmask16)((1u << r->rows) - 1);
    for (long i = 0; i < dim / 32; i++) { /* slice i: its 16 pairs of each lane, transposed */
        __m512i lanes[16];
        for (long m = 0; m < TILE; m++) lanes[m] = _mm512_load_si512(flat + m * dim / 2 + 16 * i);
        transpose16(lanes);
        for (long j = 0; j < heads; j++)
            for (long k = 0; k < 16; k++)
                _mm512_store_si512(r->queries + 256 * (j * dim / 32 + i) + 16 * k,
                                   _mm512_maskz_mov_epi32(r->of[j], lanes[k]));
    }
}
