/* The recurrences of a hybrid model's recurrent layers, token by token in float32, for every
 * request of a step in one call: the gated delta rule (Gated DeltaNet, layers/gated_deltanet.py)
 * and Mamba-2's selective scan (layers/mamba.py).
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

static float l2_inverse(const float *x, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum + 1e-6f);
}

/*
 * mixed [rows, 2 nk dk + nv dv]: the conv's output (q, k, v) in float32; g, beta [rows, nv];
 * key_heads [nv]: each value head's key head; segments: starts, lengths and state pointers
 * ([nv, dk, dv] float32 each, updated in place); saves: after `save_offset` rows of segment
 * `save_segment`, the head's state is copied into save_state (a checkpoint's [nv, dk, dv]);
 * out [rows, nv, dv].
 */
void treadle_gated_delta_rule(const float *mixed, const float *g, const float *beta, const int64_t *key_heads,
                              int64_t nk, int64_t nv, int64_t dk, int64_t dv, int64_t num_segments,
                              const int64_t *starts, const int64_t *lengths, float *const *states, int64_t num_saves,
                              const int64_t *save_segment, const int64_t *save_offset, float *const *save_state,
                              float *out) {
    const int64_t width = 2 * nk * dk + nv * dv, key_dim = nk * dk;
    int64_t work = 0;
    for (int64_t s = 0; s < num_segments; s++) work += lengths[s];
    const float scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel for schedule(dynamic, 1) if (work * nv * dk * dv >= 262144)
    for (int64_t task = 0; task < num_segments * nv; task++) {
        const int64_t seg = task / nv, h = task % nv, kh = key_heads[h];
        float *S = states[seg] + h * dk * dv;
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
