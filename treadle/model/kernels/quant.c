/* Matrix products with weights held as GGUF's quantized blocks, at the file's bits.
 *
 * A weight row is a run of blocks (32 values for Q4_0 ... Q8_0 and IQ4_NL, 256 for the K-quants
 * and IQ4_XS). Every type is read through one unpacking rule: block -> unsigned integers `uq`
 * (one byte per value), a float scale per group of 4 values (`s4`) and, for the types with a
 * minimum, a float minimum per group of 4 (`m4`). The value is
 *
 *     w = s4 * (float)(uq - off) - m4        (the type's constant offset `off`)
 *
 * computed exactly as gguf-py's `gguf.quants.dequantize` computes it (same float32 products and
 * differences, in the same order; this file is built with -ffp-contract=off so the compiler fuses
 * nothing it was not told to), so the weights used are the file's, bit for bit.
 *
 * Two products, chosen by the model's dtype, each the same arithmetic for every row whatever the
 * number of rows M, the thread that runs it or the instruction set:
 *
 * - float32 (`treadle_q_matmul_f32`): y = x . w with w dequantized exactly; 16 lanes, element e
 *   into lane e % 16 with a fused multiply-add, then a fixed tree (8, 4, 2, 1).
 * - int8 activations (`treadle_q_matmul_q8`, for bfloat16 / float16 models, as llama.cpp's CPU
 *   backend does): each row of x is quantized per 32 values to int8 with scale amax / 127 (round
 *   to nearest even); each group of 4 values gives an exact integer sum
 *       iq = sum(uq * xq) - off * sum(xq)
 *   and lane (quad % 16) accumulates  fma((float)iq, s4 * dx, acc)  then, with a minimum,
 *   fma(-m4, sum(xq) * dx, acc); the same fixed tree at the end.
 *
 * The instruction-set paths (AVX-512 VNNI, AVX2, portable C) compute these same operations in the
 * same order, so they give the same bits; the caller picks one (`isa`). Rows of the weight are
 * split across torch's OpenMP threads; one thread computes each output whole.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#define LANES 16
#define M_TILE 32 /* rows of x per pass over an unpacked weight row */

enum {
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23,
};
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512_VNNI = 2 };

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalize */
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* ---- unpacking: block -> uq (elems bytes), s4 (elems/4 floats), m4 (elems/4 floats, if any) ---- */

static inline void fill(float *dst, float v, int n) {
    for (int i = 0; i < n; i++) dst[i] = v;
}

static void unpack_q4_0(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    (void)m4;
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        uq[j] = qs[j] & 15;
        uq[j + 16] = qs[j] >> 4;
    }
    fill(s4, f16_to_f32(b), 8);
}

static void unpack_q4_1(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        uq[j] = qs[j] & 15;
        uq[j + 16] = qs[j] >> 4;
    }
    fill(s4, f16_to_f32(b), 8);
    fill(m4, -f16_to_f32(b + 2), 8); /* w = d*q + m  ==  d*q - (-m) */
}

