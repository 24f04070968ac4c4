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
 * - float32 (`treadle_q_matmul_f32`): y = x . w with w dequantized exactly; one fused
 *   multiply-add per value, in order along K: acc = fma(x[e], w[e], acc).
 * - int8 activations (`treadle_q_matmul_q8`, for bfloat16 / float16 models, as llama.cpp's CPU
 *   backend does): each row of x is quantized per 32 values to int8 with scale dx = amax / 127
 *   (round half to even); then for each group of the weight's own scale (16 or 32 values), in
 *   order along K, an exact integer sum and two fused multiply-adds:
 *       isum = sum(uq * xq) - off * sum(xq)
 *       acc  = fma((float)isum, s * dx, acc)
 *       acc  = fma(-m, sum(xq) * dx, acc)            (types with a minimum)
 *
 * The instruction-set paths compute these same operations in the same order, so they give the same
 * bits; the caller picks one (`isa`). On AVX-512 VNNI, weights are held 16 rows interleaved (the
 * packed layout, below) and a vector holds one output of 16 weight rows; AVX2, portable C and the
 * last N % 16 rows take one weight row at a time. Which layout a weight is held in is a flag in
 * the type argument (`| PACKED`): a process whose path is not VNNI holds the file's rows as they
 * are (unpacking a row out of the packed layout byte by byte cost those paths 90% of their time),
 * and every path reads either layout (the tests run each path on each). Rows of the weight are split across torch's
 * OpenMP threads; one thread computes each output whole.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#include <immintrin.h>

#define M_TILE 32 /* rows of x per pass over an unpacked weight row */

enum {
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23,
};
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512_VNNI = 2 };
#define PACKED 0x100 /* in a type argument: the weight is held in the packed layout */

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


/* A thread reads its share of a weight as one stream, but from memory (not cache) the hardware
 * prefetcher alone left the products at a third of the machine's bandwidth: a single thread ran
 * a 9 MB Q4_K product at 16 GB/s where a plain pass over the bytes reaches 40, and Q6_K at 13.
 * So each block (each row, on the row-at-a-time paths) asks for the bytes PREFETCH_AHEAD further
 * on; that took both to 45 GB/s. A prefetch past the end of the weight is harmless (it never
 * faults), and a prefetch changes no result. */
#define PREFETCH_AHEAD 8192
static inline void prefetch_ahead(const uint8_t *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + PREFETCH_AHEAD + i, 0, 3);
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
    int gs; /* values per weight scale: 16 or 32 */
} qtype;

