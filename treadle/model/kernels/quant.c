/* Matrix products with weights held as GGUF's quantized blocks, at the file's bits.
 *
 * A weight row is a run of blocks (32 values for Q4_0 ... Q8_0, IQ4_NL and MXFP4, 256 for the
 * K-quants and IQ4_XS). Every type is read through one unpacking rule: block -> unsigned integers
 * `uq` (one byte per value), a float scale per group of 4 values (`s4`) and, for the types with a
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
 * - float32 (`treadle_q_matmul_f32`): y = x . w with the exact weights, summed a weight scale
 *   group (16 or 32 values) at a time along K: for each group, four in-order fma chains over its
 *   values e % 4 = 0 .. 3 of x times the integer code, then
 *       s    = (s0 + s1) + (s2 + s3)                 si = fma(x[e], (float)(uq[e] - off), si)
 *       acc  = fma(s, s4, acc)
 *       acc  = fma(-m4, sum(x over the group), acc)  (types with a minimum; the sum in order)
 *   which is x . w to float32 rounding (the same scale and minimum as the dequantized value) but
 *   leaves a group's chains independent of the next group's (one in-order fma per value along the
 *   whole row held a decode step to one fma's latency per value). A prompt chunk of
 *   quant.F32_SLAB_MIN_ROWS rows or more on a packed weight goes another way (quant.py):
 *   the exact weights, gguf-py's values bit for bit, a slab of rows at a time as the columns of a
 *   buffer (`treadle_q_dequantize_t`, the tiles' unpacking with a store) and torch's sgemm over
 *   them (docs/benchmarks/quantized-weights.md); float32 promises no batch invariance, so a row's
 *   bits there follow sgemm's order, as transformers' own product on the dequantized file does.
 * - int8 activations (`treadle_q_matmul_q8`, for bfloat16 / float16 models, as llama.cpp's CPU
 *   backend does): each row of x is quantized per 32 values to int8 with scale dx = amax / 127
 *   (round half to even); then for each group of the weight's own scale (16 or 32 values), in
 *   order along K, an exact integer sum and two fused multiply-adds:
 *       isum = sum(uq * xq) - off * sum(xq)
 *       acc  = fma((float)isum, s * dx, acc)
 *       acc  = fma(-m, sum(xq) * dx, acc)            (types with a minimum)
 *
 * The instruction-set paths compute these same operations in the same order, so they give the same
 * bits; the caller picks one (`isa`). On AVX-512 VNNI and AVX2, weights are held 16 rows
 * interleaved (the packed layout, below) and a vector holds one output of 16 weight rows (8 on
 * AVX2: a group in two halves); the kernels are written once for both widths (quant_tiles.h).
 * Portable C and the last N % 16 rows take one weight row at a time. Which layout a weight is held
 * in is a flag in the type argument (`| PACKED`): a process on the portable path holds the file's
 * rows as they are (unpacking a row out of the packed layout byte by byte cost that path 90% of
 * its time), and every path reads either layout (the tests run each path on each). Rows of the
 * weight are split across torch's OpenMP threads; one thread computes each output whole. A tile
 * unpacks a group of 16 weight rows for up to 8 rows of x; a prompt chunk of GEMM_MIN_ROWS int8
 * rows or more on the types whose unpacking is costly (Q2_K, Q3_K, Q5_K, Q6_K) unpacks each group
 * once into a per-thread buffer and takes every row through it (quant_tiles.h, `replay`): the
 * same operations per row, so the same bits.
 *
 * Built once per path and product (quant_lib.py): TREADLE_Q_TILES = 512 compiles the AVX-512 VNNI
 * tiles, 256 the AVX2 ones, 0 neither; TREADLE_Q_EXACT = 1 the float32 product's tiles, 0 the int8
 * one's (compiling all four took ~10 s of a first start, one ~3). A library asked for tiles it
 * lacks refuses (4) rather than run the product one row at a time.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#ifndef TREADLE_Q_TILES
#define TREADLE_Q_TILES 0
#endif
#ifndef TREADLE_Q_EXACT
#define TREADLE_Q_EXACT 0
#endif

/* y_bf16 of the products: 0 float32 rows, 1 bfloat16 rows, BF16_IN_F32 float32 rows holding the
 * bfloat16-rounded values (the logits in float32 without a bf16 array beside them; the same bits
 * as a bf16 product widened) */
#define BF16_IN_F32 2

#include <immintrin.h>

#define M_TILE 32 /* rows of x per pass over an unpacked weight row */
#define GEMM_MIN_ROWS 64 /* int8 rows from which a product unpacks each weight group once (quant_tiles.h, replay) */

/* Each quantized type's GGUF id, values per block and bytes per block: the one table of them. The
 * library exports it (treadle_q_block_geometry) and quant_lib checks its TYPES against it at load. */
#define Q_TYPES(X)                                                                                     \
    X(Q4_0, 2, 32, 18) X(Q4_1, 3, 32, 20) X(Q5_0, 6, 32, 22) X(Q5_1, 7, 32, 24) X(Q8_0, 8, 32, 34)     \
    X(Q2_K, 10, 256, 84) X(Q3_K, 11, 256, 110) X(Q4_K, 12, 256, 144) X(Q5_K, 13, 256, 176)            \
    X(Q6_K, 14, 256, 210) X(IQ4_NL, 20, 32, 18) X(IQ4_XS, 23, 256, 136) X(MXFP4, 39, 32, 17)
