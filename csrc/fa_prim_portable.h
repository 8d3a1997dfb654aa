/* Portable primitives for element type T (float or double): the register
 * micro-kernel and the exp used by softmax.  Plain C99 that compilers
 * auto-vectorise for whatever baseline the build targets.
 *
 * Included by fa_inst_portable.c once per type, with T, FA_NR, FA_NAME and
 * FA_IS_F32 defined. */
#include <string.h>
#include "fa_prim_exp_consts.h"

/* c[0:mr, 0:FA_NR] (+)= alpha * sum_k a(r, k) b[k, 0:FA_NR], with a(r, k) at
 * a[r*rs_a + k*cs_a] and b rows FA_NR wide at stride ldb.  When colmax is
 * not NULL, colmax[j] becomes the max of itself and the stored column j
 * (NaN ignored).  mr is a constant after inlining, so the accumulators
 * live in registers: 16-byte vectors of the GNU vector extension (SSE2,
 * NEON and every other target gcc and clang know) where the compiler has
 * it, which left to itself vectorises this loop nest along the wrong axis;
 * plain C elsewhere. */
#if defined(__GNUC__) || defined(__clang__)
typedef T FA_NAME(v16) __attribute__((vector_size(16)));
#define FA_VW (16 / (int)sizeof(T))

static FA_ALWAYS_INLINE void FA_NAME(ukr_body)(const int mr, fa_idx kc, const T *a, fa_idx rs_a,
                                               fa_idx cs_a, const T *b, fa_idx ldb, T *c,
                                               fa_idx ldc, T alpha, int accumulate, T *colmax)
{
    FA_NAME(v16) acc[FA_MR][FA_NR / FA_VW];
    for (int r = 0; r < mr; ++r)
        for (int u = 0; u < FA_NR / FA_VW; ++u) acc[r][u] = (FA_NAME(v16)){0};
    for (fa_idx k = 0; k < kc; ++k) {
        FA_NAME(v16) bv[FA_NR / FA_VW];
        memcpy(bv, b + k * ldb, sizeof bv);
        const T *ak = a + k * cs_a;
        for (int r = 0; r < mr; ++r) {
            const T ar = ak[r * rs_a];
            for (int u = 0; u < FA_NR / FA_VW; ++u) acc[r][u] += ar * bv[u];
        }
    }
    for (int r = 0; r < mr; ++r) {
        T *cr = c + r * ldc, t[FA_NR];
        memcpy(t, acc[r], sizeof t);
        if (alpha != 1)
            for (int j = 0; j < FA_NR; ++j) t[j] *= alpha;
        for (int j = 0; j < FA_NR; ++j) cr[j] = accumulate ? cr[j] + t[j] : t[j];
        if (colmax)
            for (int j = 0; j < FA_NR; ++j) colmax[j] = cr[j] > colmax[j] ? cr[j] : colmax[j];
    }
}
#undef FA_VW
#else
static void FA_NAME(ukr_body)(const int mr, fa_idx kc, const T *a, fa_idx rs_a, fa_idx cs_a,
                              const T *b, fa_idx ldb, T *c, fa_idx ldc, T alpha, int accumulate,
                              T *colmax)
{
    T acc[FA_MR][FA_NR];
    for (int r = 0; r < mr; ++r)
        for (int j = 0; j < FA_NR; ++j) acc[r][j] = 0;
    for (fa_idx k = 0; k < kc; ++k) {
        const T *bk = b + k * ldb;
        const T *ak = a + k * cs_a;
        for (int r = 0; r < mr; ++r) {
            const T ar = ak[r * rs_a];
            for (int j = 0; j < FA_NR; ++j) acc[r][j] += ar * bk[j];
        }
    }
    for (int r = 0; r < mr; ++r) {
        T *cr = c + r * ldc;
        for (int j = 0; j < FA_NR; ++j) acc[r][j] *= alpha;
        for (int j = 0; j < FA_NR; ++j) cr[j] = accumulate ? cr[j] + acc[r][j] : acc[r][j];
        if (colmax)
            for (int j = 0; j < FA_NR; ++j) colmax[j] = cr[j] > colmax[j] ? cr[j] : colmax[j];
    }
}
#endif

