/* One Llama decoder layer for a step where every row decodes one token, in one call: RMSNorm,
 * the fused QKV projection, RoPE, the KV-cache write, paged attention, the output projection
 * with its residual, RMSNorm, gate-up, SiLU(gate) * up and the down projection with its
 * residual, or a mixture of experts in their place (decode_mixture.c). On the torch path that is some twenty calls a layer, each with Python and dispatch
 * costs that outweigh the arithmetic when a step has one or a few rows. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kv_formats.h"
#include "simd.h"

void linear_f32(const float *x, const float *w, float *y, const float *bias,
                const float *residual, long M, long N, long K);
void linear_bf16(const float *x, const uint16_t *w, float *y, const float *bias,
                 const float *residual, long M, long N, long K);
int linear_bf16_tiles(const float *x, const uint16_t *w, float *y, const float *bias,
                      const float *residual, long M, long N, long K);
int gated_bf16_tiles(const float *x, const uint16_t *w, float *act, long M, long n, long K);
int linear_quantized(const float *x, const uint8_t *w, float *y, const float *bias,
                     const float *residual, long M, long N, long K, long ldy, int bits, int isa);
int linear_int8_tiles(const float *x, const int8_t *w, const float *sw, float *y,
                      const float *bias, const float *residual, long M, long N, long K, long ldy);
int gated_int8_tiles(const float *x, const int8_t *w, const float *sw, float *act, long M,
                     long n, long K);
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, long kv_format,
                           const long *block_tables, long width, const long *seq_lens, float *out,
                           long rows, long heads, long kv_heads, long dim, long block_size,
                           float scale, long window, float softcap, const float *sinks,
                           long isa, long tiles);
void rms_norm_rows(const float *x, const float *weight, float *out, long rows, long n,
                   float eps);

/* A projection's packed weight and the bits a value takes there: 32 (float32 panels), 16
 * (bfloat16 panels), 8, 6 or 4 (quantized panels, quantized.h), or 8 on AMX-INT8 tiles with a
 * scale a feature (`scales`, int8_tiles.c); bfloat16 panels may be multiplied on AMX-BF16 tiles
 * (`tiles`, bf16_tiles.c). Quantized parts stored in different formats (a
 * file's q and k in Q4_K, v in Q6_K) are chained: `rows` features here (a whole number of
 * panels), then `next`'s. */
typedef struct Weight {
    const void *data;
    long bits, rows;
    const struct Weight *next;
    const float *scales;
    long tiles;
} Weight;

/* A layer's mixture of experts (decode_mixture.c). */
typedef struct Mixture Mixture;
int mixture_rows(const Mixture *m, const float *x, float *hidden, const float *shared, long rows,
                 long n, long isa);

/* A layer's weights; NULL where the model has none: biases (Qwen2's q, k, v; gpt-oss's all
 * four), `qk_norm` (Qwen3), `sinks` (gpt-oss: a logit a head in its softmax's sum). Beside a
 * `mixture`, gate_up and down are its shared experts' (GLM-4.5, Qwen2-MoE; or NULL), of
 * `shared_inner` dims, scaled by the sigmoid of a row's product with `shared_gate` (Qwen2-MoE's
 * [hidden]; or NULL). */
typedef struct {
    const float *input_norm;
    const Weight *qkv;
    const float *qkv_bias, *qk_norm;
    const Weight *o_proj;
    const float *o_bias, *sinks, *post_norm;
    const Weight *gate_up, *down;
    const Mixture *mixture;
    const float *shared_gate;
    long shared_inner;
} Layer;

/* LoRA adapters' pairs on a row's projections (lora.c). */
typedef struct LoraPair LoraPair;
void lora_add(const float *x, float *y, long rows, long in, long out, long ldy,
              const long *adapters, const LoraPair *pairs);
int lora_gated(const float *x, const Weight *gate_up, float *act, long rows, long hidden,
               long intermediate, const long *adapters, const LoraPair *pairs, long isa);

