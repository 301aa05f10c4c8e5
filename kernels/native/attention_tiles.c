/* Paged attention for a bfloat16 cache on AMX-BF16 tiles: 16 query rows (the query heads of a
 * KV head, token by token) against chunks of 32 keys, products of bf16 pairs summed in fp32.
 *
 * Scores are computed transposed, keys x rows, so that the keys are A tiles read from the cache
 * in place (16 tokens of a block, a row of the tile each) and a row's softmax runs down a
 * column, 16 rows a register; the values are packed once a call (attention_tiles.h). Two passes
 * over a tile's keys: the rows' largest scores, then exp and P.V summed in the output tiles, so
 * nothing is rescaled and the output leaves the tiles once. A tile's rows never mix, chunks
 * start at multiples of 32 tokens and a row's masked keys add exact zeros, so a row's bits are
 * the same whichever rows share its tile and whichever step it is in: a decode row gets the
 * bits it would get in a prompt. Figures: docs/benchmarks.md. */
#include <omp.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "attention_tiles.h"

/* Tiles 0-3: the output's 64 dims of a pass; 4-5: a chunk's scores; 6: A; 7: B. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Linux lends a process the tiles' state only once it asks (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); 1 when granted. */
int amx_ready(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

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
        g.packed = packed;
        packed += g.chunks;
        groups[count++] = g;
    }
    return count;
}

/* Gemma 2's soft cap, as attention.c applies it. */
static void soft_cap(const Tiles *a, float *s, long count) {
    const float inner = a->scale / a->softcap, outer = a->softcap / a->scale;
    for (long i = 0; i < count; i++) s[i] = outer * tanhf(s[i] * inner);
}

/* A tile's rows: the queries as B tiles of Q.K^T, [32-dim slice][dim pair][row][2], and the
 * tokens each row sees. */
typedef struct {
    uint32_t queries[256 / 2 * TILE] __attribute__((aligned(64)));
    long row[TILE], head[TILE], rows, lo, hi;
    __m512i begin, end;
    __mmask16 valid;
    int full_from, full_to; /* tokens every row sees */
} Rows;

/* The scores of chunk c's keys against the tile's rows, transposed: s[32 keys][16 rows]. Half
 * chunks no row sees are left out (their scores are masked). */
AMX static void score_chunk(const Tiles *a, const Group *g, long h, const Rows *r, long c,
                            float *s) {
    const long dim = a->dim, bs = a->block_size, *table = a->tables + g->lead * a->width;
    const long stride = a->kv_heads * dim * 2;
    _tile_zero(4);
    _tile_zero(5);
    for (long half = 0; half < 2; half++) {
        const long t = c * CHUNK + 16 * half;
        if (t + 16 <= r->lo || t >= r->hi) continue;
        const uint16_t *keys = a->k_cache + ((table[t / bs] * bs + t % bs) * a->kv_heads + h) * dim;
        for (long i = 0; i < dim / 32; i++) {
            _tile_loadd(6, keys + 32 * i, stride);
            _tile_loadd(7, r->queries + 256 * i, 64);
            if (half) _tile_dpbf16ps(5, 6, 7);
            else _tile_dpbf16ps(4, 6, 7);
        }
    }
    _tile_stored(4, s, 64);
    _tile_stored(5, s + 256, 64);
    if (a->softcap > 0.0f) soft_cap(a, s, TILE * CHUNK);
}

/* Ask for group g's blocks, keys and values, into L2 at once, so that their misses overlap:
 * a row's blocks lie anywhere in the cache, so no hardware prefetcher guesses the next one. */
static void prefetch(const Tiles *a, const Group *g) {
    const long bs = a->block_size, bytes = bs * a->kv_heads * a->dim * 2;
    const long *table = a->tables + g->lead * a->width;
    for (long b = g->begin / bs; b * bs < g->end; b++)
        for (long i = 0; i < bytes; i += 64) {
            _mm_prefetch((const char *)(a->k_cache) + table[b] * bytes + i, _MM_HINT_T1);
            _mm_prefetch((const char *)(a->v_cache) + table[b] * bytes + i, _MM_HINT_T1);
        }
}