#define Q_TYPE_ENUM(name, id, elems, bytes) T_##name = id, name##_ELEMS = elems, name##_BYTES = bytes,
enum { Q_TYPES(Q_TYPE_ENUM) };
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512_VNNI = 2 };
#define PACKED 0x100 /* in a type argument: the weight is held in the packed layout */

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* ggml's kvalues_mxfp4: the FP4 (E2M1) values doubled, code 8 (-0) as 0; ggml_e8m0_to_fp32_half halves the scale */
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ggml_e8m0_to_fp32_half: an E8M0 scale byte e as 2^(e - 128), exactly (e < 2: a subnormal, as ggml
 * writes it; e = 255, E8M0's NaN, as 2^127, as ggml and gguf-py read it) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

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
 * on; that took both to 45 GB/s. The request is for the L2 cache, not L1 (locality 1,
 * prefetcht2): asked into L1, the lines in flight were bounded by L1's few miss buffers, and on an
 * AMD EPYC a thread's products from memory ran well below the same lines asked into L2, from where
 * the kernel's loads still find them (docs/benchmarks/quantized-weights.md, "At 8B"). A prefetch
 * past the end of the weight is harmless (it never faults), and a prefetch changes no result. */
#define PREFETCH_AHEAD 8192
static inline void prefetch_ahead(const uint8_t *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + PREFETCH_AHEAD + i, 0, 1);
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

/* codes MXFP4_VALUES + 16 (4 .. 28: below 64, AVX2's cheaper products), offset 16; the scale a power of two */
static void unpack_mxfp4(const uint8_t *b, uint8_t *uq, float *s4, float *m4) {
    (void)m4;
    const uint8_t *qs = b + 1;
    for (int j = 0; j < 16; j++) {
        uq[j] = (uint8_t)(MXFP4_VALUES[qs[j] & 15] + 16);
        uq[j + 16] = (uint8_t)(MXFP4_VALUES[qs[j] >> 4] + 16);
    }
    fill(s4, e8m0_half(b[0]), 8);
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
    case T_Q4_0: *t = (qtype){Q4_0_ELEMS, Q4_0_BYTES, 8, 3, 0, unpack_q4_0}; return 0;
    case T_Q4_1: *t = (qtype){Q4_1_ELEMS, Q4_1_BYTES, 0, 0, 1, unpack_q4_1}; return 0;
    case T_Q5_0: *t = (qtype){Q5_0_ELEMS, Q5_0_BYTES, 16, 4, 0, unpack_q5_0}; return 0;
    case T_Q5_1: *t = (qtype){Q5_1_ELEMS, Q5_1_BYTES, 0, 0, 1, unpack_q5_1}; return 0;
    case T_Q8_0: *t = (qtype){Q8_0_ELEMS, Q8_0_BYTES, 128, 7, 0, unpack_q8_0}; return 0;
    case T_IQ4_NL: *t = (qtype){IQ4_NL_ELEMS, IQ4_NL_BYTES, 128, 7, 0, unpack_iq4_nl}; return 0;
    case T_Q2_K: *t = (qtype){Q2_K_ELEMS, Q2_K_BYTES, 0, 0, 1, unpack_q2_k}; return 0;
    case T_Q3_K: *t = (qtype){Q3_K_ELEMS, Q3_K_BYTES, 4, 2, 0, unpack_q3_k}; return 0;
    case T_Q4_K: *t = (qtype){Q4_K_ELEMS, Q4_K_BYTES, 0, 0, 1, unpack_q4_k}; return 0;
    case T_Q5_K: *t = (qtype){Q5_K_ELEMS, Q5_K_BYTES, 0, 0, 1, unpack_q5_k}; return 0;
    case T_Q6_K: *t = (qtype){Q6_K_ELEMS, Q6_K_BYTES, 32, 5, 0, unpack_q6_k}; return 0;
    case T_IQ4_XS: *t = (qtype){IQ4_XS_ELEMS, IQ4_XS_BYTES, 128, 7, 0, unpack_iq4_xs}; return 0;
    case T_MXFP4: *t = (qtype){MXFP4_ELEMS, MXFP4_BYTES, 16, 4, 0, unpack_mxfp4}; return 0;
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

/* ---- float32 activations ---- */

/* one output of the float32 rule (the header): per weight scale group of t->gs values, four fma
 * chains over its values e % 4 = 0 .. 3 of x times the integer code, their sum (s0 + s1) + (s2 + s3)
 * times the group's scale into acc, then (types with a minimum) the group's sum of x `xs` times
 * the minimum; the vector tiles compute the same per lane */
#define DOT_GROUPED(name, target)                                                                                                  \
    target static float name(const qtype *t, const float *x, const float *xs, const uint8_t *uq, const float *s4, const float *m4, \
                             int64_t K) {                                                                                          \
        float acc = 0.0f;                                                                                                          \
        for (int64_t g = 0; g < K; g += t->gs) {                                                                                   \
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                                                                 \
            for (int e = 0; e < t->gs; e++) s[e & 3] = fmaf(x[g + e], (float)((int)uq[g + e] - t->off), s[e & 3]);                 \
            acc = fmaf((s[0] + s[1]) + (s[2] + s[3]), s4[g / 4], acc);                                                             \
            if (t->has_min) acc = fmaf(-m4[g / 4], xs[g / t->gs], acc);                                                            \
        }                                                                                                                          \
        return acc;                                                                                                                \
    }
DOT_GROUPED(dot_f32_portable, )
DOT_GROUPED(dot_f32_avx2, TARGET_AVX2)
DOT_GROUPED(dot_f32_avx512, TARGET_VNNI)

/* float32 rows x [M, K] and, for the types with a minimum, each row's sums of x over the weight's
 * scale groups (xs [M, groups], each summed in order): what the float32 tiles read through `act` */
typedef struct {
    const float *x, *xs;
    int64_t groups;
} fxrows;

static float *group_sums(const float *x, int64_t M, int64_t K, int gs) {
    float *xs = malloc((size_t)(M * (K / gs)) * sizeof(float));
    if (xs)
        for (int64_t i = 0; i < M * (K / gs); i++) {
            const float *v = x + i * gs; /* group i % (K / gs) of row i / (K / gs): rows are K apart */
            float sum = 0.0f;
            for (int e = 0; e < gs; e++) sum += v[e];
            xs[i] = sum;
        }
    return xs;
}

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
            const uint8_t *b = row + (e / Q8_0_ELEMS) * Q8_0_BYTES;
            _mm256_storeu_si256((__m256i *)(uq + e), _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), x80));
            _mm256_storeu_ps(s4 + e / 4, _mm256_set1_ps(f16_avx2(b)));
        }
        return;
    }
    if (type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1) {
        const int size = type == T_Q4_0 ? Q4_0_BYTES : type == T_Q4_1 ? Q4_1_BYTES : type == T_Q5_0 ? Q5_0_BYTES : Q5_1_BYTES;
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
            const uint8_t *blk = row + (e / Q4_K_ELEMS) * (q5 ? Q5_K_BYTES : Q4_K_BYTES), *qs = blk + (q5 ? 48 : 16);
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
            const uint8_t *blk = row + (e / Q6_K_ELEMS) * Q6_K_BYTES;
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
 * (d, m, dmin) as the 16 rows' fields side by side (MXFP4's one-byte scale likewise, 16 bytes),
 * every other byte in 4-byte pieces, piece t of the 16 rows side by side (one 64-byte vector per
 * piece). Q8_0's quants are stored + 128 (as unsigned bytes). A vector then holds the same 4
 * values of 16 rows (in its low and high nibbles, for the 4-bit codes): what the integer dot
 * product multiplies with one broadcast quad of x. */

