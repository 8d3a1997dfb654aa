/* Portable primitives for element type T (float or double): the register
 * micro-kernel and the exp used by softmax.  Plain C99 that compilers
 * auto-vectorise for whatever baseline the build targets.
 *
 * Included by fa_portable.c once per type, with T, FA_NR, FA_NAME and
 * FA_IS_F32 defined. */
#include <string.h>
#include "fa_exp_consts.h"

/* c[0:mr, 0:FA_NR] (+)= sum_k a(r, k) b[k, 0:FA_NR], with a(r, k) at
 * a[r*rs_a + k*cs_a] and b rows FA_NR wide at stride ldb.  mr is a
 * constant after inlining, so the accumulators live in registers. */
static inline void FA_NAME(ukr_body)(const int mr, fa_idx kc, const T *a, fa_idx rs_a,
                                     fa_idx cs_a, const T *b, fa_idx ldb, T *c,
                                     fa_idx ldc, int accumulate)
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
        if (accumulate)
            for (int j = 0; j < FA_NR; ++j) cr[j] += acc[r][j];
        else
            for (int j = 0; j < FA_NR; ++j) cr[j] = acc[r][j];
    }
}

static void FA_NAME(ukr)(int mr, fa_idx kc, const T *a, fa_idx rs_a, fa_idx cs_a,
                         const T *b, fa_idx ldb, T *c, fa_idx ldc, int accumulate)
{
    switch (mr) {
    case 6: FA_NAME(ukr_body)(6, kc, a, rs_a, cs_a, b, ldb, c, ldc, accumulate); break;
    case 5: FA_NAME(ukr_body)(5, kc, a, rs_a, cs_a, b, ldb, c, ldc, accumulate); break;
    case 4: FA_NAME(ukr_body)(4, kc, a, rs_a, cs_a, b, ldb, c, ldc, accumulate); break;
    case 3: FA_NAME(ukr_body)(3, kc, a, rs_a, cs_a, b, ldb, c, ldc, accumulate); break;
    case 2: FA_NAME(ukr_body)(2, kc, a, rs_a, cs_a, b, ldb, c, ldc, accumulate); break;
    case 1: FA_NAME(ukr_body)(1, kc, a, rs_a, cs_a, b, ldb, c, ldc, accumulate); break;
    default: break;
    }
}

/* exp of one element; the algorithm of fa_exp_consts.h.  Branch-free so
 * that loops over it vectorise.  NaN in, NaN out. */
static inline T FA_NAME(exp1)(T x)
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

/* z[j] = exp(z[j] - m[j]); l[j] += z[j].  m[j] is finite or NaN. */
static void FA_NAME(exp_sub_sum)(fa_idx n, T *z, const T *m, T *l)
{
    for (fa_idx j = 0; j < n; ++j) {
        const T e = FA_NAME(exp1)(z[j] - m[j]);
        z[j] = e;
        l[j] += e;
    }
}
