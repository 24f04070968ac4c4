/* A Llama-style decoder layer's step in two calls, for bfloat16 rows whose weights are all held
 * quantized (Gemma 2 / 3's too: a norm on the attention's and the MLP's outputs before each is
 * added, per-layer rotary tables, soft-capped scores): the same kernels the layer's Python calls one by one (quant.c's products, rowops.c's
 * RMSNorm and rotary, paged_attention.c), in the same order, on the same buffers' layouts, and the
 * torch operations between them (a bias add, the K/V rows' copy into the cache, the residual adds)
 * written out with torch's rounding: the same bits. A decode step of a small model spent more time
 * in the Python around ~13 calls per layer than in the kernels; here one call runs the layer up
 * to its MLP's activation (which stays torch's), and one runs the rest.
 *
 * The kernels are not linked in: their entry points come as function pointers (`kernels`), filled
 * from the loaded libraries, so each keeps its own build flags.
 */

#include <stdint.h>
#include <string.h>

#include "bf16.h"

typedef int (*matmul_fn)(int type, const uint8_t *w, int64_t N, int64_t K, const void *x, int x_bf16, int64_t ldx, int64_t M, void *y,
                         int64_t ldy, int y_bf16, int isa);
typedef void (*norm_fn)(const uint16_t *x, int64_t a, int64_t b, int64_t d, int64_t sa, int64_t sb, const uint16_t *w, float eps,
                        uint16_t *out);
typedef void (*rotary_fn)(const uint16_t *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t x_stride, const float *cos,
                          const float *signed_sin, int64_t rot, uint16_t *out);
typedef int (*attention_fn)(const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache, int64_t block_size,
                            int64_t block_stride, int64_t kv_heads, int64_t head_dim, int64_t group, const int64_t *tables, int64_t table_stride,
                            const int64_t *row_table, const int64_t *key_begin, const int64_t *key_end, float scale, float softcap,
                            const float *sinks, uint16_t *out, int64_t out_stride, int64_t rows, int64_t span, int64_t kv_int8);

#define MAX_PARTS 4

typedef struct {
    matmul_fn matmul;
    norm_fn norm;
    rotary_fn rotary;
    attention_fn attention;
    int64_t isa, hidden, heads, kv_heads, head_dim, rot, intermediate;
    float eps, scale, softcap; /* softcap: the attention scores' (Gemma 2), or 0 */
} model_args;

/* a Linear: its parts' rows one after another (each part's product fills its columns) */
typedef struct {
    int64_t n_parts, width;
    const uint8_t *data[MAX_PARTS];
    int64_t type[MAX_PARTS], rows[MAX_PARTS];
    const uint16_t *bias; /* [width] bf16, or NULL */
} linear_args;

typedef struct {
    linear_args qkv, o, gate_up, down;
    const uint16_t *input_norm, *post_norm; /* [hidden] bf16 */
    const uint16_t *q_norm, *k_norm;        /* [head_dim] bf16: each head of q and k normed (Qwen3), or NULL */
    const uint16_t *attn_out_norm;          /* [hidden] bf16: the attention's output normed before it is added (Gemma), or NULL */
    const uint16_t *mlp_out_norm;           /* [hidden] bf16: the MLP's output normed before it is added (Gemma), or NULL */
    uint16_t *k_cache, *v_cache;            /* [blocks, block_size, kv_heads, head_dim] bf16 */
    int64_t block_size;
    int64_t local;                          /* 1: rotated by the step's second tables (Gemma 3's local layers) */
} layer_args;

typedef struct {
    int64_t rows;
    uint16_t *h;                            /* [rows, hidden]: the residual stream, added to in place */
    const float *cos, *signed_sin;          /* [rows, rot] */
    const float *local_cos, *local_signed_sin; /* [rows, rot]: the local layers' tables (= cos, signed_sin where one base) */
    const int64_t *slots;                   /* [rows]: each row's K/V slot in the cache */
    const int64_t *tables, *row_table, *key_begin, *key_end;
    int64_t table_stride, span;
    uint16_t *x, *qkv, *qk, *attn, *out, *gate_up; /* buffers: [rows, hidden], [rows, qkv width], ... */
    uint16_t *qn, *kn, *qkn;                       /* with q/k norms: [rows, heads * head_dim], [rows, kv_heads * head_dim], [rows, (heads + kv_heads) * head_dim] */
} step_args;

