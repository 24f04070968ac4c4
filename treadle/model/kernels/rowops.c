/* Row-wise operations of a decoder layer in one call each, for bfloat16 activations: the rotary
 * embedding (float32 rows too) and RMSNorm. A decode step runs ~40 small torch operations per layer, each costing
 * its dispatch; these take two of the largest groups (a rotation was 5 operations, a norm 4) down
 * to one call. Every row is computed alone, in a fixed order, so a row's bits do not depend on
 * the rows beside it (the batch-invariant default, docs/architecture.md "Numerics"). Built with
 * -ffp-contract=off: every multiply-add is as written.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/*
 * Rotary embedding in HF's rotate-half layout, as layers.apply_rotary computes it, to the bit:
 * x32 = float(x); out = bf16(x32 * cos + roll(x32, rot / 2) * signed_sin), each product rounded
 * to float32, then their sum (torch's mul and addcmul). The first `rot` values of each head turn,
 * the rest are copied (float32 rows: out = x32 * cos + roll(x32) * signed_sin in float32, as torch's
 * float32 operations give it). x: [rows, heads, head_dim] bf16, heads contiguous, row stride x_stride
 * (elements); cos, signed_sin: [rows, rot] float32 (each row's position), contiguous; out:
 * [rows, heads, head_dim] contiguous.
 */
/* one rotation per element type: T the rows' type, LOAD / STORE their widening and rounding */
#define ROTARY(NAME, T, LOAD, STORE)                                                                                           \
    void NAME(const T *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t x_stride, const float *cos, const float *signed_sin, \
              int64_t rot, T *out) {                                                                                           \
        const int64_t half = rot / 2;                                                                                          \
        _Pragma("omp parallel for schedule(static) if (rows * heads * head_dim >= 65536)") for (int64_t r = 0; r < rows; r++) { \
            const float *c = cos + r * rot, *s = signed_sin + r * rot;                                                         \
            for (int64_t h = 0; h < heads; h++) {                                                                              \
                const T *xh = x + r * x_stride + h * head_dim;                                                                 \
                T *oh = out + (r * heads + h) * head_dim;                                                                       \
                float xf[512];                                                                                                 \
                for (int64_t j = 0; j < rot; j++) xf[j] = LOAD(xh[j]);                                                         \
                for (int64_t j = 0; j < rot; j++) {                                                                            \
                    const float a = xf[j] * c[j];                                                                              \
                    const float b = xf[j < half ? j + half : j - half] * s[j];                                                 \
                    oh[j] = STORE(a + b);                                                                                      \
                }                                                                                                              \
                if (rot < head_dim) memcpy(oh + rot, xh + rot, sizeof(T) * (size_t)(head_dim - rot));                          \
            }                                                                                                                  \
        }                                                                                                                      \
    }
#define SAME(v) (v)
ROTARY(treadle_rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
ROTARY(treadle_rotary_f32, float, SAME, SAME) /* float32 rows: torch's float32 mul, mul and add exactly */
#undef SAME
#undef ROTARY

/*
 * RMSNorm of each row: r = 1 / sqrtf(sum(x²) / d + eps), the sum of squares in 16 lanes (lane l
 * adds x[j]² for j = l, l + 16, ... in order, each an fma) and then a fixed tree; out =
 * bf16((x * r) * w), rounded once. x: [a, b, d] bf16 with strides sa, sb (elements) and d
 * contiguous; w: [d] bf16; out: [a, b, d] contiguous.
 */
void treadle_rms_norm_bf16(const uint16_t *x, int64_t a, int64_t b, int64_t d, int64_t sa, int64_t sb, const uint16_t *w, float eps,
                           uint16_t *out) {
    const int64_t rows = a * b;
#pragma omp parallel for schedule(static) if (rows * d >= 65536)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *xr = x + (i / b) * sa + (i % b) * sb;
        uint16_t *o = out + i * d;
        float lanes[16] = {0};
        int64_t j = 0;
        for (; j + 16 <= d; j += 16)
#pragma omp simd
            for (int l = 0; l < 16; l++) {
                const float v = bf16_to_f32(xr[j + l]);
                lanes[l] = fmaf(v, v, lanes[l]);
            }
        for (int l = 0; j + l < d; l++) {
            const float v = bf16_to_f32(xr[j + l]);
            lanes[l] = fmaf(v, v, lanes[l]);
        }
        float t8[8], t4[4];
        for (int l = 0; l < 8; l++) t8[l] = lanes[l] + lanes[l + 8];
        for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];
        const float ss = (t4[0] + t4[2]) + (t4[1] + t4[3]);
        const float r = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
        for (int64_t k = 0; k < d; k++) o[k] = f32_to_bf16((bf16_to_f32(xr[k]) * r) * bf16_to_f32(w[k]));
    }
}