/* The rows of the tile that see token t. */
AMX static inline __mmask16 seeing(const Rows *r, long t) {
    if (t >= r->full_from && t < r->full_to) return r->valid;
    const __m512i key = _mm512_set1_epi32((int)t);
    return _mm512_mask_cmple_epi32_mask(r->valid, r->begin, key) &
           _mm512_cmplt_epi32_mask(key, r->end);
}

/* Pairs [first, first + 16) (fewer at the end) of group g's (row, query head of KV head h). */
AMX static void tile_rows(const Tiles *a, const float *q, const Group *g, long h, long first,
                          Rows *r) {
    const long dim = a->dim, group = a->heads / a->kv_heads, left = g->rows * group - first;
    uint32_t flat[TILE * 256 / 2] __attribute__((aligned(64)));
    int begin[TILE], end[TILE];
    r->rows = left < TILE ? left : TILE;
    r->lo = g->end, r->hi = 0, r->full_from = 0, r->full_to = (int)g->end;
    for (long m = 0; m < TILE; m++) {
        const long pair = first + (m < r->rows ? m : 0);
        r->row[m] = g->first + pair / group, r->head[m] = h * group + pair % group;
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
    for (long i = 0; i < dim / 32; i++) { /* slice i: its 16 pairs of each row, transposed */
        __m512i pairs[16];
        for (long m = 0; m < TILE; m++) pairs[m] = _mm512_load_si512(flat + m * dim / 2 + 16 * i);
        transpose16(pairs);
        for (long k = 0; k < 16; k++) _mm512_store_si512(r->queries + 256 * i + 16 * k, pairs[k]);
    }
}

/* One tile of a group's rows against its KV head h; `scores` holds a chunk's for each chunk
 * of the group (the second pass reads them again). */
AMX static void run_tile(const Tiles *a, const float *q, const Group *g, long h, long first,
                         float *scores, float *out) {
    Rows r;
    tile_rows(a, q, g, h, first, &r);
    float o[DIMS_A_PASS * TILE] __attribute__((aligned(64)));
    uint32_t weights[CHUNK / 2 * TILE] __attribute__((aligned(64)));
    const __m512i interleave = INTERLEAVE;
    const long from = r.lo / CHUNK, to = (r.hi + CHUNK - 1) / CHUNK;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (long c = from; c < to; c++) {
        float *s = scores + (c - from) * CHUNK * TILE;
        score_chunk(a, g, h, &r, c, s);
        for (long j = 0; j < CHUNK; j++)
            top = _mm512_mask_max_ps(top, seeing(&r, c * CHUNK + j), top,
                                     _mm512_load_ps(s + 16 * j));
    }
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (long pass = 0; pass < a->dim; pass += DIMS_A_PASS) {
        __m512 sum = _mm512_setzero_ps();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long c = from; c < to; c++) {
            const float *s = scores + (c - from) * CHUNK * TILE;
            for (long k = 0; k < CHUNK / 2; k++) {
                __m512 p[2];
                for (long e = 0; e < 2; e++) {
                    const __m512 x = _mm512_sub_ps(_mm512_load_ps(s + 16 * (2 * k + e)), top);
                    p[e] = _mm512_maskz_mov_ps(seeing(&r, c * CHUNK + 2 * k + e),
                                               exp_negative16(_mm512_mul_ps(x, scale)));
                    sum = _mm512_add_ps(sum, p[e]);
                }
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]);
                _mm512_store_si512(weights + 16 * k, _mm512_permutexvar_epi16(interleave, both));
            }
            const uint16_t *v = a->values + packed_at(a, g, h, c) + pass * CHUNK;
            const long groups = (a->dim - pass) / 16;
            _tile_loadd(7, weights, 64);
            _tile_loadd(6, v, 64);
            _tile_dpbf16ps(0, 6, 7);
            _tile_loadd(6, v + 512, 64);
            _tile_dpbf16ps(1, 6, 7);
            if (groups > 2) {
                _tile_loadd(6, v + 1024, 64);
                _tile_dpbf16ps(2, 6, 7);
                _tile_loadd(6, v + 1536, 64);
                _tile_dpbf16ps(3, 6, 7);
            }
        }
        _tile_stored(0, o, 64);
        _tile_stored(1, o + 256, 64);
        _tile_stored(2, o + 512, 64);
        _tile_stored(3, o + 768, 64);
        float total[TILE];
        _mm512_storeu_ps(total, sum);
        const long width = a->dim - pass < DIMS_A_PASS ? a->dim - pass : DIMS_A_PASS;
        for (long m = 0; m < r.rows; m++) {
            float *to_row = out + (r.row[m] * a->heads + r.head[m]) * a->dim + pass;
            for (long d = 0; d < width; d++) to_row[d] = o[d * TILE + m] / total[m];
        }
    }
}

