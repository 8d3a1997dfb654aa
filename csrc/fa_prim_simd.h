/* SIMD primitives for element type T (float or double): the MR x NR
 * register micro-kernel (NR = two vectors: 16 floats or 8 doubles in 256
 * bits, 32 or 16 in 512 bits, 8 or 4 in 128; MR = 6 or 8 rows), the vector
 * exp of fa_prim_exp_consts.h, and the small loops of the attention kernels.
 * Same contract as fa_prim_portable.h.
 *
 * Written against the vector operations of fa_vec_avx2.h, fa_vec_avx512.h
 * or fa_vec_neon.h, which the including file (fa_inst_avx2.c, fa_inst_avx512.c,
 * fa_inst_neon.c) includes first, with T, FA_NR (= 2 * VLEN), FA_NAME and
 * FA_IS_F32 defined. */
#include FA_SIMD
#include "fa_prim_exp_consts.h"
#include "fa_prim_tanh_consts.h"

#define FA_UKR_ROW(r, rs)                                                 \
    if (mr > r) {                                                         \
        const V t = VBCAST(ak + r * (rs));                                \
        c##r##0 = VFMA(t, b0, c##r##0);                                   \
        c##r##1 = VFMA(t, b1, c##r##1);                                   \
    }
#define FA_UKR_STORE(r)                                                   \
    if (mr > r) {                                                         \
        T *cr = c + r * ldc;                                              \
        if (alpha != 1) {                                                 \
            c##r##0 = VMUL(c##r##0, va);                                  \
            c##r##1 = VMUL(c##r##1, va);                                  \
        }                                                                 \
        if (accumulate) {                                                 \
            c##r##0 = VADD(VLOAD(cr), c##r##0);                           \
            c##r##1 = VADD(VLOAD(cr + VLEN), c##r##1);                    \
        }                                                                 \
        VSTORE(cr, c##r##0);                                              \
        VSTORE(cr + VLEN, c##r##1);                                       \
        if (colmax) { /* VMAX returns m0 when c is NaN */                \
            m0 = VMAX(c##r##0, m0);                                       \
            m1 = VMAX(c##r##1, m1);                                       \
        }                                                                 \
    }

#ifdef VFMA_LANE
/* By-element multiply-add (NEON's FMLA by lane): one vector load brings
 * VLEN values of A, each then multiplies the B vectors from its lane.  The
 * same fused c + a * b as the broadcast, in the same order of k, so the
 * result is bitwise that of FA_UKR_ROW.  Rows of a column (rs_a == 1, the
 * packed panels and V^T): rows r that fill a whole vector of the mr take
 * their lane, the others a broadcast, so no read passes row mr - 1. */
#define FA_UKR_ROW_COL(r)                                                 \
    if (mr > r) {                                                         \
        if ((r / VLEN + 1) * VLEN <= mr) {                                \
            c##r##0 = VFMA_LANE(c##r##0, b0, av[r / VLEN], r % VLEN);     \
            c##r##1 = VFMA_LANE(c##r##1, b1, av[r / VLEN], r % VLEN);     \
        } else {                                                          \
            const V t = VBCAST(ak + r);                                   \
            c##r##0 = VFMA(t, b0, c##r##0);                               \
            c##r##1 = VFMA(t, b1, c##r##1);                               \
        }                                                                 \
    }
/* Runs along k (cs_a == 1, the keys of the scores): ar[r] holds VLEN
 * consecutive k of row r, and step l of the VLEN uses lane l. */
#define FA_UKR_ROW_K(r, l)                                                \
    if (mr > r) {                                                         \
        c##r##0 = VFMA_LANE(c##r##0, b0, ar[r], (l) % VLEN);              \
        c##r##1 = VFMA_LANE(c##r##1, b1, ar[r], (l) % VLEN);              \
    }
#define FA_UKR_STEP_K(l)                                                  \
    if (l < VLEN) {                                                       \
        const V b0 = VLOAD(b + (l) * ldb), b1 = VLOAD(b + (l) * ldb + VLEN); \
        FA_UKR_ROW_K(0, l) FA_UKR_ROW_K(1, l) FA_UKR_ROW_K(2, l) FA_UKR_ROW_K(3, l) \
        FA_UKR_ROW_K(4, l) FA_UKR_ROW_K(5, l) FA_UKR_ROW_K(6, l) FA_UKR_ROW_K(7, l) \
    }
#endif

static FA_ALWAYS_INLINE void
FA_NAME(ukr_body)(const int mr, fa_idx kc, const T *a, fa_idx rs_a, fa_idx cs_a,
                  const T *b, fa_idx ldb, T *c, fa_idx ldc, T alpha, int accumulate, T *colmax)
{
    V c00 = VZERO(), c01 = VZERO(), c10 = VZERO(), c11 = VZERO();
    V c20 = VZERO(), c21 = VZERO(), c30 = VZERO(), c31 = VZERO();
    V c40 = VZERO(), c41 = VZERO(), c50 = VZERO(), c51 = VZERO();
    V c60 = VZERO(), c61 = VZERO(), c70 = VZERO(), c71 = VZERO(); /* only when FA_MR is 8 */
    fa_idx k = 0;
#ifdef VFMA_LANE
    if (rs_a == 1) {
        for (; k < kc; ++k) {
            const V b0 = VLOAD(b), b1 = VLOAD(b + VLEN);
            const T *ak = a + k * cs_a;
            V av[FA_MR / VLEN];
            for (int g = 0; g < mr / VLEN; ++g) av[g] = VLOAD(ak + g * VLEN);
            FA_UKR_ROW_COL(0) FA_UKR_ROW_COL(1) FA_UKR_ROW_COL(2) FA_UKR_ROW_COL(3)
            FA_UKR_ROW_COL(4) FA_UKR_ROW_COL(5) FA_UKR_ROW_COL(6) FA_UKR_ROW_COL(7)
            b += ldb;
        }
    } else if (cs_a == 1) {
        for (; k + VLEN <= kc; k += VLEN) {
            V ar[FA_MR];
            for (int r = 0; r < mr; ++r) ar[r] = VLOAD(a + r * rs_a + k);
            FA_UKR_STEP_K(0) FA_UKR_STEP_K(1) FA_UKR_STEP_K(2) FA_UKR_STEP_K(3)
            b += VLEN * ldb;
        }
    }
#endif
    /* unrolled, the loop's address arithmetic takes fewer slots of the
     * ports the FMAs run on */
#define FA_UKR_LOOP(rs)                                                   \
    _Pragma("GCC unroll 8") for (; k < kc; ++k) {                         \
        const V b0 = VLOAD(b), b1 = VLOAD(b + VLEN);                      \
        const T *ak = a + k * cs_a;                                       \
        FA_UKR_ROW(0, rs) FA_UKR_ROW(1, rs) FA_UKR_ROW(2, rs) FA_UKR_ROW(3, rs) \
        FA_UKR_ROW(4, rs) FA_UKR_ROW(5, rs) FA_UKR_ROW(6, rs) FA_UKR_ROW(7, rs) \
        b += ldb;                                                         \
    }
#ifndef VFMA_LANE
    /* rows of a column (rs_a == 1: the columns of V): the broadcasts at
     * fixed offsets of one pointer, without a row's address to compute */
    if (rs_a == 1) FA_UKR_LOOP(1)
#endif
    FA_UKR_LOOP(rs_a)
    const V va = VSET1(alpha);
    V m0 = VSET1(-(T)INFINITY), m1 = m0;
    FA_UKR_STORE(0) FA_UKR_STORE(1) FA_UKR_STORE(2) FA_UKR_STORE(3)
    FA_UKR_STORE(4) FA_UKR_STORE(5) FA_UKR_STORE(6) FA_UKR_STORE(7)
    if (colmax) {
        VSTORE(colmax, VMAX(m0, VLOAD(colmax)));
        VSTORE(colmax + VLEN, VMAX(m1, VLOAD(colmax + VLEN)));
    }
}
#undef FA_UKR_ROW
#undef FA_UKR_LOOP
#undef FA_UKR_STORE
#undef FA_UKR_ROW_COL
#undef FA_UKR_ROW_K
#undef FA_UKR_STEP_K

static void FA_NAME(ukr)(int mr, fa_idx kc, const T *a, fa_idx rs_a, fa_idx cs_a,
                         const T *b, fa_idx ldb, T *c, fa_idx ldc, T alpha, int accumulate,
                         T *colmax)
{
    switch (mr) {
#if FA_MR == 8
    case 8: FA_NAME(ukr_body)(8, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    case 7: FA_NAME(ukr_body)(7, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
#endif
    case 6: FA_NAME(ukr_body)(6, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    case 5: FA_NAME(ukr_body)(5, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    case 4: FA_NAME(ukr_body)(4, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    case 3: FA_NAME(ukr_body)(3, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    case 2: FA_NAME(ukr_body)(2, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    case 1: FA_NAME(ukr_body)(1, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    default: break;
    }
}

#if FA_IS_F32
/* u * exp(x - n ln 2) for the integer n nearest x log2(e): the reduction
 * and polynomial of fa_prim_exp_consts.h, the coefficients times the power of
 * two u (exact: the same bits as u times the polynomial) */
static FA_ALWAYS_INLINE V FA_NAME(expf_reduced)(V x, V n, const float u)
{
    V r = VFNMA(n, VSET1(FA_EXPF_LN2_HI), x);
    r = VFNMA(n, VSET1(FA_EXPF_LN2_LO), r);
    V p = VSET1((float)FA_INV_FACT_7 * u);
    p = VFMA(p, r, VSET1((float)FA_INV_FACT_6 * u));
    p = VFMA(p, r, VSET1((float)FA_INV_FACT_5 * u));
    p = VFMA(p, r, VSET1((float)FA_INV_FACT_4 * u));
    p = VFMA(p, r, VSET1((float)FA_INV_FACT_3 * u));
    p = VFMA(p, r, VSET1((float)FA_INV_FACT_2 * u));
    p = VFMA(p, r, VSET1(u));
    return VFMA(p, r, VSET1(u));
}
#endif

/* exp of one vector.  The clamp returns its second operand on NaN, so a NaN
 * lane stays NaN through the polynomial (the integer part of a NaN lane is
 * garbage, but NaN times anything is NaN). */
static FA_ALWAYS_INLINE V FA_NAME(vexp1)(V x)
{
#if FA_IS_F32
    const V xc = VMIN(VSET1(FA_EXPF_HI), VMAX(VSET1(FA_EXPF_LO), x));
    const V n = VROUND(VMUL(xc, VSET1(FA_EXPF_LOG2E)));
    const V p = FA_NAME(expf_reduced)(xc, n, 1.0f);
#ifdef VSCALEF
    return VSCALEF(p, n);
#else
    const VI ni = VCVTI(n);
    /* n1 = n / 2 rounded toward zero, as in the portable path */
    const VI n1 = VI_SRAI(VI_ADD(ni, VI_SRLI(ni, 31)), 1);
    const VI n2 = VI_SUB(ni, n1);
    const VI bias = VI_SET1(127);
    const V s1 = VI_AS(VI_SLLI(VI_ADD(n1, bias), 23));
    const V s2 = VI_AS(VI_SLLI(VI_ADD(n2, bias), 23));
    return VMUL(VMUL(p, s1), s2);
#endif
#else
    const V xc = VMIN(VSET1(FA_EXP_HI), VMAX(VSET1(FA_EXP_LO), x));
    const V n = VROUND(VMUL(xc, VSET1(FA_EXP_LOG2E)));
    V r = VFNMA(n, VSET1(FA_EXP_LN2_HI), xc);
    r = VFNMA(n, VSET1(FA_EXP_LN2_LO), r);
    V p = VSET1(FA_INV_FACT_13);
    p = VFMA(p, r, VSET1(FA_INV_FACT_12));
    p = VFMA(p, r, VSET1(FA_INV_FACT_11));
    p = VFMA(p, r, VSET1(FA_INV_FACT_10));
    p = VFMA(p, r, VSET1(FA_INV_FACT_9));
    p = VFMA(p, r, VSET1(FA_INV_FACT_8));
    p = VFMA(p, r, VSET1(FA_INV_FACT_7));
    p = VFMA(p, r, VSET1(FA_INV_FACT_6));
    p = VFMA(p, r, VSET1(FA_INV_FACT_5));
    p = VFMA(p, r, VSET1(FA_INV_FACT_4));
    p = VFMA(p, r, VSET1(FA_INV_FACT_3));
    p = VFMA(p, r, VSET1(FA_INV_FACT_2));
    p = VFMA(p, r, VSET1(1.0));
    p = VFMA(p, r, VSET1(1.0));
#ifdef VSCALEF
    return VSCALEF(p, n);
#else
    /* n1 = n / 2 toward zero; n2 = n - n1; 2^k built from the low bits of
     * k + 1.5*2^52 + 1023, shifted into the exponent field. */
    const V n1 = VTRUNC(VMUL(n, VSET1(0.5)));
    const V n2 = VSUB(n, n1);
    const V magic = VSET1(FA_EXP_ROUND + 1023.0);
    const V s1 = VI_AS(VI_SLLI(VAS_I(VADD(n1, magic)), 52));
    const V s2 = VI_AS(VI_SLLI(VAS_I(VADD(n2, magic)), 52));
    return VMUL(VMUL(p, s1), s2);
#endif
#endif
}

/* exp(x) for x <= ln 256 (or NaN): softmax's case, x = z - m with m at most
 * ln 256 below the maximum (fa_kern_attn.h).  Cheaper than vexp1 (11
 * vector operations with VSCALEF, 13 without, where vexp1 takes 14 and 24),
 * as its range allows: n = round(x log2(e)) in one fused multiply-add with
 * the rounding constant (|x log2(e)| < 2^22), r = x - n ln 2 with one
 * constant and the degree-6 polynomial of fa_prim_exp_consts.h.  2^n is one
 * power of two (n <= 8): with VSCALEF that; else 2^(n + 25), built from the
 * integer bits of t, times the polynomial scaled by 2^-25 (exact), so the
 * one rounding is the same and every path gives the same bits, subnormal
 * results included.  Within 1 ulp of exp for x >= -22 (every weight
 * above 2^-31 of the largest), 4 below (checked exhaustively; the tests
 * sweep it; its cost and accuracy: threads-and-speed.md, the paragraph on
 * the vectorised exp).  NaN stays NaN: the clamp returns x, and the
 * polynomial is NaN. */
static FA_ALWAYS_INLINE V FA_NAME(vexp_softmax1)(V x)
{
#if FA_IS_F32
#ifdef VSCALEF
    const float u = 1.0f;
#else
    const float u = 0x1p-25f;
#endif
    const V magic = VSET1(FA_EXPF_ROUND);
    const V xc = VMAX(VSET1(FA_EXPF_LO), x);
    const V t = VFMA(xc, VSET1(FA_EXPF_LOG2E), magic);
    const V n = VSUB(t, magic);
    const V r = VFNMA(n, VSET1(FA_EXPF_LN2), xc);
    V p = VSET1(FA_EXPF_SM_C6 * u);
    p = VFMA(p, r, VSET1(FA_EXPF_SM_C5 * u));
    p = VFMA(p, r, VSET1(FA_EXPF_SM_C4 * u));
    p = VFMA(p, r, VSET1(FA_EXPF_SM_C3 * u));
    p = VFMA(p, r, VSET1(FA_EXPF_SM_C2 * u));
    p = VFMA(p, r, VSET1(u));
    p = VFMA(p, r, VSET1(u));
#ifdef VSCALEF
    return VSCALEF(p, n);
#else
    /* the bits of magic end in 9 zero bits: shifted by 23, only n is left */
    return VMUL(p, VI_AS(VI_SLLI(VI_ADD(VAS_I(t), VI_SET1(127 + 25)), 23)));
#endif
#else /* double: vexp1 as it is */
    return FA_NAME(vexp1)(x);
#endif
}

/* y[j] = exp(x[j]); the tail goes through a padded vector. */
static void FA_NAME(vexp)(fa_idx n, const T *x, T *y)
{
    fa_idx j = 0;
    for (; j + VLEN <= n; j += VLEN) VSTORE(y + j, FA_NAME(vexp1)(VLOAD(x + j)));
    if (j < n) {
        T buf[VLEN] = {0};
        for (fa_idx t = 0; t < n - j; ++t) buf[t] = x[j + t];
        VSTORE(buf, FA_NAME(vexp1)(VLOAD(buf)));
        for (fa_idx t = 0; t < n - j; ++t) y[j + t] = buf[t];
    }
}

/* y[j] = tanh(x[j]) (fa_prim_tanh_consts.h); NaN stays NaN, +-inf gives +-1. */
static void FA_NAME(vtanh)(fa_idx n, const T *x, T *y)
{
#if FA_IS_F32
    static const T c[FA_TANHF_NC] = FA_TANHF_C;
    const int nc = FA_TANHF_NC;
#else
    static const T c[FA_TANH_NC] = FA_TANH_C;
    const int nc = FA_TANH_NC;
#endif
    const V one = VSET1(1), two = VSET1(2), small = VSET1((T)FA_TANH_SMALL2);
    for (fa_idx j = 0; j < n; j += VLEN) {
        T buf[VLEN] = {0};
        const int full = j + VLEN <= n;
        if (!full)
            for (fa_idx t = 0; t < n - j; ++t) buf[t] = x[j + t];
        const V xv = full ? VLOAD(x + j) : VLOAD(buf), t2 = VMUL(xv, xv);
        V p = VSET1(c[0]);
        for (int i = 1; i < nc; ++i) p = VFMA(p, t2, VSET1(c[i]));
        const V e = FA_NAME(vexp1)(VMUL(two, xv));
        const V big = VSUB(one, VDIV(two, VADD(e, one)));
        const V r = VBLEND(big, VMUL(xv, p), VLT(t2, small));
        if (full) {
            VSTORE(y + j, r);
        } else {
            VSTORE(buf, r);
            for (fa_idx t = 0; t < n - j; ++t) y[j + t] = buf[t];
        }
    }
}

/* For each column j < nc of the block z (row stride ld, nc a multiple of
 * VLEN), rows r0..r1-1: z[r, j] = exp(z[r, j] - m[j]), sum[j] = sum over r
 * of the new z, in four parts by r & 3 (a quarter of the rounding), so that
 * a range of rows sums to the bits of the whole block whose other rows are
 * hidden (exp 0).  hidden: the rows may hold -inf (keys the bounds or a mask
 * hide); those lanes then give their 0 without the polynomial, whose
 * underflow to 0 costs x86 a microcode assist per vector; the same bits
 * either way. */
static FA_ALWAYS_INLINE V FA_NAME(exp_at)(T *zr, V mj, int hidden)
{
    const V x = VSUB(VLOAD(zr), mj);
    V e;
    if (hidden) {
        const VMASK h = VEQ(x, VSET1(-(T)INFINITY));
        e = VBLEND(FA_NAME(vexp_softmax1)(VBLEND(x, VZERO(), h)), VZERO(), h);
    } else {
        e = FA_NAME(vexp_softmax1)(x);
    }
    VSTORE(zr, e);
    return e;
}

static void FA_NAME(exp_block)(fa_idx r0, fa_idx r1, fa_idx nc, fa_idx ld, T *z, const T *m,
                               T *sum, int hidden)
{
    for (fa_idx j = 0; j < nc; j += VLEN) {
        const V mj = VLOAD(m + j);
        T *zj = z + j;
        /* the four parts in registers: indexed by r & 3 in memory, each
         * add waited for the store of the one before */
        V a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
#define FA_EXP_PART(r)                                                    \
    {                                                                     \
        const V e = FA_NAME(exp_at)(zj + (r) * ld, mj, hidden);           \
        switch ((r) & 3) {                                                \
        case 0: a0 = VADD(a0, e); break;                                  \
        case 1: a1 = VADD(a1, e); break;                                  \
        case 2: a2 = VADD(a2, e); break;                                  \
        default: a3 = VADD(a3, e); break;                                 \
        }                                                                 \
    }
        fa_idx r = r0;
        for (; r < r1 && (r & 3) != 0; ++r) FA_EXP_PART(r)
        for (; r + 4 <= r1; r += 4) {
            a0 = VADD(a0, FA_NAME(exp_at)(zj + r * ld, mj, hidden));
            a1 = VADD(a1, FA_NAME(exp_at)(zj + (r + 1) * ld, mj, hidden));
            a2 = VADD(a2, FA_NAME(exp_at)(zj + (r + 2) * ld, mj, hidden));
            a3 = VADD(a3, FA_NAME(exp_at)(zj + (r + 3) * ld, mj, hidden));
        }
        for (; r < r1; ++r) FA_EXP_PART(r)
#undef FA_EXP_PART
        VSTORE(sum + j, VADD(VADD(a0, a1), VADD(a2, a3)));
    }
}

/* dst[e * ld + j] = src[j * rs + e * cs] * scale for j < nq, e < n: a block
 * of rows, transposed and scaled; square tiles go through registers (8 x 8
 * floats on x86, VLEN x VLEN where the vector operations define VTILE_T). */
static void FA_NAME(pack_t)(fa_idx nq, fa_idx n, const T *src, fa_idx rs, fa_idx cs, T scale,
                            T *dst, fa_idx ld, fa_idx ds)
{
    fa_idx j0 = 0;
#if FA_IS_F32 && FA_HAVE_X86_SIMD
    if (cs == 1 && ds == 1) {
        const __m256 sc = _mm256_set1_ps(scale);
        for (; j0 + 8 <= nq; j0 += 8)
            for (fa_idx e0 = 0; e0 + 8 <= n; e0 += 8) {
                __m256 r[8], t[8];
                for (int u = 0; u < 8; ++u) r[u] = _mm256_loadu_ps(src + (j0 + u) * rs + e0);
                for (int u = 0; u < 8; u += 2) {
                    t[u] = _mm256_unpacklo_ps(r[u], r[u + 1]);
                    t[u + 1] = _mm256_unpackhi_ps(r[u], r[u + 1]);
                }
                for (int u = 0; u < 8; u += 4) {
                    r[u] = _mm256_shuffle_ps(t[u], t[u + 2], 0x44);
                    r[u + 1] = _mm256_shuffle_ps(t[u], t[u + 2], 0xEE);
                    r[u + 2] = _mm256_shuffle_ps(t[u + 1], t[u + 3], 0x44);
                    r[u + 3] = _mm256_shuffle_ps(t[u + 1], t[u + 3], 0xEE);
                }
                for (int u = 0; u < 4; ++u) {
                    t[u] = _mm256_permute2f128_ps(r[u], r[u + 4], 0x20);
                    t[u + 4] = _mm256_permute2f128_ps(r[u], r[u + 4], 0x31);
                }
                for (int u = 0; u < 8; ++u) /* t[u] is feature e0 + u of the 8 rows */
                    _mm256_storeu_ps(dst + (e0 + u) * ld + j0, _mm256_mul_ps(t[u], sc));
            }
        /* the remaining features of these full row groups */
        for (fa_idx e = n - n % 8; e < n; ++e)
            for (fa_idx j = 0; j < j0; ++j) dst[e * ld + j] = src[j * rs + e] * scale;
    }
#elif defined(VTILE_T)
    if (cs == 1 && ds == 1) {
        const V sc = VSET1(scale);
        for (; j0 + VLEN <= nq; j0 += VLEN)
            for (fa_idx e0 = 0; e0 + VLEN <= n; e0 += VLEN) {
                V r[VLEN];
                for (int u = 0; u < VLEN; ++u) r[u] = VLOAD(src + (j0 + u) * rs + e0);
                VTILE_T(r); /* r[u] is feature e0 + u of the VLEN rows */
                for (int u = 0; u < VLEN; ++u) VSTORE(dst + (e0 + u) * ld + j0, VMUL(r[u], sc));
            }
        for (fa_idx e = n - n % VLEN; e < n; ++e)
            for (fa_idx j = 0; j < j0; ++j) dst[e * ld + j] = src[j * rs + e] * scale;
    }
#endif
    for (fa_idx e = 0; e < n; ++e)
        for (fa_idx j = j0; j < nq; ++j) dst[e * ld + j * ds] = src[j * rs + e * cs] * scale;
}

/* o[c * ld + j] /= l[j] for c < n, j < ld (a multiple of VLEN), and 0
 * where l[j] == 0; bad[j] = 0 when column j came out finite, else NaN */
static void FA_NAME(normalize)(fa_idx n, fa_idx ld, T *o, const T *l, T *bad)
{
    const V one = VSET1(1), zero = VZERO();
    for (fa_idx j = 0; j < ld; j += VLEN) {
        const V lj = VLOAD(l + j);
        V acc = zero;
        const VMASK empty = VEQ(lj, zero);
        const V d = VBLEND(lj, one, empty);
        for (fa_idx c = 0; c < n; ++c) {
            const V y = VBLEND(VDIV(VLOAD(o + c * ld + j), d), zero, empty);
            VSTORE(o + c * ld + j, y);
            acc = VADD(acc, VSUB(y, y));
        }
        VSTORE(bad + j, acc);
    }
}

/* VLEN elements of a row stored as st, from element i, as T */
static FA_ALWAYS_INLINE V FA_NAME(vload_st)(const fa_store st, const void *p, fa_idx i)
{
#if FA_IS_F32
    switch (st) {
    case FA_STORE_F16: return VLOAD_F16((const uint16_t *)p + i);
    case FA_STORE_BF16: return VLOAD_BF16((const uint16_t *)p + i);
    case FA_STORE_I8: return VLOAD_I8((const int8_t *)p + i);
    case FA_STORE_F8E5M2: return VLOAD_E5M2((const uint8_t *)p + i);
    case FA_STORE_F8E4M3: { /* fa_e4m3_f32, a lane each */
        const VI u = VLOAD_U8((const uint8_t *)p + i), m = VI_AND(u, VI_SET1(0x7f));
        const V f = VMUL(VI_AS(VI_SLLI(m, 20)), VSET1(0x1p120f));
        const VI nan = VI_AND(VI_SUB(VI_SET1(0), VI_SRLI(VI_ADD(m, VI_SET1(1)), 7)),
                              VI_SET1(0x7fc00000));
        return VI_AS(VI_OR(VI_OR(VAS_I(f), nan), VI_SLLI(VI_AND(u, VI_SET1(0x80)), 24)));
    }
    case FA_STORE_Q4: { /* fa_q4_get: VLEN (<= 16) elements lie in one block */
        const uint8_t *blk = fa_q4_block(p, i);
        const fa_idx j = i & (FA_Q4_BLOCK - 1);
        uint16_t d;
        memcpy(&d, blk, sizeof d);
#ifdef VLOAD_Q4
        return VLOAD_Q4(blk + 2 + (j & 15), (j & 16) != 0, d);
#else
        VI c = VLOAD_U8(blk + 2 + (j & 15));
        c = VI_AND(j & 16 ? VI_SRLI(c, 4) : c, VI_SET1(15));
        /* c - 8 as a float: c in the low bits of 2^23 (exact), less 2^23 + 8 */
        const V x = VSUB(VI_AS(VI_OR(c, VI_SET1(0x4b000000))), VSET1(8388616.0f));
        return VMUL(x, VSET1_F16(d)); /* the conversion in registers: exact */
#endif
    }
    default: break;
    }
#else
    (void)st;
#endif
    return VLOAD((const T *)p + i);
}

#if FA_IS_F32
/* y[0..n) = x[0..n) rounded to nearest-even binary16 */
static void FA_NAME(narrow_f16)(fa_idx n, const float *x, uint16_t *y)
{
    fa_idx j = 0;
    for (; j + VLEN <= n; j += VLEN) VSTORE_F16(y + j, VLOAD(x + j));
    for (; j < n; ++j) y[j] = fa_f32_f16(x[j]);
}
#endif

/* dst[0..n) = a contiguous row stored as st, as T */
static FA_ALWAYS_INLINE void FA_NAME(cvt_body)(const fa_store st, fa_idx n, const void *src, T *dst)
{
    fa_idx j = 0;
    for (; j + VLEN <= n; j += VLEN) VSTORE(dst + j, FA_NAME(vload_st)(st, src, j));
    for (; j < n; ++j) dst[j] = FA_NAME(st_get)(st, src, j);
}

/* The vector part of s[t * ld] = sum over c of x[t * ldx + c] * y[c], for
 * t < nq <= 4, both contiguous, y stored as st: u[t] holds the lanes whose
 * sum (VREDUCE), plus the products from the returned column on (dot_tail),
 * is the dot product.  The same operations in the same order whatever st,
 * so that converting y first gives the same bits, and whatever nq (each
 * vector of y loaded and converted once for them all). */
static FA_ALWAYS_INLINE fa_idx FA_NAME(dot_rows_vec)(const int nq, const fa_store st, fa_idx n,
                                                     const T *x, fa_idx ldx, const void *y, V *u)
{
    fa_idx c = 0;
    V s0[4], s1[4], s2[4], s3[4];
    for (int t = 0; t < nq; ++t) s0[t] = s1[t] = s2[t] = s3[t] = VZERO();
    for (; c + 4 * VLEN <= n; c += 4 * VLEN) {
#if 4 * VLEN % FA_Q4_BLOCK == 0
        /* from whole Q4 blocks at constant offsets: each block's scale read
         * and converted once, not per vector */
        const void *yc = FA_NAME(st_col)(st, y, c);
        const fa_idx i = 0;
#else
        const void *yc = y;
        const fa_idx i = c;
#endif
        const V y0 = FA_NAME(vload_st)(st, yc, i), y1 = FA_NAME(vload_st)(st, yc, i + VLEN);
        const V y2 = FA_NAME(vload_st)(st, yc, i + 2 * VLEN);
        const V y3 = FA_NAME(vload_st)(st, yc, i + 3 * VLEN);
        for (int t = 0; t < nq; ++t) {
            const T *xt = x + t * ldx + c;
            s0[t] = VFMA(VLOAD(xt), y0, s0[t]);
            s1[t] = VFMA(VLOAD(xt + VLEN), y1, s1[t]);
            s2[t] = VFMA(VLOAD(xt + 2 * VLEN), y2, s2[t]);
            s3[t] = VFMA(VLOAD(xt + 3 * VLEN), y3, s3[t]);
        }
    }
    for (; c + VLEN <= n; c += VLEN) {
        const V yv = FA_NAME(vload_st)(st, y, c);
        for (int t = 0; t < nq; ++t) s0[t] = VFMA(VLOAD(x + t * ldx + c), yv, s0[t]);
    }
    for (int t = 0; t < nq; ++t) u[t] = VADD(VADD(s0[t], s1[t]), VADD(s2[t], s3[t]));
    return c;
}

/* r plus the products x[cc] * y[cc] of the columns c..n-1, in order */
static FA_ALWAYS_INLINE T FA_NAME(dot_tail)(const fa_store st, fa_idx c, fa_idx n, const T *x,
                                            const void *y, T r)
{
    for (fa_idx cc = c; cc < n; ++cc) r += x[cc] * FA_NAME(st_get)(st, y, cc);
    return r;
}

/* s[t * ld] = sum over c of x[t * ldx + c] * y[c], for t < nq <= 4
 * (dot_rows_vec, its lanes summed, then dot_tail) */
static FA_ALWAYS_INLINE void FA_NAME(dot_rows_body)(const int nq, const fa_store st, fa_idx n,
                                                    const T *x, fa_idx ldx, const void *y, T *s,
                                                    fa_idx ld)
{
    V u[4];
    const fa_idx c = FA_NAME(dot_rows_vec)(nq, st, n, x, ldx, y, u);
    for (int t = 0; t < nq; ++t)
        s[t * ld] = FA_NAME(dot_tail)(st, c, n, x + t * ldx, y, VREDUCE(u[t]));
}

#ifdef FA_DOT_GROUP
/* Decoding's key rows, FA_DOT_GROUP (VLEN) at a time: the lanes of a sum
 * per row (dot_lanes, into `lanes`), then summed together (dot_lanes_sum),
 * with VREDUCE's pairs of lanes in a third of its operations a row: the
 * bits of dot_body (see threads-and-speed.md, "Lane sums in vectors"). */

/* lanes[0..VLEN) = the vector part of x . y (dot_rows_vec); returns the
 * column where dot_tail starts */
static FA_ALWAYS_INLINE fa_idx FA_NAME(dot_lanes)(const fa_store st, fa_idx n, const T *x,
                                                  const void *y, T *lanes)
{
    V u;
    const fa_idx c = FA_NAME(dot_rows_vec)(1, st, n, x, 0, y, &u);
    VSTORE(lanes, u);
    return c;
}

/* s[r] = x . y_r for the FA_DOT_GROUP rows y_r = y + r * rb bytes, whose
 * dot_lanes are lanes + r * VLEN, columns c..n-1 still to add */
static FA_ALWAYS_INLINE void FA_NAME(dot_lanes_sum)(const fa_store st, fa_idx c, fa_idx n,
                                                    const T *x, const char *y, fa_idx rb,
                                                    const T *lanes, T *s)
{
    V u[VLEN];
    for (int r = 0; r < VLEN; ++r) u[r] = VLOAD(lanes + r * VLEN);
    if (c == n) {
        VSTORE(s, VREDUCE_ROWS(u));
        return;
    }
    T sums[VLEN];
    VSTORE(sums, VREDUCE_ROWS(u));
    for (int r = 0; r < VLEN; ++r) s[r] = FA_NAME(dot_tail)(st, c, n, x, y + r * rb, sums[r]);
}

/* Rows of x whose dot products share each vector of y (dots_cached): four
 * partial sums a row, then the vectors of y, within the registers (16 on
 * AVX2, 32 beyond). */
#define FA_CACHED_ROWS (FA_MR >= 8 ? 4 : 2)

/* dot_lanes of the nq rows of x (ldx apart) against the FA_DOT_GROUP rows
 * y + i * rb, each vector of those loaded once for all nq: row t's lanes at
 * lanes + t * FA_DOT_GROUP * VLEN */
static FA_ALWAYS_INLINE fa_idx FA_NAME(dot_lanes_rows)(const int nq, const fa_store st, fa_idx n,
                                                       const T *x, fa_idx ldx, const char *y,
                                                       fa_idx rb, T *lanes)
{
    fa_idx c = 0;
    for (int i = 0; i < FA_DOT_GROUP; ++i) {
        V u[4];
        c = FA_NAME(dot_rows_vec)(nq, st, n, x, ldx, y + i * rb, u);
        for (int t = 0; t < nq; ++t) VSTORE(lanes + (t * FA_DOT_GROUP + i) * VLEN, u[t]);
    }
    return c;
}

/* s[t * ld + i] = x_t . y_i for the nq rows of x and the FA_DOT_GROUP rows
 * y_i = rows + i * rb, already in cache: bound by arithmetic, so each
 * vector of y is loaded once for FA_CACHED_ROWS rows of x; the bits of
 * dot_body.  n constant where the caller knows it (the loop over it then
 * unrolls). */
static FA_ALWAYS_INLINE void FA_NAME(dots_cached)(const fa_store st, fa_idx nq, fa_idx n,
                                                  const T *x, fa_idx ldx, const char *rows,
                                                  fa_idx rb, T *s, fa_idx ld)
{
    for (fa_idx t0 = 0, m; t0 < nq; t0 += m) {
        T lanes[FA_CACHED_ROWS * FA_DOT_GROUP * FA_DOT_GROUP];
        const T *xt = x + t0 * ldx;
        fa_idx c;
        m = nq - t0 < FA_CACHED_ROWS ? nq - t0 : FA_CACHED_ROWS;
        switch (m) {
#if FA_MR >= 8
        case 4: c = FA_NAME(dot_lanes_rows)(4, st, n, xt, ldx, rows, rb, lanes); break;
        case 3: c = FA_NAME(dot_lanes_rows)(3, st, n, xt, ldx, rows, rb, lanes); break;
#endif
        case 2: c = FA_NAME(dot_lanes_rows)(2, st, n, xt, ldx, rows, rb, lanes); break;
        default: c = FA_NAME(dot_lanes_rows)(1, st, n, xt, ldx, rows, rb, lanes); break;
        }
        for (fa_idx t = 0; t < m; ++t)
            FA_NAME(dot_lanes_sum)(st, c, n, xt + t * ldx, rows, rb,
                                   lanes + t * FA_DOT_GROUP * FA_DOT_GROUP, s + (t0 + t) * ld);
    }
}
#endif

/* dot_rows_body of one row of x */
static FA_ALWAYS_INLINE T FA_NAME(dot_body)(const fa_store st, fa_idx n, const T *x, const void *y)
{
    T s;
    FA_NAME(dot_rows_body)(1, st, n, x, 0, y, &s, 0);
    return s;
}

/* Whether rows stored as st are converted once for the query heads of a
 * group (dot_rows_body, gemv_t_rows_body): where 4 heads' accumulators and
 * the vectors of y fit the registers and a tile spans 64 floats (AVX-512),
 * and not for rows stored as T, which gained nothing (see
 * threads-and-speed.md, "Rows converted once per head group"). */
static FA_ALWAYS_INLINE int FA_NAME(rows_shared)(const fa_store st)
{
    return st != FA_STORE_NATIVE && FA_MR >= 8 && VLEN >= 16;
}

/* o[c] += sum over r < nk of p[r] * x[r * rs + c], for c < n, x stored as
 * st, leaving out the rows whose p[r] is exactly 0 (their x is never
 * read).  Up to 8 vectors of o stay in registers for the sweep over r. */
static FA_ALWAYS_INLINE void FA_NAME(gemv_t_body)(const int nv, const fa_store st, fa_idx nk,
                                                  const T *p, const void *x, fa_idx rs, T *o)
{
    V acc[8];
    for (int u = 0; u < nv; ++u) acc[u] = VLOAD(o + u * VLEN);
    for (fa_idx r = 0; r < nk; ++r) {
        if (p[r] == 0) continue;
        const V pr = VSET1(p[r]);
        const void *xr = FA_NAME(st_at)(st, x, r * rs);
        for (int u = 0; u < nv; ++u) acc[u] = VFMA(pr, FA_NAME(vload_st)(st, xr, u * VLEN), acc[u]);
    }
    for (int u = 0; u < nv; ++u) VSTORE(o + u * VLEN, acc[u]);
}

static FA_ALWAYS_INLINE void FA_NAME(gemv_t_cols)(const fa_store st, fa_idx nk, fa_idx n,
                                                  const T *p, const void *x, fa_idx rs, T *o)
{
    fa_idx c = 0;
    for (; c + 8 * VLEN <= n; c += 8 * VLEN)
        FA_NAME(gemv_t_body)(8, st, nk, p, FA_NAME(st_col)(st, x, c), rs, o + c);
    const void *xc = FA_NAME(st_col)(st, x, c); /* 8 VLEN: whole Q4 blocks */
    switch ((n - c) / VLEN) {
    case 7: FA_NAME(gemv_t_body)(7, st, nk, p, xc, rs, o + c); break;
    case 6: FA_NAME(gemv_t_body)(6, st, nk, p, xc, rs, o + c); break;
    case 5: FA_NAME(gemv_t_body)(5, st, nk, p, xc, rs, o + c); break;
    case 4: FA_NAME(gemv_t_body)(4, st, nk, p, xc, rs, o + c); break;
    case 3: FA_NAME(gemv_t_body)(3, st, nk, p, xc, rs, o + c); break;
    case 2: FA_NAME(gemv_t_body)(2, st, nk, p, xc, rs, o + c); break;
    case 1: FA_NAME(gemv_t_body)(1, st, nk, p, xc, rs, o + c); break;
    default: break;
    }
    c += (n - c) / VLEN * VLEN;
    for (fa_idx r = 0; c < n && r < nk; ++r) {
        if (p[r] == 0) continue;
        const void *xr = FA_NAME(st_at)(st, x, r * rs);
        for (fa_idx cc = c; cc < n; ++cc) o[cc] += p[r] * FA_NAME(st_get)(st, xr, cc);
    }
}

/* Rows wider than the registers hold (8 vectors: AVX2 from 64 floats,
 * NEON from 32) are summed a run of rows at a time, every column group of
 * a run before the next run, so that each row is read whole while it is in
 * L1 (a column group swept over all nk rows read each row in parts, which
 * the hardware prefetcher streams badly: threads-and-speed.md, "Value rows
 * summed in runs").  Each o[c] still sums its rows in order: the same bits. */
#define FA_GEMV_RUN_BYTES 4096
static FA_ALWAYS_INLINE void FA_NAME(gemv_t_any)(const fa_store st, fa_idx nk, fa_idx n,
                                                 const T *p, const void *x, fa_idx rs, T *o)
{
    if (n <= 8 * VLEN) {
        FA_NAME(gemv_t_cols)(st, nk, n, p, x, rs, o);
        return;
    }
    const fa_idx row_bytes = FA_NAME(st_row_bytes)(st, n);
    const fa_idx run = row_bytes >= FA_GEMV_RUN_BYTES / 2 ? 2 : FA_GEMV_RUN_BYTES / row_bytes;
    for (fa_idx r0 = 0; r0 < nk; r0 += run)
        FA_NAME(gemv_t_cols)(st, nk - r0 < run ? nk - r0 : run, n, p + r0,
                             FA_NAME(st_at)(st, x, r0 * rs), rs, o);
}

/* gemv_t_cols for the nq <= 4 rows of weights p + t * ldp into the rows
 * o + t * ldo, none of the weights 0: each vector of x is loaded (and
 * converted) once for all of them, nv vectors of a row at a time.  Each o
 * element sums the products of gemv_t_cols in the same order: the same
 * bits. */
static FA_ALWAYS_INLINE void FA_NAME(gemv_t_rows_body)(const int nq, const int nv,
                                                       const fa_store st, fa_idx nk,
                                                       const T *p, fa_idx ldp, const void *x,
                                                       fa_idx rs, fa_idx c, T *o, fa_idx ldo)
{
    V acc[4][8];
    for (int t = 0; t < nq; ++t)
        for (int u = 0; u < nv; ++u) acc[t][u] = VLOAD(o + t * ldo + c + u * VLEN);
    for (fa_idx r = 0; r < nk; ++r) {
        const void *xr = FA_NAME(st_at)(st, x, r * rs);
        V b[4];
        for (int t = 0; t < nq; ++t) b[t] = VSET1(p[t * ldp + r]);
        for (int u = 0; u < nv; ++u) {
            const V xv = FA_NAME(vload_st)(st, xr, c + u * VLEN);
            for (int t = 0; t < nq; ++t) acc[t][u] = VFMA(b[t], xv, acc[t][u]);
        }
    }
    for (int t = 0; t < nq; ++t)
        for (int u = 0; u < nv; ++u) VSTORE(o + t * ldo + c + u * VLEN, acc[t][u]);
}

/* Vectors per tile of gemv_t_rows_nq: nq x nv accumulators, nq broadcast
 * weights and a vector of x within AVX-512's 32 registers (the one path
 * rows_shared lets share). */
#define FA_GEMV_NV(nq) ((nq) <= 2 ? 8 : 4)

static FA_ALWAYS_INLINE void FA_NAME(gemv_t_rows_nq)(const int nq, const fa_store st, fa_idx nk,
                                                     fa_idx n, const T *p, fa_idx ldp,
                                                     const void *x, fa_idx rs, T *o, fa_idx ldo)
{
    const int nv = FA_GEMV_NV(nq);
    fa_idx c = 0;
    for (; c + nv * VLEN <= n; c += nv * VLEN)
        FA_NAME(gemv_t_rows_body)(nq, nv, st, nk, p, ldp, x, rs, c, o, ldo);
    switch ((n - c) / VLEN) {
    case 7: FA_NAME(gemv_t_rows_body)(nq, 7, st, nk, p, ldp, x, rs, c, o, ldo); break;
    case 6: FA_NAME(gemv_t_rows_body)(nq, 6, st, nk, p, ldp, x, rs, c, o, ldo); break;
    case 5: FA_NAME(gemv_t_rows_body)(nq, 5, st, nk, p, ldp, x, rs, c, o, ldo); break;
    case 4: FA_NAME(gemv_t_rows_body)(nq, 4, st, nk, p, ldp, x, rs, c, o, ldo); break;
    case 3: FA_NAME(gemv_t_rows_body)(nq, 3, st, nk, p, ldp, x, rs, c, o, ldo); break;
    case 2: FA_NAME(gemv_t_rows_body)(nq, 2, st, nk, p, ldp, x, rs, c, o, ldo); break;
    case 1: FA_NAME(gemv_t_rows_body)(nq, 1, st, nk, p, ldp, x, rs, c, o, ldo); break;
    default: break;
    }
    c += (n - c) / VLEN * VLEN;
    for (int t = 0; t < nq; ++t) /* gemv_t_cols' scalar columns */
        for (fa_idx r = 0; c < n && r < nk; ++r) {
            const void *xr = FA_NAME(st_at)(st, x, r * rs);
            for (fa_idx cc = c; cc < n; ++cc)
                o[t * ldo + cc] += p[t * ldp + r] * FA_NAME(st_get)(st, xr, cc);
        }
}

/* gemv_t_any for nq rows of weights and of o (the query heads of
 * grouped-query decoding), in gemv_t_any's runs of rows.  Rows stored in
 * fewer bits are read and converted once for all the heads where no weight
 * of the run is 0 and rows_shared says so, else gemv_t_cols runs per head,
 * leaving zero weights' rows out. */
static FA_ALWAYS_INLINE void FA_NAME(gemv_t_rows_any)(const fa_store st, fa_idx nq, fa_idx nk,
                                                      fa_idx n, const T *p, fa_idx ldp,
                                                      const void *x, fa_idx rs, T *o, fa_idx ldo)
{
    const fa_idx row_bytes = FA_NAME(st_row_bytes)(st, n);
    const fa_idx run = n <= 8 * VLEN ? nk
                       : row_bytes >= FA_GEMV_RUN_BYTES / 2 ? 2 : FA_GEMV_RUN_BYTES / row_bytes;
    for (fa_idx r0 = 0; r0 < nk; r0 += run) {
        const fa_idx m = nk - r0 < run ? nk - r0 : run;
        const void *xr = FA_NAME(st_at)(st, x, r0 * rs);
        int shared = nq > 1 && FA_NAME(rows_shared)(st);
        for (fa_idx t = 0; shared && t < nq; ++t)
            for (fa_idx r = 0; r < m; ++r) shared &= p[t * ldp + r0 + r] != 0;
        for (fa_idx t0 = 0; t0 < nq; t0 += 4) {
            const T *pt = p + t0 * ldp + r0;
            T *ot = o + t0 * ldo;
            switch (!shared ? 1 : nq - t0 < 4 ? nq - t0 : 4) {
            case 4: FA_NAME(gemv_t_rows_nq)(4, st, m, n, pt, ldp, xr, rs, ot, ldo); break;
            case 3: FA_NAME(gemv_t_rows_nq)(3, st, m, n, pt, ldp, xr, rs, ot, ldo); break;
            case 2: FA_NAME(gemv_t_rows_nq)(2, st, m, n, pt, ldp, xr, rs, ot, ldo); break;
            default:
                for (fa_idx t = t0; t < nq && t < t0 + 4; ++t)
                    FA_NAME(gemv_t_cols)(st, m, n, p + t * ldp + r0, xr, rs, o + t * ldo);
                break;
            }
        }
    }
}
#undef FA_GEMV_NV
#undef FA_GEMV_RUN_BYTES
#undef V
#undef VI
#undef VMASK
#undef VLEN
#undef VZERO
#undef VSET1
#undef VLOAD
#undef VSTORE
#undef VBCAST
#undef VADD
#undef VSUB
#undef VMUL
#undef VDIV
#undef VFMA
#undef VFNMA
#undef VMAX
#undef VMIN
#undef VROUND
#undef VTRUNC
#undef VEQ
#undef VLT
#undef VBLEND
#undef VCVTI
#undef VI_SET1
#undef VI_ADD
#undef VI_SUB
#undef VI_SRAI
#undef VI_SRLI
#undef VI_SLLI
#undef VI_AS
#undef VAS_I
#undef VREDUCE
#undef VREDUCE_ROWS
#undef VLOAD_F16
#undef VLOAD_BF16
#undef VLOAD_I8
#undef VLOAD_E5M2
#undef VLOAD_U8
#undef VI_AND
#undef VI_OR
#undef VSET1_F16
#undef VLOAD_Q4
#undef VSTORE_F16
#undef VSCALEF
#undef VFMA_LANE
#undef VTILE_T