static inline void unpack5(const uint8_t *qhp, const uint8_t *qs, uint8_t *uq) {
    uint32_t qh = (uint32_t)qhp[0] | ((uint32_t)qhp[1] << 8) | ((uint32_t)qhp[2] << 16) | ((uint32_t)qhp[3] << 24);
    for (int j = 0; j < 16; j++) {
        uq[j] = (uint8_t)((qs[j] & 15) | (((qh >> j) & 1) << 4));
        uq[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
}

static void unpack_q5_0(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    (void)m4;
    unpack5(b + 2, b + 6, uq);
    fill(s4, f16_to_f32(b), 8);
}

static void unpack_q5_1(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    unpack5(b + 4, b + 8, uq);
    fill(s4, f16_to_f32(b), 8);
    fill(m4, -f16_to_f32(b + 2), 8);
}

static void unpack_q8_0(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    (void)m4;
    for (int j = 0; j < 32; j++) uq[j] = b[2 + j] ^ 0x80; /* int8 q + 128 */
    fill(s4, f16_to_f32(b), 8);
}

static void unpack_iq4_nl(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    (void)m4;
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        uq[j] = (uint8_t)(IQ4_VALUES[qs[j] & 15] + 128);
        uq[j + 16] = (uint8_t)(IQ4_VALUES[qs[j] >> 4] + 128);
    }
    fill(s4, f16_to_f32(b), 8);
}

static void unpack_q2_k(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    const uint8_t *scales = b, *qs = b + 16;
    float d = f16_to_f32(b + 80), dmin = f16_to_f32(b + 82);
    for (int half = 0; half < 2; half++)
        for (int s = 0; s < 4; s++)
            for (int j = 0; j < 32; j++) uq[half * 128 + s * 32 + j] = (qs[half * 32 + j] >> (2 * s)) & 3;
    for (int i = 0; i < 16; i++) {
        fill(s4 + 4 * i, d * (float)(scales[i] & 15), 4);
        fill(m4 + 4 * i, dmin * (float)(scales[i] >> 4), 4);
    }
}

static void unpack_q3_k(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    (void)m4;
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    float d = f16_to_f32(b + 108);
    for (int half = 0; half < 2; half++)
        for (int s = 0; s < 4; s++)
            for (int j = 0; j < 32; j++) uq[half * 128 + s * 32 + j] = (qs[half * 32 + j] >> (2 * s)) & 3;
    for (int bit = 0; bit < 8; bit++)
        for (int j = 0; j < 32; j++) uq[bit * 32 + j] += (uint8_t)(((hmask[j] >> bit) & 1) << 2);
    for (int i = 0; i < 16; i++) {
        int low = (sc[i & 7] >> (4 * (i >> 3))) & 15, high = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        fill(s4 + 4 * i, d * (float)((low | (high << 4)) - 32), 4);
    }
}

static inline void k_scale_min(const uint8_t *s, int i, int *sc, int *mn) {
    if (i < 4) {
        *sc = s[i] & 63;
        *mn = s[i + 4] & 63;
    } else {
        *sc = (s[i + 4] & 15) | ((s[i - 4] >> 2) & 0x30);
        *mn = (s[i + 4] >> 4) | ((s[i] >> 2) & 0x30);
    }
}

static void unpack_q4_k(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    const uint8_t *qs = b + 16;
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 32; j++) {
            uq[c * 64 + j] = qs[c * 32 + j] & 15;
            uq[c * 64 + 32 + j] = qs[c * 32 + j] >> 4;
        }
    for (int i = 0; i < 8; i++) {
        int sc, mn;
        k_scale_min(b + 4, i, &sc, &mn);
        fill(s4 + 8 * i, d * (float)sc, 8);
        fill(m4 + 8 * i, dmin * (float)mn, 8);
    }
}

static void unpack_q5_k(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 32; j++) {
            uq[c * 64 + j] = qs[c * 32 + j] & 15;
            uq[c * 64 + 32 + j] = qs[c * 32 + j] >> 4;
        }
    for (int bit = 0; bit < 8; bit++)
        for (int j = 0; j < 32; j++) uq[bit * 32 + j] |= (uint8_t)(((qh[j] >> bit) & 1) << 4);
    for (int i = 0; i < 8; i++) {
        int sc, mn;
        k_scale_min(b + 4, i, &sc, &mn);
        fill(s4 + 8 * i, d * (float)sc, 8);
        fill(m4 + 8 * i, dmin * (float)mn, 8);
    }
}

static void unpack_q6_k(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    (void)m4;
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16_to_f32(b + 208);
    for (int half = 0; half < 2; half++) {
        for (int j = 0; j < 64; j++) {
            uq[half * 128 + j] = ql[half * 64 + j] & 15;
            uq[half * 128 + 64 + j] = ql[half * 64 + j] >> 4;
        }
        for (int t = 0; t < 4; t++)
            for (int j = 0; j < 32; j++) uq[half * 128 + t * 32 + j] |= (uint8_t)(((qh[half * 32 + j] >> (2 * t)) & 3) << 4);
    }
    for (int i = 0; i < 16; i++) fill(s4 + 4 * i, d * (float)sc[i], 4);
}

