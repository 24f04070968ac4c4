/* The packed-layout kernels of quant.c, written once for two vector widths. Each build of quant.c
 * includes this file for its own path's width (TREADLE_Q_TILES): AVX-512 VNNI (a vector is 16
 * lanes: one output of each of a group's 16 weight rows) or AVX2 (8 lanes: the group's rows 0-7,
 * then 8-15, `half`). Every lane computes the
 * rule of quant.c's header for its own weight row, with the same float operations in the same
 * order on both widths, so they give the same bits; the integer sums are exact either way.
 *
 * Before including, quant.c defines:
 *   TW                   the functions' target attribute
 *   SFX(name)            the names of this width's functions
 *   LANES                16 or 8
 *   VI, VF               the integer and float vector types
 *   and the operations below (I_*, F_*, LOADV, F16V, U16V, U8V, DOT8, ADD_WHERE, STOREV);
 *   TREADLE_Q_EXACT      1: the float32 product's tiles (f32_*), 0: the int8 one's (q8_*).
 *
 * `half` selects a group's rows 8 * half .. 8 * half + 7 on AVX2 and is 0 on AVX-512: a 64-byte
 * piece of the layout holds 16 rows' 4 bytes, of which this width reads bytes 32 * half on;
 * a float16 field holds 16 rows' 2 bytes, of which it reads bytes 16 * half on (a 1-byte field,
 * MXFP4's scale: bytes 8 * half on). */

#define P_OFF(half) ((half) * LANES * 4)  /* into a piece */
#define H_OFF(half) ((half) * LANES * 2)  /* into a float16 field */
#define PIECE(base, k, half) LOADV((base) + 64 * (k) + P_OFF(half))

/* byte i of each lane's quad, as a 32-bit integer (one shuffle; byte 0 one mask) */
TW static inline __attribute__((always_inline)) VI SFX(quad_byte)(VI quad, int i) {
    if (i == 0) return I_AND(quad, I_SET1_32(255));
    const char z = (char)0x80, b0 = (char)i, b1 = (char)(4 + i), b2 = (char)(8 + i), b3 = (char)(12 + i);
    return I_SHUF8(quad, I_BCAST128(_mm_setr_epi8(b0, z, z, z, b1, z, z, z, b2, z, z, z, b3, z, z, z)));
}

/* the float32 rule's weights themselves (EXACT 2's store): for byte i of each lane's quad (value
 * 4q + i of a 32-value group), w = dw * (float)(code - off), then + add (MODE 1) or - add (MODE 2),
 * as gguf-py computes it */
TW static inline __attribute__((always_inline)) VF SFX(exact_weight)(VI quad, int i, VF dw, VF add, const int MODE, int off) {
    VF w = F_MUL(dw, F_CVT32(I_SUB32(SFX(quad_byte)(quad, i), I_SET1_32(off))));
    if (MODE == 1) w = F_ADD(w, add);
    if (MODE == 2) w = F_SUB(w, add);
    return w;
}

/* byte i of each lane's quad less the offset, as a float (exactly) */
TW static inline __attribute__((always_inline)) VF SFX(code_f32)(VI quad, int i, int off) {
    const VI b = SFX(quad_byte)(quad, i);
    return F_CVT32(off ? I_SUB32(b, I_SET1_32(off)) : b);
}

/* chain i (s[m][i]) of one group for MT = 4 or 8 rows: the group's codes for it converted once and
 * held in registers while four rows at a time run their chain over them */
TW static inline __attribute__((always_inline)) void SFX(exact_chain)(const VI *u, const int nq, int off, const float *const *xr, const int MT,
                                                                     int64_t e0, const int i, VF (*s)[4]) {
    const int R = MT < 4 ? MT : 4;
    VF c[8];
    _Pragma("GCC unroll 8") for (int j = 0; j < nq; j++) c[j] = SFX(code_f32)(u[j], i, off);
    _Pragma("GCC unroll 2") for (int m0 = 0; m0 < MT; m0 += R) {
        VF t[4];
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) t[r] = F_ZERO;
        _Pragma("GCC unroll 8") for (int j = 0; j < nq; j++)
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) t[r] = F_FMA(F_SET1(xr[m0 + r][e0 + 4 * j + i]), c[j], t[r]);
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) s[m0 + r][i] = t[r];
    }
}

TW static inline __attribute__((always_inline)) void SFX(exact_chains)(const VI *u, const int nq, int off, const float *const *xr, const int MT,
                                                                      int64_t e0, VF (*s)[4]) {
    SFX(exact_chain)(u, nq, off, xr, MT, e0, 0, s);
    SFX(exact_chain)(u, nq, off, xr, MT, e0, 1, s);
    SFX(exact_chain)(u, nq, off, xr, MT, e0, 2, s);
    SFX(exact_chain)(u, nq, off, xr, MT, e0, 3, s);
}

/* the four chains of MT rows, a function per row count called once per group (inlined into every
 * tile, as the one- and two-row code is, the compiler made slower code of them) */