static int linear(const model_args *m, const linear_args *l, const uint16_t *x, int64_t K, int64_t rows, uint16_t *y) {
    int64_t col = 0;
    for (int64_t p = 0; p < l->n_parts; p++) {
        int code = m->matmul((int)l->type[p], l->data[p], l->rows[p], K, x, 1, K, rows, y + col, l->width, 1, (int)m->isa);
        if (code) return code;
        col += l->rows[p];
    }
    if (l->bias)
#pragma omp parallel for schedule(static) if (rows * l->width >= 65536)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < l->width; j++)
                y[r * l->width + j] = f32_to_bf16(bf16_to_f32(y[r * l->width + j]) + bf16_to_f32(l->bias[j]));
    return 0;
}

/* h += y, each sum rounded once to bf16 (torch's add_) */
static void add_into(uint16_t *h, const uint16_t *y, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(y[i]));
}

/* h += y [rows, hidden], or h += norm(y) where the layer norms its blocks' outputs (into `spare`) */
static void add_output(const model_args *m, const uint16_t *out_norm, const step_args *s, const uint16_t *y, uint16_t *spare) {
    const int64_t T = s->rows;
    if (out_norm) {
        m->norm(y, T, 1, m->hidden, m->hidden, m->hidden, out_norm, m->eps, spare);
        y = spare;
    }
    add_into(s->h, y, T * m->hidden);
}

/* The layer from its input norm to its MLP's gate/up product (left in s->gate_up): the attention
 * block added to s->h, the MLP's input norm (`post_norm`: Llama's post-attention norm, Gemma's
 * pre-feedforward norm), gate_up. */
int treadle_decoder_attention(const model_args *m, const layer_args *l, const step_args *s) {
    const int64_t T = s->rows, H = m->heads, KVH = m->kv_heads, D = m->head_dim, width = l->qkv.width;
    m->norm(s->h, T, 1, m->hidden, m->hidden, m->hidden, l->input_norm, m->eps, s->x);
    int code = linear(m, &l->qkv, s->x, m->hidden, T, s->qkv);
    if (code) return code;
    /* q and k rotated together, out of the product's rows ([T, H + KVH, D], row stride `width`),
     * or out of their per-head norms, each part normed on its own and the two joined per row */
    const uint16_t *qk_rows = s->qkv;
    int64_t qk_stride = width;
    if (l->q_norm) {
        m->norm(s->qkv, T, H, D, width, D, l->q_norm, m->eps, s->qn);
        m->norm(s->qkv + H * D, T, KVH, D, width, D, l->k_norm, m->eps, s->kn);
        for (int64_t t = 0; t < T; t++) {
            memcpy(s->qkn + t * (H + KVH) * D, s->qn + t * H * D, (size_t)(H * D) * 2);
            memcpy(s->qkn + t * (H + KVH) * D + H * D, s->kn + t * KVH * D, (size_t)(KVH * D) * 2);
        }
        qk_rows = s->qkn;
        qk_stride = (H + KVH) * D;
    }
    m->rotary(qk_rows, T, H + KVH, D, qk_stride, l->local ? s->local_cos : s->cos, l->local ? s->local_signed_sin : s->signed_sin, m->rot,
              s->qk);
    /* this step's K and V rows into their cache slots (index_copy_) */
    const int64_t kv_row = KVH * D;
    for (int64_t t = 0; t < T; t++) {
        memcpy(l->k_cache + s->slots[t] * kv_row, s->qk + t * (H + KVH) * D + H * D, (size_t)kv_row * 2);
        memcpy(l->v_cache + s->slots[t] * kv_row, s->qkv + t * width + (H + KVH) * D, (size_t)kv_row * 2);
    }
    code = m->attention(s->qk, (H + KVH) * D, l->k_cache, l->v_cache, l->block_size, l->block_size * kv_row, KVH, D, H / KVH, s->tables, s->table_stride,
                        s->row_table, s->key_begin, s->key_end, m->scale, m->softcap, NULL, s->attn, H * D, T, s->span, 0);
    if (code) return code;
    code = linear(m, &l->o, s->attn, H * D, T, s->out);
    if (code) return code;
    add_output(m, l->attn_out_norm, s, s->out, s->x); /* x: the input norm's rows, read by qkv alone */
    m->norm(s->h, T, 1, m->hidden, m->hidden, m->hidden, l->post_norm, m->eps, s->x);
    return linear(m, &l->gate_up, s->x, m->hidden, T, s->gate_up);
}

/* The MLP's down product of the activation `act` [rows, intermediate], added to s->h (normed first
 * where the layer says). */
int treadle_decoder_down(const model_args *m, const layer_args *l, const step_args *s, const uint16_t *act) {
    int code = linear(m, &l->down, act, m->intermediate, s->rows, s->out);
    if (code) return code;
    add_output(m, l->mlp_out_norm, s, s->out, s->x); /* x: the MLP's input rows, read by gate_up alone */
    return 0;
}