typedef struct {
    int p0, p1, xor80; /* bytes [p0, p1) of a block in 4-byte pieces; the rest are 2-byte fields */
    int b1;            /* ... but bytes [0, b1) are 1-byte fields (MXFP4's scale) */
} packdesc;

static int pack_desc(int type, packdesc *p) {
    switch (type) {
    case T_Q4_0: case T_IQ4_NL: case T_Q5_0: *p = (packdesc){2, type == T_Q5_0 ? Q5_0_BYTES : Q4_0_BYTES, 0}; return 1;
    case T_Q4_1: case T_Q5_1: *p = (packdesc){4, type == T_Q5_1 ? Q5_1_BYTES : Q4_1_BYTES, 0}; return 1;
    case T_Q8_0: *p = (packdesc){2, Q8_0_BYTES, 1}; return 1;
    case T_Q4_K: case T_Q5_K: *p = (packdesc){4, type == T_Q5_K ? Q5_K_BYTES : Q4_K_BYTES, 0}; return 1;
    case T_Q6_K: *p = (packdesc){0, 208, 0}; return 1;
    case T_Q2_K: *p = (packdesc){0, 80, 0}; return 1;
    case T_Q3_K: *p = (packdesc){0, 108, 0}; return 1;
    case T_IQ4_XS: *p = (packdesc){4, IQ4_XS_BYTES, 0}; return 1;
    case T_MXFP4: *p = (packdesc){1, MXFP4_BYTES, 0, 1}; return 1;
    default: return 0;
    }
}

/* where byte j of row r's block lands in the 16 rows' packed block: a field or a piece starting at
 * byte f of the block, of n bytes, lands at 16 * f, row r's n bytes at 16 * f + r * n */
static inline int packed_pos(const packdesc *p, int r, int j) {
    if (j < p->b1) return 16 * j + r;
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

/* One block of a 16-row group moved between the rows (each `rb` bytes apart) and its packed block:
 * each 2-byte field and 4-byte piece as a whole (packed_pos's layout), the 16 rows' copies of
 * one written (or read) side by side. */
static inline void pack_block(const packdesc *p, int bytes, uint8_t *rows, int64_t rb, uint8_t *packed, int to_file) {
    const uint32_t flip = p->xor80 ? 0x80808080u : 0;
    for (int f = 0; f < bytes;) {
        const uint32_t x = f >= p->p0 ? flip : 0;
        if (f < p->b1) { /* a 1-byte field */
            for (int r = 0; r < 16; r++) {
                uint8_t *row = rows + r * rb + f, *at = packed + 16 * f + r;
                if (to_file)
                    *row = *at;
                else
                    *at = *row;
            }
            f += 1;
        } else if (f >= p->p0 && f < p->p1) { /* a piece */
            for (int r = 0; r < 16; r++) {
                uint8_t *row = rows + r * rb + f, *at = packed + 16 * f + r * 4;
                uint32_t v;
                memcpy(&v, to_file ? at : row, 4);
                v ^= x;
                memcpy(to_file ? row : at, &v, 4);
            }
            f += 4;
        } else { /* a field */
            for (int r = 0; r < 16; r++) {
                uint8_t *row = rows + r * rb + f, *at = packed + 16 * f + r * 2;
                uint16_t v;
                memcpy(&v, to_file ? at : row, 2);
                v ^= (uint16_t)x;
                memcpy(to_file ? row : at, &v, 2);
            }
            f += 2;
        }
    }
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
    /* 16-row groups over the threads (loading a model: the pass over its bytes is the load's largest) */
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < grouped / 16; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *packed = (to_file ? (uint8_t *)src : dst) + g * 16 * rb + b * 16 * t.bytes;
            uint8_t *rows = (to_file ? dst : (uint8_t *)src) + g * 16 * rb + b * t.bytes;
            pack_block(&p, t.bytes, rows, rb, packed, to_file);
        }
    memcpy(dst + grouped * rb, src + grouped * rb, (size_t)((N - grouped) * rb));
    return 0;
}

