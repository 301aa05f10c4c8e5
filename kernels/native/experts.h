/* What the native mixtures of experts share (expert_tiles.c on AMX-BF16 tiles,
 * quantized_experts.c on GGUF blocks): the gated activations' numbers, the fields that follow
 * each kernel's weights in its struct (kernels/expert_calls.py's EXPERT_FIELDS), and a run of
 * one expert's rows that a task takes. */
#pragma once
#include <stdint.h>
#include <string.h>

enum { GLU_SILU = 0, GLU_CLAMPED_SWIGLU = 1 };

#define EXPERT_FIELDS                                                          \
    const float *gate_up_bias; /* [experts][gate's inner, up's inner], or NULL */ \
    const float *down_bias;    /* [experts][hidden], or NULL */                 \
    long experts, hidden, inner, glu;                                          \
    float alpha, limit; /* the clamped SwiGLU's */

/* `real` rows from `first` (then, on the tiles, padding). */
typedef struct {
    long expert, first, real;
} Group;

/* Each (token, choice) pair a row, grouped by its `chosen` expert, in pair order within one:
 * `pair` [rows] each row's pair, an expert's rows padded with -1 to a multiple of `pad`;
 * `groups` runs of at most `most` of one expert's real rows, `*group_count` of them. Returns
 * the rows; `count` and `start` [experts] are scratch. */
static inline long group_pairs(const int64_t *chosen, long pairs, long experts, long pad,
                               long most, long *count, long *start, long *pair, Group *groups,
                               long *group_count) {
    memset(count, 0, sizeof(long) * experts);
    for (long p = 0; p < pairs; p++) count[chosen[p]]++;
    long rows = 0;
    *group_count = 0;
    for (long e = 0; e < experts; e++) {
        start[e] = rows;
        for (long first = 0; first < count[e]; first += most) {
            const long real = count[e] - first < most ? count[e] - first : most;
            groups[(*group_count)++] = (Group){e, rows + first, real};
        }
        rows += (count[e] + pad - 1) / pad * pad;
        for (long i = start[e] + count[e]; i < rows; i++) pair[i] = -1;
        count[e] = 0;
    }
    for (long p = 0; p < pairs; p++) pair[start[chosen[p]] + count[chosen[p]]++] = p;
    return rows;
}