static void unpack_iq4_xs(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    (void)m4;
    float d = f16_to_f32(b);
    uint16_t sh = (uint16_t)(b[2] | (b[3] << 8));
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
        fill(s4 + 8 * ib, d * (float)(ls - 32), 8);
        for (int j = 0; j < 16; j++) {
            uq[ib * 32 + j] = (uint8_t)(IQ4_VALUES[qs[ib * 16 + j] & 15] + 128);
            uq[ib * 32 + 16 + j] = (uint8_t)(IQ4_VALUES[qs[ib * 16 + j] >> 4] + 128);
        }
    }
}

typedef void (*unpack_fn)(const uint8_t *, uint8_t *, float *, float *);

typedef struct {
    int elems, bytes, off, shift, has_min; /* off = 1 << shift, or 0 */
    unpack_fn unpack;
} qtype;

static int qtype_of(int type, qtype *t) {
    switch (type) {
    case T_Q4_0: *t = (qtype){32, 18, 8, 3, 0, unpack_q4_0}; return 0;
    case T_Q4_1: *t = (qtype){32, 20, 0, 0, 1, unpack_q4_1}; return 0;
    case T_Q5_0: *t = (qtype){32, 22, 16, 4, 0, unpack_q5_0}; return 0;
    case T_Q5_1: *t = (qtype){32, 24, 0, 0, 1, unpack_q5_1}; return 0;
    case T_Q8_0: *t = (qtype){32, 34, 128, 7, 0, unpack_q8_0}; return 0;
    case T_IQ4_NL: *t = (qtype){32, 18, 128, 7, 0, unpack_iq4_nl}; return 0;
    case T_Q2_K: *t = (qtype){256, 84, 0, 0, 1, unpack_q2_k}; return 0;
    case T_Q3_K: *t = (qtype){256, 110, 4, 2, 0, unpack_q3_k}; return 0;
    case T_Q4_K: *t = (qtype){256, 144, 0, 0, 1, unpack_q4_k}; return 0;
    case T_Q5_K: *t = (qtype){256, 176, 0, 0, 1, unpack_q5_k}; return 0;
    case T_Q6_K: *t = (qtype){256, 210, 32, 5, 0, unpack_q6_k}; return 0;
    case T_IQ4_XS: *t = (qtype){256, 136, 128, 7, 0, unpack_iq4_xs}; return 0;
    default: return -1;
    }
}

/* One weight row, unpacked: K bytes of uq, K/4 floats of s4 (and of m4). */
static void unpack_row(const qtype *t, const uint8_t *row, int64_t K, uint8_t *uq, float *s4, float *m4) {
    for (int64_t e = 0; e < K; e += t->elems) t->unpack(row + (e / t->elems) * t->bytes, uq + e, s4 + e / 4, m4 + e / 4);
}

/* w = s4 * (uq - off) - m4, exactly as gguf.quants.dequantize */
static void dequantize_unpacked(const qtype *t, int64_t K, const uint8_t *uq, const float *s4, const float *m4, float *w) {
    for (int64_t e = 0; e < K; e++) {
        float v = s4[e / 4] * (float)((int)uq[e] - t->off);
        w[e] = t->has_min ? v - m4[e / 4] : v;
    }
}

/* ---- the fixed final tree ---- */

static inline float reduce16(float *acc) {
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))

TARGET_VNNI static inline float reduce512(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));       /* l + 8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));          /* l + 4 */
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                           /* l + 2 */
    __m128 e = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));                                       /* l + 1 */
    return _mm_cvtss_f32(e);
}

TARGET_AVX2 static inline float reduce256x2(__m256 lo, __m256 hi) {
    __m256 a = _mm256_add_ps(lo, hi);
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    __m128 e = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));
    return _mm_cvtss_f32(e);
}

/* ---- float32 activations, exact weights ---- */

static float dot_f32_portable(const float *x, const float *w, int64_t K) {
    float acc[LANES] = {0};
    for (int64_t e = 0; e < K; e++) acc[e % LANES] = fmaf(x[e], w[e], acc[e % LANES]);
    return reduce16(acc);
}

TARGET_VNNI static float dot_f32_avx512(const float *x, const float *w, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    int64_t e = 0;
    for (; e + 16 <= K; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + e), _mm512_loadu_ps(w + e), acc);
    if (e < K) {
        __mmask16 k = (__mmask16)((1u << (K - e)) - 1);
        acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(k, x + e), _mm512_maskz_loadu_ps(k, w + e), acc, k);
    }
    return reduce512(acc);
}