/* ---- the packed layout's kernels (quant_tiles.h), for AVX-512 VNNI and for AVX2 ---- */

typedef void (*group_fn)(const uint8_t *, int64_t, char *, int64_t, int64_t, int64_t, int64_t, void *, int64_t, int, int64_t);
/* the dequantizing store's slab: row e of W^T at out + e * ld (quant_tiles.h, EXACT 2) */
typedef struct {
    float *out;
    int64_t ld;
} wstore;
typedef void (*store_fn)(const uint8_t *, int64_t, char *, int64_t);
/* a prompt chunk's unpacked weight group (quant_tiles.h, EXACT 3): where the next scale group's codes
 * and floats go, and what the last one recorded (values per scale, MODE, offset) */
typedef struct {
    uint8_t *u;
    float *f;
    int gs, mode, off;
} ucursor;
/* each thread's buffer for it, grown to the widest K it has seen (chunk_buffer_for) and kept for the
 * thread's life (torch's OpenMP threads live as long as the process) */
static __thread struct {
    uint8_t *u;
    float *f;
    int64_t K;
} chunk_buffer;

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
    if (y_bf16 == BF16_IN_F32) {
        _mm512_storeu_ps((float *)y + i, _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)));
        return;
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)y + i), _mm512_cvtepi32_epi16(r));
}

/* acc + the 4-byte dot products of u's lanes with the quad of x at p, the quad broadcast by the
 * product's own load (an embedded broadcast: of _mm512_set1_epi32 the compiler makes a separate
 * broadcast instruction per product, and those competed with the products for the core) */
TARGET_FAST static inline __m512i dpbusd_quad(__m512i acc, __m512i u, const int32_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*p));
    return acc;
}

#define TW TARGET_FAST
#define SFX(name) name##_512
#define LANES 16
#define VI __m512i
#define VF __m512
#define I_SET1_32 _mm512_set1_epi32
#define I_SET1_8 _mm512_set1_epi8
#define I_ZERO _mm512_setzero_si512()
#define I_AND _mm512_and_si512
#define I_OR _mm512_or_si512
#define I_SRLI32 _mm512_srli_epi32
#define I_SLLI32 _mm512_slli_epi32
#define I_SRAI32 _mm512_srai_epi32
#define I_SRLI16 _mm512_srli_epi16
#define I_SLLI16 _mm512_slli_epi16
#define I_SUB32 _mm512_sub_epi32
#define I_ADD32 _mm512_add_epi32
#define I_ADD8 _mm512_add_epi8
#define I_SHUF8 _mm512_shuffle_epi8
#define I_BCAST128 _mm512_broadcast_i32x4
#define F_ZERO _mm512_setzero_ps()
#define F_SET1 _mm512_set1_ps
#define F_CVT32 _mm512_cvtepi32_ps
#define F_MUL _mm512_mul_ps
#define F_ADD _mm512_add_ps
#define F_SUB _mm512_sub_ps
#define F_FMA _mm512_fmadd_ps
#define F_FNMA _mm512_fnmadd_ps
#define LOADV(p) _mm512_loadu_si512((const void *)(p))
#define F16V(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define U16V(p) _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p)))
#define U8V(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define I_MAX32 _mm512_max_epi32
#define F_BITS _mm512_castsi512_ps
#define ADD_WHERE(u, bits, mask, addend) _mm512_mask_add_epi8((u), _mm512_test_epi8_mask((bits), (mask)), (u), (addend))
#define DOT8(acc, u0, u1, xp, wide) dpbusd_quad(dpbusd_quad((acc), (u0), (xp)), (u1), (xp) + 1)
#define DOT4_SHIFT(wide) 0
#define STOREV store16
#define F_STOREU _mm512_storeu_ps
#define F_LOADU _mm512_loadu_ps
#define I_STOREU(p, v) _mm512_storeu_si512((void *)(p), (v))
#if TREADLE_Q_TILES == 512
#include "quant_tiles.h"
#endif
#undef TW
#undef SFX
#undef LANES
#undef VI
#undef VF
#undef I_SET1_32
#undef I_SET1_8
#undef I_ZERO
#undef I_AND
#undef I_OR
#undef I_SRLI32
#undef I_SLLI32
#undef I_SRAI32
#undef I_SRLI16
#undef I_SLLI16
#undef I_SUB32
#undef I_ADD32
#undef I_ADD8
#undef I_SHUF8
#undef I_BCAST128
#undef F_ZERO
#undef F_SET1
#undef F_CVT32
#undef F_MUL
#undef F_ADD
#undef F_SUB
#undef F_FMA
#undef F_FNMA
#undef LOADV
#undef F16V
#undef U16V
#undef U8V
#undef I_MAX32
#undef F_BITS
#undef ADD_WHERE
#undef DOT8
#undef DOT4_SHIFT
#undef STOREV
#undef F_STOREU
#undef F_LOADU
#undef I_STOREU

