/* Paged attention, one query token at a time, with a fixed order of every sum.
 *
 * treadle's attention for bfloat16 KV caches. Each work item is one query token and one KV
 * head: its `group` query heads attend over the token's own keys, read through its block table
 * (no gathered copy). The arithmetic of an item depends only on its own query, keys and values:
 * not on how many tokens the call has, which other requests share the step, whether the token is
 * a prompt token or a generated one, how the prompt was chunked or which thread runs it. So a
 * request's numbers are the same whatever its batch (see docs/architecture.md, "Numerics").
 *
 * Every reduction has a fixed order: 16 explicit lanes and a fixed tree at the end, every multiply-add
 * a written fma, and the build lets the compiler neither reassociate (no -ffast-math) nor fuse
 * (-ffp-contract=off). The portable C code states the arithmetic (see "The arithmetic of one item"
 * below); with AVX-512 the same operations run 16 keys or 16 dimensions at a time: 16 keys' dot
 * products reduced together by one transposing tree that adds the same pairs, the exponentials 16 at
 * a time, the value sums held in registers across keys. The two give the same bits (a test builds
 * both). Keys and values are bf16 (widened exactly), the math is float32, the output is rounded to
 * bf16 (round to nearest even), as torch rounds.
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
 *
 * Attention sinks (gpt-oss: one learned logit per query head, sinks != NULL): the sink joins the
 * softmax's denominator and nothing else, p_j = exp(s_j - m) / (sum_j exp(s_j - m) + exp(sink - m))
 * with m the maximum over the scores and the sink, as transformers' eager attention computes it.
 * Without sinks the sink is -inf: the same maximum and sum, so the same bits as before.
 *
 * Keys derived from values (Gemma 4's attention_k_eq_v layers, whose keys are their values times the
 * key norm's weight, rotated: the cache holds the values once, `key_derive`): each key is made from its
 * value row as it is read, x[d] = value[d] * weight[d] (int8: (q[d] * scale) * weight[d]), then rotated
 * in the rotate-half layout by its position's row of the rotary tables (a key's position is its index:
 * the tables' row key_begin + j), k[d] = x[d] * cos[d] - x[d + half] * sin[d] and k[d + half] =
 * x[d + half] * cos[d] + x[d] * sin[d] (each product rounded, then the sum: rowops.c's rotation, so
 * float32 keys made this way equal the model's own), dimensions past 2 * half as they are. The score
 * is then the bf16 key's: dot(q, k) * scale.
 */

#include <math.h>
#include <omp.h>
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
#endif

/* An int8 cache row's scale: the float32 after its head_dim values. */
static inline float row_scale(const int8_t *row, int64_t head_dim) {
    float s;
    memcpy(&s, row + head_dim, sizeof s);
    return s;
}


/* exp(x) for x <= 0 (scores minus their maximum): Cody-Waite reduction, degree-6 polynomial, every
 * multiply-add a written fma (the file is built with -ffp-contract=off, so the compiler adds none).
 * Written without libm so that the vector version below gives the same bits. */
static inline float exp_nonpositive(float x) {
    const float xc = x < -87.0f ? -87.0f : x; /* branch-free, so that the loops below vectorize */
    const float n = floorf(fmaf(xc, 1.44269504088896341f, 0.5f));
    float r = fmaf(-n, 0.693359375f, xc);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.0f / 720.0f;
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

static inline float lane_sum(const float *acc) {
    float t8[8], t4[4], t2[2];
    for (int l = 0; l < 8; l++) t8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];
    for (int l = 0; l < 2; l++) t2[l] = t4[l] + t4[l + 2];
    return t2[0] + t2[1];
}

/* The cache row `offset` elements in (int8 or bf16 elements). */
static inline const void *cache_row(const void *cache, int64_t offset, int kv_int8) {
    return kv_int8 ? (const void *)((const int8_t *)cache + offset) : (const void *)((const uint16_t *)cache + offset);
}

/* a cache row that will be read soon: its cache lines asked for now (a step's KV comes from memory, not
 * the caches; 32 keys ahead) */
static inline void prefetch_row(const void *cache, int64_t offset, int64_t head_dim, int kv_int8) {
    const char *row = cache_row(cache, offset, kv_int8);
    const int64_t bytes = kv_int8 ? head_dim + 4 : 2 * head_dim;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
}