#define EXACT_CHAINS(MT)                                                                                                           \
    TW static __attribute__((noinline)) void SFX(exact_chains_##MT)(const VI *u, int nq, int off, const float *const *xr, int64_t e0, \
                                                                     VF (*s)[4]) {                                                 \
        if (nq == 8)                                                                                                               \
            SFX(exact_chains)(u, 8, off, xr, MT, e0, s);                                                                           \
        else                                                                                                                       \
            SFX(exact_chains)(u, 4, off, xr, MT, e0, s);                                                                           \
    }
EXACT_CHAINS(4)
EXACT_CHAINS(8)
#undef EXACT_CHAINS

/* float32 x (the float32 product's rule, quant.c's header), quads q0 .. q0 + nq of 32-value group
 * a32 (nq = 4: its 16-value half h16): each row's four chains s_i = fma(x[e], code - off, s_i) over
 * the group's values e = 4q + i in order, then acc = fma((s0 + s1) + (s2 + s3), dw, acc) and, MODE
 * 1 / 2, acc = fma(+/- add, the group's sum of x, acc). No chain waits on another group's. */
TW static inline __attribute__((always_inline)) void SFX(exact_group)(const VI *u, int q0, int nq, VF dw, VF add, const int MODE, int off,
                                                                     const float *const *xr, const int MT, int64_t a32, int h16, VF *acc) {
    const int64_t e0 = 32 * a32 + 4 * q0, g = nq == 8 ? a32 : 2 * a32 + h16;
    VF s[8][4];
    if (MT <= 2) { /* one or two rows convert each code as they go */
        for (int m = 0; m < MT; m++)
            for (int i = 0; i < 4; i++) s[m][i] = F_ZERO;
        for (int j = 0; j < nq; j++)
            for (int i = 0; i < 4; i++) {
                const VF c = SFX(code_f32)(u[q0 + j], i, off);
                for (int m = 0; m < MT; m++) s[m][i] = F_FMA(F_SET1(xr[m][e0 + 4 * j + i]), c, s[m][i]);
            }
    } else if (MT == 4) {
        SFX(exact_chains_4)(u + q0, nq, off, xr, e0, s);
    } else {
        SFX(exact_chains_8)(u + q0, nq, off, xr, e0, s);
    }
    for (int m = 0; m < MT; m++) {
        acc[m] = F_FMA(F_ADD(F_ADD(s[m][0], s[m][1]), F_ADD(s[m][2], s[m][3])), dw, acc[m]);
        if (MODE == 1) acc[m] = F_FMA(add, F_SET1(xr[8 + m][g]), acc[m]);
        if (MODE == 2) acc[m] = F_FNMA(add, F_SET1(xr[8 + m][g]), acc[m]);
    }
}

/* EXACT 2 (the dequantizing store): the float32 rule's weights of quads q0 .. q0 + nq of 32-value
 * group g, each value e of the LANES rows written as one vector at ws->out + e * ws->ld (the
 * weight's columns: a slab of W^T that a float32 prompt chunk multiplies with one sgemm) */
TW static inline __attribute__((always_inline)) void SFX(store_quads)(const VI *u, int q0, int nq, VF dw, VF add, const int MODE, int off,
                                                                     const wstore *ws, int64_t e0) {
    for (int q = q0; q < q0 + nq; q++)
        for (int i = 0; i < 4; i++) F_STOREU(ws->out + (e0 + 4 * q + i) * ws->ld, SFX(exact_weight)(u[q], i, dw, add, MODE, off));
}

/* The int8 rule's operations for MT rows of quantized activations against one weight scale group
 * (below, `consume`). DOT8 adds sum(code * x) over two quads' 8 values to each 32-bit lane, or
 * sum((code - 128) * x) where the codes reach 255 (`off` 128, AVX2's signed products): the sum
 * starts from the rule's -off * sum(xq) less what DOT8 already took away. */