/* AVX2 (8 lanes: half a group at a time). No 4-byte dot product instruction: maddubs multiplies
 * unsigned by signed bytes and adds pairs into 16 bits, saturating, then madd adds the pairs into
 * 32 bits. Codes below 64 go in unsigned as they are (63 * 127 * 2 < 32767). Codes up to 255 (Q8_0,
 * IQ4) as w = code - 128, signed: |w| * (x * sign(w)), at most 128 * 127 * 2 = 32512, so the sum is
 * sum((code - 128) * x), from which the rule's integer follows exactly (DOT4_SHIFT). */
TARGET_AVX2F static inline __m256i dot4_avx2(__m256i acc, __m256i u, int32_t x4, int wide) {
    const __m256i x = _mm256_set1_epi32(x4);
    __m256i p;
    if (wide) {
        const __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
        p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    } else {
        p = _mm256_maddubs_epi16(u, x);
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* Two quads at once: codes below 64 (not `wide`) give maddubs pair sums of at most 63 * 128 * 2 =
 * 16128 in magnitude, so two such products add in 16 bits (at most 32256) before one madd: the
 * same integer as two dot4_avx2, in five operations where those took six. */
TARGET_AVX2F static inline __m256i dot8_avx2(__m256i acc, __m256i u0, __m256i u1, int32_t x0, int32_t x1, int wide) {
    if (wide) return dot4_avx2(dot4_avx2(acc, u0, x0, 1), u1, x1, 1);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, _mm256_set1_epi32(x0)), _mm256_maddubs_epi16(u1, _mm256_set1_epi32(x1)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

TARGET_AVX2F static inline void store8(void *y, int y_bf16, int64_t i, __m256 v) {
    if (!y_bf16) {
        _mm256_storeu_ps((float *)y + i, v);
        return;
    }
    const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), _mm256_and_si256(hi, _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    if (y_bf16 == BF16_IN_F32) {
        _mm256_storeu_ps((float *)y + i, _mm256_castsi256_ps(_mm256_slli_epi32(r, 16)));
        return;
    }
    /* the low 16 bits of each lane, in order */
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)y + i), packed);
}

#define TW TARGET_AVX2F
#define SFX(name) name##_256
#define LANES 8
#define VI __m256i
#define VF __m256
#define I_SET1_32 _mm256_set1_epi32
#define I_SET1_8 _mm256_set1_epi8
#define I_ZERO _mm256_setzero_si256()
#define I_AND _mm256_and_si256
#define I_OR _mm256_or_si256
#define I_SRLI32 _mm256_srli_epi32
#define I_SLLI32 _mm256_slli_epi32
#define I_SRAI32 _mm256_srai_epi32
#define I_SRLI16 _mm256_srli_epi16
#define I_SLLI16 _mm256_slli_epi16
#define I_SUB32 _mm256_sub_epi32
#define I_ADD32 _mm256_add_epi32
#define I_ADD8 _mm256_add_epi8
#define I_SHUF8 _mm256_shuffle_epi8
#define I_BCAST128 _mm256_broadcastsi128_si256
#define F_ZERO _mm256_setzero_ps()
#define F_SET1 _mm256_set1_ps
#define F_CVT32 _mm256_cvtepi32_ps
#define F_MUL _mm256_mul_ps
#define F_ADD _mm256_add_ps
#define F_SUB _mm256_sub_ps
#define F_FMA _mm256_fmadd_ps
#define F_FNMA _mm256_fnmadd_ps
#define LOADV(p) _mm256_loadu_si256((const __m256i *)(p))
#define F16V(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define U16V(p) _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define U8V(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define I_MAX32 _mm256_max_epi32
#define F_BITS _mm256_castsi256_ps
#define ADD_WHERE(u, bits, mask, addend) \
    _mm256_add_epi8((u), _mm256_andnot_si256(_mm256_cmpeq_epi8(_mm256_and_si256((bits), (mask)), _mm256_setzero_si256()), (addend)))
#define DOT8(acc, u0, u1, xp, wide) dot8_avx2((acc), (u0), (u1), (xp)[0], (xp)[1], (wide))
#define DOT4_SHIFT(wide) ((wide) ? 128 : 0)
#define STOREV store8
#define F_STOREU _mm256_storeu_ps
#define F_LOADU _mm256_loadu_ps
#define I_STOREU(p, v) _mm256_storeu_si256((__m256i *)(p), (v))
#if TREADLE_Q_TILES == 256
#include "quant_tiles.h"
#endif

/* ---- entry points ---- */

/* the packed layout's kernel for this path and type (NULL: the row-at-a-time path's) */
static group_fn group_kernel(int isa, int type, int exact) {
#if TREADLE_Q_TILES == 512
    return isa == ISA_AVX512_VNNI ? group_kernel_512(type, exact) : NULL;
#elif TREADLE_Q_TILES == 256
    return isa == ISA_AVX2 ? group_kernel_256(type, exact) : NULL;
#else
    (void)isa, (void)type, (void)exact;
    return NULL;
#endif
}

/* the packed layout's dequantizing store for this path and type (NULL: rows one at a time) */
static store_fn store_kernel(int isa, int type) {
#if TREADLE_Q_TILES == 512 && TREADLE_Q_EXACT
    return isa == ISA_AVX512_VNNI ? store_kernel_512(type) : NULL;
#elif TREADLE_Q_TILES == 256 && TREADLE_Q_EXACT
    return isa == ISA_AVX2 ? store_kernel_256(type) : NULL;
#else
    (void)isa, (void)type;
    return NULL;
#endif
}