static int qtype_fields(int type, qtype *t) {
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

static int qtype_of(int type, qtype *t) {
    if (qtype_fields(type, t)) return -1;
    t->gs = type == T_Q2_K || type == T_Q3_K || type == T_Q6_K ? 16 : 32;
    return 0;
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

#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))

/* ---- float32 activations, exact weights ---- */

/* one output: acc = fma(x[e], w[e], acc) for e in order (the vector kernel does the same per lane) */
#define DOT_F32(name, target)                                                \
    target static float name(const float *x, const float *w, int64_t K) {    \
        float acc = 0.0f;                                                    \
        for (int64_t e = 0; e < K; e++) acc = fmaf(x[e], w[e], acc);         \
        return acc;                                                          \
    }
DOT_F32(dot_f32_portable, )
DOT_F32(dot_f32_avx2, TARGET_AVX2)
DOT_F32(dot_f32_avx512, TARGET_VNNI)

/* ---- int8 activations ---- */

/* One row of x, quantized: xq [K] int8; per 32 values the scale dx, the sum xs32 of the 32 xq and
 * sdx32 = (float)xs32 * dx; per 16 values xs16 and sdx16 likewise. */
typedef struct {
    int8_t *xq;
    float *dx, *sdx32, *sdx16;
    int32_t *xs32, *xs16;
} arow;

/* bytes of M quantized rows of K values (K a multiple of 32) */
static inline size_t act_bytes(int64_t M, int64_t K) { return (size_t)M * (size_t)K * 2; }

/* row m of the quantized activations: xq [M, K], then per row dx, xs32, sdx32 [K/32], xs16, sdx16 [K/16] */
static inline arow act_row(char *act, int64_t M, int64_t K, int64_t m) {
    char *p = act + (size_t)M * (size_t)K + (size_t)m * (size_t)K;
    return (arow){(int8_t *)act + m * K, (float *)p, (float *)(p + K / 8 * 2), (float *)(p + K / 8 * 3 + K / 4),
                  (int32_t *)(p + K / 8), (int32_t *)(p + K / 8 * 3)};
}

static void quantize_row(const void *x, int x_bf16, int64_t K, arow r) {
    for (int64_t g = 0; g < K; g += 32) {
        float v[32], amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            v[j] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[g + j]) : ((const float *)x)[g + j];
            float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s[2] = {0, 0};
        for (int j = 0; j < 32; j++) {
            r.xq[g + j] = (int8_t)nearbyintf(v[j] * id);
            s[j / 16] += r.xq[g + j];
        }
        r.dx[g / 32] = d;
        r.xs32[g / 32] = s[0] + s[1];
        r.sdx32[g / 32] = (float)(s[0] + s[1]) * d;
        for (int h = 0; h < 2; h++) {
            r.xs16[g / 16 + h] = s[h];
            r.sdx16[g / 16 + h] = (float)s[h] * d;
        }
    }
}

/* The rule, one weight row (unpacked) against one quantized row of x: for each group of the
 * weight's own scale (16 or 32 values), in order,
 *     isum = sum(uq * xq) - off * sum(xq)                       (exact, int32)
 *     acc  = fma((float)isum, s * dx, acc)
 *     acc  = fma(-m, sum(xq) * dx, acc)                         (types with a minimum)
 * Every path below computes these same operations, in this order, for every output. The integer
 * sums are exact, so how they are vectorized does not matter. */
#define DOT_RULE(name, target)                                                                                        \
    target static float name(const qtype *t, const uint8_t *uq, const float *s4, const float *m4, arow a, int64_t K) { \
        float acc = 0.0f;                                                                                             \
        if (t->gs == 16) {                                                                                            \
            for (int64_t e = 0; e < K; e += 16) {                                                                     \
                int32_t isum = 0;                                                                                     \
                for (int j = 0; j < 16; j++) isum += (int32_t)uq[e + j] * (int32_t)a.xq[e + j];                      \
                isum -= t->off * a.xs16[e / 16];                                                                      \
                acc = fmaf((float)isum, s4[e / 4] * a.dx[e / 32], acc);                                               \
                if (t->has_min) acc = fmaf(-m4[e / 4], a.sdx16[e / 16], acc);                                         \
            }                                                                                                         \
        } else {                                                                                                      \
            for (int64_t e = 0; e < K; e += 32) {                                                                     \
                int32_t isum = 0;                                                                                     \
                for (int j = 0; j < 32; j++) isum += (int32_t)uq[e + j] * (int32_t)a.xq[e + j];                      \
                isum -= t->off * a.xs32[e / 32];                                                                      \
                acc = fmaf((float)isum, s4[e / 4] * a.dx[e / 32], acc);                                               \
                if (t->has_min) acc = fmaf(-m4[e / 4], a.sdx32[e / 32], acc);                                         \
            }                                                                                                         \
        }                                                                                                             \
        return acc;                                                                                                   \
    }

DOT_RULE(dot_q8_portable, )
DOT_RULE(dot_q8_avx2, TARGET_AVX2)
DOT_RULE(dot_q8_vnni, TARGET_VNNI)

/* ---- the row-at-a-time paths' vector unpacking (AVX2, also run on AVX-512 CPUs) ---- */

/* A row unpacked with vector instructions, for the row-at-a-time paths of VNNI (a weight's last
 * N % 16 rows) and AVX2 (every row): the 5th bits of Q5_0 / Q5_1 / Q5_K spread to bytes by a
 * shuffle and a compare. The same bytes and floats as the block functions above (the tests run
 * every path on every type). */
#define TARGET_AVX2F __attribute__((target("avx2,fma,f16c")))

TARGET_AVX2F static inline float f16_avx2(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

TARGET_AVX2F static inline __m256i nibbles32_avx2(const uint8_t *qs) { /* 16 bytes -> low nibbles, then high nibbles */
    __m128i q = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

/* 16 in byte j where bit j of `bits` is set, else 0 */
TARGET_AVX2F static inline __m256i bits32_to_16s(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

TARGET_AVX2F static inline __m256i block32_avx2(int type, const uint8_t *blk) {
    switch (type) {
    case T_Q4_0: return nibbles32_avx2(blk + 2);
    case T_Q4_1: return nibbles32_avx2(blk + 4);
    default: {
        const int with_min = type == T_Q5_1;
        uint32_t qh;
        memcpy(&qh, blk + (with_min ? 4 : 2), 4);
        return _mm256_or_si256(nibbles32_avx2(blk + (with_min ? 8 : 6)), bits32_to_16s(qh));
    }
    }
}

TARGET_AVX2F static void unpack_row_avx2(int type, const uint8_t *row, int64_t K, uint8_t *uq, float *s4, float *m4) {
    if (type == T_Q8_0) {
        const __m256i x80 = _mm256_set1_epi8((char)0x80);
        for (int64_t e = 0; e < K; e += 32) {
            const uint8_t *b = row + (e / 32) * 34;
            _mm256_storeu_si256((__m256i *)(uq + e), _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), x80));
            _mm256_storeu_ps(s4 + e / 4, _mm256_set1_ps(f16_avx2(b)));
        }
        return;
    }
    if (type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1) {
        const int size = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
        const int with_min = type == T_Q4_1 || type == T_Q5_1;
        for (int64_t e = 0; e < K; e += 32) {
            const uint8_t *b = row + (e / 32) * size;
            _mm256_storeu_si256((__m256i *)(uq + e), block32_avx2(type, b));
            _mm256_storeu_ps(s4 + e / 4, _mm256_set1_ps(f16_avx2(b)));
            if (with_min) _mm256_storeu_ps(m4 + e / 4, _mm256_set1_ps(-f16_avx2(b + 2)));
        }
        return;
    }
    const __m256i m15 = _mm256_set1_epi8(15), x10 = _mm256_set1_epi8(16);
    for (int64_t e = 0; e < K;) { /* the K-quants */
        switch (type) {
        case T_Q4_K: case T_Q5_K: {
            const int q5 = type == T_Q5_K;
            const uint8_t *blk = row + (e / 256) * (q5 ? 176 : 144), *qs = blk + (q5 ? 48 : 16);
            const float d = f16_avx2(blk), dmin = f16_avx2(blk + 2);
            const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m256i lo = _mm256_and_si256(q, m15), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
                if (q5) {
                    const __m256i bl = _mm256_set1_epi8((char)(1 << (2 * c))), bh = _mm256_set1_epi8((char)(1 << (2 * c + 1)));
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bl), bl), x10));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bh), bh), x10));
                }
                _mm256_storeu_si256((__m256i *)(uq + e + 64 * c), lo);
                _mm256_storeu_si256((__m256i *)(uq + e + 64 * c + 32), hi);
            }
            for (int i = 0; i < 8; i++) {
                int sc, mn;
                k_scale_min(blk + 4, i, &sc, &mn);
                _mm256_storeu_ps(s4 + e / 4 + 8 * i, _mm256_set1_ps(d * (float)sc));
                _mm256_storeu_ps(m4 + e / 4 + 8 * i, _mm256_set1_ps(dmin * (float)mn));
            }
            e += 256;
            break;
        }
        case T_Q6_K: {
            const uint8_t *blk = row + (e / 256) * 210;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = f16_avx2(blk + 208);
            for (int half = 0; half < 2; half++) {
                __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
                for (int c = 0; c < 2; c++) {
                    __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 64 * half + 32 * c));
                    __m256i lo = _mm256_and_si256(q, m15), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
                    /* element half*128 + t*32 + j takes bits 2t of qh[j]: lo covers t = c, hi t = c + 2 */
                    __m256i hl = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), _mm256_set1_epi8(3));
                    __m256i hh = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 4), _mm256_set1_epi8(3));
                    _mm256_storeu_si256((__m256i *)(uq + e + 128 * half + 32 * c), _mm256_or_si256(lo, _mm256_slli_epi16(hl, 4)));
                    _mm256_storeu_si256((__m256i *)(uq + e + 128 * half + 64 + 32 * c), _mm256_or_si256(hi, _mm256_slli_epi16(hh, 4)));
                }
            }
            for (int i = 0; i < 16; i++) _mm_storeu_ps(s4 + e / 4 + 4 * i, _mm_set1_ps(d * (float)sc[i]));
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