TW static inline __attribute__((always_inline)) void SFX(dot_rows)(const VI *u, int q0, int nq, VF dw, VF add, const int MODE, int off, const arow *a,
                                                                  const int MT, int64_t a32, int h16, VF *acc) {
    const int wide = off >= 128; /* codes up to 255 */
    if (MT >= 4) {
        /* the rows side by side, a pair of quads at a time: the instructions next to each other are
         * independent, where a row after a row left the out-of-order window full of one row's chain
         * (exact integers: any order gives the same sums) */
        VI s[8];
        for (int i = 0; i < MT; i++) s[i] = I_SET1_32((DOT4_SHIFT(wide) - off) * (nq == 8 ? a[i].xs32[a32] : a[i].xs16[2 * a32 + h16]));
        for (int q = q0; q < q0 + nq; q += 2)
            for (int i = 0; i < MT; i++) {
                const int32_t *xq4 = (const int32_t *)(a[i].xq + 32 * a32);
                s[i] = DOT8(s[i], u[q], u[q + 1], xq4 + q, wide);
            }
        for (int i = 0; i < MT; i++) acc[i] = F_FMA(F_CVT32(s[i]), F_MUL(dw, F_SET1(a[i].dx[a32])), acc[i]);
        for (int i = 0; i < MT; i++) {
            const VF sdx = F_SET1(nq == 8 ? a[i].sdx32[a32] : a[i].sdx16[2 * a32 + h16]);
            if (MODE == 1) acc[i] = F_FMA(add, sdx, acc[i]);
            if (MODE == 2) acc[i] = F_FNMA(add, sdx, acc[i]);
        }
        return;
    }
    for (int i = 0; i < MT; i++) {
        const int32_t *xq4 = (const int32_t *)(a[i].xq + 32 * a32);
        const int32_t xs = nq == 8 ? a[i].xs32[a32] : a[i].xs16[2 * a32 + h16];
        VI s0 = I_SET1_32((DOT4_SHIFT(wide) - off) * xs), s1 = I_ZERO;
        for (int q = q0; q < q0 + nq; q += 4) { /* two accumulators, each a pair of quads a time (exact integers: any order) */
            s0 = DOT8(s0, u[q], u[q + 1], xq4 + q, wide);
            s1 = DOT8(s1, u[q + 2], u[q + 3], xq4 + q + 2, wide);
        }
        acc[i] = F_FMA(F_CVT32(I_ADD32(s0, s1)), F_MUL(dw, F_SET1(a[i].dx[a32])), acc[i]);
        const VF sdx = F_SET1(nq == 8 ? a[i].sdx32[a32] : a[i].sdx16[2 * a32 + h16]);
        if (MODE == 1) acc[i] = F_FMA(add, sdx, acc[i]);
        if (MODE == 2) acc[i] = F_FNMA(add, sdx, acc[i]);
    }
}

/* EXACT 3 (a prompt chunk's unpacking, below): the scale group's codes, its scale and (MODE 1 / 2)
 * its minimum appended to the thread's buffer (a ucursor), to be multiplied later by every row */
TW static inline __attribute__((always_inline)) void SFX(record)(const VI *u, int q0, int nq, VF dw, VF add, const int MODE, int off, ucursor *c) {
    for (int q = q0; q < q0 + nq; q++, c->u += LANES * 4) I_STOREU(c->u, u[q]);
    F_STOREU(c->f, dw), c->f += LANES;
    if (MODE) F_STOREU(c->f, add), c->f += LANES;
    c->gs = 4 * nq, c->mode = MODE, c->off = off;
}

/* The consumer of one weight scale group's codes `u` (quads q0 .. q0 + nq of 32-value group a32;
 * nq = 4: its 16-value half h16), scale dw and, MODE 1 / 2, a value added / subtracted (the
 * minimum): the int8 rule's operations for rows of quantized activations (dot_rows), or (EXACT)
 * the float32 rule's on x itself, or (EXACT 2) the exact weights stored, or (EXACT 3) the group
 * recorded for a prompt chunk. */
TW static inline __attribute__((always_inline)) void SFX(consume)(const VI *u, int q0, int nq, VF dw, VF add, const int MODE, int off, const int EXACT,
                                                                 const arow *a, const float *const *xr, const int MT, int64_t a32, int h16, VF *acc) {
    if (EXACT == 3)
        SFX(record)(u, q0, nq, dw, add, MODE, off, (ucursor *)xr[0]);
    else if (EXACT == 2)
        SFX(store_quads)(u, q0, nq, dw, add, MODE, off, (const wstore *)xr[0], 32 * a32);
    else if (EXACT)
        SFX(exact_group)(u, q0, nq, dw, add, MODE, off, xr, MT, a32, h16, acc);
    else
        SFX(dot_rows)(u, q0, nq, dw, add, MODE, off, a, MT, a32, h16, acc);
}

/* a tile's rows of x (quantized rows, or EXACT 1: x itself from `act`, an fxrows, in xr[i] and the
 * rows' group sums in xr[8 + i]; EXACT 2 and 3 read no rows, and EXACT 3's `act` is the ucursor
 * that `consume` finds in xr[0]) and zeroed outputs */
TW static inline __attribute__((always_inline)) void SFX(tile_start)(char *act, int64_t M, int64_t K, int64_t m0, const int MT, const int EXACT,
                                                                    arow *a, const float **xr, VF *acc) {
    if (EXACT == 3) xr[0] = (const float *)act;
    for (int i = 0; i < MT; i++) {
        if (EXACT == 1) {
            const fxrows *f = (const fxrows *)act;
            xr[i] = f->x + (m0 + i) * K;
            xr[8 + i] = f->xs ? f->xs + (m0 + i) * f->groups : NULL;
        } else if (EXACT == 0)
            a[i] = act_row(act, M, K, m0 + i);
        acc[i] = F_ZERO;
    }
}

TW static inline VI SFX(iq4_table)(void) { /* IQ4_VALUES + 128, in each 128-bit lane */
    return I_BCAST128(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166, (char)181, (char)197, (char)217,
                                    (char)241));
}

TW static inline VI SFX(mxfp4_table)(void) { /* MXFP4_VALUES + 16, in each 128-bit lane */
    return I_BCAST128(_mm_setr_epi8(16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4));
}