/* the packed layout's prompt-chunk kernel for this path and type (int8 activations; NULL: none) */
static group_fn gemm_kernel(int isa, int type) {
#if TREADLE_Q_TILES == 512 && !TREADLE_Q_EXACT
    return isa == ISA_AVX512_VNNI ? gemm_kernel_512(type) : NULL;
#elif TREADLE_Q_TILES == 256 && !TREADLE_Q_EXACT
    return isa == ISA_AVX2 ? gemm_kernel_256(type) : NULL;
#else
    (void)isa, (void)type;
    return NULL;
#endif
}

/* this thread's chunk buffer made room for weight rows of K values: 0, or 1 where it could not be.
 * Per 32 values: 8 quads of at most 16 lanes' 4 bytes, and at most two scale groups' scale and
 * minimum for 16 lanes. */
static int chunk_buffer_for(int64_t K) {
    if (chunk_buffer.K >= K) return 0;
    free(chunk_buffer.u), free(chunk_buffer.f);
    chunk_buffer.u = malloc((size_t)K * 16);
    chunk_buffer.f = malloc((size_t)K * 2 * sizeof(float));
    chunk_buffer.K = chunk_buffer.u && chunk_buffer.f ? K : 0;
    return chunk_buffer.K ? 0 : 1;
}

/* whether this library holds the path's kernels for that product (the portable path's are in every one) */
static int built_for(int isa, int exact) {
    return isa == ISA_PORTABLE ||
           (exact == TREADLE_Q_EXACT && ((isa == ISA_AVX512_VNNI && TREADLE_Q_TILES == 512) || (isa == ISA_AVX2 && TREADLE_Q_TILES == 256)));
}

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

/* a type's values and bytes per block (Q_TYPES) through elems and bytes, or -1 for a type it lacks */
int treadle_q_block_geometry(int type, int *elems, int *bytes) {
    switch (type) {
#define Q_TYPE_CASE(name, id, e, b) \
    case id: *elems = e; *bytes = b; return 0;
        Q_TYPES(Q_TYPE_CASE)
    default: return -1;
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
    if (y_bf16 == BF16_IN_F32)
        ((float *)y)[i] = bf16_to_f32(f32_to_bf16(v));
    else if (y_bf16)
        ((uint16_t *)y)[i] = f32_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* A thread's buffers for weight rows taken one at a time: the codes, a packed row's bytes, the
 * scales and minimums per 4 values, the row's exact values. */
typedef struct {
    uint8_t *uq, *tmp;
    float *s4, *m4, *f;
} row_buffers;

static int row_buffers_alloc(row_buffers *b, int64_t K) {
    b->uq = malloc((size_t)K), b->tmp = malloc((size_t)K * 2);
    b->s4 = malloc((size_t)K), b->m4 = malloc((size_t)K), b->f = malloc((size_t)K * 4);
    return b->uq && b->tmp && b->s4 && b->m4 && b->f;
}

static void row_buffers_free(row_buffers *b) { free(b->uq), free(b->tmp), free(b->s4), free(b->m4), free(b->f); }

/* row n of a stored [N, K] weight, dequantized exactly (gguf-py's values), into b->f */
static const float *exact_row(const qtype *t, int type, int packed, const uint8_t *w, int64_t N, int64_t K, int64_t n, row_buffers *b) {
    unpack_row(t, file_row(type, packed, t, w, N, K, n, b->tmp), K, b->uq, b->s4, b->m4);
    dequantize_unpacked(t, K, b->uq, b->s4, b->m4, b->f);
    return b->f;
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
        row_buffers b;
        if (!row_buffers_alloc(&b, K)) {
#pragma omp atomic write
            err = 2;
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) {
                const float *f = exact_row(&t, type, packed, w, N, K, ids ? ids[i] : i, &b);
                for (int64_t e = 0; e < K; e++) store(y, y_bf16, i * K + e, f[e]);
            }
        }
        row_buffers_free(&b);
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
    if (!built_for(isa, 1)) return 4;
    float (*dot)(const qtype *, const float *, const float *, const uint8_t *, const float *, const float *, int64_t) =
        isa == ISA_AVX512_VNNI ? dot_f32_avx512 : isa == ISA_AVX2 ? dot_f32_avx2 : dot_f32_portable;
    const fxrows rows = {x, t.has_min ? group_sums(x, M, K, t.gs) : NULL, K / t.gs};
    if (t.has_min && !rows.xs) return 2;
    const int64_t rb = K / t.elems * t.bytes;
    const group_fn x16 = packed ? group_kernel(isa, type, 1) : NULL;
    const int64_t groups = x16 ? N / 16 : 0;
    const int parallel = (double)M * (double)N * (double)K >= 2e5;
    int err = 0;
#pragma omp parallel if (parallel)
    {
        for (int64_t m0 = 0; m0 < M && groups; m0 += M_TILE) {
            const int64_t m1 = m0 + M_TILE < M ? m0 + M_TILE : M;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) x16(w + g * 16 * rb, K / t.elems, (char *)&rows, M, K, m0, m1, y, ldy, y_bf16, g * 16);
        }
        if (groups * 16 < N) {
            row_buffers b;
            if (!row_buffers_alloc(&b, K)) {
#pragma omp atomic write
                err = 2;
            } else {
#pragma omp for schedule(static)
                for (int64_t n = groups * 16; n < N; n++) {
                    prefetch_ahead(w + n * rb, rb);
                    unpack_row(&t, file_row(type, packed, &t, w, N, K, n, b.tmp), K, b.uq, b.s4, b.m4);
                    for (int64_t m = 0; m < M; m++)
                        store(y, y_bf16, m * ldy + n, dot(&t, x + m * K, rows.xs ? rows.xs + m * rows.groups : NULL, b.uq, b.s4, b.m4, K));
                }
            }
            row_buffers_free(&b);
        }
    }
    free((void *)rows.xs);
    return err;
}