TARGET_AVX2 static float dot_f32_avx2(const float *x, const float *w, int64_t K) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    int64_t e = 0;
    for (; e + 16 <= K; e += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(x + e), _mm256_loadu_ps(w + e), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(x + e + 8), _mm256_loadu_ps(w + e + 8), hi);
    }
    if (e < K) { /* K is a multiple of 32, so never reached; kept exact anyway */
        float acc[LANES];
        _mm256_storeu_ps(acc, lo);
        _mm256_storeu_ps(acc + 8, hi);
        for (; e < K; e++) acc[e % LANES] = fmaf(x[e], w[e], acc[e % LANES]);
        return reduce16(acc);
    }
    return reduce256x2(lo, hi);
}

/* ---- int8 activations ---- */

typedef struct {
    int8_t *xq;   /* [K] */
    float *dx4;   /* [K/4]: the 32-group's scale, per quad */
    int32_t *xoff4; /* [K/4]: -off * (sum of the quad's xq), the weight type's offset folded in */
    float *xsd4;    /* [K/4]: (sum of the quad's xq) * dx4 */
} qrow;

static void quantize_row(const void *x, int x_bf16, int64_t K, int off, qrow r) {
    for (int64_t g = 0; g < K; g += 32) {
        float v[32], amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            v[j] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[g + j]) : ((const float *)x)[g + j];
            float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; j++) r.xq[g + j] = (int8_t)nearbyintf(v[j] * id);
        for (int q = 0; q < 8; q++) {
            int32_t s = 0;
            for (int t = 0; t < 4; t++) s += r.xq[g + 4 * q + t];
            r.dx4[g / 4 + q] = d;
            r.xoff4[g / 4 + q] = -off * s;
            r.xsd4[g / 4 + q] = (float)s * d;
        }
    }
}

static float dot_q8_portable(const qtype *t, const uint8_t *uq, const float *s4, const float *m4, qrow r, int64_t K) {
    float acc[LANES] = {0};
    for (int64_t q = 0; q < K / 4; q++) {
        int32_t iq = r.xoff4[q];
        for (int i = 0; i < 4; i++) iq += (int32_t)uq[4 * q + i] * (int32_t)r.xq[4 * q + i];
        int l = (int)(q % LANES);
        acc[l] = fmaf((float)iq, s4[q] * r.dx4[q], acc[l]);
        if (t->has_min) acc[l] = fmaf(-m4[q], r.xsd4[q], acc[l]);
    }
    return reduce16(acc);
}

TARGET_VNNI static float dot_q8_vnni(const qtype *t, const uint8_t *uq, const float *s4, const float *m4, qrow r, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    const int64_t quads = K / 4;
    for (int64_t q = 0; q < quads; q += 16) {
        __mmask16 k = quads - q >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (quads - q)) - 1);
        __mmask64 kb = quads - q >= 16 ? ~(__mmask64)0 : (((__mmask64)1 << (4 * (quads - q))) - 1);
        __m512i init = t->shift ? _mm512_maskz_loadu_epi32(k, r.xoff4 + q) : zero;
        __m512i iq = _mm512_dpbusd_epi32(init, _mm512_maskz_loadu_epi8(kb, uq + 4 * q), _mm512_maskz_loadu_epi8(kb, r.xq + 4 * q));
        __m512 sdx = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s4 + q), _mm512_maskz_loadu_ps(k, r.dx4 + q));
        acc = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(iq), sdx, acc, k);
        if (t->has_min) acc = _mm512_mask3_fnmadd_ps(_mm512_maskz_loadu_ps(k, m4 + q), _mm512_maskz_loadu_ps(k, r.xsd4 + q), acc, k);
    }
    return reduce512(acc);
}

TARGET_AVX2 static inline __m256i quads_avx2(const uint8_t *u, const int8_t *x) {
    /* 8 exact sums of 4 products u8 * s8 (values 32) */
    __m256i pa = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)u)),
                                   _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x)));
    __m256i pb = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(u + 16))),
                                   _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + 16))));
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(pa, pb), 0xD8);
}