typedef struct {
    long rows, hidden, intermediate, heads, kv_heads, dim;
    float eps, scale;
    void *k_cache, *v_cache;
    long kv_format;           /* the caches' values: one of simd.h's KV_* */
    const long *slots;        /* [rows] flat cache slot of each row's new token */
    const float *rotations;   /* [rows][dim / 2][2]: cos, sin at each row's position */
    const long *block_tables; /* [rows][width] */
    long width, block_size;
    const long *seq_lens;     /* [rows], the new token included */
    float *scratch;           /* see `decode_layer_scratch` */
    long window;              /* this layer's sliding window; 0: full attention */
    long isa;                 /* the quantized products' tiles (quantized.c) */
    long tiles;               /* attention on AMX tiles (paged_decode_attention) */
    const long *adapters;     /* [rows] each row's LoRA adapter, -1: none (lora.c) */
} Step;

/* y = x @ W.T (+ bias) (+ residual) on any packed weight; -1 where a quantized product could
 * not allocate. */
int linear_weight(const float *x, const Weight *w, float *y, const float *bias,
                  const float *residual, long M, long N, long K, long isa) {
    if (w->scales) return linear_int8_tiles(x, w->data, w->scales, y, bias, residual, M, N, K, N);
    if (w->bits == 32) linear_f32(x, w->data, y, bias, residual, M, N, K);
    else if (w->bits == 16 && w->tiles)
        return linear_bf16_tiles(x, w->data, y, bias, residual, M, N, K);
    else if (w->bits == 16) linear_bf16(x, w->data, y, bias, residual, M, N, K);
    else
        for (long first = 0; w; first += w->rows, w = w->next) {
            const long n = w->next ? w->rows : N - first;
            if (linear_quantized(x, w->data, y + first, bias ? bias + first : NULL,
                                 residual ? residual + first : NULL, M, n, K, N, (int)w->bits,
                                 (int)isa))
                return -1;
        }
    return 0;
}

long decode_layer_scratch(long rows, long hidden, long intermediate, long heads, long kv_heads,
                          long dim) {
    return rows * ((heads + 2 * kv_heads) * dim + 2 * heads * dim + hidden + 3 * intermediate);
}

/* Each query and key head RMS-normed where the model has `qk_norm` ([heads + kv_heads][dim],
 * Qwen3), RoPE on heads whose dims are stored as (re, im) pairs (see interleave_rotary_halves
 * in executor_svc/model/llama.py), then the queries into `queries` and K and V into the cache. */
static void rotate_and_cache(const Step *s, float *projected, const float *qk_norm,
                             float *queries) {
    const long dim = s->dim, width = (s->heads + 2 * s->kv_heads) * dim;
    const long kv_width = s->kv_heads * dim, q_width = s->heads * dim;
#pragma omp parallel for if (s->rows >= 8)
    for (long r = 0; r < s->rows; r++) {
        float *qkv = projected + r * width;
        const float *turn = s->rotations + r * dim;
        for (long h = 0; h < s->heads + s->kv_heads; h++) {
            float *pair = qkv + h * dim;
            if (qk_norm) rms_norm_rows(pair, qk_norm + h * dim, pair, 1, dim, s->eps);
            for (long i = 0; i < dim; i += 2) {
                float re = pair[i], im = pair[i + 1], c = turn[i], sn = turn[i + 1];
                pair[i] = re * c - im * sn;
                pair[i + 1] = re * sn + im * c;
            }
        }
        for (long i = 0; i < q_width; i++) queries[r * q_width + i] = qkv[i];
        const float *key = qkv + q_width, *value = key + kv_width;
        round_kv(key, s->k_cache, s->slots[r] * kv_width, kv_width, s->kv_format);
        round_kv(value, s->v_cache, s->slots[r] * kv_width, kv_width, s->kv_format);
    }
}