/* Tile `first` / 16 of group's pairs for KV head `head`; or, for a group of one tile a KV
 * head (a decode row), `head` -1: every KV head's, its blocks read once, in turn. */
typedef struct {
    long group, head, first;
} Task;

AMX static void run_task(const Tiles *a, const float *q, const Group *groups, Task task,
                         float *scores, float *out) {
    const Group *g = &groups[task.group];
    if (task.head >= 0) return run_tile(a, q, g, task.head, task.first, scores, out);
    prefetch(a, g);
    for (long h = 0; h < a->kv_heads; h++) {
        for (long c = g->chunk; c < g->chunk + g->chunks; c++) pack_values(a, g, h, c);
        run_tile(a, q, g, h, 0, scores, out);
    }
}

/* As paged_decode_attention (attention.c), for a bf16 cache, dim a multiple of 32 up to 256,
 * on a CPU with AMX-BF16 once `amx_ready`. Returns 0, or -1 when out of memory. */
AMX int tiled_attention(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                        const long *block_tables, long width, const long *seq_lens, float *out,
                        long rows, long heads, long kv_heads, long dim, long block_size,
                        float scale, long window, float softcap) {
    Tiles a = {k_cache, v_cache, block_tables, seq_lens, width, heads, kv_heads, dim,
               block_size, window, scale, softcap};
    Group *groups = malloc(sizeof(Group) * rows);
    if (groups == NULL) return -1;
    const long count = group_rows(&a, rows, groups), per_head = heads / kv_heads;
    long chunks = 0, tasks = 0;
    for (long i = 0; i < count; i++) {
        chunks += groups[i].chunks;
        const long tiles = (groups[i].rows * per_head + TILE - 1) / TILE;
        tasks += tiles > 1 ? kv_heads * tiles : 1;
    }
    Task *task = malloc(sizeof(Task) * tasks);
    long *owner = malloc(sizeof(long) * chunks); /* each packed chunk's group */
    a.values = aligned_alloc(64, sizeof(uint16_t) * chunks * kv_heads * dim * CHUNK);
    if (!task || !owner || !a.values) {
        free(groups); free(task); free(owner); free(a.values);
        return -1;
    }
    for (long i = 0, t = 0; i < count; i++) {
        for (long c = 0; c < groups[i].chunks; c++) owner[groups[i].packed + c] = i;
        if (groups[i].rows * per_head <= TILE) task[t++] = (Task){i, -1, 0};
        else
            for (long h = 0; h < kv_heads; h++)
                for (long first = 0; first < groups[i].rows * per_head; first += TILE)
                    task[t++] = (Task){i, h, first};
    }
    long most = 0; /* chunks of the longest group */
    for (long i = 0; i < count; i++) most = groups[i].chunks > most ? groups[i].chunks : most;
    TileConfig config = {.palette = 1};
    for (int i = 0; i < 8; i++) config.bytes_per_row[i] = 64, config.rows[i] = TILE;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (long i = 0; i < chunks * kv_heads; i++) {
            const Group *g = &groups[owner[i / kv_heads]];
            if (g->rows * per_head > TILE) /* else its task packs them (run_task) */
                pack_values(&a, g, i % kv_heads, g->chunk + i / kv_heads - g->packed);
        }
        /* gcc 12 takes _tile_loadconfig to read 8 bytes: the barrier keeps all 64 stored. */
        __asm__ volatile("" : : "r"(&config) : "memory");
        _tile_loadconfig(&config);
        float *scores = aligned_alloc(64, sizeof(float) * most * CHUNK * TILE);
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < tasks; i++)
            if (scores)
                run_task(&a, q, groups, task[i], scores, out);
        _tile_release();
        free(scores);
    }
    free(groups); free(task); free(owner); free(a.values);
    return failed ? -1 : 0;
}