TARGET_AVX2 static inline __m256 step_avx2(const qtype *t, const uint8_t *uq, const float *s4, const float *m4, qrow r, int64_t q, __m256 acc) {
    __m256i iq = quads_avx2(uq + 4 * q, r.xq + 4 * q);
    if (t->shift) iq = _mm256_add_epi32(iq, _mm256_loadu_si256((const __m256i *)(r.xoff4 + q)));
    __m256 sdx = _mm256_mul_ps(_mm256_loadu_ps(s4 + q), _mm256_loadu_ps(r.dx4 + q));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iq), sdx, acc);
    if (t->has_min) acc = _mm256_fnmadd_ps(_mm256_loadu_ps(m4 + q), _mm256_loadu_ps(r.xsd4 + q), acc);
    return acc;
}

TARGET_AVX2 static float dot_q8_avx2(const qtype *t, const uint8_t *uq, const float *s4, const float *m4, qrow r, int64_t K) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    const int64_t quads = K / 4; /* a multiple of 8 */
    for (int64_t q = 0; q < quads; q += 16) {
        lo = step_avx2(t, uq, s4, m4, r, q, lo);
        if (q + 8 < quads) hi = step_avx2(t, uq, s4, m4, r, q + 8, hi);
    }
    return reduce256x2(lo, hi);
}

/* ---- AVX-512 unpacking of whole rows, for the common types (the same bytes and floats as the
 * block functions above, written with vector instructions) ---- */

#define TARGET_FAST __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