static void FA_NAME(ukr)(int mr, fa_idx kc, const T *a, fa_idx rs_a, fa_idx cs_a,
                         const T *b, fa_idx ldb, T *c, fa_idx ldc, T alpha, int accumulate,
                         T *colmax)
{
    switch (mr) {
    case 6: FA_NAME(ukr_body)(6, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    case 5: FA_NAME(ukr_body)(5, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    case 4: FA_NAME(ukr_body)(4, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    case 3: FA_NAME(ukr_body)(3, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    case 2: FA_NAME(ukr_body)(2, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    case 1: FA_NAME(ukr_body)(1, kc, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate, colmax); break;
    default: break;
    }
}

/* exp of one element; the algorithm of fa_prim_exp_consts.h.  Branch-free so
 * that loops over it vectorise.  NaN in, NaN out. */
static FA_ALWAYS_INLINE T FA_NAME(exp1)(T x)
{
#if FA_IS_F32
    float xc = x < FA_EXPF_LO ? FA_EXPF_LO : x;
    xc = xc > FA_EXPF_HI ? FA_EXPF_HI : xc;
    xc = xc == xc ? xc : 0.0f;                       /* keep NaN out of the int path */
    float n = (xc * FA_EXPF_LOG2E + FA_EXPF_ROUND) - FA_EXPF_ROUND;
    float r = (xc - n * FA_EXPF_LN2_HI) - n * FA_EXPF_LN2_LO;
    float p = (float)FA_INV_FACT_7;
    p = p * r + (float)FA_INV_FACT_6;
    p = p * r + (float)FA_INV_FACT_5;
    p = p * r + (float)FA_INV_FACT_4;
    p = p * r + (float)FA_INV_FACT_3;
    p = p * r + (float)FA_INV_FACT_2;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int ni = (int)n, n1 = ni / 2, n2 = ni - n1;
    unsigned u1 = (unsigned)(n1 + 127) << 23, u2 = (unsigned)(n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &u1, sizeof s1);
    memcpy(&s2, &u2, sizeof s2);
    float y = (p * s1) * s2;
    return x == x ? y : x;
#else
    double xc = x < FA_EXP_LO ? FA_EXP_LO : x;
    xc = xc > FA_EXP_HI ? FA_EXP_HI : xc;
    xc = xc == xc ? xc : 0.0;
    double n = (xc * FA_EXP_LOG2E + FA_EXP_ROUND) - FA_EXP_ROUND;
    double r = (xc - n * FA_EXP_LN2_HI) - n * FA_EXP_LN2_LO;
    double p = FA_INV_FACT_13;
    p = p * r + FA_INV_FACT_12;
    p = p * r + FA_INV_FACT_11;
    p = p * r + FA_INV_FACT_10;
    p = p * r + FA_INV_FACT_9;
    p = p * r + FA_INV_FACT_8;
    p = p * r + FA_INV_FACT_7;
    p = p * r + FA_INV_FACT_6;
    p = p * r + FA_INV_FACT_5;
    p = p * r + FA_INV_FACT_4;
    p = p * r + FA_INV_FACT_3;
    p = p * r + FA_INV_FACT_2;
    p = p * r + 1.0;
    p = p * r + 1.0;
    long long ni = (long long)n, n1 = ni / 2, n2 = ni - n1;
    unsigned long long u1 = (unsigned long long)(n1 + 1023) << 52;
    unsigned long long u2 = (unsigned long long)(n2 + 1023) << 52;
    double s1, s2;
    memcpy(&s1, &u1, sizeof s1);
    memcpy(&s2, &u2, sizeof s2);
    double y = (p * s1) * s2;
    return x == x ? y : x;
#endif
}

/* y[j] = exp(x[j]) */
static void FA_NAME(vexp)(fa_idx n, const T *x, T *y)
{
    for (fa_idx j = 0; j < n; ++j) y[j] = FA_NAME(exp1)(x[j]);
}

/* For each column j < nc of the block z (row stride ld), rows r0..r1-1:
 * z[r, j] = exp(z[r, j] - m[j]) and sum[j] = sum over r of the new z[r, j],
 * in four parts by r & 3 (a quarter of the rounding), so that a range of
 * rows sums to the bits of the whole block whose other rows are hidden.
 * hidden: the rows may hold -inf (hidden keys); their 0 then skips exp1,
 * whose underflow costs x86 a microcode assist (the same bits either way). */
static void FA_NAME(exp_block)(fa_idx r0, fa_idx r1, fa_idx nc, fa_idx ld, T *z, const T *m,
                               T *sum, int hidden)
{
    for (fa_idx r = r0; r < r1; ++r) {
        T *zr = z + r * ld;
        if (hidden) {
            for (fa_idx j = 0; j < nc; ++j) {
                const T x = zr[j] - m[j];
                zr[j] = x == -(T)INFINITY ? 0 : FA_NAME(exp1)(x);
            }
        } else {
            for (fa_idx j = 0; j < nc; ++j) zr[j] = FA_NAME(exp1)(zr[j] - m[j]);
        }
    }
    for (fa_idx j = 0; j < nc; ++j) {
        T part[4] = {0, 0, 0, 0};
        for (fa_idx r = r0; r < r1; ++r) part[r & 3] += z[r * ld + j];
        sum[j] = (part[0] + part[1]) + (part[2] + part[3]);
    }
}

/* dst[e * ld + j * ds] = src[j * rs + e * cs] * scale for j < nq, e < n: a
 * block of rows, transposed and scaled. */
static void FA_NAME(pack_t)(fa_idx nq, fa_idx n, const T *src, fa_idx rs, fa_idx cs, T scale,
                            T *dst, fa_idx ld, fa_idx ds)
{
    for (fa_idx e = 0; e < n; ++e)
        for (fa_idx j = 0; j < nq; ++j) dst[e * ld + j * ds] = src[j * rs + e * cs] * scale;
}

/* o[c * ld + j] /= l[j] for c < n, j < ld, and 0 where l[j] == 0;
 * bad[j] = 0 when column j came out finite, else NaN */
static void FA_NAME(normalize)(fa_idx n, fa_idx ld, T *o, const T *l, T *bad)
{
    for (fa_idx j = 0; j < ld; ++j) bad[j] = 0;
    for (fa_idx c = 0; c < n; ++c)
        for (fa_idx j = 0; j < ld; ++j) {
            const T y = l[j] == 0 ? 0 : o[c * ld + j] / l[j];
            o[c * ld + j] = y;
            bad[j] += y - y;
        }
}

/* y[j] = tanh(x[j]), with the C library's tanh */
static void FA_NAME(vtanh)(fa_idx n, const T *x, T *y)
{
    for (fa_idx j = 0; j < n; ++j) y[j] = (T)tanh((double)x[j]);
}

#if FA_IS_F32
/* y[0..n) = x[0..n) rounded to nearest-even binary16 */
static void FA_NAME(narrow_f16)(fa_idx n, const float *x, uint16_t *y)
{
    for (fa_idx j = 0; j < n; ++j) y[j] = fa_f32_f16(x[j]);
}
#endif

/* t[0..n) = elements c..c+n-1 of a Q4 row (c a multiple of FA_Q4_BLOCK, n
 * at most one block): its scale converted once, not per element */
static FA_ALWAYS_INLINE void FA_NAME(q4_run)(const void *p, fa_idx c, fa_idx n, T *t)
{
    const uint8_t *blk = fa_q4_block(p, c);
    const float d = fa_q4_scale(blk);
    for (fa_idx e = 0; e < n; ++e) {
        const uint8_t b = blk[2 + (e & 15)];
        t[e] = (T)((float)((e & 16 ? b >> 4 : b & 15) - 8) * d);
    }
}

/* dst[0..n) = a contiguous row stored as st, as T */
static FA_ALWAYS_INLINE void FA_NAME(cvt_body)(const fa_store st, fa_idx n, const void *src, T *dst)
{
    if (st == FA_STORE_Q4) {
        for (fa_idx c = 0; c < n; c += FA_Q4_BLOCK)
            FA_NAME(q4_run)(src, c, n - c < FA_Q4_BLOCK ? n - c : FA_Q4_BLOCK, dst + c);
        return;
    }
    for (fa_idx j = 0; j < n; ++j) dst[j] = FA_NAME(st_get)(st, src, j);
}

/* sum over c of x[c] * y[c] (both contiguous, y stored as st), in eight
 * interleaved partial sums; a Q4 row a block at a time, the same sums */
static FA_ALWAYS_INLINE T FA_NAME(dot_body)(const fa_store st, fa_idx n, const T *x, const void *y)
{
    T part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    fa_idx c = 0;
    if (st == FA_STORE_Q4) {
        T q[FA_Q4_BLOCK];
        for (fa_idx c0 = 0; c0 < n; c0 += FA_Q4_BLOCK) {
            const fa_idx m = n - c0 < FA_Q4_BLOCK ? n - c0 : FA_Q4_BLOCK;
            FA_NAME(q4_run)(y, c0, m, q);
            for (; c + 8 <= c0 + m; c += 8)
                for (int t = 0; t < 8; ++t) part[t] += x[c + t] * q[c - c0 + t];
            for (; c < c0 + m; ++c) part[0] += x[c] * q[c - c0]; /* the last block's tail */
        }
    } else {
        for (; c + 8 <= n; c += 8)
            for (int t = 0; t < 8; ++t) part[t] += x[c + t] * FA_NAME(st_get)(st, y, c + t);
        for (; c < n; ++c) part[0] += x[c] * FA_NAME(st_get)(st, y, c);
    }
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

/* o[c] += sum over r < nk of p[r] * x[r * rs + c], for c < n, x stored as
 * st, leaving out the rows whose p[r] is exactly 0 (their x is never read). */
static FA_ALWAYS_INLINE void FA_NAME(gemv_t_any)(const fa_store st, fa_idx nk, fa_idx n,
                                                 const T *p, const void *x, fa_idx rs, T *o)
{
    for (fa_idx r = 0; r < nk; ++r) {
        const T pr = p[r]; /* held: o could alias p, as far as the compiler knows */
        if (pr == 0) continue;
        const void *xr = FA_NAME(st_at)(st, x, r * rs);
        if (st == FA_STORE_Q4) {
            T q[FA_Q4_BLOCK];
            for (fa_idx c0 = 0; c0 < n; c0 += FA_Q4_BLOCK) {
                const fa_idx m = n - c0 < FA_Q4_BLOCK ? n - c0 : FA_Q4_BLOCK;
                FA_NAME(q4_run)(xr, c0, m, q);
                for (fa_idx e = 0; e < m; ++e) o[c0 + e] += pr * q[e];
            }
        } else {
            for (fa_idx c = 0; c < n; ++c) o[c] += pr * FA_NAME(st_get)(st, xr, c);
        }
    }
}

/* Whether rows stored as st are converted once for the query heads of a
 * group: on the AVX-512 path (fa_prim_simd.h), never here. */
static FA_ALWAYS_INLINE int FA_NAME(rows_shared)(const fa_store st)
{
    (void)st;
    return 0;
}

/* s[t * ld] = dot_body(st, n, x + t * ldx, y) for t < nq */
static FA_ALWAYS_INLINE void FA_NAME(dot_rows_body)(const int nq, const fa_store st, fa_idx n,
                                                    const T *x, fa_idx ldx, const void *y, T *s,
                                                    fa_idx ld)
{
    for (int t = 0; t < nq; ++t) s[t * ld] = FA_NAME(dot_body)(st, n, x + t * ldx, y);
}

/* gemv_t_any for nq rows of weights p + t * ldp into the rows o + t * ldo
 * (the AVX-512 path reads x once for them all) */
static FA_ALWAYS_INLINE void FA_NAME(gemv_t_rows_any)(const fa_store st, fa_idx nq, fa_idx nk,
                                                      fa_idx n, const T *p, fa_idx ldp,
                                                      const void *x, fa_idx rs, T *o, fa_idx ldo)
{
    for (fa_idx t = 0; t < nq; ++t) FA_NAME(gemv_t_any)(st, nk, n, p + t * ldp, x, rs, o + t * ldo);
}