/* Rows n0 .. n1 of a stored [N, K] weight dequantized exactly (the float32 product's weights,
 * gguf-py's values) into the columns of out [K, ldo]: out[e * ldo + n - n0]. A float32 prompt chunk
 * multiplies a slab of these with one sgemm (quant.py). n0 a multiple of 16; n1 too, or N. */
int treadle_q_dequantize_t(int type, const uint8_t *w, int64_t N, int64_t K, int64_t n0, int64_t n1, float *out, int64_t ldo, int isa) {
    const int packed = (type & PACKED) != 0;
    type &= ~PACKED;
    qtype t;
    if (qtype_of(type, &t) || K % t.elems) return 1;
    if (n0 < 0 || n0 % 16 || n1 < n0 || n1 > N || (n1 % 16 && n1 != N) || ldo < n1 - n0) return 1;
    if (!treadle_q_isa_supported(isa)) return 3;
    if (!built_for(isa, 1)) return 4;
    const int64_t rb = K / t.elems * t.bytes;
    const store_fn x16 = packed ? store_kernel(isa, type) : NULL;
    const int64_t g1 = x16 ? (n1 < N / 16 * 16 ? n1 : N / 16 * 16) / 16 : n0 / 16; /* whole groups the vector store takes */
    int err = 0;
#pragma omp parallel
    {
        const wstore ws = {out, ldo};
#pragma omp for schedule(static) nowait
        for (int64_t g = n0 / 16; g < g1; g++) x16(w + g * 16 * rb, K / t.elems, (char *)&ws, g * 16 - n0);
        if (g1 * 16 < n1) {
            row_buffers b;
            if (!row_buffers_alloc(&b, K)) {
#pragma omp atomic write
                err = 2;
            } else {
#pragma omp for schedule(static)
                for (int64_t n = g1 * 16; n < n1; n++) {
                    const float *f = exact_row(&t, type, packed, w, N, K, n, &b);
                    for (int64_t e = 0; e < K; e++) out[e * ldo + n - n0] = f[e];
                }
            }
            row_buffers_free(&b);
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
    if (!built_for(isa, 0)) return 4;
    char *act = malloc(act_bytes(M, K));
    if (!act) return 2;
    const size_t elem = x_bf16 ? 2 : 4;
    const int64_t rb = K / t.elems * t.bytes;
    /* a prompt chunk of GEMM_MIN_ROWS rows or more: each weight group unpacked once for all its rows */
    const group_fn chunk = packed && M >= GEMM_MIN_ROWS ? gemm_kernel(isa, type) : NULL;
    const group_fn x16 = chunk ? chunk : packed ? group_kernel(isa, type, 0) : NULL;
    const int64_t m_tile = chunk ? M : M_TILE;
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
        const int ready = !chunk || !chunk_buffer_for(K);
        if (!ready) {
#pragma omp atomic write
            err = 2;
        }
        for (int64_t m0 = 0; m0 < M && groups; m0 += m_tile) {
            const int64_t m1 = m0 + m_tile < M ? m0 + m_tile : M;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++)
                if (ready) x16(w + g * 16 * rb, K / t.elems, act, M, K, m0, m1, y, ldy, y_bf16, g * 16);
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

/* ---- float32 rows quantized into blocks (--quantization, model/quantize.py): gguf-py's rounding
 * for Q8_0, Q4_0 and Q5_0 and quantize.py's Q4_K, the same bytes as those numpy forms (float32
 * operations in the same order; built without contraction), 2-14x faster. Finite values; a block
 * whose scale underflows (largest magnitude under ~1e-36) gets codes 0 where numpy's are undefined
 * (the values are 0 either way: its float16 scale is). Q4_K's factors are never -0. ---- */

/* float32 -> float16 bits, round to nearest even (numpy's astype(float16)), subnormals and overflow included */
static uint16_t f32_to_f16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 0xffu;
    uint32_t man = x & 0x7fffffu;
    if (exp == 0xffu) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0u)); /* inf, nan */
    const int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 0x1f) return (uint16_t)(sign | 0x7c00u); /* too large: inf */
    if (e <= 0) {                                      /* a float16 subnormal, or zero */
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000u;
        const int shift = 14 - e;
        const uint32_t half = 1u << (shift - 1), rest = man & ((1u << shift) - 1);
        uint32_t h = man >> shift;
        if (rest > half || (rest == half && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = sign | ((uint32_t)e << 10) | (man >> 13);
    const uint32_t rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* a carry moves into the exponent, as it should */
    return (uint16_t)h;
}

static inline void put_f16(uint8_t *o, float v) {
    const uint16_t h = f32_to_f16_bits(v);
    o[0] = (uint8_t)(h & 0xff), o[1] = (uint8_t)(h >> 8);
}

/* gguf-py's np_roundf: half away from zero, as sign(n) * (floor(|n|) + floor(2 (|n| - floor(|n|)))) */
static inline float round_away(float n) {
    const float a = fabsf(n), fl = floorf(a), b = fl + floorf(2.0f * (a - fl));
    return n > 0.0f ? b : n < 0.0f ? -b : 0.0f;
}

/* the value of largest magnitude, the first such (np.argmax of abs) */
static inline float signed_absmax(const float *x, int n) {
    int at = 0;
    float best = fabsf(x[0]);
    for (int i = 1; i < n; i++)
        if (fabsf(x[i]) > best) best = fabsf(x[i]), at = i;
    return x[at];
}

static void quantize_q8_0_block(const float *x, uint8_t *o) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]);
    const float d = amax / 127.0f, inv = d == 0.0f ? 0.0f : 1.0f / d, id = isfinite(inv) ? inv : 0.0f;
    put_f16(o, d);
    for (int i = 0; i < 32; i++) o[2 + i] = (uint8_t)(int8_t)round_away(x[i] * id);
}

