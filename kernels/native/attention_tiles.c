/* Paged attention for a bfloat16 cache on AMX-BF16 tiles: 16 query rows (the query heads of a
 * KV head, token by token) against chunks of 32 keys, products of bf16 pairs summed in fp32.
 *
 * Scores are computed transposed, keys x rows, so that the keys are A tiles read from the cache
 * in place (16 tokens of a block, a row of the tile each) and a row's softmax runs down a
 * column, 16 rows a register. Two passes over a tile's keys: the rows' largest scores, then exp
 * and P.V summed in the output tiles, so nothing is rescaled and the output leaves the tiles
 * once; there the weights, transposed to rows x keys, are A tiles and the values, packed once a
 * call with two keys interleaved (attention_tiles.h), B tiles. A tile's rows never mix, chunks
 * start at multiples of 32 tokens and a row's masked keys add exact zeros, so a row's bits are
 * the same whichever rows share its tile and whichever step it is in: a decode row gets the
 * bits it would get in a prompt. Figures: docs/benchmarks.md. */
/* syscall() is declared only beyond strict C11. */
#define _GNU_SOURCE
#include <omp.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include "attention_tiles.h"

/* Tiles are not renamed: a load into a tile waits for the product before that reads it. So
 * while scoring, tiles 0-3 hold the queries' slices, 4-5 a chunk's scores and the keys alternate
 * between 6 and 7; while weighing, 0-3 sum the output's 64 dims of a pass, 16 each, the weights
 * alternate between 6 and 7 and the values between 4 and 5. */

