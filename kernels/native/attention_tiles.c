/* Paged attention for a bfloat16 cache on AMX-BF16 tiles: 16 query rows (the query heads of a
 * KV head, token by token) against chunks of 32 keys, products of bf16 pairs summed in fp32. An
 * fp8 cache's codes are widened to bf16 exactly as they are read (attention_packing.h), so they
 * take the same tiles and get the bits of a bf16 cache holding their values.
 *
 * Scores are computed transposed, keys x rows, so that the keys are A tiles read from the cache
 * in place (16 tokens of a block, a row of the tile each) and a row's softmax runs down a
 * column, 16 rows a register. Two passes over a tile's keys: the rows' largest scores, then exp
 * and P.V summed in the output tiles, so nothing is rescaled and the output leaves the tiles
 * once; there the weights, transposed to rows x keys, are A tiles and the values, packed with two
 * keys interleaved (attention_tiles.h) once a call for a prompt or as a decode tile weighs them,
 * B tiles. A decode row's tile takes the query heads of several KV heads, each head's queries
 * and weights zero in the others' lanes, so that exp and the transposes run once for them. A
 * tile's rows never mix, chunks start at multiples of 32 tokens and a row's masked keys and
 * other heads' lanes add exact zeros, so a row's bits are the same whichever rows share its tile
 * and whichever step it is in: a decode row gets the bits it would get in a prompt. Figures:
 * docs/benchmarks.md. */
/* syscall() is declared only beyond strict C11. */
#define _GNU_SOURCE
#include <omp.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include "attention_ahead.h"
#include "attention_packing.h"

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

/* The scores of chunk c's keys against the tile's lanes, transposed: s[32 keys][16 lanes]. A
 * token's KV heads lie side by side, so the tile's heads' 32-dim slices are one run of them.
 * Half chunks no lane sees are left out (their scores are masked). */
AMX static void score_chunk(const Tiles *a, const Group *g, const Rows *r, long c, float *s) {
    const long *table = a->tables + g->lead * a->width;
    const long stride = a->kv_heads * a->dim * kv_bytes(a->format);
    const long slices = r->heads * a->dim / 32, slice_bytes = 32 * kv_bytes(a->format);
    uint16_t wide[TILE * SPAN_TILES * 32] __attribute__((aligned(64))); /* fp8 keys, widened */
    const int widened = g->packed >= 0 && a->keys != NULL; /* a prompt's, from an fp8 cache */
    /* The next chunk's keys into L1 while this one's are scored: a tile's 16 tokens, 2 to 4
     * lines each a stride apart, have no hardware prefetcher ahead of them (docs/benchmarks.md). */
    for (long t = (c + 1) * CHUNK; !widened && t < (c + 2) * CHUNK && t < r->hi; t += 16) {
        const char *next = head_at(a, a->k_cache, table, r->kv, t);
        for (long j = 0; j < 16 * stride; j += stride)
            for (long line = 0; line < slices * slice_bytes; line += 64)
                _mm_prefetch(next + j + line, _MM_HINT_T0);
    }
    _tile_zero(4);
    _tile_zero(5);
    for (long half = 0; half < 2; half++) {
        const long t = c * CHUNK + 16 * half;
        if (t + 16 <= r->lo || t >= r->hi) continue;
        const char *keys = head_at(a, a->k_cache, table, r->kv, t);
        long pitch = stride;
        if (widened) { /* once a call, for all the prompt's tiles */
            const long chunk = (g->packed + c - g->chunk) * a->kv_heads + r->kv;
            keys = (const char *)(a->keys + (chunk * CHUNK + 16 * half) * a->dim);
            pitch = a->dim * 2;
        } else if (a->format != KV_BF16) { /* a decode row's 16 tokens as bf16, back from L1 */
            for (long j = 0; j < TILE; j++)
                widen_run(a, keys + j * stride, slices, (__m512i *)(wide + j * slices * 32));
            keys = (const char *)wide, pitch = slices * 64;
        }
        for (long i = 0; i < slices; i++) {
            if (slices > QUERY_TILES) load_tile(i % QUERY_TILES, r->queries + 256 * i, 64);
            load_tile(6 + i % 2, keys + 64 * i, pitch);
            dot_tiles(4 + half, 6 + i % 2, i % QUERY_TILES);
        }
    }
    _tile_stored(4, s, 64);
    _tile_stored(5, s + 256, 64);
    if (a->softcap > 0.0f) soft_cap(a, s, TILE * CHUNK);
}

