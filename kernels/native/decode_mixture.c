/* A decode layer's mixture of experts in place of its MLP (decode_layer.c): the router's
 * logits (a projection), each row's softmax over the experts in float32, its top-k (the lower
 * index first between equals) scaled to sum to 1 where the model does, then the experts'
 * weighted sum (on AMX-BF16 tiles, expert_tiles.c, or on GGUF blocks, quantized_experts.c)
 * added to the residual: what the model's layers compute (routers.py), in one native call. */
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
} Mixture;

/* A row's top-k experts and their weights, from its logits over `count` experts. */
static void route_row(const float *logits, long count, long top_k, long normalize,
                      int64_t *chosen, float *weights) {
    float top = logits[0], sum = 0.0f;
    for (long e = 1; e < count; e++) top = fmaxf(top, logits[e]);
    for (long e = 0; e < count; e++) sum += expf(logits[e] - top);
    float kept = 0.0f;
    for (long k = 0; k < top_k; k++) {
        long best = -1;
        for (long e = 0; e < count; e++) {
            int taken = 0;
            for (long j = 0; j < k; j++) taken |= chosen[j] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        chosen[k] = best;
        weights[k] = expf(logits[best] - top) / sum;
        kept += weights[k];
    }
    if (normalize)
        for (long k = 0; k < top_k; k++) weights[k] /= kept;
}

/* hidden [rows][n] += the mixture of x [rows][n] (the post-attention norm's rows). -1 where a
 * buffer cannot be allocated. */
int mixture_rows(const Mixture *m, const float *x, float *hidden, long rows, long n, long isa) {
    float *logits = malloc(sizeof(float) * rows * m->count);
    float *weights = malloc(sizeof(float) * rows * m->top_k);
    float *out = malloc(sizeof(float) * rows * n);
    int64_t *chosen = malloc(sizeof(int64_t) * rows * m->top_k);
    int failed = !logits || !weights || !out || !chosen;
    if (!failed)
        failed = linear_weight(x, m->router, logits, m->router_bias, NULL, rows, m->count, n, isa);
    if (!failed) {
        for (long r = 0; r < rows; r++)
            route_row(logits + r * m->count, m->count, m->top_k, m->normalize,
                      chosen + r * m->top_k, weights + r * m->top_k);
        failed = m->tiles ? expert_tiles(m->experts, x, rows, m->top_k, chosen, weights, out)
                          : quantized_experts(m->experts, x, rows, m->top_k, chosen, weights, out,
                                              isa);
    }
    if (!failed)
        for (long i = 0; i < rows * n; i += 8)
            _mm256_storeu_ps(hidden + i, _mm256_add_ps(_mm256_loadu_ps(hidden + i),
                                                       _mm256_loadu_ps(out + i)));
    free(logits);
    free(weights);
    free(out);
    free(chosen);
    return failed ? -1 : 0;
}