TARGET_FAST static inline float f16_fast(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

TARGET_FAST static inline __m256i nibbles32(const uint8_t *qs) { /* 16 bytes -> low nibbles, then high nibbles */
    __m128i q = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

/* the 32 unsigned values of one Q4_0 / Q4_1 / Q5_0 / Q5_1 block */
TARGET_FAST static inline __m256i block32(int type, const uint8_t *blk) {
    switch (type) {
    case T_Q4_0: return nibbles32(blk + 2);
    case T_Q4_1: return nibbles32(blk + 4);
    default: {
        const int with_min = type == T_Q5_1;
        uint32_t qh;
        memcpy(&qh, blk + (with_min ? 4 : 2), 4);
        return _mm256_or_si256(nibbles32(blk + (with_min ? 8 : 6)), _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(16)));
    }
    }
}

TARGET_FAST static void unpack_row_fast(int type, const uint8_t *row, int64_t K, uint8_t *uq, float *s4, float *m4) {
    if (type == T_Q8_0) {
        const __m512i x80 = _mm512_set1_epi8((char)0x80);
        int64_t e = 0;
        for (; e + 32 < K; e += 64) { /* two blocks: one 64-byte store each, which the dot reads back whole */
            const uint8_t *b0 = row + (e / 32) * 34, *b1 = b0 + 34;
            __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                           _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
            _mm512_storeu_si512((void *)(uq + e), _mm512_xor_si512(v, x80));
            _mm512_storeu_ps(s4 + e / 4, _mm512_insertf32x8(_mm512_set1_ps(f16_fast(b0)), _mm256_set1_ps(f16_fast(b1)), 1));
        }
        if (e < K) {
            const uint8_t *b0 = row + (e / 32) * 34;
            _mm256_storeu_si256((__m256i *)(uq + e), _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b0 + 2)), _mm512_castsi512_si256(x80)));
            _mm256_storeu_ps(s4 + e / 4, _mm256_set1_ps(f16_fast(b0)));
        }
        return;
    }
    if (type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1) {
        const int size = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
        const int with_min = type == T_Q4_1 || type == T_Q5_1;
        for (int64_t e = 0; e < K; e += 64) {
            const uint8_t *b0 = row + (e / 32) * size;
            if (e + 32 < K) { /* two blocks: one 64-byte store each, which the dot reads back whole */
                const uint8_t *b1 = b0 + size;
                _mm512_storeu_si512((void *)(uq + e), _mm512_inserti64x4(_mm512_castsi256_si512(block32(type, b0)), block32(type, b1), 1));
                _mm512_storeu_ps(s4 + e / 4, _mm512_insertf32x8(_mm512_set1_ps(f16_fast(b0)), _mm256_set1_ps(f16_fast(b1)), 1));
                if (with_min) _mm512_storeu_ps(m4 + e / 4, _mm512_insertf32x8(_mm512_set1_ps(-f16_fast(b0 + 2)), _mm256_set1_ps(-f16_fast(b1 + 2)), 1));
            } else {
                _mm256_storeu_si256((__m256i *)(uq + e), block32(type, b0));
                _mm256_storeu_ps(s4 + e / 4, _mm256_set1_ps(f16_fast(b0)));
                if (with_min) _mm256_storeu_ps(m4 + e / 4, _mm256_set1_ps(-f16_fast(b0 + 2)));
            }
        }
        return;
    }
    const __m256i m15 = _mm256_set1_epi8(15), x10 = _mm256_set1_epi8(16);
    for (int64_t e = 0; e < K;) { /* the K-quants */
        switch (type) {
        case T_Q4_K: case T_Q5_K: {
            const int q5 = type == T_Q5_K;
            const uint8_t *blk = row + (e / 256) * (q5 ? 176 : 144), *qs = blk + (q5 ? 48 : 16);
            const float d = f16_fast(blk), dmin = f16_fast(blk + 2);
            const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m256i lo = _mm256_and_si256(q, m15), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
                if (q5) {
                    lo = _mm256_or_si256(lo, _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * c)))), x10));
                    hi = _mm256_or_si256(hi, _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * c + 1)))), x10));
                }
                /* one 64-byte store per 64 values: the dot's 64-byte loads are forwarded from it */
                _mm512_storeu_si512((void *)(uq + e + 64 * c), _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
            }
            for (int i = 0; i < 8; i += 2) {
                int sc0, mn0, sc1, mn1;
                k_scale_min(blk + 4, i, &sc0, &mn0);
                k_scale_min(blk + 4, i + 1, &sc1, &mn1);
                _mm512_storeu_ps(s4 + e / 4 + 8 * i, _mm512_insertf32x8(_mm512_set1_ps(d * (float)sc0), _mm256_set1_ps(d * (float)sc1), 1));
                _mm512_storeu_ps(m4 + e / 4 + 8 * i, _mm512_insertf32x8(_mm512_set1_ps(dmin * (float)mn0), _mm256_set1_ps(dmin * (float)mn1), 1));
            }
            e += 256;
            break;
        }
        case T_Q6_K: {
            const uint8_t *blk = row + (e / 256) * 210;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = f16_fast(blk + 208);
            for (int half = 0; half < 2; half++) {
                __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half)), los[2], his[2];
                for (int c = 0; c < 2; c++) {
                    __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 64 * half + 32 * c));
                    __m256i lo = _mm256_and_si256(q, m15), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
                    /* element half*128 + t*32 + j takes bits 2t of qh[j]: lo covers t = c, hi t = c + 2 */
                    __m256i hl = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), _mm256_set1_epi8(3));
                    __m256i hh = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 4), _mm256_set1_epi8(3));
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(hl, 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(hh, 4));
                    los[c] = lo, his[c] = hi;
                }
                /* one 64-byte store per 64 values: the dot's 64-byte loads are forwarded from it */
                _mm512_storeu_si512((void *)(uq + e + 128 * half), _mm512_inserti64x4(_mm512_castsi256_si512(los[0]), los[1], 1));
                _mm512_storeu_si512((void *)(uq + e + 128 * half + 64), _mm512_inserti64x4(_mm512_castsi256_si512(his[0]), his[1], 1));
            }
            for (int i = 0; i < 16; i += 4) {
                __m128 a0 = _mm_set1_ps(d * (float)sc[i]), a1 = _mm_set1_ps(d * (float)sc[i + 1]);
                __m128 a2 = _mm_set1_ps(d * (float)sc[i + 2]), a3 = _mm_set1_ps(d * (float)sc[i + 3]);
                __m512 v = _mm512_insertf32x4(_mm512_insertf32x4(_mm512_insertf32x4(_mm512_castps128_ps512(a0), a1, 1), a2, 2), a3, 3);
                _mm512_storeu_ps(s4 + e / 4 + 4 * i, v);
            }
            e += 256;
            break;
        }
        default: /* only the types has_fast_unpack() names come here */
            return;
        }
    }
}