/* ---- AVX-512 VNNI ---- */

#define TARGET_FAST __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

/* quantize_row with AVX-512: the same operations (max of |x|, one scalar division, products
 * rounded half to even, integer sums), so the same bytes and floats */
TARGET_FAST static void quantize_row_avx512(const void *x, int x_bf16, int64_t K, arow r) {
    for (int64_t g = 0; g < K; g += 32) {
        __m512 v[2];
        for (int h = 0; h < 2; h++) {
            if (x_bf16) {
                const __m256i b = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + g + 16 * h));
                v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
            } else {
                v[h] = _mm512_loadu_ps((const float *)x + g + 16 * h);
            }
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s[2];
        for (int h = 0; h < 2; h++) {
            const __m512 p = _mm512_roundscale_ps(_mm512_mul_ps(v[h], _mm512_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i q = _mm512_cvtps_epi32(p);
            _mm_storeu_si128((__m128i *)(r.xq + g + 16 * h), _mm512_cvtepi32_epi8(q));
            s[h] = _mm512_reduce_add_epi32(q);
        }
        r.dx[g / 32] = d;
        r.xs32[g / 32] = s[0] + s[1];
        r.sdx32[g / 32] = (float)(s[0] + s[1]) * d;
        for (int h = 0; h < 2; h++) {
            r.xs16[g / 16 + h] = s[h];
            r.sdx16[g / 16 + h] = (float)s[h] * d;
        }
    }
}

/* ---- the packed layout: 16 rows interleaved ----
 *
 * For every type, a weight of N rows is stored as
 * N / 16 groups of 16 rows, then the N % 16 last rows as the file has them. A group holds, for
 * each block b of the row in turn, the 16 rows' block b with its bytes moved: every float16 field
 * (d, m, dmin) as the 16 rows' fields side by side, every other byte in 4-byte pieces, piece t of
 * the 16 rows side by side (one 64-byte vector per piece). Q8_0's quants are stored + 128 (as
 * unsigned bytes). A vector then holds the same 4 values of 16 rows (in its low and high nibbles,
 * for the 4-bit codes): what the integer dot product multiplies with one broadcast quad of x. */

typedef struct {
    int p0, p1, xor80; /* bytes [p0, p1) of a block in 4-byte pieces; the rest are 2-byte fields */
} packdesc;

static int pack_desc(int type, packdesc *p) {
    switch (type) {
    case T_Q4_0: case T_IQ4_NL: case T_Q5_0: *p = (packdesc){2, type == T_Q5_0 ? 22 : 18, 0}; return 1;
    case T_Q4_1: case T_Q5_1: *p = (packdesc){4, type == T_Q5_1 ? 24 : 20, 0}; return 1;
    case T_Q8_0: *p = (packdesc){2, 34, 1}; return 1;
    case T_Q4_K: case T_Q5_K: *p = (packdesc){4, type == T_Q5_K ? 176 : 144, 0}; return 1;
    case T_Q6_K: *p = (packdesc){0, 208, 0}; return 1;
    case T_Q2_K: *p = (packdesc){0, 80, 0}; return 1;
    case T_Q3_K: *p = (packdesc){0, 108, 0}; return 1;
    case T_IQ4_XS: *p = (packdesc){4, 136, 0}; return 1;
    default: return 0;
    }
}

/* where byte j of row r's block lands in the 16 rows' packed block: a field or a piece starting at
 * byte f of the block, of n bytes, lands at 16 * f, row r's n bytes at 16 * f + r * n */
static inline int packed_pos(const packdesc *p, int r, int j) {
    if (j >= p->p0 && j < p->p1) {
        const int f = j - (j - p->p0) % 4;
        return 16 * f + r * 4 + (j - f);
    }
    const int f = j & ~1;
    return 16 * f + r * 2 + (j - f);
}

/* Row n of a stored weight in the file's layout: a pointer into w, or `tmp` filled from a group. */
static const uint8_t *file_row(int type, int packed, const qtype *t, const uint8_t *w, int64_t N, int64_t K, int64_t n, uint8_t *tmp) {
    const int64_t rb = K / t->elems * t->bytes;
    packdesc p;
    if (!packed || !pack_desc(type, &p) || n >= N / 16 * 16) return w + n * rb;
    const uint8_t *group = w + (n / 16) * 16 * rb;
    const int r = (int)(n % 16);
    for (int64_t b = 0; b < K / t->elems; b++)
        for (int j = 0; j < t->bytes; j++) {
            uint8_t v = group[b * 16 * t->bytes + packed_pos(&p, r, j)];
            tmp[b * t->bytes + j] = p.xor80 && j >= p.p0 ? v ^ 0x80 : v;
        }
    return tmp;
}

/* the file's blocks (N rows of K values) -> the stored layout, or back (to_file) */
int treadle_q_pack(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *dst, int to_file) {
    type &= ~PACKED;
    qtype t;
    if (qtype_of(type, &t) || K % t.elems) return 1;
    const int64_t rb = K / t.elems * t.bytes, nb = K / t.elems;
    packdesc p;
    if (!pack_desc(type, &p)) {
        memcpy(dst, src, (size_t)(N * rb));
        return 0;
    }
    const int64_t grouped = N / 16 * 16;
    /* where byte j of a block of row r goes inside its 16-row block group, and its bit flip */
    int16_t pos[16 * 256];
    uint8_t flip[256];
    for (int j = 0; j < t.bytes; j++) {
        flip[j] = p.xor80 && j >= p.p0 ? 0x80 : 0;
        for (int r = 0; r < 16; r++) pos[r * 256 + j] = (int16_t)packed_pos(&p, r, j);
    }
    /* 16-row groups over the threads (loading a model: the pass over its bytes is the load's largest) */
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < grouped / 16; g++)
        for (int r = 0; r < 16; r++) {
            const int16_t *pr = pos + r * 256;
            for (int64_t b = 0; b < nb; b++) {
                uint8_t *packed = (to_file ? (uint8_t *)src : dst) + g * 16 * rb + b * 16 * t.bytes;
                uint8_t *row = (to_file ? dst : (uint8_t *)src) + (g * 16 + r) * rb + b * t.bytes;
                if (to_file)
                    for (int j = 0; j < t.bytes; j++) row[j] = packed[pr[j]] ^ flip[j];
                else
                    for (int j = 0; j < t.bytes; j++) packed[pr[j]] = row[j] ^ flip[j];
            }
        }
    memcpy(dst + grouped * rb, src + grouped * rb, (size_t)((N - grouped) * rb));
    return 0;
}

