/* The next group's blocks asked for while a thread computes one (attention_tiles.c). */
#pragma once
#include "attention_tiles.h"

/* A group's blocks, keys and values, asked for into L2 a few lines at a time while the thread
 * computes the group before it: a row's blocks lie anywhere in the cache, so no hardware
 * prefetcher guesses the next one, and asked for all at once they stall the thread until most
 * have come (docs/benchmarks.md). */
typedef struct {
    const char *k_cache, *v_cache;
    const long *table;
    long block, last, line, lines, quota; /* next block and line; lines a block; lines a call */
} Ahead;

#define NOTHING_AHEAD ((Ahead){.block = 1, .last = 0})

/* Group g's lines, spread over `calls` calls of `drip`. */
static void look_ahead(Ahead *p, const Tiles *a, const Group *g, long calls) {
    const long bs = a->block_size, lines = bs * a->kv_heads * a->dim * kv_bytes(a->format) / 64;
    const long first = g->begin / bs, last = (g->end - 1) / bs;
    *p = (Ahead){(const char *)a->k_cache, (const char *)a->v_cache,
                 a->tables + g->lead * a->width, first, last, 0, lines,
                 ((last - first + 1) * lines + calls - 1) / calls};
}

/* Ask for the next `quota` lines of keys and as many of values, a block's in step. It writes
 * its place back: gcc takes a function that only prefetches for one without effects, and
 * drops its calls (session 29's `prefetch` was never compiled in). */
static void drip(Ahead *p) {
    for (long left = p->quota; left > 0 && p->block <= p->last;) {
        const long at = p->table[p->block] * p->lines * 64;
        const long end = p->line + left < p->lines ? p->line + left : p->lines;
        for (long line = p->line; line < end; line++) {
            _mm_prefetch(p->k_cache + at + line * 64, _MM_HINT_T1);
            _mm_prefetch(p->v_cache + at + line * 64, _MM_HINT_T1);
        }
        left -= end - p->line;
        p->line = end;
        if (end == p->lines) p->line = 0, p->block++;
    }
}