/* e8m0_half of the LANES scale bytes at p, lane by lane: (e - 1) << 23, or for e < 2 the subnormal
 * (e + 1) << 21 (0x00200000 << e); as signed integers the larger of the two is the right one for
 * every e (4 (e - 1) >= e + 1 exactly where e >= 2), so one max takes the place of a select */
TW static inline VF SFX(e8m0_half)(const uint8_t *p) {
    const VI e = U8V(p);
    return F_BITS(I_MAX32(I_SLLI32(I_SUB32(e, I_SET1_32(1)), 23), I_SLLI32(I_ADD32(e, I_SET1_32(1)), 21)));
}

/* the slab's columns of weight rows n0 + half * LANES on (EXACT 2: `act` is the slab, a wstore) */
TW static inline wstore SFX(store_column)(const char *act, int64_t n0, int half) {
    wstore col = *(const wstore *)act;
    col.out += n0 + half * LANES;
    return col;
}

/* rows m0 .. m0 + MT of x against one group of 16 weight rows (outputs n0 .. n0 + 15): the rule's
 * operations, lane r for weight row n0 + r (the 32-value types) */
TW static inline __attribute__((always_inline)) void SFX(tile32)(const int type, const int MT, const int EXACT, const uint8_t *group, int64_t nb,
                                                                char *act, int64_t M, int64_t K, int64_t m0, void *y, int64_t ldy, int y_bf16, int64_t n0,
                                                                int half) {
    const int with_min = type == T_Q4_1 || type == T_Q5_1, five = type == T_Q5_0 || type == T_Q5_1, mx = type == T_MXFP4;
    const int bytes = type == T_Q4_0 || type == T_IQ4_NL ? Q4_0_BYTES
                      : type == T_Q4_1                     ? Q4_1_BYTES
                      : type == T_Q5_0                     ? Q5_0_BYTES
                      : type == T_Q5_1                     ? Q5_1_BYTES
                      : mx                                 ? MXFP4_BYTES
                                                           : Q8_0_BYTES;
    /* where the codes' pieces start (bytes of the block, times 16): MXFP4's after its 1-byte scale */
    const int qoff = type == T_Q4_1 || type == T_Q5_0 ? (type == T_Q4_1 ? 4 : 6) : type == T_Q5_1 ? 8 : mx ? 1 : 2, qhoff = with_min ? 4 : 2;
    const int off = type == T_Q4_0 ? 8 : type == T_Q5_0 || mx ? 16 : type == T_Q8_0 || type == T_IQ4_NL ? 128 : 0;
    const VI m15 = I_SET1_8(15);
    const VI table = mx ? SFX(mxfp4_table)() : SFX(iq4_table)();
    const VI spread = I_BCAST128(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c));
    arow a[8];
    const float *xr[16];
    VF acc[8];
    SFX(tile_start)(act, M, K, m0, MT, EXACT, a, xr, acc);
    wstore col; /* EXACT 2: `act` is the slab; this half's columns */
    if (EXACT == 2) col = SFX(store_column)(act, n0, half), xr[0] = (const float *)&col;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = group + b * 16 * bytes, *qs = gb + 16 * qoff;
        prefetch_ahead(gb, 16 * bytes);
        const VF d = mx ? SFX(e8m0_half)(gb + half * LANES) : F16V(gb + H_OFF(half));
        const VF mn = with_min ? F16V(gb + 32 + H_OFF(half)) : F_ZERO;
        VI u[8];
        if (type == T_Q8_0) {
            for (int q = 0; q < 8; q++) u[q] = PIECE(qs, q, half);
        } else {
            for (int q = 0; q < 4; q++) {
                const VI v = PIECE(qs, q, half);
                u[q] = I_AND(v, m15);
                u[q + 4] = I_AND(I_SRLI16(v, 4), m15);
            }
            if (type == T_IQ4_NL || mx)
                for (int q = 0; q < 8; q++) u[q] = I_SHUF8(table, u[q]);
            if (five) { /* value 4q + i of a row takes bit 4q + i of its qh */
                const VI qh = PIECE(gb + 16 * qhoff, 0, half);
                for (int q = 0; q < 8; q++) {
                    const VI byte = I_SHUF8(qh, I_ADD8(spread, I_SET1_8((char)(q / 2))));
                    u[q] = ADD_WHERE(u[q], byte, I_SET1_32(q % 2 ? (int)0x80402010 : 0x08040201), I_SET1_8(16));
                }
            }
        }
        SFX(consume)(u, 0, 8, d, mn, with_min ? 1 : 0, off, EXACT, a, xr, MT, b, 0, acc);
    }
    if (EXACT < 2)
        for (int i = 0; i < MT; i++) STOREV(y, y_bf16, (m0 + i) * ldy + n0 + half * LANES, acc[i]);
}

/* The K-quants (256 values a block): Q4_K and Q5_K (32-value groups with 6-bit scales and minimums)
 * and Q6_K (16-value groups with int8 scales), the rule's operations. */