/* One cache row's values, widened exactly. */
static inline void widen_row(const void *row, int64_t head_dim, int kv_int8, float *out) {
    if (kv_int8)
        for (int64_t d = 0; d < head_dim; d++) out[d] = (float)((const int8_t *)row)[d];
    else
        for (int64_t d = 0; d < head_dim; d++) out[d] = bf16_to_f32(((const uint16_t *)row)[d]);
}

/* Keys made from values (see the header): the key norm's weight, the rotary tables by position. */
typedef struct {
    const float *weight;     /* [head_dim] */
    const float *cos, *sin;  /* [positions, half] */
    int64_t half, positions;
} key_derive;

/* The key of position `pos` from its value row (bf16, or an int8 row), as float32. */
static void derive_key(const void *row, int64_t head_dim, int kv_int8, const key_derive *kd, int64_t pos, float *k) {
    float x[512];
    widen_row(row, head_dim, kv_int8, x);
    const float vs = kv_int8 ? row_scale((const int8_t *)row, head_dim) : 1.0f;
    for (int64_t d = 0; d < head_dim; d++) x[d] = (kv_int8 ? x[d] * vs : x[d]) * kd->weight[d];
    const int64_t half = kd->half;
    const float *c = kd->cos + pos * half, *s = kd->sin + pos * half;
    for (int64_t d = 0; d < half; d++) {
        k[d] = x[d] * c[d] - x[d + half] * s[d];
        k[d + half] = x[d + half] * c[d] + x[d] * s[d];
    }
    for (int64_t d = 2 * half; d < head_dim; d++) k[d] = x[d];
}

/* q . k over head_dim: lane l sums q[d] * k[d] for d = l, l + 16, ... (a product, then fmas), then
 * lane_sum's tree; head_dim a multiple of 16. */
static inline float dot(const float *q, const float *k, int64_t head_dim) {
    float acc[LANES];
#pragma omp simd
    for (int l = 0; l < LANES; l++) acc[l] = q[l] * k[l];
    for (int64_t d = LANES; d < head_dim; d += LANES)
#pragma omp simd
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(q[d + l], k[d + l], acc[l]);
    return lane_sum(acc);
}

/*
 * The arithmetic of one item (row `row`, KV head h, its `group` query heads), which every path
 * follows to the bit:
 *   score s[g][j] = dot(q[g], k[j]) * scale (int8: (dot * k_scale[j]) * scale); soft-capped where asked;
 *   m = max_j s; e = exp_nonpositive(s - m); sum = lane_sum of 16 lanes, lane l adding e[j] for
 *   j = l, l + 16, ... in order; out[g][d] = bf16((sum_j e[g][j] * v[j][d], an fma chain in j order
 *   from 0; int8: the weight is e * v_scale[j]) * (1 / sum)).
 * The portable code below is that, written out; the AVX-512 code computes the same operations 16
 * keys or 16 dimensions at a time.
 */
static void scores_portable(const float *qf, const void *k_cache, const int64_t *offsets, int64_t n, int64_t head_dim,
                            int64_t group, float scale, int kv_int8, const key_derive *kd, int64_t begin, float *s) {
    float kf[512];
    for (int64_t j = 0; j < n; j++) {
        const void *k = cache_row(k_cache, offsets[j], kv_int8);
        if (j + 32 < n) prefetch_row(k_cache, offsets[j + 32], head_dim, kv_int8);
        const int scaled = kv_int8 && kd == NULL; /* a derived key is float32, its scale inside */
        if (kd) derive_key(k, head_dim, kv_int8, kd, begin + j, kf);
        else widen_row(k, head_dim, kv_int8, kf);
        const float ks = scaled ? row_scale((const int8_t *)k, head_dim) : 1.0f;
        for (int64_t g = 0; g < group; g++) {
            const float d = dot(qf + g * head_dim, kf, head_dim);
            s[g * n + j] = scaled ? d * ks * scale : d * scale;
        }
    }
}

/* The denominator's sum of the scores' exponentials, plus the sink's (none: sink = -inf). */
static inline float with_sink(float sum, float sink, float m) {
    return sink == -INFINITY ? sum : sum + exp_nonpositive(sink - m);
}

static float softmax_portable(float *s, int64_t n, float sink) {
    float m = sink;
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
    return 1.0f / with_sink(lane_sum(part), sink, m);
}

