/* Paged decode attention on x86-64 with AVX2 and FMA: one float32 query token per row against
 * that row's cached K and V (float32, or 16- or 8-bit values widened a block at a time), read in
 * place through its block table.
 *
 * The torch path gathers every row's blocks into a contiguous copy (per layer, K and V) before
 * one batched SDPA; here each task takes a run of blocks of one row, or of up to 16 rows that
 * read the same blocks (a prompt's tokens), and, block by block, scores all of the rows' query
 * heads against every key in it and sums V weighted by the softmax, so each block is read once,
 * whole, while it is in the cache. A row's context is split into several parts (as
 * flash-decoding does on a GPU), so that one long row gives every thread work; their partial
 * softmaxes are then merged. Cache layout as in kernels/reference.py:
 * [blocks][block_size][kv_heads][head_dim]. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention_rows.h"
#include "kv_formats.h"
#include "simd.h"

/* A row's context is split into parts of this many blocks, counted from its first visible
 * token: where the splits fall depends on the row alone, never on the rows beside it, so a
 * row's result is the same bits in any step (the quantized path relies on it). */
#define BLOCKS_PER_TASK 4
/* A task takes the same part of up to this many rows that read the same blocks: a block is
 * then read (and a 16- or 8-bit one widened) once for all of them while it is in L1, not once
 * a row. Each row's arithmetic is the same, in the same order, as alone (attention_rows.h). */
#define ROWS_PER_TASK 16

typedef struct {
    Scorer score;
    Weigher weigh;
    const void *k_cache, *v_cache;
    long format; /* the caches' values: one of simd.h's KV_* */
    const long *block_tables;
    long width, heads, kv_heads, dim, block_size;
    float scale, softcap;
    const float *sinks; /* [heads] each head's logit summed into its softmax's total; or NULL */
} Decode;

/* Part `part` of rows [row, row + rows), tokens [begin, end): each row's own end is the
 * least of `end` and its length. */
typedef struct {
    long row, rows, part, begin, end;
} Task;

/* A task's result for each query head: the largest score, the sum of exp((score - top) *
 * scale) and the values weighted by those numerators, not yet divided by the sum. */
typedef struct {
    float *top, *total, *out; /* [heads], [heads], [heads][dim] */
} Partial;

/* Ask for a block's bytes before they are worked on: the blocks of a row lie anywhere in the
 * cache, so no hardware prefetcher can guess the next one. A task asks for all of its K and V
 * at its start, so that their misses overlap, into L2 (they would overflow L1). */
static inline void prefetch_block(const char *block, long bytes) {
    for (long i = 0; i < bytes; i += 64) _mm_prefetch(block + i, _MM_HINT_T1);
}

/* Tokens [skip, skip + count) of cache block `block` as float32: in place for a float32 cache;
 * a 16- or 8-bit one widened into `buffer`, where the scoring loops read it from L1 once a head. */
static const float *block_values(const Decode *a, const void *cache, long block, long skip,
                                 long count, float *buffer) {
    const long token_values = a->kv_heads * a->dim;
    const long first = (block * a->block_size + skip) * token_values, n = count * token_values;
    if (a->format == KV_F32) return (const float *)cache + first;
    for (long i = 0; i < n; i += 8)
        _mm256_storeu_ps(buffer + i, widen_kv(cache, first + i, a->format));
    return buffer;
}

/* Block b's share of tokens [begin, end): returns the count of them from *t on (0 or less:
 * none), *skip tokens into the block (a sliding window may begin mid-block). */
static inline long block_span(long begin, long end, long b, long bs, long *t, long *skip) {
    *t = b * bs > begin ? b * bs : begin;
    *skip = *t - b * bs;
    return end - *t < bs - *skip ? end - *t : bs - *skip;
}

/* Gemma 2's soft cap, in the unscaled units the softmax takes: s becomes
 * softcap / scale * tanh(s * scale / softcap), so that times scale it is softcap * tanh(s * scale
 * / softcap), as transformers computes it. */
static void soft_cap(const Decode *a, float *scores, long count) {
    const float inner = a->scale / a->softcap, outer = a->softcap / a->scale;
    for (long i = 0; i < count; i++) scores[i] = outer * tanhf(scores[i] * inner);
}

/* Every query head of each of the task's rows over its tokens. `scores` holds rows x heads x
 * stride floats; `buffer` a block's values (a 16- or 8-bit cache's, widened); `parts` the rows'
 * partials, `first_part` the index of each row's first. */