/* A thread's buffers: a chunk's scores for each chunk of a group (the second pass reads them
 * again), a decode tile's chunk of values packed for each of its KV heads, a prompt tile's
 * weights of each chunk where head_dim is over DIMS_A_PASS (its later passes of output dims
 * weigh with the first's), and the next group's lines to ask for. */
typedef struct {
    float *scores;
    uint16_t *local;
    uint32_t *weights; /* [chunk][256]; NULL: one pass */
    Ahead ahead;
} Scratch;

/* One tile of a group's lanes against KV heads [kv, kv + heads), in the thread's buffers
 * (`Scratch`), the next group's lines asked for a chunk at a time. */
AMX static void run_tile(const Tiles *a, const float *q, const Group *g, long kv, long heads,
                         long first, Scratch *mine, float *out) {
    Rows r;
    tile_rows(a, q, g, kv, heads, first, &r);
    const long slices = heads * a->dim / 32;
    for (long i = 0; i < slices && slices <= QUERY_TILES; i++)
        load_tile(i, r.queries + 256 * i, 64);
    float o[DIMS_A_PASS * TILE] __attribute__((aligned(64)));
    uint32_t fresh[TILE * CHUNK / 2 * TILE] __attribute__((aligned(64))); /* head j: 256 j */
    const __m512i interleave = INTERLEAVE;
    const long from = r.lo / CHUNK, to = (r.hi + CHUNK - 1) / CHUNK;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (long c = from; c < to; c++) {
        float *s = mine->scores + (c - from) * CHUNK * TILE;
        drip(&mine->ahead);
        score_chunk(a, g, &r, c, s);
        for (long j = 0; j < CHUNK; j++)
            top = _mm512_mask_max_ps(top, seeing(&r, c * CHUNK + j), top,
                                     _mm512_load_ps(s + 16 * j));
    }
    /* e^((s - top) scale) as 2^(s rate - top rate): one FMA before the exponential */
    const __m512 rate = _mm512_set1_ps(a->scale * 1.44269504088896341f);
    const __m512 shift = _mm512_mul_ps(top, rate);
    /* A prompt's tile (one KV head) weighs every pass with its first pass's weights; a decode
     * tile, waiting on memory, computes them again rather than fill L2 with them. */
    const int kept = mine->weights != NULL && g->packed >= 0;
    __m512 sum = _mm512_setzero_ps();
    for (long pass = 0; pass < a->dim; pass += DIMS_A_PASS) {
        const int computing = pass == 0 || !kept; /* this pass's weights, from the scores */
        if (!kept) sum = _mm512_setzero_ps();
        const long groups = (a->dim - pass < DIMS_A_PASS ? a->dim - pass : DIMS_A_PASS) / 16;
        for (long i = 0; i < groups; i++) zero_tile(i);
        for (long c = from, turn = 0, w = 0; c < to; c++) {
            const float *s = mine->scores + (c - from) * CHUNK * TILE;
            uint32_t *weights = kept ? mine->weights + (c - from) * 256 : fresh;
            __m512i pairs[CHUNK / 2]; /* [key pair][lane], then [lane][key pair] */
            for (long k = 0; k < CHUNK / 2 && computing; k++) {
                __m512 p[2];
                for (long e = 0; e < 2; e++) {
                    const __m512 x = _mm512_load_ps(s + 16 * (2 * k + e));
                    p[e] = _mm512_maskz_mov_ps(seeing(&r, c * CHUNK + 2 * k + e),
                                               exp2_negative16(_mm512_fmsub_ps(x, rate, shift)));
                    sum = _mm512_add_ps(sum, p[e]);
                }
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]);
                pairs[k] = _mm512_permutexvar_epi16(interleave, both);
            }
            if (computing) transpose16(pairs);
            for (long j = 0; j < heads && computing; j++) /* KV head j's: zero in others' lanes */
                for (long m = 0; m < TILE; m++)
                    _mm512_store_si512(weights + 256 * j + 16 * m,
                                       _mm512_maskz_mov_epi32(-(r.of[j] >> m & 1), pairs[m]));
            for (long j = 0; j < heads; j++, w++) {
                uint16_t *local = mine->local + j * a->dim * CHUNK;
                if (g->packed < 0) { /* a decode tile's values: packed here, read from L1 */
                    drip(&mine->ahead);
                    pack_values(a, g, kv + j, c, pass, pass + groups * 16, local);
                }
                const uint16_t *v = packed_at(a, g, kv + j, c, local) + pass * CHUNK;
                load_tile(6 + w % 2, weights + 256 * j, 64);
                for (long i = 0; i < groups; i++, turn++) {
                    load_tile(4 + turn % 2, v + 512 * i, 64);
                    dot_tiles(i, 6 + w % 2, 4 + turn % 2);
                }
            }
        }
        for (long i = 0; i < groups; i++) store_tile(i, o + 256 * i);
        float total[TILE], shifts[TILE];
        _mm512_storeu_ps(total, sum);
        _mm512_storeu_ps(shifts, shift);
        for (long m = 0; m < r.rows && a->sinks; m++) /* e^(sink - top scale) */
            total[m] += exp2f(a->sinks[r.head[m]] * 1.44269504088896341f - shifts[m]);
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
 * decode row), that KV head's tile, or, `head` -1, every KV head's, `span` of them a tile, the
 * group's blocks read once. */