/* ---- the packed 32-value types on AVX-512 VNNI: 16 weight rows per vector ---- */

TARGET_FAST static inline void store16(void *y, int y_bf16, int64_t i, __m512 v) {
    if (!y_bf16) {
        _mm512_storeu_ps((float *)y + i, v);
        return;
    }
    /* f32_to_bf16, lane by lane: round to nearest even, NaN kept quiet */
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), _mm512_and_si512(hi, _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)y + i), _mm512_cvtepi32_epi16(r));
}

#define X16_INLINE TARGET_FAST static inline __attribute__((always_inline))

/* float32 x, the exact weights (the float32 product's rule): for quads q0 .. q0 + nq of 32-value group
 * g, w = dw * (float)(code - off), then + add (MODE 1) or - add (MODE 2), as gguf-py computes it, and
 * acc = fma(x, w, acc) for each value in order */
X16_INLINE void exact_quads(const __m512i *u, int q0, int nq, __m512 dw, __m512 add, const int MODE, int off, const float *const *xr, const int MT,
                            int64_t e0, __m512 *acc) {
    const __m512i offv = _mm512_set1_epi32(off), byte = _mm512_set1_epi32(255);
    for (int q = q0; q < q0 + nq; q++)
        for (int i = 0; i < 4; i++) {
            const __m512i c = _mm512_and_si512(_mm512_srli_epi32(u[q], 8 * i), byte);
            __m512 w = _mm512_mul_ps(dw, _mm512_cvtepi32_ps(_mm512_sub_epi32(c, offv)));
            if (MODE == 1) w = _mm512_add_ps(w, add);
            if (MODE == 2) w = _mm512_sub_ps(w, add);
            for (int m = 0; m < MT; m++) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xr[m][e0 + 4 * q + i]), w, acc[m]);
        }
}

/* The consumer of one weight scale group's codes `u` (quads q0 .. q0 + nq of 32-value group a32;
 * nq = 4: its 16-value half h16), scale dw and, MODE 1 / 2, a value added / subtracted (the
 * minimum): the int8 rule's operations for rows of quantized activations, or (EXACT) the float32
 * rule's on x itself. */
X16_INLINE void consume(const __m512i *u, int q0, int nq, __m512 dw, __m512 add, const int MODE, int off, const int EXACT, const arow *a,
                        const float *const *xr, const int MT, int64_t a32, int h16, __m512 *acc) {
    if (EXACT) {
        exact_quads(u, q0, nq, dw, add, MODE, off, xr, MT, 32 * a32, acc);
        return;
    }
    for (int i = 0; i < MT; i++) {
        const int32_t *xq4 = (const int32_t *)(a[i].xq + 32 * a32);
        const int32_t xs = nq == 8 ? a[i].xs32[a32] : a[i].xs16[2 * a32 + h16];
        __m512i s0 = _mm512_set1_epi32(-off * xs), s1 = _mm512_setzero_si512();
        for (int q = q0; q < q0 + nq; q += 2) {
            s0 = _mm512_dpbusd_epi32(s0, u[q], _mm512_set1_epi32(xq4[q]));
            s1 = _mm512_dpbusd_epi32(s1, u[q + 1], _mm512_set1_epi32(xq4[q + 1]));
        }
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(dw, _mm512_set1_ps(a[i].dx[a32])), acc[i]);
        const __m512 sdx = _mm512_set1_ps(nq == 8 ? a[i].sdx32[a32] : a[i].sdx16[2 * a32 + h16]);
        if (MODE == 1) acc[i] = _mm512_fmadd_ps(add, sdx, acc[i]);
        if (MODE == 2) acc[i] = _mm512_fnmadd_ps(add, sdx, acc[i]);
    }
}

/* a tile's rows of x (quantized rows, or EXACT: x itself, float32 [M, K]) and zeroed outputs */
X16_INLINE void tile_start(char *act, int64_t M, int64_t K, int64_t m0, const int MT, const int EXACT, arow *a, const float **xr, __m512 *acc) {
    for (int i = 0; i < MT; i++) {
        if (EXACT)
            xr[i] = (const float *)act + (m0 + i) * K;
        else
            a[i] = act_row(act, M, K, m0 + i);
        acc[i] = _mm512_setzero_ps();
    }
}