static void values_portable(const float *p, const void *v_cache, const int64_t *offsets, int64_t n, int64_t head_dim,
                            int64_t group, int kv_int8, float *acc) {
    float vf[512];
    for (int64_t i = 0; i < group * head_dim; i++) acc[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const void *v = cache_row(v_cache, offsets[j], kv_int8);
        if (j + 32 < n) prefetch_row(v_cache, offsets[j + 32], head_dim, kv_int8);
        widen_row(v, head_dim, kv_int8, vf);
        const float vs = kv_int8 ? row_scale((const int8_t *)v, head_dim) : 1.0f;
        for (int64_t g = 0; g < group; g++) {
            const float w = kv_int8 ? p[g * n + j] * vs : p[g * n + j];
            float *a = acc + g * head_dim;
            for (int64_t d = 0; d < head_dim; d++) a[d] = fmaf(w, vf[d], a[d]);
        }
    }
}

#if TREADLE_AVX512
/* 16 elements of a row: kv_int8 0 bf16, 1 int8, 2 float32 (a derived key) */
static inline __m512 widen16(const void *row, int64_t d, int kv_int8) {
    if (kv_int8 == 2) return _mm512_loadu_ps((const float *)row + d);
    return kv_int8 ? load16_i8((const int8_t *)row + d) : load16((const uint16_t *)row + d);
}