/* Linux lends a process the tiles' state only once it asks (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); 1 when granted. */
int amx_ready(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

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
    const long dim = a->dim, *table = a->tables + g->lead * a->width;
    const long stride = a->kv_heads * dim * 2;
    const long slices = dim / 32;
    /* The next chunk's keys into L1 while this one's are scored: a tile's 16 rows, 2 to 4 lines
     * each a stride apart, have no hardware prefetcher ahead of them (docs/benchmarks.md). */
    for (long t = (c + 1) * CHUNK; t < (c + 2) * CHUNK && t < r->hi; t += 16) {
        const char *next = (const char *)head_at(a, a->k_cache, table, h, t);
        for (long j = 0; j < 16 * stride; j += stride)
            for (long line = 0; line < dim * 2; line += 64)
                _mm_prefetch(next + j + line, _MM_HINT_T0);
    }
    _tile_zero(4);
    _tile_zero(5);
    for (long half = 0; half < 2; half++) {
        const long t = c * CHUNK + 16 * half;
        if (t + 16 <= r->lo || t >= r->hi) continue;
        const uint16_t *keys = head_at(a, a->k_cache, table, h, t);
        for (long i = 0; i < slices; i++) {
            if (slices > QUERY_TILES) load_tile(i % QUERY_TILES, r->queries + 256 * i, 64);
            load_tile(6 + i % 2, keys + 32 * i, stride);
            dot_tiles(4 + half, 6 + i % 2, i % QUERY_TILES);
        }
    }
    _tile_stored(4, s, 64);
    _tile_stored(5, s + 256, 64);
    if (a->softcap > 0.0f) soft_cap(a, s, TILE * CHUNK);
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

/* A thread's buffers: a chunk's scores for each chunk of a group (the second pass reads them
 * again), the packed values of a group its task packs, and the next group's lines to ask for. */
typedef struct {
    float *scores;
    uint16_t *local;
    Ahead ahead;
} Scratch;

/* One tile of a group's rows against its KV head h, in the thread's buffers (`Scratch`), the
 * next group's lines asked for a chunk at a time. */
AMX static void run_tile(const Tiles *a, const float *q, const Group *g, long h, long first,
                         Scratch *mine, float *out) {
    Rows r;
    tile_rows(a, q, g, h, first, &r);
    for (long i = 0; i < a->dim / 32 && a->dim / 32 <= QUERY_TILES; i++)
        load_tile(i, r.queries + 256 * i, 64);
    float o[DIMS_A_PASS * TILE] __attribute__((aligned(64)));
    uint32_t weights[CHUNK / 2 * TILE] __attribute__((aligned(64)));
    const __m512i interleave = INTERLEAVE;
    const long from = r.lo / CHUNK, to = (r.hi + CHUNK - 1) / CHUNK;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (long c = from; c < to; c++) {
        float *s = mine->scores + (c - from) * CHUNK * TILE;
        drip(&mine->ahead);
        score_chunk(a, g, h, &r, c, s);
        for (long j = 0; j < CHUNK; j++)
            top = _mm512_mask_max_ps(top, seeing(&r, c * CHUNK + j), top,
                                     _mm512_load_ps(s + 16 * j));
    }
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (long pass = 0; pass < a->dim; pass += DIMS_A_PASS) {
        __m512 sum = _mm512_setzero_ps();
        const long groups = (a->dim - pass < DIMS_A_PASS ? a->dim - pass : DIMS_A_PASS) / 16;
        for (long i = 0; i < groups; i++) zero_tile(i);
        for (long c = from, turn = 0; c < to; c++) {
            const float *s = mine->scores + (c - from) * CHUNK * TILE;
            drip(&mine->ahead);
            __m512i pairs[CHUNK / 2]; /* [key pair][row], then [row][key pair] */
            for (long k = 0; k < CHUNK / 2; k++) {
                __m512 p[2];
                for (long e = 0; e < 2; e++) {
                    const __m512 x = _mm512_sub_ps(_mm512_load_ps(s + 16 * (2 * k + e)), top);
                    p[e] = _mm512_maskz_mov_ps(seeing(&r, c * CHUNK + 2 * k + e),
                                               exp_negative16(_mm512_mul_ps(x, scale)));
                    sum = _mm512_add_ps(sum, p[e]);
                }
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]);
                pairs[k] = _mm512_permutexvar_epi16(interleave, both);
            }
            transpose16(pairs);
            for (long k = 0; k < CHUNK / 2; k++) _mm512_store_si512(weights + 16 * k, pairs[k]);
            const uint16_t *v = packed_at(a, g, h, c, mine->local) + pass * CHUNK;
            load_tile(6 + c % 2, weights, 64);
            for (long i = 0; i < groups; i++, turn++) {
                load_tile(4 + turn % 2, v + 512 * i, 64);
                dot_tiles(i, 6 + c % 2, 4 + turn % 2);
            }
        }
        for (long i = 0; i < groups; i++) store_tile(i, o + 256 * i);
        float total[TILE];
        _mm512_storeu_ps(total, sum);
        for (long m = 0; m < r.rows; m++) {
            float *to_row = out + (r.row[m] * a->heads + r.head[m]) * a->dim + pass;
            for (long i = 0; i < groups; i++)
                _mm512_storeu_ps(to_row + 16 * i,
                                 _mm512_div_ps(_mm512_load_ps(o + 256 * i + 16 * m),
                                               _mm512_set1_ps(total[m])));
        }
    }
}

/* Tile `first` / 16 of group's pairs for KV head `head`; for a group of one tile a KV head (a
 * decode row), that tile with its values packed by the task, or, `head` -1, every KV head's in
 * turn, the group's blocks read once. */
typedef struct {
    long group, head, first;
} Task;

AMX static void run_task(const Tiles *a, const float *q, const Group *groups, Task task,
                         Scratch *mine, float *out) {
    const Group *g = &groups[task.group];
    if (g->packed >= 0) return run_tile(a, q, g, task.head, task.first, mine, out);
    const long first = task.head < 0 ? 0 : task.head;
    const long last = task.head < 0 ? a->kv_heads : first + 1;
    for (long h = first; h < last; h++) {
        for (long c = g->chunk; c < g->chunk + g->chunks; c++) {
            drip(&mine->ahead);
            pack_values(a, g, h, c, mine->local);
        }
        run_tile(a, q, g, h, 0, mine, out);
    }
}

/* As paged_decode_attention (attention.c), for a bf16 cache, dim a multiple of 32 up to 256,
 * on a CPU with AMX-BF16 once `amx_ready`. Returns 0, or -1 when out of memory. */