TARGET_FAST static inline __m512i iq4_table(void) { /* IQ4_VALUES + 128, in each 128-bit lane */
    return _mm512_broadcast_i32x4(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166, (char)181,
                                                (char)197, (char)217, (char)241));
}

#define PIECE(base, k) _mm512_loadu_si512((const void *)((base) + 64 * (k)))


/* rows m0 .. m0 + MT of x against one group of 16 weight rows (outputs n0 .. n0 + 15): the rule's
 * operations, lane r for weight row n0 + r */
X16_INLINE void x16_tile(const int type, const int MT, const int EXACT, const uint8_t *group, int64_t nb, char *act, int64_t M, int64_t K, int64_t m0, void *y,
                         int64_t ldy, int y_bf16, int64_t n0) {
    const int with_min = type == T_Q4_1 || type == T_Q5_1, five = type == T_Q5_0 || type == T_Q5_1;
    const int bytes = type == T_Q4_0 || type == T_IQ4_NL ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : type == T_Q5_1 ? 24 : 34;
    const int qoff = type == T_Q4_1 || type == T_Q5_0 ? (type == T_Q4_1 ? 4 : 6) : type == T_Q5_1 ? 8 : 2, qhoff = with_min ? 4 : 2;
    const int off = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q8_0 || type == T_IQ4_NL ? 128 : 0;
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512i table = iq4_table();
    const __m512i spread = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c));
    arow a[8];
    const float *xr[8];
    __m512 acc[8];
    tile_start(act, M, K, m0, MT, EXACT, a, xr, acc);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = group + b * 16 * bytes, *qs = gb + 16 * qoff;
        prefetch_ahead(gb, 16 * bytes);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gb));
        const __m512 mn = with_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + 32))) : _mm512_setzero_ps();
        __m512i u[8];
        if (type == T_Q8_0) {
            for (int q = 0; q < 8; q++) u[q] = _mm512_loadu_si512((const void *)(qs + 64 * q));
        } else {
            for (int q = 0; q < 4; q++) {
                const __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * q));
                u[q] = _mm512_and_si512(v, m15);
                u[q + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
            }
            if (type == T_IQ4_NL)
                for (int q = 0; q < 8; q++) u[q] = _mm512_shuffle_epi8(table, u[q]);
            if (five) { /* value 4q + i of a row takes bit 4q + i of its qh */
                const __m512i qh = _mm512_loadu_si512((const void *)(gb + 16 * qhoff)), x10 = _mm512_set1_epi8(16);
                for (int q = 0; q < 8; q++) {
                    const __m512i byte = _mm512_shuffle_epi8(qh, _mm512_add_epi8(spread, _mm512_set1_epi8((char)(q / 2))));
                    const __mmask64 k = _mm512_test_epi8_mask(byte, _mm512_set1_epi32(q % 2 ? (int)0x80402010 : 0x08040201));
                    u[q] = _mm512_mask_add_epi8(u[q], k, u[q], x10);
                }
            }
        }
        consume(u, 0, 8, d, mn, with_min ? 1 : 0, off, EXACT, a, xr, MT, b, 0, acc);
    }
    for (int i = 0; i < MT; i++) store16(y, y_bf16, (m0 + i) * ldy + n0, acc[i]);
}

/* The K-quants (256 values a block): Q4_K and Q5_K (32-value groups with 6-bit scales and minimums)
 * and Q6_K (16-value groups with int8 scales), 16 weight rows per vector, the rule's operations. */
X16_INLINE void x16k_tile(const int type, const int MT, const int EXACT, const uint8_t *group, int64_t nb, char *act, int64_t M, int64_t K, int64_t m0,
                          void *y, int64_t ldy, int y_bf16, int64_t n0) {
    const int bytes = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    const __m512i m15 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3), m63 = _mm512_set1_epi32(63), m30 = _mm512_set1_epi32(0x30);
    const __m512i x10 = _mm512_set1_epi8(16);
    arow a[8];
    const float *xr[8];
    __m512 acc[8];
    tile_start(act, M, K, m0, MT, EXACT, a, xr, acc);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = group + b * 16 * bytes;
        prefetch_ahead(gb, 16 * bytes);
        if (type == T_Q6_K) {
            const uint8_t *P = gb; /* ql pieces 0..31, qh 32..47, scales 48..51; d after */
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + 16 * 208)));
            for (int g = 0; g < 8; g++) {
                const int h = g / 4, t = g % 4;
                __m512i u[8];
                for (int q = 0; q < 8; q++) {
                    const __m512i ql = PIECE(P, 16 * h + 8 * (t % 2) + q), qh = PIECE(P, 32 + 8 * h + q);
                    const __m512i lo = _mm512_and_si512(t >= 2 ? _mm512_srli_epi16(ql, 4) : ql, m15);
                    u[q] = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * t), m3), 4));
                }
                __m512 dw[2];
                for (int k = 0; k < 2; k++) { /* sub-block 2g + k: int8 scale, byte (2g + k) % 4 of piece 48 + (2g + k) / 4 */
                    const int sb = 2 * g + k;
                    const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(PIECE(P, 48 + sb / 4), 24 - 8 * (sb % 4)), 24);
                    dw[k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                }
                const int64_t a32 = b * 8 + g;
                consume(u, 0, 4, dw[0], dw[0], 0, 32, EXACT, a, xr, MT, a32, 0, acc);
                consume(u, 4, 4, dw[1], dw[1], 0, 32, EXACT, a, xr, MT, a32, 1, acc);
            }
            continue;
        }
        const int q5 = type == T_Q5_K;
        const uint8_t *P = gb + 64; /* pieces: scales 0..2, (Q5_K: qh 3..10), qs after */
        const int qs0 = q5 ? 11 : 3;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gb)), dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + 32)));
        const __m512i v0 = PIECE(P, 0), v1 = PIECE(P, 1), v2 = PIECE(P, 2);
        for (int s = 0; s < 8; s++) {
            __m512i sc, mn;
            if (s < 4) {
                sc = _mm512_and_si512(_mm512_srli_epi32(v0, 8 * s), m63);
                mn = _mm512_and_si512(_mm512_srli_epi32(v1, 8 * s), m63);
            } else {
                const int k = s - 4;
                sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v2, 8 * k), _mm512_set1_epi32(15)),
                                     _mm512_and_si512(_mm512_srli_epi32(v0, 8 * k + 2), m30));
                mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v2, 8 * k + 4), _mm512_set1_epi32(15)),
                                     _mm512_and_si512(_mm512_srli_epi32(v1, 8 * k + 2), m30));
            }
            const __m512 dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)), mw = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
            __m512i u[8];
            for (int q = 0; q < 8; q++) {
                const __m512i v = PIECE(P, qs0 + 8 * (s / 2) + q);
                u[q] = _mm512_and_si512(s % 2 ? _mm512_srli_epi16(v, 4) : v, m15);
                if (q5) u[q] = _mm512_mask_add_epi8(u[q], _mm512_test_epi8_mask(PIECE(P, 3 + q), _mm512_set1_epi8((char)(1 << s))), u[q], x10);
            }
            const int64_t a32 = b * 8 + s;
            consume(u, 0, 8, dw, mw, 2, 0, EXACT, a, xr, MT, a32, 0, acc);
        }
    }
    for (int i = 0; i < MT; i++) store16(y, y_bf16, (m0 + i) * ldy + n0, acc[i]);
}