TW static inline __attribute__((always_inline)) void SFX(tilek)(const int type, const int MT, const int EXACT, const uint8_t *group, int64_t nb,
                                                               char *act, int64_t M, int64_t K, int64_t m0, void *y, int64_t ldy, int y_bf16, int64_t n0,
                                                               int half) {
    const int bytes = type == T_Q4_K ? Q4_K_BYTES : type == T_Q5_K ? Q5_K_BYTES : Q6_K_BYTES;
    const VI m15 = I_SET1_8(15), m3 = I_SET1_8(3), m63 = I_SET1_32(63), m30 = I_SET1_32(0x30);
    const VI x10 = I_SET1_8(16);
    arow a[8];
    const float *xr[16];
    VF acc[8];
    SFX(tile_start)(act, M, K, m0, MT, EXACT, a, xr, acc);
    wstore col; /* EXACT 2: `act` is the slab; this half's columns */
    if (EXACT == 2) col = SFX(store_column)(act, n0, half), xr[0] = (const float *)&col;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = group + b * 16 * bytes;
        prefetch_ahead(gb, 16 * bytes);
        if (type == T_Q6_K) {
            const uint8_t *P = gb; /* ql pieces 0..31, qh 32..47, scales 48..51; d after */
            const VF d = F16V(gb + 16 * 208 + H_OFF(half));
            for (int g = 0; g < 8; g++) {
                const int h = g / 4, t = g % 4;
                VI u[8];
                for (int q = 0; q < 8; q++) {
                    const VI ql = PIECE(P, 16 * h + 8 * (t % 2) + q, half), qh = PIECE(P, 32 + 8 * h + q, half);
                    const VI lo = I_AND(t >= 2 ? I_SRLI16(ql, 4) : ql, m15);
                    u[q] = I_OR(lo, I_SLLI16(I_AND(I_SRLI16(qh, 2 * t), m3), 4));
                }
                VF dw[2];
                for (int k = 0; k < 2; k++) { /* sub-block 2g + k: int8 scale, byte (2g + k) % 4 of piece 48 + (2g + k) / 4 */
                    const int sb = 2 * g + k;
                    const VI sc = I_SRAI32(I_SLLI32(PIECE(P, 48 + sb / 4, half), 24 - 8 * (sb % 4)), 24);
                    dw[k] = F_MUL(d, F_CVT32(sc));
                }
                const int64_t a32 = b * 8 + g;
                SFX(consume)(u, 0, 4, dw[0], dw[0], 0, 32, EXACT, a, xr, MT, a32, 0, acc);
                SFX(consume)(u, 4, 4, dw[1], dw[1], 0, 32, EXACT, a, xr, MT, a32, 1, acc);
            }
            continue;
        }
        const int q5 = type == T_Q5_K;
        const uint8_t *P = gb + 64; /* pieces: scales 0..2, (Q5_K: qh 3..10), qs after */
        const int qs0 = q5 ? 11 : 3;
        const VF d = F16V(gb + H_OFF(half)), dmin = F16V(gb + 32 + H_OFF(half));
        const VI v0 = PIECE(P, 0, half), v1 = PIECE(P, 1, half), v2 = PIECE(P, 2, half);
        for (int s = 0; s < 8; s++) {
            VI sc, mn;
            if (s < 4) {
                sc = I_AND(I_SRLI32(v0, 8 * s), m63);
                mn = I_AND(I_SRLI32(v1, 8 * s), m63);
            } else {
                const int k = s - 4;
                sc = I_OR(I_AND(I_SRLI32(v2, 8 * k), I_SET1_32(15)), I_AND(I_SRLI32(v0, 8 * k + 2), m30));
                mn = I_OR(I_AND(I_SRLI32(v2, 8 * k + 4), I_SET1_32(15)), I_AND(I_SRLI32(v1, 8 * k + 2), m30));
            }
            const VF dw = F_MUL(d, F_CVT32(sc)), mw = F_MUL(dmin, F_CVT32(mn));
            VI u[8];
            for (int q = 0; q < 8; q++) {
                const VI v = PIECE(P, qs0 + 8 * (s / 2) + q, half);
                u[q] = I_AND(s % 2 ? I_SRLI16(v, 4) : v, m15);
                if (q5) u[q] = ADD_WHERE(u[q], PIECE(P, 3 + q, half), I_SET1_8((char)(1 << s)), x10);
            }
            const int64_t a32 = b * 8 + s;
            SFX(consume)(u, 0, 8, dw, mw, 2, 0, EXACT, a, xr, MT, a32, 0, acc);
        }
    }
    if (EXACT < 2)
        for (int i = 0; i < MT; i++) STOREV(y, y_bf16, (m0 + i) * ldy + n0 + half * LANES, acc[i]);
}

/* Q2_K and Q3_K (16-value groups, 2- and 3-bit codes) and IQ4_XS (32-value groups of IQ4_NL's
 * codebook with 6-bit scales), the rule's operations. */