static int has_fast_unpack(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K ||
           type == T_Q6_K;
}

/* Four rows of x against one unpacked weight row: each row's operations exactly as dot_q8_vnni's. */
TARGET_VNNI static void dot4_q8_vnni(const qtype *t, const uint8_t *uq, const float *s4, const float *m4, const qrow *r, int64_t K, float *out) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    const __m512i zero = _mm512_setzero_si512();
    const int64_t quads = K / 4;
    for (int64_t q = 0; q < quads; q += 16) {
        __mmask16 k = quads - q >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (quads - q)) - 1);
        __mmask64 kb = quads - q >= 16 ? ~(__mmask64)0 : (((__mmask64)1 << (4 * (quads - q))) - 1);
        const __m512i u = _mm512_maskz_loadu_epi8(kb, uq + 4 * q);
        const __m512 s = _mm512_maskz_loadu_ps(k, s4 + q);
        const __m512 mn = t->has_min ? _mm512_maskz_loadu_ps(k, m4 + q) : _mm512_setzero_ps();
#define ROW(i, acc)                                                                                                            \
    do {                                                                                                                       \
        __m512i init = t->shift ? _mm512_maskz_loadu_epi32(k, r[i].xoff4 + q) : zero;                                          \
        __m512i iq = _mm512_dpbusd_epi32(init, u, _mm512_maskz_loadu_epi8(kb, r[i].xq + 4 * q));                               \
        acc = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(iq), _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, r[i].dx4 + q)), acc, k); \
        if (t->has_min) acc = _mm512_mask3_fnmadd_ps(mn, _mm512_maskz_loadu_ps(k, r[i].xsd4 + q), acc, k);                      \
    } while (0)
        ROW(0, acc0);
        ROW(1, acc1);
        ROW(2, acc2);
        ROW(3, acc3);
#undef ROW
    }
    out[0] = reduce512(acc0), out[1] = reduce512(acc1), out[2] = reduce512(acc2), out[3] = reduce512(acc3);
}

/* ---- entry points ---- */

int treadle_q_isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
    case ISA_PORTABLE: return 1;
    case ISA_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case ISA_AVX512_VNNI:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
    default: return 0;
    }
}

/* bytes of one row of K values of this type, or -1 (unknown type, or K not a whole number of blocks) */
int64_t treadle_q_row_bytes(int type, int64_t K) {
    qtype t;
    if (qtype_of(type, &t) || K <= 0 || K % t.elems) return -1;
    return K / t.elems * t.bytes;
}

static inline void store(void *y, int y_bf16, int64_t i, float v) {
    if (y_bf16)
        ((uint16_t *)y)[i] = f32_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* rows ids[i] (or i, ids NULL) of a [*, K] weight -> y [n, K] float32 or bf16 */
int treadle_q_dequantize(int type, const uint8_t *w, int64_t row_stride, int64_t K, const int64_t *ids, int64_t n, void *y, int y_bf16) {
    qtype t;
    if (qtype_of(type, &t) || K % t.elems) return 1;
    int err = 0;
#pragma omp parallel
    {
        uint8_t *uq = malloc((size_t)K);
        float *s4 = malloc((size_t)K), *m4 = malloc((size_t)K), *f = malloc((size_t)K * 4);
        if (!uq || !s4 || !m4 || !f) {
#pragma omp atomic write
            err = 2;
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) {
                unpack_row(&t, w + (ids ? ids[i] : i) * row_stride, K, uq, s4, m4);
                dequantize_unpacked(&t, K, uq, s4, m4, f);
                for (int64_t e = 0; e < K; e++) store(y, y_bf16, i * K + e, f[e]);
            }
        }
        free(uq), free(s4), free(m4), free(f);
    }
    return err;
}

