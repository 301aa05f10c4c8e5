/* A decode layer's mixture of experts in place of its MLP (decode_layer.c): the router's
 * logits (a projection), each row's softmax over the experts in float32, its top-k (the lower
 * index first between equals) scaled to sum to 1 where the model does, or DeepSeek-V3's
 * sigmoid scores chosen within the best groups (GLM-4.5); then the experts' weighted sum (on
 * AMX-BF16 tiles, expert_tiles.c, or on GGUF blocks, quantized_experts.c) and the shared
 * experts' rows the layer computed, added to the residual: what the model's layers compute
 * (routers.py, llama.py), in one native call. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct Weight Weight; /* decode_layer.c's */
int linear_weight(const float *x, const Weight *w, float *y, const float *bias,
                  const float *residual, long M, long N, long K, long isa);
/* The experts' own structs, read only there. */
int expert_tiles(const void *w, const float *x, long tokens, long top_k, const int64_t *chosen,
                 const float *weights, float *y);
int quantized_experts(const void *w, const float *x, long tokens, long top_k,
                      const int64_t *chosen, const float *weights, float *y, long isa);

typedef struct {
    const Weight *router;
    const float *router_bias; /* or NULL */
    const void *experts;      /* expert_tiles.c's Experts (`tiles`), else quantized_experts.c's */
    long tiles, count, top_k, normalize;
    const float *correction;  /* [count] added to sigmoid scores to choose; NULL: a softmax */
    long groups, kept_groups; /* the experts in `groups`, the top-k within the best kept */
    float scale;              /* the chosen sigmoid scores' factor */
} Mixture;

/* The best of `count` values (`allowed`, or every one where NULL) not yet in chosen[0..k). */
static long best_unchosen(const float *values, const int *allowed, long count,
                          const int64_t *chosen, long k) {
    long best = -1;
    for (long e = 0; e < count; e++) {
        int taken = allowed && !allowed[e];
        for (long j = 0; j < k; j++) taken |= chosen[j] == e;
        if (!taken && (best < 0 || values[e] > values[best])) best = e;
    }
    return best;
}

/* A row's top-k experts and their weights, from its logits over `count` experts. */
static void route_row(const float *logits, long count, long top_k, long normalize,
                      int64_t *chosen, float *weights) {
    float top = logits[0], sum = 0.0f;
    for (long e = 1; e < count; e++) top = fmaxf(top, logits[e]);
    for (long e = 0; e < count; e++) sum += expf(logits[e] - top);
    float kept = 0.0f;
    for (long k = 0; k < top_k; k++) {
        chosen[k] = best_unchosen(logits, NULL, count, chosen, k);
        weights[k] = expf(logits[chosen[k]] - top) / sum;
        kept += weights[k];
    }
    if (normalize)
        for (long k = 0; k < top_k; k++) weights[k] /= kept;
}

/* GLM-4.5's (DeepSeek-V3's) routing of a row: sigmoid scores, each group scored by its two
 * best scores plus corrections, the top-k of the best `kept_groups` groups chosen by score
 * plus correction, weighted by their scores (normalized where the model does) times `scale`. */
static void route_grouped(const Mixture *m, const float *logits, int64_t *chosen,
                          float *weights) {
    const long count = m->count, size = count / m->groups;
    float scores[count], choice[count], group_scores[m->groups];
    int allowed[count];
    int64_t groups[m->groups];
    for (long e = 0; e < count; e++) {
        scores[e] = 1.0f / (1.0f + expf(-logits[e]));
        choice[e] = scores[e] + m->correction[e];
        allowed[e] = m->groups == 1;
    }
    for (long g = 0; g < m->groups && m->groups > 1; g++) {
        int64_t two[2];
        two[0] = best_unchosen(choice + g * size, NULL, size, two, 0);
        two[1] = best_unchosen(choice + g * size, NULL, size, two, 1);
        group_scores[g] = choice[g * size + two[0]] + choice[g * size + two[1]];
    }
    for (long k = 0; k < m->kept_groups && m->groups > 1; k++) {
        groups[k] = best_unchosen(group_scores, NULL, m->groups, groups, k);
        for (long e = 0; e < size; e++) allowed[groups[k] * size + e] = 1;
    }
    float sum = 0.0f;
    for (long k = 0; k < m->top_k; k++) {
        chosen[k] = best_unchosen(choice, allowed, count, chosen, k);
        weights[k] = scores[chosen[k]];
        sum += weights[k];
    }
    for (long k = 0; k < m->top_k; k++)
        weights[k] = (m->normalize ? weights[k] / (sum + 1e-20f) : weights[k]) * m->scale;
}

/* hidden [rows][n] += the mixture of x [rows][n] (the post-attention norm's rows), plus
 * `shared` [rows][n] (the shared experts' rows; or NULL). -1 where a buffer cannot be
 * allocated. */
int mixture_rows(const Mixture *m, const float *x, float *hidden, const float *shared, long rows,
                 long n, long isa) {
    float *logits = malloc(sizeof(float) * rows * m->count);
    float *weights = malloc(sizeof(float) * rows * m->top_k);
    float *out = malloc(sizeof(float) * rows * n);
    int64_t *chosen = malloc(sizeof(int64_t) * rows * m->top_k);
    int failed = !logits || !weights || !out || !chosen;
    if (!failed)
        failed = linear_weight(x, m->router, logits, m->router_bias, NULL, rows, m->count, n, isa);
    if (!failed) {
        for (long r = 0; r < rows; r++)
            if (m->correction)
                route_grouped(m, logits + r * m->count, chosen + r * m->top_k,
                              weights + r * m->top_k);
            else
                route_row(logits + r * m->count, m->count, m->top_k, m->normalize,
                          chosen + r * m->top_k, weights + r * m->top_k);
        failed = m->tiles ? expert_tiles(m->experts, x, rows, m->top_k, chosen, weights, out)
                          : quantized_experts(m->experts, x, rows, m->top_k, chosen, weights, out,
                                              isa);
    }
    if (!failed)
        for (long i = 0; i < rows * n; i += 8) {
            __m256 sum = _mm256_loadu_ps(out + i);
            if (shared) sum = _mm256_add_ps(sum, _mm256_loadu_ps(shared + i));
            _mm256_storeu_ps(hidden + i, _mm256_add_ps(_mm256_loadu_ps(hidden + i), sum));
        }
    free(logits);
    free(weights);
    free(out);
    free(chosen);
    return failed ? -1 : 0;
}
