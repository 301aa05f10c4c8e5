/* Paged decode attention on x86-64 with AVX2 and FMA: one float32 query token per row against
 * that row's cached K and V (float32, or bfloat16 or float16 widened a block at a time), read in
 * place through its block table.
 *
 * The torch path gathers every row's blocks into a contiguous copy (per layer, K and V) before
 * one batched SDPA; here each task takes a run of one row's blocks and, block by block, scores
 * all of the row's query heads against every key in it and sums V weighted by the softmax, so
 * each block is read once, whole, while it is in the cache. A row's context is split into
 * several such tasks (as flash-decoding does on a GPU), so that one long row gives every thread
 * work; their partial softmaxes are then merged. Cache layout as in
 * kernels/reference.py: [blocks][block_size][kv_heads][head_dim]. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

/* A row's context is split into tasks of this many blocks, counted from its first visible
 * token: where the splits fall depends on the row alone, never on the rows beside it, so a
 * row's result is the same bits in any step (the quantized path relies on it). */
#define BLOCKS_PER_TASK 4

typedef struct {
    const void *k_cache, *v_cache;
    long format; /* the caches' values: KV_F32, KV_BF16 or KV_F16 (simd.h) */
    const long *block_tables;
    long width, heads, kv_heads, dim, block_size;
    float scale, softcap;
} Decode;

/* Tokens [begin, end) of a row. */
typedef struct {
    long row, begin, end;
} Task;

/* A task's result for each query head: the largest score, the sum of exp((score - top) *
 * scale) and the values weighted by those numerators, not yet divided by the sum. */
typedef struct {
    float *top, *total, *out; /* [heads], [heads], [heads][dim] */
} Partial;

/* In place: s[0..len) becomes exp((s - top) * scale), padded with zeros to a multiple of 8;
 * returns the sum and sets *top to the largest score. */
static float softmax_numerators(float *s, long len, float scale, float *top_out) {
    float top = -INFINITY;
    for (long t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
    long padded = (len + 7) & ~7L;
    for (long t = len; t < padded; t++) s[t] = -INFINITY;
    __m256 sum = _mm256_setzero_ps(), shift = _mm256_set1_ps(top), factor = _mm256_set1_ps(scale);
    for (long t = 0; t < padded; t += 8) {
        __m256 e = exp_negative(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift), factor));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, sum);
    for (int i = 0; i < 8; i++) total += lanes[i];
    *top_out = top;
    return total;
}

/* Ask for a block's bytes before they are worked on: the blocks of a row lie anywhere in the
 * cache, so no hardware prefetcher can guess the next one. A task asks for all of its K and V
 * at its start, so that their misses overlap, into L2 (they would overflow L1). */
static inline void prefetch_block(const char *block, long bytes) {
    for (long i = 0; i < bytes; i += 64) _mm_prefetch(block + i, _MM_HINT_T1);
}

/* Tokens [skip, skip + count) of cache block `block` as float32: in place for a float32 cache;
 * a 16-bit one widened into `buffer`, where the scoring loops read it from L1 once a head. */
static const float *block_values(const Decode *a, const void *cache, long block, long skip,
                                 long count, float *buffer) {
    const long token_values = a->kv_heads * a->dim;
    const long first = (block * a->block_size + skip) * token_values, n = count * token_values;
    if (a->format == KV_F32) return (const float *)cache + first;
    const uint16_t *from = (const uint16_t *)cache + first;
    for (long i = 0; i < n; i += 8) {
        __m128i half = _mm_loadu_si128((const __m128i *)(from + i));
        __m256 wide = a->format == KV_F16
                          ? _mm256_cvtph_ps(half)
                          : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
        _mm256_storeu_ps(buffer + i, wide);
    }
    return buffer;
}

/* [sum(v[0]), ..., sum(v[7])]: eight dot products' lanes reduced at once. */
static inline __m256 sum_lanes8(const __m256 v[8]) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* scores[t] = q . key(t) for the `count` tokens from `key` on, `token_stride` apart: eight
 * tokens at a time, so eight independent FMA chains are in flight instead of one. */