static void attend(const Decode *a, const float *q, const long *seq_lens, const Task *task,
                   float *scores, long stride, float *buffer, const Partial *parts,
                   const long *first_part) {
    const long heads = a->heads, group = heads / a->kv_heads, dim = a->dim, bs = a->block_size;
    const long token_stride = a->kv_heads * dim, begin = task->begin;
    const long block_bytes = bs * token_stride * kv_bytes(a->format);
    const char *k_bytes = a->k_cache, *v_bytes = a->v_cache;
    const long *table = a->block_tables + task->row * a->width;
    const long first = begin / bs, last = (task->end - 1) / bs;
    long ends[ROWS_PER_TASK];
    for (long i = 0; i < task->rows; i++)
        ends[i] = seq_lens[task->row + i] < task->end ? seq_lens[task->row + i] : task->end;
    for (long b = first; b <= last; b++) {
        prefetch_block(k_bytes + table[b] * block_bytes, block_bytes);
        prefetch_block(v_bytes + table[b] * block_bytes, block_bytes);
    }
    for (long b = first; b <= last; b++) {
        long t, skip;
        const long count = block_span(begin, task->end, b, bs, &t, &skip);
        const float *block = block_values(a, a->k_cache, table[b], skip, count, buffer);
        for (long i = 0; i < task->rows; i++) {
            const long own = block_span(begin, ends[i], b, bs, &t, &skip);
            const float *q_row = q + (task->row + i) * heads * dim;
            for (long h = 0; own > 0 && h < heads; h += group)
                a->score(q_row + h * dim, group, block + (h / group) * dim, own, token_stride,
                         dim, scores + (i * heads + h) * stride + t - begin, stride);
        }
    }
    for (long i = 0; i < task->rows; i++) {
        if (ends[i] <= begin) continue;
        float *row_scores = scores + i * heads * stride;
        const Partial p = parts[first_part[task->row + i] + task->part];
        if (a->softcap > 0.0f) soft_cap(a, row_scores, heads * stride);
        for (long h = 0; h < heads; h++) {
            p.total[h] = softmax_numerators(row_scores + h * stride, ends[i] - begin, a->scale,
                                            &p.top[h]);
            for (long d = 0; d < dim; d++) p.out[h * dim + d] = 0.0f;
        }
    }
    for (long b = first; b <= last; b++) {
        long t, skip;
        const long count = block_span(begin, task->end, b, bs, &t, &skip);
        const float *block = block_values(a, a->v_cache, table[b], skip, count, buffer);
        for (long i = 0; i < task->rows; i++) {
            const long own = block_span(begin, ends[i], b, bs, &t, &skip);
            if (own <= 0) continue; /* a shorter row may have no such part */
            const Partial p = parts[first_part[task->row + i] + task->part];
            for (long h = 0; h < heads; h += group)
                a->weigh(block + (h / group) * dim, group, own, token_stride, dim,
                         scores + (i * heads + h) * stride + t - begin, stride, p.out + h * dim);
        }
    }
}

/* out = the row's partials rescaled to their common largest score, summed, divided by their
 * summed numerators (and a head's sink's, gpt-oss's). One partial is rescaled by exp(0),
 * exactly 1: its values over its total. */
static void merge(const Decode *a, const Partial *parts, long count, float *out) {
    const long dim = a->dim;
    for (long h = 0; h < a->heads; h++, out += dim) {
        float top = -INFINITY, total = 0.0f, factor[count];
        for (long i = 0; i < count; i++) top = parts[i].top[h] > top ? parts[i].top[h] : top;
        for (long i = 0; i < count; i++) {
            factor[i] = expf((parts[i].top[h] - top) * a->scale);
            total += factor[i] * parts[i].total[h];
        }
        if (a->sinks) total += expf(a->sinks[h] - top * a->scale);
        const __m256 inverse = _mm256_set1_ps(1.0f / total);
        for (long d = 0; d < dim; d += 8) {
            __m256 sum = _mm256_setzero_ps();
            for (long i = 0; i < count; i++) {
                const __m256 part = _mm256_loadu_ps(parts[i].out + h * dim + d);
                sum = _mm256_add_ps(sum, _mm256_mul_ps(_mm256_set1_ps(factor[i]), part));
            }
            _mm256_storeu_ps(out + d, _mm256_mul_ps(sum, inverse));
        }
    }
}

/* The first token a row of length `len` sees. */
static inline long first_visible(long len, long window) {
    return window > 0 && len > window ? len - window : 0;
}

/* Whether row r reads the blocks row `lead` reads, from the same first token: the tables agree
 * over both rows' blocks (two requests' rows may share their first, prefix-cached blocks). */