/* Q2_K and Q3_K (16-value groups, 2- and 3-bit codes) and IQ4_XS (32-value groups of IQ4_NL's
 * codebook with 6-bit scales), 16 weight rows per vector, the rule's operations. */
X16_INLINE void x16s_tile(const int type, const int MT, const int EXACT, const uint8_t *group, int64_t nb, char *act, int64_t M, int64_t K, int64_t m0,
                          void *y, int64_t ldy, int y_bf16, int64_t n0) {
    const int bytes = type == T_Q2_K ? 84 : type == T_Q3_K ? 110 : 136;
    const __m512i m15 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3), x4 = _mm512_set1_epi8(4);
    const __m512i table = iq4_table();
    arow a[8];
    const float *xr[8];
    __m512 acc[8];
    tile_start(act, M, K, m0, MT, EXACT, a, xr, acc);
#define BYTE_OF(v, k) _mm512_and_si512(_mm512_srli_epi32((v), 8 * ((k) % 4)), _mm512_set1_epi32(255))
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = group + b * 16 * bytes;
        prefetch_ahead(gb, 16 * bytes);
        if (type == T_IQ4_XS) { /* d at 0, the high scale bits (2 bytes) at 32, pieces from 64: low scale bits, then codes */
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gb));
            const __m512i sh = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(gb + 32)));
            const uint8_t *P = gb + 64;
            const __m512i sl = PIECE(P, 0);
            for (int ib = 0; ib < 8; ib++) {
                const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(sl, 4 * ib), _mm512_set1_epi32(15)); /* byte ib/2, nibble ib%2 */
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(sh, 2 * ib), _mm512_set1_epi32(3));
                const __m512i ls = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
                const __m512 dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(ls));
                __m512i u[8];
                for (int q = 0; q < 4; q++) {
                    const __m512i v = PIECE(P, 1 + 4 * ib + q);
                    u[q] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, m15));
                    u[q + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), m15));
                }
                const int64_t a32 = b * 8 + ib;
                consume(u, 0, 8, dw, dw, 0, 128, EXACT, a, xr, MT, a32, 0, acc);
            }
            continue;
        }
        const int q3 = type == T_Q3_K;
        const uint8_t *P = gb; /* pieces from 0; Q2_K: scales 0..3, codes 4..19, d, dmin after; Q3_K: high bits 0..7, codes 8..23, scales 24..26, d after */
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + 16 * (q3 ? 108 : 80))));
        const __m512 dmin = q3 ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + 16 * 82)));
        for (int g = 0; g < 8; g++) {
            const int h = g / 4, s = g % 4;
            __m512i u[8];
            for (int q = 0; q < 8; q++) {
                const __m512i v = PIECE(P, (q3 ? 8 : 4) + 8 * h + q);
                u[q] = _mm512_and_si512(_mm512_srli_epi16(v, 2 * s), m3);
                if (q3) u[q] = _mm512_mask_add_epi8(u[q], _mm512_test_epi8_mask(PIECE(P, q), _mm512_set1_epi8((char)(1 << g))), u[q], x4);
            }
            __m512 dw[2], mw[2];
            for (int k = 0; k < 2; k++) {
                const int i16 = 2 * g + k;
                if (q3) { /* 6-bit signed scale: low nibble of byte i16 % 8, 2 high bits of byte 8 + i16 % 4 */
                    const __m512i low = _mm512_and_si512(_mm512_srli_epi32(BYTE_OF(PIECE(P, 24 + (i16 & 7) / 4), i16 & 7), 4 * (i16 >> 3)), _mm512_set1_epi32(15));
                    const __m512i high = _mm512_and_si512(_mm512_srli_epi32(BYTE_OF(PIECE(P, 26), i16 & 3), 2 * (i16 >> 2)), _mm512_set1_epi32(3));
                    const __m512i sc = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
                    dw[k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                } else { /* scale in the low nibble of byte i16, minimum in the high */
                    const __m512i byte = BYTE_OF(PIECE(P, i16 / 4), i16);
                    dw[k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(byte, _mm512_set1_epi32(15))));
                    mw[k] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(byte, 4)));
                }
            }
            const int64_t a32 = b * 8 + g;
            for (int k = 0; k < 2; k++) consume(u, 4 * k, 4, dw[k], q3 ? dw[k] : mw[k], q3 ? 0 : 2, q3 ? 4 : 0, EXACT, a, xr, MT, a32, k, acc);
        }
    }