TW static inline __attribute__((always_inline)) void SFX(tiles)(const int type, const int MT, const int EXACT, const uint8_t *group, int64_t nb,
                                                               char *act, int64_t M, int64_t K, int64_t m0, void *y, int64_t ldy, int y_bf16, int64_t n0,
                                                               int half) {
    const int bytes = type == T_Q2_K ? Q2_K_BYTES : type == T_Q3_K ? Q3_K_BYTES : IQ4_XS_BYTES;
    const VI m15 = I_SET1_8(15), m3 = I_SET1_8(3), x4 = I_SET1_8(4);
    const VI table = SFX(iq4_table)();
    arow a[8];
    const float *xr[16];
    VF acc[8];
    SFX(tile_start)(act, M, K, m0, MT, EXACT, a, xr, acc);
    wstore col; /* EXACT 2: `act` is the slab; this half's columns */
    if (EXACT == 2) col = SFX(store_column)(act, n0, half), xr[0] = (const float *)&col;
#define BYTE_OF(v, k) I_AND(I_SRLI32((v), 8 * ((k) % 4)), I_SET1_32(255))
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = group + b * 16 * bytes;
        prefetch_ahead(gb, 16 * bytes);
        if (type == T_IQ4_XS) { /* d at 0, the high scale bits (2 bytes) at 32, pieces from 64: low scale bits, then codes */
            const VF d = F16V(gb + H_OFF(half));
            const VI sh = U16V(gb + 32 + H_OFF(half));
            const uint8_t *P = gb + 64;
            const VI sl = PIECE(P, 0, half);
            for (int ib = 0; ib < 8; ib++) {
                const VI lo = I_AND(I_SRLI32(sl, 4 * ib), I_SET1_32(15)); /* byte ib/2, nibble ib%2 */
                const VI hi = I_AND(I_SRLI32(sh, 2 * ib), I_SET1_32(3));
                const VI ls = I_SUB32(I_OR(lo, I_SLLI32(hi, 4)), I_SET1_32(32));
                const VF dw = F_MUL(d, F_CVT32(ls));
                VI u[8];
                for (int q = 0; q < 4; q++) {
                    const VI v = PIECE(P, 1 + 4 * ib + q, half);
                    u[q] = I_SHUF8(table, I_AND(v, m15));
                    u[q + 4] = I_SHUF8(table, I_AND(I_SRLI16(v, 4), m15));
                }
                const int64_t a32 = b * 8 + ib;
                SFX(consume)(u, 0, 8, dw, dw, 0, 128, EXACT, a, xr, MT, a32, 0, acc);
            }
            continue;
        }
        const int q3 = type == T_Q3_K;
        const uint8_t *P = gb; /* pieces from 0; Q2_K: scales 0..3, codes 4..19, d, dmin after; Q3_K: high bits 0..7, codes 8..23, scales 24..26, d after */
        const VF d = F16V(gb + 16 * (q3 ? 108 : 80) + H_OFF(half));
        const VF dmin = q3 ? F_ZERO : F16V(gb + 16 * 82 + H_OFF(half));
        for (int g = 0; g < 8; g++) {
            const int h = g / 4, s = g % 4;
            VI u[8];
            for (int q = 0; q < 8; q++) {
                const VI v = PIECE(P, (q3 ? 8 : 4) + 8 * h + q, half);
                u[q] = I_AND(I_SRLI16(v, 2 * s), m3);
                if (q3) u[q] = ADD_WHERE(u[q], PIECE(P, q, half), I_SET1_8((char)(1 << g)), x4);
            }
            VF dw[2], mw[2];
            for (int k = 0; k < 2; k++) {
                const int i16 = 2 * g + k;
                if (q3) { /* 6-bit signed scale: low nibble of byte i16 % 8, 2 high bits of byte 8 + i16 % 4 */
                    const VI low = I_AND(I_SRLI32(BYTE_OF(PIECE(P, 24 + (i16 & 7) / 4, half), i16 & 7), 4 * (i16 >> 3)), I_SET1_32(15));
                    const VI high = I_AND(I_SRLI32(BYTE_OF(PIECE(P, 26, half), i16 & 3), 2 * (i16 >> 2)), I_SET1_32(3));
                    const VI sc = I_SUB32(I_OR(low, I_SLLI32(high, 4)), I_SET1_32(32));
                    dw[k] = F_MUL(d, F_CVT32(sc));
                } else { /* scale in the low nibble of byte i16, minimum in the high */
                    const VI byte = BYTE_OF(PIECE(P, i16 / 4, half), i16);
                    dw[k] = F_MUL(d, F_CVT32(I_AND(byte, I_SET1_32(15))));
                    mw[k] = F_MUL(dmin, F_CVT32(I_SRLI32(byte, 4)));
                }
            }
            const int64_t a32 = b * 8 + g;
            for (int k = 0; k < 2; k++) SFX(consume)(u, 4 * k, 4, dw[k], q3 ? dw[k] : mw[k], q3 ? 0 : 2, q3 ? 4 : 0, EXACT, a, xr, MT, a32, k, acc);
        }
    }
#undef BYTE_OF
    if (EXACT < 2)
        for (int i = 0; i < MT; i++) STOREV(y, y_bf16, (m0 + i) * ldy + n0 + half * LANES, acc[i]);
}

/* One group of 16 weight rows against rows m0 .. m1 of x: tiles of 8, 4, 2, 1 rows of x, each
 * over the group's 16 rows (both halves, on AVX2). */