/* lane_sum of each of 16 vectors (the same pairs, in the same order), as one vector in a's order */
static inline __m512 lane_sums16(const __m512 *a) {
    __m512 t8[8], t4[4], t2[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: a[2i]'s l + (l + 8); lanes 8-15: a[2i + 1]'s */
        t8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* quarter c: vector 4i + c's l + (l + 4) */
        t4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t8[2 * i], t8[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(t8[2 * i], t8[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* quarter c: vector 8i + c's two, then 8i + 4 + c's two */
        t2[i] = _mm512_add_ps(_mm512_shuffle_ps(t4[2 * i], t4[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(t4[2 * i], t4[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* quarter c: the sums of vectors c, 4 + c, 8 + c, 12 + c */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(t2[0], t2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(t2[0], t2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

/* The 16-lane partial dots of heads g0 .. g0 + G - 1 with one key: lanes[(g0 + g) * 16] (G a constant where inlined) */
static inline __attribute__((always_inline)) void key_dots(const float *qf, const void *k, int64_t head_dim, int kv_int8,
                                                             int G, __m512 *lanes) {
    __m512 a[8];
    const __m512 k0 = widen16(k, 0, kv_int8);
    for (int g = 0; g < G; g++) a[g] = _mm512_mul_ps(_mm512_loadu_ps(qf + g * head_dim), k0);
    for (int64_t d = LANES; d < head_dim; d += LANES) {
        const __m512 kd = widen16(k, d, kv_int8);
        for (int g = 0; g < G; g++) a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * head_dim + d), kd, a[g]);
    }
    for (int g = 0; g < G; g++) lanes[g * 16] = a[g];
}

static void scores_avx512(const float *qf, const void *k_cache, const int64_t *offsets, int64_t n, int64_t head_dim,
                          int64_t group, float scale, int kv_int8, const key_derive *kd, int64_t begin, float *s) {
    __m512 lanes[16 * 16];
    float kf[512];
    const int mode = kd ? 2 : kv_int8, scaled = kv_int8 && kd == NULL; /* a derived key is float32 */
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int c = n - j0 < 16 ? (int)(n - j0) : 16;
        float ks[16];
        for (int jj = 0; jj < 16; jj++) {
            if (jj >= c) {
                for (int64_t g = 0; g < group; g++) lanes[g * 16 + jj] = _mm512_setzero_ps();
                ks[jj] = 1.0f;
                continue;
            }
            const void *k = cache_row(k_cache, offsets[j0 + jj], kv_int8);
            if (j0 + 32 + jj < n) prefetch_row(k_cache, offsets[j0 + 32 + jj], head_dim, kv_int8);
            ks[jj] = scaled ? row_scale((const int8_t *)k, head_dim) : 1.0f;
            if (kd) {
                derive_key(k, head_dim, kv_int8, kd, begin + j0 + jj, kf);
                k = kf;
            }
            for (int64_t g0 = 0; g0 < group; g0 += 8) {
                const float *q = qf + g0 * head_dim;
                __m512 *out = lanes + g0 * 16 + jj;
                switch (group - g0 < 8 ? group - g0 : 8) {
                    case 1: key_dots(q, k, head_dim, mode, 1, out); break;
                    case 2: key_dots(q, k, head_dim, mode, 2, out); break;
                    case 3: key_dots(q, k, head_dim, mode, 3, out); break;
                    case 4: key_dots(q, k, head_dim, mode, 4, out); break;
                    case 5: key_dots(q, k, head_dim, mode, 5, out); break;
                    case 6: key_dots(q, k, head_dim, mode, 6, out); break;
                    case 7: key_dots(q, k, head_dim, mode, 7, out); break;
                    default: key_dots(q, k, head_dim, mode, 8, out); break;
                }
            }
        }
        const __mmask16 valid = (__mmask16)((1u << c) - 1u);
        const __m512 kscale = _mm512_loadu_ps(ks), vscale = _mm512_set1_ps(scale);
        for (int64_t g = 0; g < group; g++) {
            __m512 d = lane_sums16(lanes + g * 16);
            d = scaled ? _mm512_mul_ps(_mm512_mul_ps(d, kscale), vscale) : _mm512_mul_ps(d, vscale);
            _mm512_mask_storeu_ps(s + g * n + j0, valid, d);
        }
    }
}

static inline __m512 exp_nonpositive16(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}

static float softmax_avx512(float *s, int64_t n, float sink) {
    __m512 m16 = _mm512_set1_ps(sink);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(s + j));
    float m = _mm512_reduce_max_ps(m16);
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    const __m512 mv = _mm512_set1_ps(m);
    __m512 part = _mm512_setzero_ps();
    for (j = 0; j < n; j += 16) {
        const __mmask16 valid = n - j < 16 ? (__mmask16)((1u << (n - j)) - 1u) : (__mmask16)0xffff;
        const __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, s + j), mv)));
        _mm512_mask_storeu_ps(s + j, valid, e);
        part = _mm512_add_ps(part, e);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, part);
    return 1.0f / with_sink(lane_sum(lanes), sink, m);
}

/* acc[g0 + g][d0 .. d0 + 16 NV) over every key (G, NV constants where inlined) */
static inline __attribute__((always_inline)) void value_block(const float *p, const void *v_cache, const int64_t *offsets,
                                                                int64_t n, int64_t head_dim, int kv_int8, int64_t g0, int G,
                                                                int64_t d0, int NV, float *acc) {
    __m512 a[4][4];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < NV; i++) a[g][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const void *v = cache_row(v_cache, offsets[j], kv_int8);
        if (j + 32 < n) prefetch_row(v_cache, offsets[j + 32], head_dim, kv_int8);
        __m512 x[4];
        for (int i = 0; i < NV; i++) x[i] = widen16(v, d0 + 16 * i, kv_int8);
        const float vs = kv_int8 ? row_scale((const int8_t *)v, head_dim) : 1.0f;
        for (int g = 0; g < G; g++) {
            const float pj = p[(g0 + g) * n + j];
            const __m512 w = _mm512_set1_ps(kv_int8 ? pj * vs : pj);
            for (int i = 0; i < NV; i++) a[g][i] = _mm512_fmadd_ps(w, x[i], a[g][i]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < NV; i++) _mm512_storeu_ps(acc + (g0 + g) * head_dim + d0 + 16 * i, a[g][i]);
}

#define TREADLE_VALUE_BLOCK(G) \
    switch (nv) { \
        case 1: value_block(p, v_cache, offsets, n, head_dim, kv_int8, g0, G, d0, 1, acc); break; \
        case 2: value_block(p, v_cache, offsets, n, head_dim, kv_int8, g0, G, d0, 2, acc); break; \
        case 3: value_block(p, v_cache, offsets, n, head_dim, kv_int8, g0, G, d0, 3, acc); break; \
        default: value_block(p, v_cache, offsets, n, head_dim, kv_int8, g0, G, d0, 4, acc); break; \
    }

static void values_avx512(const float *p, const void *v_cache, const int64_t *offsets, int64_t n, int64_t head_dim,
                          int64_t group, int kv_int8, float *acc) {
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        const int nv = head_dim - d0 < 64 ? (int)((head_dim - d0) / 16) : 4;
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            switch (group - g0 < 4 ? group - g0 : 4) {
                case 1: TREADLE_VALUE_BLOCK(1) break;
                case 2: TREADLE_VALUE_BLOCK(2) break;
                case 3: TREADLE_VALUE_BLOCK(3) break;
                default: TREADLE_VALUE_BLOCK(4) break;
            }
        }
    }
}
#undef TREADLE_VALUE_BLOCK
#define SCORES scores_avx512
#define SOFTMAX softmax_avx512
#define VALUES values_avx512
#else
#define SCORES scores_portable
#define SOFTMAX softmax_portable
#define VALUES values_portable
#endif

/*
 * One item: row `row`, KV head `h`. scratch holds group * span floats, offsets span slots.
 * kv_int8: the caches are int8 rows of head_dim + 4 bytes (values, then the scale), else bf16.
 */
static void attend_item(
    const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache, int64_t block_size,
    int64_t block_stride, int64_t kv_heads, int64_t head_dim, int64_t group, const int64_t *tables, int64_t table_stride,
    const int64_t *row_table, const int64_t *key_begin, const int64_t *key_end, float scale, float softcap,
    const float *sinks, uint16_t *out, int64_t out_stride, int64_t row, int64_t h, float *scratch, int64_t *offsets,
    int kv_int8, const key_derive *kd) {
    enum { MAX_GROUP = 16, MAX_DIM = 512 };
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
        for (int64_t slot = first; slot < stop; slot++) offsets[j++] = block * block_stride + slot * slot_stride + h * row_elems;
        pos += stop - first;
    }
    float inv[MAX_GROUP];
    SCORES(qf, k_cache, offsets, n, head_dim, group, scale, kv_int8, kd, begin, scratch);
    if (softcap > 0.0f)
        for (int64_t i = 0; i < group * n; i++) scratch[i] = softcap * tanhf(scratch[i] / softcap);
    for (int64_t g = 0; g < group; g++) inv[g] = SOFTMAX(scratch + g * n, n, sinks ? sinks[h * group + g] : -INFINITY);
    VALUES(scratch, v_cache, offsets, n, head_dim, group, kv_int8, acc);
    for (int64_t g = 0; g < group; g++) {
        uint16_t *o = out + row * out_stride + (h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) o[d] = f32_to_bf16(acc[g * head_dim + d] * inv[g]);
    }
}

/* The first item whose cost starts at or after `cost` (ends[r]: the cost of rows before r, whose
 * kv_heads items cost the same each); items run row by row, heads within a row. */
static int64_t first_item(const int64_t *ends, int64_t rows, int64_t kv_heads, int64_t cost) {
    int64_t lo = 0, hi = rows; /* the row holding `cost`: ends[lo] <= cost < ends[lo + 1] */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (ends[mid] <= cost) lo = mid;
        else hi = mid;
    }
    if (cost >= ends[rows]) return rows * kv_heads;
    const int64_t each = (ends[lo + 1] - ends[lo]) / kv_heads;
    return lo * kv_heads + (cost - ends[lo] + each - 1) / each;
}

/*
 * All rows x kv_heads items, split over the OpenMP threads (torch's own pool: the library is linked
 * against the libgomp torch has already loaded) in contiguous runs of about equal cost, so that a
 * prompt's later rows, which have more keys, are shared out too. Which thread runs an item does not
 * change its arithmetic.
 * q, out:       [rows, kv_heads * group, head_dim] bf16, row strides q_stride / out_stride (elements)
 * k/v_cache:    [num_blocks, block_size, kv_heads, head_dim] bf16, or with kv_int8
 *               [num_blocks, block_size, kv_heads, head_dim + 4] int8 (values, then a float32 scale);
 *               block_stride elements from one block to the next (block_size * kv_heads * row where
 *               the cache is a tensor of its own; a page's size where it is a view into a mixed pool)
 * tables:       [num_tables, table_stride] int64 block ids; row_table[row] picks the row's table
 * key_begin/end:[rows] the row attends to keys key_begin .. key_end - 1 (key_end = position + 1)
 * span:         the largest key_end - key_begin
 * softcap:      > 0: scores soft-capped (see the header); 0: not
 * sinks:        NULL, or [kv_heads * group] float32: each query head's sink logit (see the header)
 * key_weight:   NULL, or [head_dim] float32: the keys are derived from the values (see the header;
 *               k_cache is then not read), rotated by rot_cos / rot_sin [rot_positions, rot_half] float32
 * Returns 0, -1 for an unsupported shape, -2 when out of memory, -3 for a key past the rotary tables.
 */
int treadle_paged_attention_derived(
    const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache, int64_t block_size,
    int64_t block_stride, int64_t kv_heads, int64_t head_dim, int64_t group, const int64_t *tables, int64_t table_stride,
    const int64_t *row_table, const int64_t *key_begin, const int64_t *key_end, float scale, float softcap,
    const float *sinks, uint16_t *out, int64_t out_stride, int64_t rows, int64_t span, int64_t kv_int8,
    const float *key_weight, const float *rot_cos, const float *rot_sin, int64_t rot_half, int64_t rot_positions) {
    if (head_dim % LANES != 0 || head_dim > 512 || group > 16) return -1;
    const key_derive derive = {key_weight, rot_cos, rot_sin, rot_half, rot_positions};
    const key_derive *kd = key_weight ? &derive : NULL;
    if (kd) {
        k_cache = v_cache; /* each key is made from its value row */
        if (2 * rot_half > head_dim) return -1;
        for (int64_t r = 0; r < rows; r++)
            if (key_end[r] > rot_positions) return -3; /* a key past the rotary tables */
    }
    /* each thread takes one contiguous run of items of about equal cost (keys, plus a fixed share) */
    int64_t *ends = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    if (ends == NULL) return -2;
    ends[0] = 0;
    for (int64_t r = 0; r < rows; r++) ends[r + 1] = ends[r] + (key_end[r] - key_begin[r] + 16) * kv_heads;
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * (size_t)(group * span));
        int64_t *offsets = malloc(sizeof(int64_t) * (size_t)span);
        if (scratch == NULL || offsets == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
            const int64_t first = first_item(ends, rows, kv_heads, ends[rows] * t / threads);
            const int64_t last = first_item(ends, rows, kv_heads, ends[rows] * (t + 1) / threads);
            for (int64_t item = first; item < last; item++)
                attend_item(q, q_stride, k_cache, v_cache, block_size, block_stride, kv_heads, head_dim, group, tables, table_stride,
                            row_table, key_begin, key_end, scale, softcap, sinks, out, out_stride, item / kv_heads, item % kv_heads,
                            scratch, offsets, (int)kv_int8, kd);
        }
        free(scratch);
        free(offsets);
    }
    free(ends);
    return failed ? -2 : 0;
}