AMX int tiled_attention(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                        const long *block_tables, long width, const long *seq_lens, float *out,
                        long rows, long heads, long kv_heads, long dim, long block_size,
                        float scale, long window, float softcap) {
    Tiles a = {k_cache, v_cache, block_tables, seq_lens, width, heads, kv_heads, dim,
               block_size, window, scale, softcap, NULL, heads / kv_heads};
    Group *groups = malloc(sizeof(Group) * rows);
    if (groups == NULL) return -1;
    const long count = group_rows(&a, rows, groups), chunk_size = dim * CHUNK;
    long shared = 0, tasks = 0, most = 0; /* chunks packed in `values`; chunks of a group */
    long alone = 0; /* groups of one tile a KV head */
    for (long i = 0; i < count; i++) {
        shared += groups[i].packed < 0 ? 0 : groups[i].chunks;
        alone += groups[i].packed < 0;
        const long tiles = (groups[i].rows * a.per_head + TILE - 1) / TILE;
        tasks += groups[i].packed < 0 ? 0 : kv_heads * tiles;
        most = groups[i].chunks > most ? groups[i].chunks : most;
    }
    /* A group of one tile a KV head is one task, its blocks read once, unless there are too few
     * such groups to keep every thread busy: then one task a KV head. */
    const long split = alone < 4 * omp_get_max_threads() ? kv_heads : 1;
    tasks += alone * split;
    Task *task = malloc(sizeof(Task) * tasks);
    long *owner = malloc(sizeof(long) * (shared + 1)); /* each shared chunk's group */
    a.values = aligned_alloc(64, sizeof(uint16_t) * (shared * kv_heads + 1) * chunk_size);
    if (!task || !owner || !a.values) {
        free(groups); free(task); free(owner); free(a.values);
        return -1;
    }
    long big = 0; /* tasks of groups of several tiles first, then the rest (decode rows) */
    for (long i = 0; i < count; i++) {
        const Group *g = &groups[i];
        for (long c = 0; g->packed >= 0 && c < g->chunks; c++) owner[g->packed + c] = i;
        for (long h = 0; g->packed >= 0 && h < kv_heads; h++)
            for (long first = 0; first < g->rows * a.per_head; first += TILE)
                task[big++] = (Task){i, h, first};
    }
    for (long i = 0, t = big; i < count; i++)
        for (long h = 0; groups[i].packed < 0 && h < split; h++)
            task[t++] = (Task){i, split > 1 ? h : -1, 0};
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (long i = 0; i < shared * kv_heads; i++) {
            const Group *g = &groups[owner[i / kv_heads]];
            pack_values(&a, g, i % kv_heads, g->chunk + i / kv_heads - g->packed, NULL);
        }
        configure_tiles();
        Scratch mine = {aligned_alloc(64, sizeof(float) * most * CHUNK * TILE),
                        aligned_alloc(64, sizeof(uint16_t) * most * chunk_size), NOTHING_AHEAD};
        if (mine.scores == NULL || mine.local == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1) nowait
        for (long i = 0; i < big; i++)
            if (!failed) run_task(&a, q, groups, task[i], &mine, out);
        /* A thread's next group is known: its blocks are asked for through the task before it,
         * unless that task is of the same group (a row split by KV heads: in L2 already). A
         * thread's first group is not asked for ahead: all at once, it was slower. */
        const long threads = omp_get_num_threads();
#pragma omp for schedule(static, 1)
        for (long i = big; i < tasks; i++) {
            const Task next = task[i + threads < tasks ? i + threads : i];
            const long heads = task[i].head < 0 ? kv_heads : 1; /* the KV heads task i runs */
            if (next.group != task[i].group) /* a drip as it packs, scores, weighs a chunk */
                look_ahead(&mine.ahead, &a, &groups[next.group],
                           3 * heads * groups[task[i].group].chunks);
            if (!failed) run_task(&a, q, groups, task[i], &mine, out);
        }
        _tile_release();
        free(mine.scores);
        free(mine.local);
    }
    free(groups); free(task); free(owner); free(a.values);
    return failed ? -1 : 0;
}
