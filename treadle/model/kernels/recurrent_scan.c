/* The recurrences of a hybrid model's recurrent layers, token by token in float32, for every
 * request of a step in one call: a Gated DeltaNet's convolution and gated delta rule
 * (layers/gated_deltanet.py) and Mamba-2's selective scan (layers/mamba.py).
 *
 * Each (request, head) pair is one task: its state is read and written by that task alone, and
 * its sums run in one fixed order (over the key dimension, ascending), so a request's outputs and
 * states are the same bits whether its tokens arrive whole, in chunks, beside other requests or
 * after a restored checkpoint (the batch-invariant rule). Per token and head the state is
 * touched twice: decay and read (S *= exp(g); kv = k^T S), then write and output (S += k delta^T;
 * o = q^T S); a state of dk x dv floats (64 KB at 128 x 128) stays in the core's cache for a
 * segment's tokens.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static float l2_inverse(const float *x, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum + 1e-6f);
}

static inline float round_to(float x, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

/*
 * A Gated DeltaNet layer's step after its input projection, for every segment (a request's rows):
 *
 * 1. the short causal convolution over each segment's conv state (`conv_states`, [channels,
 *    d_conv - 1] float32, updated in place) and its rows of qkv [rows, channels], then silu, into
 *    `mixed` [rows, channels]; with `bf16`, the conv's output and the silu are rounded to bfloat16
 *    as a bfloat16 model computes them;
 * 2. the gated delta rule per (segment, value head): q, k l2-normed (q also by 1/sqrt(dk)),
 *    g, beta [rows, nv]; key_heads [nv]: each value head's key head; `states` [nv, dk, dv]
 *    float32 each, updated in place; out [rows, nv, dv].
 *
 * saves: after `save_offset` rows of segment `save_segment`, its states are copied into
 * save_conv / save_state (a checkpoint's).
 */
void treadle_gated_delta_net(const float *qkv, const float *conv_weight, int64_t d_conv, int64_t bf16, float *mixed,
                             const float *g, const float *beta, const int64_t *key_heads, int64_t nk, int64_t nv,
                             int64_t dk, int64_t dv, int64_t num_segments, const int64_t *starts,
                             const int64_t *lengths, float *const *conv_states, float *const *states,
                             int64_t num_saves, const int64_t *save_segment, const int64_t *save_offset,
                             float *const *save_conv, float *const *save_state, float *out) {
    const int64_t key_dim = nk * dk, width = 2 * key_dim + nv * dv, keep = d_conv - 1;
    int64_t work = 0;
    for (int64_t s = 0; s < num_segments; s++) work += lengths[s];
    const int64_t blocks = (width + 63) / 64;
#pragma omp parallel for schedule(static) if (work * width * d_conv >= 262144)
    for (int64_t task = 0; task < num_segments * blocks; task++) {
        const int64_t seg = task / blocks, c0 = (task % blocks) * 64, c1 = c0 + 64 < width ? c0 + 64 : width;
        const int64_t n = lengths[seg], start = starts[seg];
        float *state = conv_states[seg];
        for (int64_t c = c0; c < c1; c++) {
            float old[64]; /* d_conv <= 64 (the configs' limit) */
            for (int64_t k = 0; k < keep; k++) old[k] = state[c * keep + k];
#define WINDOW(i) ((i) < keep ? old[(i)] : qkv[(start + (i) - keep) * width + c])
            const float *w = conv_weight + c * d_conv;
            for (int64_t t = 0; t < n; t++) {
                float acc = 0.0f;
                for (int64_t k = 0; k < d_conv; k++) acc += w[k] * WINDOW(t + k);
                acc = round_to(acc, (int)bf16);
                mixed[(start + t) * width + c] = round_to(acc / (1.0f + expf(-acc)), (int)bf16);
            }
            for (int64_t k = 0; k < keep; k++) state[c * keep + k] = WINDOW(n + k);
            for (int64_t p = 0; p < num_saves; p++)
                if (save_segment[p] == seg)
                    for (int64_t k = 0; k < keep; k++) save_conv[p][c * keep + k] = WINDOW(save_offset[p] + k);
#undef WINDOW
        }
    }
#pragma omp parallel for schedule(dynamic, 1) if (work * nv * dk * dv >= 262144)
    for (int64_t task = 0; task < num_segments * nv; task++) {
        const int64_t seg = task / nv, h = task % nv, kh = key_heads[h];
        float *S = states[seg] + h * dk * dv;
        const float scale = 1.0f / sqrtf((float)dk);
        float q[1024], k[1024], kv[1024], o[1024];
        for (int64_t t = 0; t < lengths[seg]; t++) {
            const int64_t row = starts[seg] + t;
            const float *x = mixed + row * width;
            const float *qs = x + kh * dk, *ks = x + key_dim + kh * dk, *v = x + 2 * key_dim + h * dv;
            const float qi = l2_inverse(qs, dk), ki = l2_inverse(ks, dk);
            for (int64_t i = 0; i < dk; i++) {
                q[i] = qs[i] * qi * scale;
                k[i] = ks[i] * ki;
            }
            const float decay = expf(g[row * nv + h]), b = beta[row * nv + h];
            for (int64_t j = 0; j < dv; j++) kv[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                float *Si = S + i * dv;
                const float ki_ = k[i];
                for (int64_t j = 0; j < dv; j++) {
                    Si[j] *= decay;
                    kv[j] += ki_ * Si[j];
                }
            }
            for (int64_t j = 0; j < dv; j++) {
                kv[j] = (v[j] - kv[j]) * b; /* delta */
                o[j] = 0.0f;
            }
            for (int64_t i = 0; i < dk; i++) {
                float *Si = S + i * dv;
                const float ki_ = k[i], qi_ = q[i];
                for (int64_t j = 0; j < dv; j++) {
                    Si[j] += ki_ * kv[j];
                    o[j] += qi_ * Si[j];
                }
            }
            memcpy(out + (row * nv + h) * dv, o, sizeof(float) * (size_t)dv);
            for (int64_t p = 0; p < num_saves; p++)
                if (save_segment[p] == seg && save_offset[p] == t + 1)
                    memcpy(save_state[p] + h * dk * dv, S, sizeof(float) * (size_t)(dk * dv));
        }
    }
}