/* Every key from the key cache (no derived keys): the C layer path's entry (decoder.c). */
int treadle_paged_attention(
    const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache, int64_t block_size,
    int64_t block_stride, int64_t kv_heads, int64_t head_dim, int64_t group, const int64_t *tables, int64_t table_stride,
    const int64_t *row_table, const int64_t *key_begin, const int64_t *key_end, float scale, float softcap,
    const float *sinks, uint16_t *out, int64_t out_stride, int64_t rows, int64_t span, int64_t kv_int8) {
    return treadle_paged_attention_derived(q, q_stride, k_cache, v_cache, block_size, block_stride, kv_heads, head_dim, group,
                                           tables, table_stride, row_table, key_begin, key_end, scale, softcap, sinks, out,
                                           out_stride, rows, span, kv_int8, NULL, NULL, NULL, 0, 0);
}

/*
 * int8 KV rows written in place: row (t, h) of x ([tokens, heads, head_dim], bf16 or float32, token
 * stride x_token_stride elements, heads contiguous) becomes cache row (slots[t], h): head_dim int8
 * values round(x / s), s = max |x| / 127 (half to even; s floored at 1e-30 for the division), then s
 * as float32. The same bits as attention.quantize_kv (torch), in one pass and no temporary.
 */
void treadle_store_int8_rows(const void *x, int64_t x_is_bf16, int64_t x_token_stride, int64_t tokens, int64_t heads,
                             int64_t head_dim, const int64_t *slots, int8_t *cache, int64_t block_size,
                             int64_t block_stride) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = t * x_token_stride + h * head_dim;
            float v[512], amax = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) {
                v[d] = x_is_bf16 ? bf16_to_f32(((const uint16_t *)x)[at + d]) : ((const float *)x)[at + d];
                const float a = fabsf(v[d]);
                amax = a > amax ? a : amax;
            }
            const float scale = amax / 127.0f;
            const float div = scale > 1e-30f ? scale : 1e-30f;
            int8_t *out = cache + slots[t] / block_size * block_stride + ((slots[t] % block_size) * heads + h) * (head_dim + 4);
            for (int64_t d = 0; d < head_dim; d++) {
                float r = nearbyintf(v[d] / div);
                r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                out[d] = (int8_t)r;
            }
            memcpy(out + head_dim, &scale, sizeof scale);
        }
}