#undef BYTE_OF
    for (int i = 0; i < MT; i++) store16(y, y_bf16, (m0 + i) * ldy + n0, acc[i]);
}

#define X16_TYPE(TYPE, TILE)  X16_VARIANT(TYPE, TILE, 0, x16_##TYPE) X16_VARIANT(TYPE, TILE, 1, x16f_##TYPE)
#define X16_VARIANT(TYPE, TILE, EXACT, NAME)                                                                                            \
    TARGET_FAST static void NAME(const uint8_t *group, int64_t nb, char *act, int64_t M, int64_t K, int64_t m0, int64_t m1, void *y, \
                                       int64_t ldy, int y_bf16, int64_t n0) {                                          \
        while (m0 < m1) {                                                                                               \
            const int64_t left = m1 - m0;                                                                               \
            if (left >= 8) TILE(TYPE, 8, EXACT, group, nb, act, M, K, m0, y, ldy, y_bf16, n0), m0 += 8;                    \
            else if (left >= 4) TILE(TYPE, 4, EXACT, group, nb, act, M, K, m0, y, ldy, y_bf16, n0), m0 += 4;               \
            else if (left >= 2) TILE(TYPE, 2, EXACT, group, nb, act, M, K, m0, y, ldy, y_bf16, n0), m0 += 2;               \
            else TILE(TYPE, 1, EXACT, group, nb, act, M, K, m0, y, ldy, y_bf16, n0), m0 += 1;                              \
        }                                                                                                               \
    }
X16_TYPE(T_Q4_0, x16_tile)
X16_TYPE(T_Q4_1, x16_tile)
X16_TYPE(T_Q5_0, x16_tile)
X16_TYPE(T_Q5_1, x16_tile)
X16_TYPE(T_Q8_0, x16_tile)
X16_TYPE(T_IQ4_NL, x16_tile)
X16_TYPE(T_Q4_K, x16k_tile)
X16_TYPE(T_Q5_K, x16k_tile)
X16_TYPE(T_Q6_K, x16k_tile)
X16_TYPE(T_Q2_K, x16s_tile)
X16_TYPE(T_Q3_K, x16s_tile)
X16_TYPE(T_IQ4_XS, x16s_tile)

typedef void (*x16_fn)(const uint8_t *, int64_t, char *, int64_t, int64_t, int64_t, int64_t, void *, int64_t, int, int64_t);

static x16_fn x16_for(int type) {
    switch (type) {
    case T_Q4_0: return x16_T_Q4_0;
    case T_Q4_1: return x16_T_Q4_1;
    case T_Q5_0: return x16_T_Q5_0;
    case T_Q5_1: return x16_T_Q5_1;
    case T_Q8_0: return x16_T_Q8_0;
    case T_IQ4_NL: return x16_T_IQ4_NL;
    case T_Q4_K: return x16_T_Q4_K;
    case T_Q5_K: return x16_T_Q5_K;
    case T_Q6_K: return x16_T_Q6_K;
    case T_Q2_K: return x16_T_Q2_K;
    case T_Q3_K: return x16_T_Q3_K;
    case T_IQ4_XS: return x16_T_IQ4_XS;
    default: return NULL;
    }
}

static x16_fn x16f_for(int type) {
    switch (type) {
    case T_Q4_0: return x16f_T_Q4_0;
    case T_Q4_1: return x16f_T_Q4_1;
    case T_Q5_0: return x16f_T_Q5_0;
    case T_Q5_1: return x16f_T_Q5_1;
    case T_Q8_0: return x16f_T_Q8_0;
    case T_IQ4_NL: return x16f_T_IQ4_NL;
    case T_Q4_K: return x16f_T_Q4_K;
    case T_Q5_K: return x16f_T_Q5_K;
    case T_Q6_K: return x16f_T_Q6_K;
    case T_Q2_K: return x16f_T_Q2_K;
    case T_Q3_K: return x16f_T_Q3_K;
    case T_IQ4_XS: return x16f_T_IQ4_XS;
    default: return NULL;
    }
}

/* ---- entry points ---- */

int treadle_q_isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
    case ISA_PORTABLE: return 1;
    case ISA_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case ISA_AVX512_VNNI:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    default: return 0;
    }
}

/* bytes of one row of K values of this type, or -1 (unknown type, or K not a whole number of blocks) */
int64_t treadle_q_row_bytes(int type, int64_t K) {
    type &= ~PACKED;
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

/* rows ids[i] (or i, ids NULL) of a stored [N, K] weight -> y [n, K] float32 or bf16 */
int treadle_q_dequantize(int type, const uint8_t *w, int64_t N, int64_t K, const int64_t *ids, int64_t n, void *y, int y_bf16) {
    const int packed = (type & PACKED) != 0;
    type &= ~PACKED;
    qtype t;
    if (qtype_of(type, &t) || K % t.elems) return 1;
    int err = 0;
#pragma omp parallel
    {
        uint8_t *uq = malloc((size_t)K), *tmp = malloc((size_t)K * 2);
        float *s4 = malloc((size_t)K), *m4 = malloc((size_t)K), *f = malloc((size_t)K * 4);
        if (!uq || !tmp || !s4 || !m4 || !f) {
#pragma omp atomic write
            err = 2;
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) {
                unpack_row(&t, file_row(type, packed, &t, w, N, K, ids ? ids[i] : i, tmp), K, uq, s4, m4);
                dequantize_unpacked(&t, K, uq, s4, m4, f);
                for (int64_t e = 0; e < K; e++) store(y, y_bf16, i * K + e, f[e]);
            }
        }
        free(uq), free(tmp), free(s4), free(m4), free(f);
    }
    return err;
}