/*
 * Mamba-2's scan. mixed [rows, heads hp + 2 groups n]: the conv's output (x, B, C) in float32;
 * dt, decay [rows, heads] (decay = exp(dt A)); head h reads group h / (heads / groups); states
 * [heads, hp, n] float32; saves and segments as above; out [rows, heads, hp]:
 * h = decay h + (dt x) B^T, y = h C (D x is added by the caller).
 */
void treadle_mamba2_scan(const float *mixed, const float *dt, const float *decay, int64_t heads, int64_t hp,
                         int64_t n, int64_t groups, int64_t num_segments, const int64_t *starts, const int64_t *lengths,
                         float *const *states, int64_t num_saves, const int64_t *save_segment,
                         const int64_t *save_offset, float *const *save_state, float *out) {
    const int64_t width = heads * hp + 2 * groups * n, per_group = heads / groups;
    int64_t work = 0;
    for (int64_t s = 0; s < num_segments; s++) work += lengths[s];
#pragma omp parallel for schedule(dynamic, 1) if (work * heads * hp * n >= 262144)
    for (int64_t task = 0; task < num_segments * heads; task++) {
        const int64_t seg = task / heads, h = task % heads, grp = h / per_group;
        float *S = states[seg] + h * hp * n;
        for (int64_t t = 0; t < lengths[seg]; t++) {
            const int64_t row = starts[seg] + t;
            const float *x = mixed + row * width + h * hp;
            const float *B = mixed + row * width + heads * hp + grp * n, *C = B + groups * n;
            const float d = decay[row * heads + h], step = dt[row * heads + h];
            float *y = out + (row * heads + h) * hp;
            for (int64_t p = 0; p < hp; p++) {
                float *Sp = S + p * n;
                const float dx = step * x[p];
                float acc = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    Sp[j] = Sp[j] * d + dx * B[j];
                    acc += Sp[j] * C[j];
                }
                y[p] = acc;
            }
            for (int64_t p = 0; p < num_saves; p++)
                if (save_segment[p] == seg && save_offset[p] == t + 1)
                    memcpy(save_state[p] + h * hp * n, S, sizeof(float) * (size_t)(hp * n));
        }
    }
}