/* act = silu(gate) * up, where each row of gate_up is [gate | up]; n a multiple of 8. */
void silu_and_multiply(const float *gate_up, float *act, long rows, long n) {
#pragma omp parallel for if (rows >= 8)
    for (long r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * n, *up = gate + n;
        for (long i = 0; i < n; i += 8)
            _mm256_storeu_ps(act + r * n + i,
                             silu_times(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    }
}

/* y = silu(gate) * up of x's rows through gate_up, times down (+ residual), `inner` dims
 * between; the LoRA pairs of gate_up and down where `lora`. */
static int gated_mlp(const Weight *gate_up, const Weight *down, const float *x, float *gu,
                     float *act, float *y, const float *residual, long inner,
                     const LoraPair *const *lora, const Step *s) {
    const long rows = s->rows, hidden = s->hidden, isa = s->isa;
    const int int8 = gate_up->scales != NULL, bf16 = gate_up->bits == 16 && gate_up->tiles;
    if ((int8 || bf16) && inner % 16 == 0) { /* SiLU in the product's finish */
        if (int8 ? gated_int8_tiles(x, gate_up->data, gate_up->scales, act, rows, inner, hidden)
                 : gated_bf16_tiles(x, gate_up->data, act, rows, inner, hidden))
            return -1;
        if (lora && lora_gated(x, gate_up, act, rows, hidden, inner, s->adapters, lora[2], isa))
            return -1;
    } else {
        if (linear_weight(x, gate_up, gu, NULL, NULL, rows, 2 * inner, hidden, isa)) return -1;
        if (lora) lora_add(x, gu, rows, hidden, 2 * inner, 2 * inner, s->adapters, lora[2]);
        silu_and_multiply(gu, act, rows, inner);
    }
    if (linear_weight(act, down, y, NULL, residual, rows, hidden, inner, isa)) return -1;
    if (lora) lora_add(act, y, rows, inner, hidden, hidden, s->adapters, lora[3]);
    return 0;
}

/* hidden += the mixture of x's rows, with the shared experts' rows where the layer has them. */
static int mixture_and_shared(const Layer *l, const float *x, float *hidden, const Step *s) {
    const long rows = s->rows, n = s->hidden, inner = l->shared_inner;
    if (!l->gate_up) return mixture_rows(l->mixture, x, hidden, NULL, rows, n, s->isa);
    float *gu = malloc(sizeof(float) * rows * (3 * inner + n)), *act = gu + rows * 2 * inner;
    float *shared = act + rows * inner;
    int failed = !gu || gated_mlp(l->gate_up, l->down, x, gu, act, shared, NULL, inner, NULL, s);
    for (long r = 0; r < rows && !failed && l->shared_gate; r++) {
        float dot = 0.0f;
        for (long i = 0; i < n; i++) dot += x[r * n + i] * l->shared_gate[i];
        const float scale = 1.0f / (1.0f + expf(-dot));
        for (long i = 0; i < n; i++) shared[r * n + i] *= scale;
    }
    if (!failed) failed = mixture_rows(l->mixture, x, hidden, shared, rows, n, s->isa);
    free(gu);
    return failed ? -1 : 0;
}

/* -1 where a buffer could not be allocated. `lora`: the layer's LoRA pairs, [qkv, o_proj,
 * gate_up, down][adapter], or NULL where no row runs an adapter. */
int decode_layer(float *hidden, const Layer *l, const LoraPair *const *lora, const Step *s) {
    const long rows = s->rows, q_width = s->heads * s->dim, isa = s->isa;
    const long qkv_width = q_width + 2 * s->kv_heads * s->dim, inner = s->intermediate;
    float *projected = s->scratch, *queries = projected + rows * qkv_width;
    float *attn = queries + rows * q_width, *x = attn + rows * q_width;
    float *gu = x + rows * s->hidden, *act = gu + rows * 2 * inner;
    rms_norm_rows(hidden, l->input_norm, x, rows, s->hidden, s->eps);
    if (linear_weight(x, l->qkv, projected, l->qkv_bias, NULL, rows, qkv_width, s->hidden, isa))
        return -1;
    if (lora) lora_add(x, projected, rows, s->hidden, qkv_width, qkv_width, s->adapters, lora[0]);
    rotate_and_cache(s, projected, l->qk_norm, queries);
    if (paged_decode_attention(queries, s->k_cache, s->v_cache, s->kv_format, s->block_tables,
                               s->width, s->seq_lens, attn, rows, s->heads, s->kv_heads, s->dim,
                               s->block_size, s->scale, s->window, 0.0f, l->sinks, isa, s->tiles))
        return -1;
    if (linear_weight(attn, l->o_proj, hidden, l->o_bias, hidden, rows, s->hidden, q_width, isa))
        return -1;
    if (lora) lora_add(attn, hidden, rows, q_width, s->hidden, s->hidden, s->adapters, lora[1]);
    rms_norm_rows(hidden, l->post_norm, x, rows, s->hidden, s->eps);
    if (l->mixture) return mixture_and_shared(l, x, hidden, s);
    return gated_mlp(l->gate_up, l->down, x, gu, act, hidden, hidden, inner, lora, s);
}