/* y[m, n] = sum_k x[m, k] w[n, k]: x float32 [M, K] (rows contiguous), w a stored [N, K] weight of `type`, y [M, ldy] float32 or bf16 */
int treadle_q_matmul_f32(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, void *y, int64_t ldy, int y_bf16, int isa) {
    const int packed = (type & PACKED) != 0;
    type &= ~PACKED;
    qtype t;
    if (qtype_of(type, &t) || K % t.elems) return 1;
    if (!treadle_q_isa_supported(isa)) return 3;
    float (*dot)(const float *, const float *, int64_t) = isa == ISA_AVX512_VNNI ? dot_f32_avx512 : isa == ISA_AVX2 ? dot_f32_avx2 : dot_f32_portable;
    const int64_t rb = K / t.elems * t.bytes;
    const x16_fn x16 = isa == ISA_AVX512_VNNI && packed ? x16f_for(type) : NULL;
    const int64_t groups = x16 ? N / 16 : 0;
    const int parallel = (double)M * (double)N * (double)K >= 2e5;
    int err = 0;
#pragma omp parallel if (parallel)
    {
        for (int64_t m0 = 0; m0 < M && groups; m0 += M_TILE) {
            const int64_t m1 = m0 + M_TILE < M ? m0 + M_TILE : M;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) x16(w + g * 16 * rb, K / t.elems, (char *)x, M, K, m0, m1, y, ldy, y_bf16, g * 16);
        }
        if (groups * 16 < N) {
            uint8_t *uq = malloc((size_t)K), *tmp = malloc((size_t)K * 2);
            float *s4 = malloc((size_t)K), *m4 = malloc((size_t)K), *f = malloc((size_t)K * 4);
            if (!uq || !tmp || !s4 || !m4 || !f) {
#pragma omp atomic write
                err = 2;
            } else {
#pragma omp for schedule(static)
                for (int64_t n = groups * 16; n < N; n++) {
                    prefetch_ahead(w + n * rb, rb);
                    unpack_row(&t, file_row(type, packed, &t, w, N, K, n, tmp), K, uq, s4, m4);
                    dequantize_unpacked(&t, K, uq, s4, m4, f);
                    for (int64_t m = 0; m < M; m++) store(y, y_bf16, m * ldy + n, dot(x + m * K, f, K));
                }
            }
            free(uq), free(tmp), free(s4), free(m4), free(f);
        }
    }
    return err;
}

/* The same product with x (float32 or bf16) quantized to int8 per 32 values (see the header). */
int treadle_q_matmul_q8(int type, const uint8_t *w, int64_t N, int64_t K, const void *x, int x_bf16, int64_t ldx, int64_t M, void *y,
                        int64_t ldy, int y_bf16, int isa) {
    const int packed = (type & PACKED) != 0;
    type &= ~PACKED;
    qtype t;
    if (qtype_of(type, &t) || K % t.elems || K % 32) return 1;
    if (!treadle_q_isa_supported(isa)) return 3;
    char *act = malloc(act_bytes(M, K));
    if (!act) return 2;
    const size_t elem = x_bf16 ? 2 : 4;
    const int64_t rb = K / t.elems * t.bytes;
    const x16_fn x16 = isa == ISA_AVX512_VNNI && packed ? x16_for(type) : NULL;
    const int64_t groups = x16 ? N / 16 : 0; /* groups of 16 rows the vector kernel takes; the rest one row at a time */
    const int fast = (isa == ISA_AVX512_VNNI || isa == ISA_AVX2) && has_fast_unpack(type);
    float (*dot)(const qtype *, const uint8_t *, const float *, const float *, arow, int64_t) =
        isa == ISA_AVX512_VNNI ? dot_q8_vnni : isa == ISA_AVX2 ? dot_q8_avx2 : dot_q8_portable;
    void (*quantize)(const void *, int, int64_t, arow) = isa == ISA_AVX512_VNNI ? quantize_row_avx512 : quantize_row;
    /* small products on one thread: waking the others costs more than they would save */
    const int parallel = (double)M * (double)N * (double)K >= 2e5;
    int err = 0;
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize(((const char *)x + (size_t)(m * ldx) * elem), x_bf16, K, act_row(act, M, K, m));
        /* the implicit barrier: every row is quantized before any is used */
        for (int64_t m0 = 0; m0 < M && groups; m0 += M_TILE) {
            const int64_t m1 = m0 + M_TILE < M ? m0 + M_TILE : M;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) x16(w + g * 16 * rb, K / t.elems, act, M, K, m0, m1, y, ldy, y_bf16, g * 16);
        }
        if (groups * 16 < N) {
            uint8_t *uq = malloc((size_t)K), *tmp = malloc((size_t)K * 2);
            float *s4 = malloc((size_t)K), *m4 = malloc((size_t)K);
            if (!uq || !tmp || !s4 || !m4) {
#pragma omp atomic write
                err = 2;
            } else {
                for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
                    const int64_t m1 = m0 + M_TILE < M ? m0 + M_TILE : M;
#pragma omp for schedule(static) nowait
                    for (int64_t n = groups * 16; n < N; n++) {
                        prefetch_ahead(w + n * rb, rb);
                        const uint8_t *row = file_row(type, packed, &t, w, N, K, n, tmp);
                        if (fast)
                            unpack_row_avx2(type, row, K, uq, s4, m4);
                        else
                            unpack_row(&t, row, K, uq, s4, m4);
                        for (int64_t m = m0; m < m1; m++) store(y, y_bf16, m * ldy + n, dot(&t, uq, s4, m4, act_row(act, M, K, m), K));
                    }
                }
            }
            free(uq), free(tmp), free(s4), free(m4);
        }
    }
    free(act);
    return err;
}
