/* Constants of the vector exp shared by every instruction-set path.
 *
 * exp(x) = 2^n * exp(r),  n = round(x / ln 2),  r = x - n ln 2 (|r| <= ln2/2).
 * ln 2 is split in two (Cody and Waite) so that n * LN2_HI is exact.
 * exp(r) is its Taylor polynomial: degree 7 for float (truncation below
 * 0.05 ulp on |r| <= 0.347), degree 13 for double (below 0.05 ulp).
 * 2^n is applied as two exact powers of two, so results in the subnormal
 * range are rounded once instead of flushed to zero.
 * Measured error: tests/test_exp.py. */
#ifndef FA_EXP_CONSTS_H
#define FA_EXP_CONSTS_H

#define FA_EXPF_LO (-104.0f)            /* exp below this rounds to 0 */
#define FA_EXPF_HI (89.0f)              /* exp above this overflows to inf */
#define FA_EXPF_LOG2E 1.44269504088896341f
#define FA_EXPF_LN2_HI 0.693359375f     /* 355/512: 9 significant bits */
#define FA_EXPF_LN2_LO (-2.12194440e-4f)
#define FA_EXPF_ROUND 12582912.0f       /* 1.5 * 2^23: adding it rounds to an integer */

/* The softmax's float exp (vexp_softmax1, x <= ln 256): one reduction
 * constant, the float nearest ln 2 (n * LN2 is exact inside the fused
 * multiply-add; ln 2 - LN2 = -1.9e-9 adds |n| * 1.9e-9 to the relative
 * error, which stays below 2^-24 of the row's largest weight), and a
 * degree-6 polynomial of exp on |r| <= 0.3467 with 1 + r fixed, the rest
 * minimax for the relative error (Lawson's algorithm; 3.7e-9 with these
 * float coefficients). */
#define FA_EXPF_LN2 0x1.62e430p-1f
#define FA_EXPF_SM_C2 0x1.fffffcp-2f
#define FA_EXPF_SM_C3 0x1.555492p-3f
#define FA_EXPF_SM_C4 0x1.5558f2p-5f
#define FA_EXPF_SM_C5 0x1.123a0cp-7f
#define FA_EXPF_SM_C6 0x1.6a23f2p-10f

#define FA_EXP_LO (-746.0)
#define FA_EXP_HI (710.0)
#define FA_EXP_LOG2E 1.4426950408889634074
#define FA_EXP_LN2_HI 6.93147180369123816490e-01 /* 32 trailing zero bits */
#define FA_EXP_LN2_LO 1.90821492927058770002e-10
#define FA_EXP_ROUND 6755399441055744.0         /* 1.5 * 2^52 */

/* 1/k! for k = 2..13, highest degree first (Horner order). */
#define FA_INV_FACT_13 1.6059043836821614599e-10
#define FA_INV_FACT_12 2.0876756987868098979e-09
#define FA_INV_FACT_11 2.5052108385441718775e-08
#define FA_INV_FACT_10 2.7557319223985890653e-07
#define FA_INV_FACT_9 2.7557319223985890653e-06
#define FA_INV_FACT_8 2.4801587301587301587e-05
#define FA_INV_FACT_7 1.9841269841269841270e-04
#define FA_INV_FACT_6 1.3888888888888888889e-03
#define FA_INV_FACT_5 8.3333333333333333333e-03
#define FA_INV_FACT_4 4.1666666666666666667e-02
#define FA_INV_FACT_3 1.6666666666666666667e-01
#define FA_INV_FACT_2 0.5

#endif