#define TILE_VARIANT(TYPE, TILE, EXACT, NAME)                                                                                              \
    TW static void NAME(const uint8_t *group, int64_t nb, char *act, int64_t M, int64_t K, int64_t m0, int64_t m1, void *y, int64_t ldy, \
                        int y_bf16, int64_t n0) {                                                                                          \
        for (int half = 0; half < 16 / LANES; half++)                                                                                      \
            for (int64_t m = m0; m < m1;) {                                                                                                \
                const int64_t left = m1 - m;                                                                                               \
                if (left >= 8) SFX(TILE)(TYPE, 8, EXACT, group, nb, act, M, K, m, y, ldy, y_bf16, n0, half), m += 8;                       \
                else if (left >= 4) SFX(TILE)(TYPE, 4, EXACT, group, nb, act, M, K, m, y, ldy, y_bf16, n0, half), m += 4;                  \
                else if (left >= 2) SFX(TILE)(TYPE, 2, EXACT, group, nb, act, M, K, m, y, ldy, y_bf16, n0, half), m += 2;                  \
                else SFX(TILE)(TYPE, 1, EXACT, group, nb, act, M, K, m, y, ldy, y_bf16, n0, half), m += 1;                                 \
            }                                                                                                                              \
    }
/* a library holds one of the two products' tiles (TREADLE_Q_EXACT: float32 x, else int8 activations) */
#if TREADLE_Q_EXACT
#define TILE_TYPE(TYPE, TILE) TILE_VARIANT(TYPE, TILE, 1, SFX(f32_##TYPE))
#else
#define TILE_TYPE(TYPE, TILE) TILE_VARIANT(TYPE, TILE, 0, SFX(q8_##TYPE))
#endif
TILE_TYPE(T_Q4_0, tile32)
TILE_TYPE(T_Q4_1, tile32)
TILE_TYPE(T_Q5_0, tile32)
TILE_TYPE(T_Q5_1, tile32)
TILE_TYPE(T_Q8_0, tile32)
TILE_TYPE(T_IQ4_NL, tile32)
TILE_TYPE(T_MXFP4, tile32)
TILE_TYPE(T_Q4_K, tilek)
TILE_TYPE(T_Q5_K, tilek)
TILE_TYPE(T_Q6_K, tilek)
TILE_TYPE(T_Q2_K, tiles)
TILE_TYPE(T_Q3_K, tiles)
TILE_TYPE(T_IQ4_XS, tiles)
#undef TILE_TYPE
#undef TILE_VARIANT

#if !TREADLE_Q_EXACT
/* A prompt chunk (quant.c's GEMM_MIN_ROWS rows or more of int8 activations, the types below): each group of 16
 * weight rows unpacked once per half into the thread's buffer (EXACT 3: per weight scale group
 * its codes, scale and minimum, in the tiles' order), then every row of x taken through it in
 * tiles of 8, 4, 2, 1 rows by dot_rows: the tiles' operations in the tiles' order, so each row
 * gets a decode step's bits, but the weights are unpacked once per chunk where the tiles unpack
 * them once per 8 rows, and read from memory once where the tiles read them once per M_TILE. */
TW static inline __attribute__((always_inline)) void SFX(replay)(const int GS, const int MODE, const int off, const int MT, const uint8_t *ub,
                                                                const float *fb, char *act, int64_t M, int64_t K, int64_t m0, void *y, int64_t ldy,
                                                                int y_bf16, int64_t n0, int half) {
    arow a[8];
    VF acc[8];
    SFX(tile_start)(act, M, K, m0, MT, 0, a, NULL, acc);
    const int nq = GS / 4;
    for (int64_t a32 = 0; a32 < K / 32; a32++)
        for (int h = 0; h < 32 / GS; h++) {
            VI u[8];
            for (int q = 0; q < nq; q++, ub += LANES * 4) u[4 * h + q] = LOADV(ub);
            const VF dw = F_LOADU(fb), add = MODE ? F_LOADU(fb + LANES) : dw;
            fb += MODE ? 2 * LANES : LANES;
            SFX(dot_rows)(u, 4 * h, nq, dw, add, MODE, off, a, MT, a32, h, acc);
        }
    for (int i = 0; i < MT; i++) STOREV(y, y_bf16, (m0 + i) * ldy + n0 + half * LANES, acc[i]);
}