static int same_blocks(const Decode *a, const long *seq_lens, long window, long lead, long r) {
    const long start = first_visible(seq_lens[lead], window);
    if (start != first_visible(seq_lens[r], window)) return 0;
    const long *x = a->block_tables + lead * a->width, *y = a->block_tables + r * a->width;
    const long longest = seq_lens[lead] > seq_lens[r] ? seq_lens[lead] : seq_lens[r];
    for (long b = start / a->block_size; b <= (longest - 1) / a->block_size; b++)
        if (x[b] != y[b]) return 0;
    return 1;
}

int tiled_attention(const float *q, const void *k_cache, const void *v_cache, long format,
                    const long *block_tables, long width, const long *seq_lens, float *out,
                    long rows, long heads, long kv_heads, long dim, long block_size, float scale,
                    long window, float softcap, const float *sinks);

/* q and out: [rows][heads][head_dim]; head_dim a multiple of 8; the caches' values in
 * `kv_format`. A `window` > 0 attends each row's last `window` tokens only; a
 * `softcap` > 0 soft-caps the scores; `sinks` (or NULL), a logit a head, adds to each softmax's
 * total. `isa` (simd.h): AVX-512's registers on ISA_AVX512_VNNI,
 * the same bits on any. `tiles` (only once `amx_ready`): a bf16 or fp8 cache with head_dim a
 * multiple of 32 goes through AMX-BF16 tiles (attention_tiles.c), other bits. Returns 0, or -1
 * when out of memory. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, long kv_format,
                           const long *block_tables, long width, const long *seq_lens, float *out,
                           long rows, long heads, long kv_heads, long dim, long block_size,
                           float scale, long window, float softcap, const float *sinks,
                           long isa, long tiles) {
    /* The tiles take bf16, and fp8 widened to it exactly. */
    const int tiled = kv_format == KV_BF16 || kv_format == KV_E4M3 || kv_format == KV_E5M2;
    if (tiles && tiled && dim % 32 == 0 && dim <= 256 && block_size % 16 == 0)
        return tiled_attention(q, k_cache, v_cache, kv_format, block_tables, width, seq_lens,
                               out, rows, heads, kv_heads, dim, block_size, scale, window,
                               softcap, sinks);
    const int wide = isa == ISA_AVX512_VNNI;
    Decode a = {wide ? score_wide : score_narrow, wide ? weigh_wide : weigh_narrow,
                k_cache, v_cache, kv_format, block_tables, width, heads,
                kv_heads, dim, block_size, scale, softcap, sinks};
    const long per_task = BLOCKS_PER_TASK * block_size;
    long row_parts = 0, tasks = 0, stride = 8; /* a head's scores in a part, in whole vectors */
    long *first_part = malloc(sizeof(long) * (rows + 1));
    if (first_part == NULL) return -1;
    for (long r = 0; r < rows; r++) {
        first_part[r] = row_parts;
        row_parts += (seq_lens[r] - first_visible(seq_lens[r], window) + per_task - 1) / per_task;
    }
    Task *task = malloc(sizeof(Task) * row_parts); /* each task holds at least one row's part */
    float *partials = malloc(sizeof(float) * row_parts * heads * (dim + 2));
    Partial *parts = malloc(sizeof(Partial) * row_parts);
    if (!task || !partials || !parts) {
        free(first_part); free(task); free(partials); free(parts);
        return -1;
    }
    first_part[rows] = row_parts;
    for (long i = 0; i < row_parts; i++) {
        float *base = partials + i * heads * (dim + 2);
        parts[i] = (Partial){base, base + heads, base + 2 * heads};
    }
    for (long lead = 0, next; lead < rows; lead = next) {
        long longest = seq_lens[lead];
        for (next = lead + 1; next < rows && next - lead < ROWS_PER_TASK &&
                              same_blocks(&a, seq_lens, window, lead, next);
             next++)
            longest = seq_lens[next] > longest ? seq_lens[next] : longest;
        long part = 0;
        for (long begin = first_visible(seq_lens[lead], window); begin < longest;
             begin += per_task, part++, tasks++) {
            const long end = begin + per_task < longest ? begin + per_task : longest;
            task[tasks] = (Task){lead, next - lead, part, begin, end};
            stride = end - begin + 7 > stride ? end - begin + 7 : stride;
        }
    }
    stride &= ~7L;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * ROWS_PER_TASK * heads * stride);
        float *buffer = malloc(sizeof(float) * block_size * kv_heads * dim);
        if (scores == NULL || buffer == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < tasks; i++)
            if (scores && buffer)
                attend(&a, q, seq_lens, &task[i], scores, stride, buffer, parts, first_part);
        free(scores);
        free(buffer);
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++)
            merge(&a, parts + first_part[r], first_part[r + 1] - first_part[r],
                  out + r * heads * dim);
    }
    free(first_part); free(task); free(partials); free(parts);
    return failed ? -1 : 0;
}
