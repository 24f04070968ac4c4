/* Paged attention, one query token at a time, with a fixed order of every sum.
 *
 * treadle's attention for bfloat16 KV caches. Each work item is one query token and one KV
 * head: its `group` query heads attend over the token's own keys, read through its block table
 * (no gathered copy). The arithmetic of an item depends only on its own query, keys and values:
 * not on how many tokens the call has, which other requests share the step, whether the token is
 * a prompt token or a generated one, how the prompt was chunked or which thread runs it. So a
 * request's numbers are the same whatever its batch (see docs/architecture.md, "Numerics").
 *
 * Every reduction has a fixed order: 16 explicit lanes and a fixed tree at the end (with AVX-512
 * and head_dim 64, the same lanes and the intrinsic's reduction), and the build does not allow
 * the compiler to reassociate (no -ffast-math). One binary, one order: whichever path computes a
 * row, the bits are the same. Keys and values are bf16 (widened exactly), the math is float32,
 * the output is rounded to bf16 (round to nearest even), as torch rounds.
 *
 * int8 KV caches (--kv-cache-dtype int8): each cache row (one token, one KV head) is head_dim int8
 * values and then their float32 scale (4 bytes), x = scale * q. The kernel reads them as they are:
 * a score is (q . k_int8) * k_scale * softmax_scale, with the dot in the same lanes and tree as a
 * bf16 key's; a value row is accumulated as (p * v_scale) * v_int8. No dequantized copy is made,
 * and the order of every sum is the bf16 path's, so int8 is batch-invariant too.
 *
 * Soft-capping (Gemma 2's attn_logit_softcapping, softcap > 0): each score s = (q . k) * scale
 * becomes softcap * tanhf(s / softcap) before the softmax, one scalar libm call per score (never
 * vectorized: no -ffast-math), so the same bits on every path.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define LANES 16

#if defined(__AVX512F__)
#include <immintrin.h>
#define TREADLE_AVX512 1
static inline __m512 load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 load16_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* head_dim 64, a key widened to four vectors (bf16 or int8 alike): q . k in 16 lanes, then the intrinsic's tree */
static inline float dot64(const float *qg, __m512 k0, __m512 k1, __m512 k2, __m512 k3) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k0);
    a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16), k1, a);
    a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 32), k2, a);
    a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 48), k3, a);
    return _mm512_reduce_add_ps(a);
}
/* head_dim 64: a += p * v, v widened to four vectors */
static inline void axpy64(float *a, float p, __m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    const __m512 pv = _mm512_set1_ps(p);
    _mm512_storeu_ps(a, _mm512_fmadd_ps(pv, v0, _mm512_loadu_ps(a)));
    _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(pv, v1, _mm512_loadu_ps(a + 16)));
    _mm512_storeu_ps(a + 32, _mm512_fmadd_ps(pv, v2, _mm512_loadu_ps(a + 32)));
    _mm512_storeu_ps(a + 48, _mm512_fmadd_ps(pv, v3, _mm512_loadu_ps(a + 48)));
}
#endif

/* An int8 cache row's scale: the float32 after its head_dim values. */
static inline float row_scale(const int8_t *row, int64_t head_dim) {
    float s;
    memcpy(&s, row + head_dim, sizeof s);
    return s;
}