/* Q4_0 (levels 16, top 15) and Q5_0 (32, 31): q = trunc(x / d + levels / 2 + 0.5), d = max / -(levels / 2) */
static void quantize_q4_q5_block(const float *x, uint8_t *o, int five) {
    const float half = five ? 16.0f : 8.0f, top = five ? 31.0f : 15.0f;
    const float d = signed_absmax(x, 32) / -half, inv = d == 0.0f ? 0.0f : 1.0f / d, id = isfinite(inv) ? inv : 0.0f;
    uint8_t q[32];
    for (int i = 0; i < 32; i++) {
        const float v = truncf(x[i] * id + (half + 0.5f));
        q[i] = !(v > 0.0f) ? 0 : v >= top ? (uint8_t)top : (uint8_t)v; /* (NaN: 0) */
    }
    put_f16(o, d);
    if (!five) {
        for (int j = 0; j < 16; j++) o[2 + j] = (uint8_t)(q[j] | (q[j + 16] << 4));
        return;
    }
    uint32_t qh = 0;
    for (int i = 0; i < 32; i++) qh |= (uint32_t)((q[i] >> 4) & 1u) << i;
    for (int k = 0; k < 4; k++) o[2 + k] = (uint8_t)(qh >> (8 * k));
    for (int j = 0; j < 16; j++) o[6 + j] = (uint8_t)((q[j] & 0x0f) | (q[j + 16] << 4));
}

/* quantize.py's Q4_K: per 32 values scale (max - min) / 15 and minimum -min (min at most 0), the
 * block's 8 scales and minimums coded in 6 bits against its two float16 factors (max / 63) */
static void quantize_q4_k_block(const float *x, uint8_t *o) {
    float scale[8], minimum[8], smax = 0.0f, mmax = 0.0f;
    for (int g = 0; g < 8; g++) {
        float lo = x[32 * g], hi = x[32 * g];
        for (int i = 1; i < 32; i++) {
            const float v = x[32 * g + i];
            if (v < lo) lo = v;
            if (v > hi) hi = v;
        }
        const float low = lo < 0.0f ? lo : 0.0f;
        scale[g] = (hi - low) / 15.0f, minimum[g] = -low;
        if (g == 0 || scale[g] > smax) smax = scale[g];
        if (g == 0 || minimum[g] > mmax) mmax = minimum[g];
    }
    put_f16(o, smax / 63.0f), put_f16(o + 2, mmax / 63.0f);
    o[1] &= 0x7f, o[3] &= 0x7f; /* both are at least 0: never -0 (a constant block's max of -0 and 0) */
    const float df = f16_to_f32(o), dminf = f16_to_f32(o + 2);
    uint8_t sc[8], mn[8];
    for (int g = 0; g < 8; g++) {
        const float s = df > 0.0f ? rintf(scale[g] / df) : 0.0f, m = dminf > 0.0f ? rintf(minimum[g] / dminf) : 0.0f;
        sc[g] = !(s > 0.0f) ? 0 : s >= 63.0f ? 63 : (uint8_t)s;
        mn[g] = !(m > 0.0f) ? 0 : m >= 63.0f ? 63 : (uint8_t)m;
    }
    for (int j = 0; j < 4; j++) {
        o[4 + j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        o[8 + j] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
        o[12 + j] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
    }
    uint8_t q[256];
    for (int g = 0; g < 8; g++) {
        const float step = df * (float)sc[g], off = dminf * (float)mn[g];
        for (int i = 0; i < 32; i++) {
            const float v = step > 0.0f ? rintf((x[32 * g + i] + off) / step) : 0.0f;
            q[32 * g + i] = !(v > 0.0f) ? 0 : v >= 15.0f ? 15 : (uint8_t)v;
        }
    }
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 32; i++) o[16 + 32 * c + i] = (uint8_t)(q[64 * c + i] | (q[64 * c + 32 + i] << 4));
}

/* rows of float32 x [N, K] into `type`'s blocks, out [N, row bytes]; 1 for a type not quantized here */
int treadle_q_quantize(int type, const float *x, int64_t N, int64_t K, uint8_t *out) {
    qtype t;
    if (qtype_of(type, &t) || K % t.elems || (type != T_Q8_0 && type != T_Q4_0 && type != T_Q5_0 && type != T_Q4_K)) return 1;
    const int64_t rb = K / t.elems * t.bytes, blocks = K / t.elems;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + n * K + b * t.elems;
            uint8_t *ob = out + n * rb + b * t.bytes;
            if (type == T_Q8_0)
                quantize_q8_0_block(xb, ob);
            else if (type == T_Q4_K)
                quantize_q4_k_block(xb, ob);
            else
                quantize_q4_q5_block(xb, ob, type == T_Q5_0);
        }
    return 0;
}