/* y[m, n] = sum_k x[m, k] w[n, k]: x float32 [M, ldx], w [N] rows of `type`, y [M, ldy] float32 or bf16 */
int treadle_q_matmul_f32(int type, const uint8_t *w, int64_t row_stride, int64_t N, int64_t K, const float *x, int64_t ldx, int64_t M,
                         void *y, int64_t ldy, int y_bf16, int isa) {
    qtype t;
    if (qtype_of(type, &t) || K % t.elems) return 1;
    if (!treadle_q_isa_supported(isa)) return 3;
    float (*dot)(const float *, const float *, int64_t) = isa == ISA_AVX512_VNNI ? dot_f32_avx512 : isa == ISA_AVX2 ? dot_f32_avx2 : dot_f32_portable;
    int err = 0;
#pragma omp parallel
    {
        uint8_t *uq = malloc((size_t)K);
        float *s4 = malloc((size_t)K), *m4 = malloc((size_t)K), *f = malloc((size_t)K * 4);
        if (!uq || !s4 || !m4 || !f) {
#pragma omp atomic write
            err = 2;
        } else {
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                unpack_row(&t, w + n * row_stride, K, uq, s4, m4);
                dequantize_unpacked(&t, K, uq, s4, m4, f);
                for (int64_t m = 0; m < M; m++) store(y, y_bf16, m * ldy + n, dot(x + m * ldx, f, K));
            }
        }
        free(uq), free(s4), free(m4), free(f);
    }
    return err;
}

/* row m of the quantized activations: xq [M, K], then dx4, xoff4, xsd4 [M, K/4] each */
static inline qrow act_row(char *act, int64_t M, int64_t K, int64_t m) {
    return (qrow){(int8_t *)act + m * K, (float *)(act + M * K) + m * (K / 4), (int32_t *)(act + 2 * M * K) + m * (K / 4),
                  (float *)(act + 3 * M * K) + m * (K / 4)};
}

/* The same product with x (float32 or bf16) quantized to int8 per 32 values (see the header). */
int treadle_q_matmul_q8(int type, const uint8_t *w, int64_t row_stride, int64_t N, int64_t K, const void *x, int x_bf16, int64_t ldx,
                        int64_t M, void *y, int64_t ldy, int y_bf16, int isa) {
    qtype t;
    if (qtype_of(type, &t) || K % t.elems || K % 32) return 1;
    if (!treadle_q_isa_supported(isa)) return 3;
    /* one allocation for the quantized activations: xq [M, K] then dx4, xs4, xsd4 [M, K/4] each */
    char *act = malloc((size_t)M * (size_t)K * 4);
    if (!act) return 2;
    const size_t elem = x_bf16 ? 2 : 4;
    const int fast = isa == ISA_AVX512_VNNI && has_fast_unpack(type);
    float (*dot)(const qtype *, const uint8_t *, const float *, const float *, qrow, int64_t) =
        isa == ISA_AVX512_VNNI ? dot_q8_vnni : isa == ISA_AVX2 ? dot_q8_avx2 : dot_q8_portable;
    int err = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row((const char *)x + (size_t)(m * ldx) * elem, x_bf16, K, t.off, act_row(act, M, K, m));
        /* the implicit barrier: every row is quantized before any is used */
        uint8_t *uq = malloc((size_t)K);
        float *s4 = malloc((size_t)K), *m4 = malloc((size_t)K);
        if (!uq || !s4 || !m4) {
#pragma omp atomic write
            err = 2;
        } else {
            /* each thread takes a contiguous range of weight rows and passes over x in tiles */
            for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
                const int64_t m1 = m0 + M_TILE < M ? m0 + M_TILE : M;
#pragma omp for schedule(static) nowait
                for (int64_t n = 0; n < N; n++) {
                    if (fast)
                        unpack_row_fast(type, w + n * row_stride, K, uq, s4, m4);
                    else
                        unpack_row(&t, w + n * row_stride, K, uq, s4, m4);
                    int64_t m = m0;
                    if (isa == ISA_AVX512_VNNI)
                        for (; m + 4 <= m1; m += 4) {
                            qrow r[4];
                            float out[4];
                            for (int i = 0; i < 4; i++) r[i] = act_row(act, M, K, m + i);
                            dot4_q8_vnni(&t, uq, s4, m4, r, K, out);
                            for (int i = 0; i < 4; i++) store(y, y_bf16, (m + i) * ldy + n, out[i]);
                        }
                    for (; m < m1; m++) store(y, y_bf16, m * ldy + n, dot(&t, uq, s4, m4, act_row(act, M, K, m), K));
                }
            }
        }
        free(uq), free(s4), free(m4);
    }
    free(act);
    return err;
}