static void score_tokens(const float *q, const float *key, long count, long token_stride,
                         long dim, float *scores) {
    long t = 0;
    for (; t + 8 <= count; t += 8, key += 8 * token_stride) {
        __m256 sums[8];
        for (int i = 0; i < 8; i++) sums[i] = _mm256_setzero_ps();
        for (long d = 0; d < dim; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            for (int i = 0; i < 8; i++)
                sums[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(key + i * token_stride + d), sums[i]);
        }
        _mm256_storeu_ps(scores + t, sum_lanes8(sums));
    }
    for (; t < count; t++, key += token_stride) scores[t] = dot(q, key, dim);
}

/* out[0..dim) += sum over `count` tokens of weight[t] * value(t), 64 dims at a time held in
 * registers. */
static void weigh_values(const float *value, long count, long token_stride, long dim,
                         const float *weight, float *out) {
    for (long d0 = 0; d0 < dim; d0 += 64) {
        const long lanes = (dim - d0 < 64 ? dim - d0 : 64) / 8;
        __m256 acc[8];
        for (int i = 0; i < lanes; i++) acc[i] = _mm256_loadu_ps(out + d0 + 8 * i);
        const float *v = value + d0;
        for (long t = 0; t < count; t++, v += token_stride) {
            __m256 w = _mm256_set1_ps(weight[t]);
            for (int i = 0; i < lanes; i++)
                acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
        for (int i = 0; i < lanes; i++) _mm256_storeu_ps(out + d0 + 8 * i, acc[i]);
    }
}

/* Block b's share of a task: returns the count of its tokens from *t on, *skip tokens into
 * the block (a sliding window may begin mid-block). */
static inline long block_span(const Task *task, long b, long bs, long *t, long *skip) {
    *t = b * bs > task->begin ? b * bs : task->begin;
    *skip = *t - b * bs;
    return task->end - *t < bs - *skip ? task->end - *t : bs - *skip;
}

/* Gemma 2's soft cap, in the unscaled units the softmax takes: s becomes
 * softcap / scale * tanh(s * scale / softcap), so that times scale it is softcap * tanh(s * scale
 * / softcap), as transformers computes it. */
static void soft_cap(const Decode *a, float *scores, long count) {
    const float inner = a->scale / a->softcap, outer = a->softcap / a->scale;
    for (long i = 0; i < count; i++) scores[i] = outer * tanhf(scores[i] * inner);
}

/* Every query head of the task's row over the task's tokens. `scores` holds heads x stride
 * floats; `buffer` a block's values (a 16-bit cache's, widened). */
static void attend(const Decode *a, const float *q, const Task *task, float *scores, long stride,
                   float *buffer, Partial p) {
    const long heads = a->heads, group = heads / a->kv_heads, dim = a->dim, bs = a->block_size;
    const long token_stride = a->kv_heads * dim;
    const long block_bytes = bs * token_stride * (a->format == KV_F32 ? 4 : 2);
    const char *k_bytes = a->k_cache, *v_bytes = a->v_cache;
    const long *table = a->block_tables + task->row * a->width;
    const float *q_row = q + task->row * heads * dim;
    const long first = task->begin / bs, last = (task->end - 1) / bs;
    for (long b = first; b <= last; b++) {
        prefetch_block(k_bytes + table[b] * block_bytes, block_bytes);
        prefetch_block(v_bytes + table[b] * block_bytes, block_bytes);
    }
    for (long b = first; b <= last; b++) {
        long t, skip;
        const long count = block_span(task, b, bs, &t, &skip);
        const float *block = block_values(a, a->k_cache, table[b], skip, count, buffer);
        for (long h = 0; h < heads; h++)
            score_tokens(q_row + h * dim, block + (h / group) * dim, count, token_stride, dim,
                         scores + h * stride + t - task->begin);
    }
    if (a->softcap > 0.0f) soft_cap(a, scores, heads * stride);
    for (long h = 0; h < heads; h++) {
        p.total[h] = softmax_numerators(scores + h * stride, task->end - task->begin, a->scale,
                                        &p.top[h]);
        for (long d = 0; d < dim; d++) p.out[h * dim + d] = 0.0f;
    }
    for (long b = first; b <= last; b++) {
        long t, skip;
        const long count = block_span(task, b, bs, &t, &skip);
        const float *block = block_values(a, a->v_cache, table[b], skip, count, buffer);
        for (long h = 0; h < heads; h++)
            weigh_values(block + (h / group) * dim, count, token_stride, dim,
                         scores + h * stride + t - task->begin, p.out + h * dim);
    }
}

/* out = the row's partials rescaled to their common largest score, summed, divided by their
 * summed numerators. One partial is rescaled by exp(0), exactly 1: its values over its total. */
static void merge(const Decode *a, const Partial *parts, long count, float *out) {
    const long dim = a->dim;
    for (long h = 0; h < a->heads; h++, out += dim) {
        float top = -INFINITY, total = 0.0f, factor[count];
        for (long i = 0; i < count; i++) top = parts[i].top[h] > top ? parts[i].top[h] : top;
        for (long i = 0; i < count; i++) {
            factor[i] = expf((parts[i].top[h] - top) * a->scale);
            total += factor[i] * parts[i].total[h];
        }
        const float inverse = 1.0f / total;
        for (long d = 0; d < dim; d++) {
            float sum = 0.0f;
            for (long i = 0; i < count; i++) sum += factor[i] * parts[i].out[h * dim + d];
            out[d] = sum * inverse;
        }
    }
}

/* q and out: [rows][heads][head_dim]; head_dim a multiple of 8; the caches' values in
 * `kv_format`. A `window` > 0 attends each row's last `window` tokens only; a
 * `softcap` > 0 soft-caps the scores. Returns 0, or -1 when out of memory. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, long kv_format,
                           const long *block_tables, long width, const long *seq_lens, float *out,
                           long rows, long heads, long kv_heads, long dim, long block_size,
                           float scale, long window, float softcap) {
    Decode a = {k_cache, v_cache, kv_format, block_tables, width, heads,
                kv_heads, dim, block_size, scale, softcap};
    const long per_task = BLOCKS_PER_TASK * block_size;
    long most_tasks = 0, tasks = 0, stride = 8; /* a head's scores in a task, in whole vectors */
    for (long r = 0; r < rows; r++) most_tasks += (seq_lens[r] + per_task - 1) / per_task;
    long *first_task = malloc(sizeof(long) * (rows + 1));
    Task *task = malloc(sizeof(Task) * most_tasks);
    float *partials = malloc(sizeof(float) * most_tasks * heads * (dim + 2));
    Partial *parts = malloc(sizeof(Partial) * most_tasks);
    if (!first_task || !task || !partials || !parts) {
        free(first_task); free(task); free(partials); free(parts);
        return -1;
    }
    for (long r = 0; r < rows; r++) {
        const long start = window > 0 && seq_lens[r] > window ? seq_lens[r] - window : 0;
        first_task[r] = tasks;
        for (long begin = start; begin < seq_lens[r]; begin += per_task, tasks++) {
            const long end = begin + per_task < seq_lens[r] ? begin + per_task : seq_lens[r];
            task[tasks] = (Task){r, begin, end};
            float *base = partials + tasks * heads * (dim + 2);
            parts[tasks] = (Partial){base, base + heads, base + 2 * heads};
            stride = end - begin + 7 > stride ? end - begin + 7 : stride;
        }
    }
    first_task[rows] = tasks;
    stride &= ~7L;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * heads * stride);
        float *buffer = malloc(sizeof(float) * block_size * kv_heads * dim);
        if (scores == NULL || buffer == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < tasks; i++)
            if (scores && buffer) attend(&a, q, &task[i], scores, stride, buffer, parts[i]);
        free(scores);
        free(buffer);
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++)
            merge(&a, parts + first_task[r], first_task[r + 1] - first_task[r],
                  out + r * heads * dim);
    }
    free(first_task); free(task); free(partials); free(parts);
    return failed ? -1 : 0;
}