typedef struct {
    long group, head, first;
} Task;

AMX static void run_task(const Tiles *a, const float *q, const Group *groups, Task task,
                         Scratch *mine, float *out) {
    const Group *g = &groups[task.group];
    if (g->packed >= 0) return run_tile(a, q, g, task.head, 1, task.first, mine, out);
    const long first = task.head < 0 ? 0 : task.head;
    const long last = task.head < 0 ? a->kv_heads : first + 1;
    const long most = task.head < 0 ? span(a, g) : 1;
    for (long kv = first, heads; kv < last; kv += heads) {
        heads = last - kv < most ? last - kv : most;
        run_tile(a, q, g, kv, heads, 0, mine, out);
    }
}

/* The drips a decode group's task makes: one as a tile scores a chunk, then, in each pass of
 * 64 output dims, one as it packs and weighs each KV head's share of it. */
static long drips(const Tiles *a, const Group *g, long head) {
    const long heads = head < 0 ? a->kv_heads : 1, most = head < 0 ? span(a, g) : 1;
    const long tiles = (heads + most - 1) / most, passes = (a->dim + 63) / DIMS_A_PASS;
    return g->chunks * (tiles + passes * heads);
}

/* As paged_decode_attention (attention.c), for a bf16 or fp8 cache (`format`), dim a multiple
 * of 32 up to 256, on a CPU with AMX-BF16 once `amx_ready`. Returns 0, or -1 when out of
 * memory. */
AMX int tiled_attention(const float *q, const void *k_cache, const void *v_cache, long format,
                        const long *block_tables, long width, const long *seq_lens, float *out,
                        long rows, long heads, long kv_heads, long dim, long block_size,
                        float scale, long window, float softcap, const float *sinks) {
    Tiles a = {k_cache, v_cache, block_tables, seq_lens, width, heads, kv_heads, dim,
               block_size, window, scale, softcap, NULL, NULL, heads / kv_heads, format};
    a.sinks = sinks;
    if (format != KV_BF16) a.fp8 = fp8_tables(format);
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
    const size_t weighing = sizeof(uint32_t) * most * 256; /* Scratch.weights: a prompt's */
    Task *task = malloc(sizeof(Task) * tasks);
    long *owner = malloc(sizeof(long) * (shared + 1)); /* each shared chunk's group */
    a.values = aligned_alloc(64, sizeof(uint16_t) * (shared * kv_heads + 1) * chunk_size);
    if (format != KV_BF16)
        a.keys = aligned_alloc(64, sizeof(uint16_t) * (shared * kv_heads + 1) * chunk_size);
    if (!task || !owner || !a.values || (format != KV_BF16 && !a.keys)) {
        free(groups); free(task); free(owner); free(a.values); free(a.keys);
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
            pack_values(&a, g, i % kv_heads, g->chunk + i / kv_heads - g->packed, 0, dim, NULL);
            if (a.keys) widen_keys(&a, g, i % kv_heads, g->chunk + i / kv_heads - g->packed);
        }
        configure_tiles();
        Scratch mine = {aligned_alloc(64, sizeof(float) * most * CHUNK * TILE),
                        aligned_alloc(64, sizeof(uint16_t) * kv_heads * chunk_size),
                        dim > DIMS_A_PASS ? aligned_alloc(64, weighing) : NULL, NOTHING_AHEAD};
        if (!mine.scores || !mine.local || (dim > DIMS_A_PASS && !mine.weights)) failed = 1;
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
            if (next.group != task[i].group)
                look_ahead(&mine.ahead, &a, &groups[next.group], drips(&a, &groups[task[i].group],
                                                                       task[i].head));
            if (!failed) run_task(&a, q, groups, task[i], &mine, out);
        }
        _tile_release();
        free(mine.scores);
        free(mine.local);
        free(mine.weights);
    }
    free(groups); free(task); free(owner); free(a.values); free(a.keys);
    return failed ? -1 : 0;
}