/* GS, MODE and OFF: what the type's tile passes `consume` (checked against what it recorded) */
#define GEMM_TYPE(TYPE, TILE, GS, MODE, OFF)                                                                                               \
    TW static void SFX(g8_##TYPE)(const uint8_t *group, int64_t nb, char *act, int64_t M, int64_t K, int64_t m0, int64_t m1, void *y,     \
                                  int64_t ldy, int y_bf16, int64_t n0) {                                                                  \
        for (int half = 0; half < 16 / LANES; half++) {                                                                                   \
            ucursor c = {chunk_buffer.u, chunk_buffer.f, 0, 0, 0};                                                                        \
            SFX(TILE)(TYPE, 1, 3, group, nb, (char *)&c, 0, K, 0, NULL, 0, 0, n0, half);                                                  \
            if (c.gs != GS || c.mode != MODE || c.off != OFF) __builtin_trap();                                                           \
            for (int64_t m = m0; m < m1;) {                                                                                               \
                const int64_t left = m1 - m;                                                                                              \
                if (left >= 8) SFX(replay)(GS, MODE, OFF, 8, chunk_buffer.u, chunk_buffer.f, act, M, K, m, y, ldy, y_bf16, n0, half), m += 8;      \
                else if (left >= 4) SFX(replay)(GS, MODE, OFF, 4, chunk_buffer.u, chunk_buffer.f, act, M, K, m, y, ldy, y_bf16, n0, half), m += 4; \
                else if (left >= 2) SFX(replay)(GS, MODE, OFF, 2, chunk_buffer.u, chunk_buffer.f, act, M, K, m, y, ldy, y_bf16, n0, half), m += 2; \
                else SFX(replay)(GS, MODE, OFF, 1, chunk_buffer.u, chunk_buffer.f, act, M, K, m, y, ldy, y_bf16, n0, half), m += 1;                \
            }                                                                                                                             \
        }                                                                                                                                 \
    }
/* The types whose unpacking costs enough that doing it once per chunk wins from 64 rows; the
 * others' codes are a mask or a shift away, and for them the buffer only cost time (the per-type
 * measurements: docs/benchmarks/quantized-weights.md, "At 8B"). */
GEMM_TYPE(T_Q5_K, tilek, 32, 2, 0)
GEMM_TYPE(T_Q6_K, tilek, 16, 0, 32)
GEMM_TYPE(T_Q2_K, tiles, 16, 2, 0)
GEMM_TYPE(T_Q3_K, tiles, 16, 0, 4)
#undef GEMM_TYPE

/* this width's prompt-chunk function for a type (NULL: the tiles take its chunks) */
static group_fn SFX(gemm_kernel)(int type) {
#define CASE(TYPE) \
    case TYPE: return SFX(g8_##TYPE);
    switch (type) {
        CASE(T_Q5_K) CASE(T_Q6_K) CASE(T_Q2_K) CASE(T_Q3_K)
    default: return NULL;
    }
#undef CASE
}
#endif

#if TREADLE_Q_EXACT
/* the dequantizing store of one group of 16 weight rows (the float32 product's library holds it):
 * its rows as columns n0 .. n0 + 15 of the slab `ws` (a wstore) */
#define STORE_TYPE(TYPE, TILE)                                                                        \
    TW static void SFX(w32_##TYPE)(const uint8_t *group, int64_t nb, char *ws, int64_t n0) {        \
        for (int half = 0; half < 16 / LANES; half++) SFX(TILE)(TYPE, 1, 2, group, nb, ws, 0, 0, 0, NULL, 0, 0, n0, half); \
    }
STORE_TYPE(T_Q4_0, tile32)
STORE_TYPE(T_Q4_1, tile32)
STORE_TYPE(T_Q5_0, tile32)
STORE_TYPE(T_Q5_1, tile32)
STORE_TYPE(T_Q8_0, tile32)
STORE_TYPE(T_IQ4_NL, tile32)
STORE_TYPE(T_MXFP4, tile32)
STORE_TYPE(T_Q4_K, tilek)
STORE_TYPE(T_Q5_K, tilek)
STORE_TYPE(T_Q6_K, tilek)
STORE_TYPE(T_Q2_K, tiles)
STORE_TYPE(T_Q3_K, tiles)
STORE_TYPE(T_IQ4_XS, tiles)
#undef STORE_TYPE

static store_fn SFX(store_kernel)(int type) {
#define CASE(TYPE) \
    case TYPE: return SFX(w32_##TYPE);
    switch (type) {
        CASE(T_Q4_0) CASE(T_Q4_1) CASE(T_Q5_0) CASE(T_Q5_1) CASE(T_Q8_0) CASE(T_IQ4_NL) CASE(T_MXFP4)
        CASE(T_Q4_K) CASE(T_Q5_K) CASE(T_Q6_K) CASE(T_Q2_K) CASE(T_Q3_K) CASE(T_IQ4_XS)
    default: return NULL;
    }
#undef CASE
}
#endif

/* this width's function for a type: int8 activations, or (exact) float32 x; NULL for the product
 * this library holds no tiles of */
static group_fn SFX(group_kernel)(int type, int exact) {
#if TREADLE_Q_EXACT
#define CASE(TYPE) \
    case TYPE: return exact ? SFX(f32_##TYPE) : NULL;
#else
#define CASE(TYPE) \
    case TYPE: return exact ? NULL : SFX(q8_##TYPE);
#endif
    switch (type) {
        CASE(T_Q4_0) CASE(T_Q4_1) CASE(T_Q5_0) CASE(T_Q5_1) CASE(T_Q8_0) CASE(T_IQ4_NL) CASE(T_MXFP4)
        CASE(T_Q4_K) CASE(T_Q5_K) CASE(T_Q6_K) CASE(T_Q2_K) CASE(T_Q3_K) CASE(T_IQ4_XS)
    default: return NULL;
    }
#undef CASE
}

#undef P_OFF
#undef H_OFF
#undef PIECE