/* exp(x) for x <= 0 (scores minus their maximum): Cody-Waite reduction, degree-6 polynomial.
 * Written without libm so that it vectorizes and gives the same bits on every path. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float n = floorf(x * log2e + 0.5f);
    float r = x - n * ln2_hi;
    r = r - n * ln2_lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = (int32_t)n + 127;
    uint32_t bits = (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float lane_sum(const float *acc) {
    float t8[8], t4[4], t2[2];
    for (int l = 0; l < 8; l++) t8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];
    for (int l = 0; l < 2; l++) t2[l] = t4[l] + t4[l + 2];
    return t2[0] + t2[1];
}

/* q . k over head_dim, 16 lanes then the fixed tree; head_dim a multiple of 16. */
static inline float dot(const float *q, const uint16_t *k, int64_t head_dim) {
    float acc[LANES] = {0};
    for (int64_t d = 0; d < head_dim; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += q[d + l] * bf16_to_f32(k[d + l]);
    return lane_sum(acc);
}

static inline float dot_i8(const float *q, const int8_t *k, int64_t head_dim) {
    float acc[LANES] = {0};
    for (int64_t d = 0; d < head_dim; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += q[d + l] * (float)k[d + l];
    return lane_sum(acc);
}

/*
 * One item: row `row`, KV head `h`. scratch holds group * span floats, offsets span slots.
 * kv_int8: the caches are int8 rows of head_dim + 4 bytes (values, then the scale), else bf16.
 */
static void attend_item(
    const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache, int64_t block_size,
    int64_t kv_heads, int64_t head_dim, int64_t group, const int64_t *tables, int64_t table_stride,
    const int64_t *row_table, const int64_t *key_begin, const int64_t *key_end, float scale, float softcap,
    uint16_t *out, int64_t out_stride, int64_t row, int64_t h, float *scratch, int64_t *offsets, int kv_int8) {
    enum { MAX_GROUP = 16, MAX_DIM = 256 };
    const int64_t row_elems = kv_int8 ? head_dim + 4 : head_dim;  /* one cache row, in cache elements */
    const int64_t slot_stride = kv_heads * row_elems;
    float qf[MAX_GROUP * MAX_DIM];
    float acc[MAX_GROUP * MAX_DIM];
    const int64_t begin = key_begin[row], end = key_end[row], n = end - begin;
    const int64_t *table = tables + row_table[row] * table_stride;
    const uint16_t *qrow = q + row * q_stride + h * group * head_dim;
    for (int64_t i = 0; i < group * head_dim; i++) qf[i] = bf16_to_f32(qrow[i]);
    /* where each key's slot is, walking the table block by block (no division per key) */
    for (int64_t pos = begin, j = 0; pos < end;) {
        const int64_t block = table[pos / block_size], first = pos % block_size;
        const int64_t stop = end - pos < block_size - first ? first + (end - pos) : block_size;
        for (int64_t slot = first; slot < stop; slot++) offsets[j++] = (block * block_size + slot) * slot_stride + h * row_elems;
        pos += stop - first;
    }
    /* scores: scratch[g * n + j] */
    for (int64_t j = 0; j < n && kv_int8; j++) {
        const int8_t *k = (const int8_t *)k_cache + offsets[j];
        const float ks = row_scale(k, head_dim);
#if TREADLE_AVX512
        if (head_dim == 64) {
            const __m512 k0 = load16_i8(k), k1 = load16_i8(k + 16), k2 = load16_i8(k + 32), k3 = load16_i8(k + 48);
            for (int64_t g = 0; g < group; g++) scratch[g * n + j] = dot64(qf + g * 64, k0, k1, k2, k3) * ks * scale;
            continue;
        }
#endif
        for (int64_t g = 0; g < group; g++) scratch[g * n + j] = dot_i8(qf + g * head_dim, k, head_dim) * ks * scale;
    }
    for (int64_t j = 0; j < n && !kv_int8; j++) {
        const uint16_t *k = (const uint16_t *)k_cache + offsets[j];
#if TREADLE_AVX512
        if (head_dim == 64) {
            const __m512 k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
            for (int64_t g = 0; g < group; g++) scratch[g * n + j] = dot64(qf + g * 64, k0, k1, k2, k3) * scale;
            continue;
        }
#endif
        for (int64_t g = 0; g < group; g++) scratch[g * n + j] = dot(qf + g * head_dim, k, head_dim) * scale;
    }
    if (softcap > 0.0f)
        for (int64_t i = 0; i < group * n; i++) scratch[i] = softcap * tanhf(scratch[i] / softcap);
    /* softmax weights, unnormalized, and their sums */
    float inv[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *s = scratch + g * n;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
        float part[LANES] = {0};
        int64_t j = 0;
        for (; j + LANES <= n; j += LANES)
            for (int l = 0; l < LANES; l++) {
                s[j + l] = exp_nonpositive(s[j + l] - m);
                part[l] += s[j + l];
            }
        for (int l = 0; j + l < n; l++) {
            s[j + l] = exp_nonpositive(s[j + l] - m);
            part[l] += s[j + l];
        }
        inv[g] = 1.0f / lane_sum(part);
    }
    /* values: sequential over keys, lanes over head_dim, every head of the group per key */
    for (int64_t i = 0; i < group * head_dim; i++) acc[i] = 0.0f;
    for (int64_t j = 0; j < n && kv_int8; j++) {
        const int8_t *v = (const int8_t *)v_cache + offsets[j];
        const float vs = row_scale(v, head_dim);
#if TREADLE_AVX512
        if (head_dim == 64) {
            const __m512 v0 = load16_i8(v), v1 = load16_i8(v + 16), v2 = load16_i8(v + 32), v3 = load16_i8(v + 48);
            for (int64_t g = 0; g < group; g++) axpy64(acc + g * 64, scratch[g * n + j] * vs, v0, v1, v2, v3);
            continue;
        }
#endif
        for (int64_t g = 0; g < group; g++) {
            const float p = scratch[g * n + j] * vs;
            float *a = acc + g * head_dim;
            for (int64_t d = 0; d < head_dim; d++) a[d] += p * (float)v[d];
        }
    }
    for (int64_t j = 0; j < n && !kv_int8; j++) {
        const uint16_t *v = (const uint16_t *)v_cache + offsets[j];
#if TREADLE_AVX512
        if (head_dim == 64) {
            const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
            for (int64_t g = 0; g < group; g++) axpy64(acc + g * 64, scratch[g * n + j], v0, v1, v2, v3);
            continue;
        }
#endif
        float vf[MAX_DIM];
        for (int64_t d = 0; d < head_dim; d++) vf[d] = bf16_to_f32(v[d]);
        for (int64_t g = 0; g < group; g++) {
            const float p = scratch[g * n + j];
            float *a = acc + g * head_dim;
            for (int64_t d = 0; d < head_dim; d++) a[d] += p * vf[d];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        uint16_t *o = out + row * out_stride + (h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) o[d] = f32_to_bf16(acc[g * head_dim + d] * inv[g]);
    }
}

/*
 * All rows x kv_heads items, split over the OpenMP threads (torch's own pool: the library is
 * linked against the libgomp torch has already loaded). Which thread runs an item does not
 * change its arithmetic.
 * q, out:       [rows, kv_heads * group, head_dim] bf16, row strides q_stride / out_stride (elements)
 * k/v_cache:    [num_blocks, block_size, kv_heads, head_dim] bf16, or with kv_int8
 *               [num_blocks, block_size, kv_heads, head_dim + 4] int8 (values, then a float32 scale)
 * tables:       [num_tables, table_stride] int64 block ids; row_table[row] picks the row's table
 * key_begin/end:[rows] the row attends to keys key_begin .. key_end - 1 (key_end = position + 1)
 * span:         the largest key_end - key_begin
 * softcap:      > 0: scores soft-capped (see the header); 0: not
 * Returns 0, -1 for an unsupported shape, -2 when out of memory.
 */
int treadle_paged_attention(
    const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache, int64_t block_size,
    int64_t kv_heads, int64_t head_dim, int64_t group, const int64_t *tables, int64_t table_stride,
    const int64_t *row_table, const int64_t *key_begin, const int64_t *key_end, float scale, float softcap,
    uint16_t *out, int64_t out_stride, int64_t rows, int64_t span, int64_t kv_int8) {
    if (head_dim % LANES != 0 || head_dim > 256 || group > 16) return -1;
    const int64_t items = rows * kv_heads;
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * (size_t)(group * span));
        int64_t *offsets = malloc(sizeof(int64_t) * (size_t)span);
        if (scratch == NULL || offsets == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (scratch != NULL && offsets != NULL)
                attend_item(q, q_stride, k_cache, v_cache, block_size, kv_heads, head_dim, group, tables, table_stride,
                            row_table, key_begin, key_end, scale, softcap, out, out_stride, item / kv_heads, item % kv_heads,
                            scratch, offsets, (int)kv_int8);
        }
        free(scratch);
        free(offsets);
    }
    return failed ? -2 : 0;
}

/*
 * int8 KV rows written in place: row (t, h) of x ([tokens, heads, head_dim], bf16 or float32, token
 * stride x_token_stride elements, heads contiguous) becomes cache row (slots[t], h): head_dim int8
 * values round(x / s), s = max |x| / 127 (half to even; s floored at 1e-30 for the division), then s
 * as float32. The same bits as attention.quantize_kv (torch), in one pass and no temporary.
 */
void treadle_store_int8_rows(const void *x, int64_t x_is_bf16, int64_t x_token_stride, int64_t tokens, int64_t heads,
                             int64_t head_dim, const int64_t *slots, int8_t *cache) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = t * x_token_stride + h * head_dim;
            float v[256], amax = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) {
                v[d] = x_is_bf16 ? bf16_to_f32(((const uint16_t *)x)[at + d]) : ((const float *)x)[at + d];
                const float a = fabsf(v[d]);
                amax = a > amax ? a : amax;
            }
            const float scale = amax / 127.0f;
            const float div = scale > 1e-30f ? scale : 1e-30f;
            int8_t *out = cache + (slots[t] * heads + h) * (head_dim + 4);
            for (int64_t d = 0; d < head_dim; d++) {
                float r = nearbyintf(v[d] / div);
                r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                out[d] = (int8_t)r;
            }
            memcpy(out + head_dim, &scale, sizeof scale);
        }
}
