/* The vector tanh of the score soft-cap (fa_prim_simd.h).
 *
 * For |x| < FA_TANH_SMALL, tanh(x) = x * P(x^2), P the Chebyshev fit of
 * tanh(sqrt(t)) / sqrt(t) on t in [0, FA_TANH_SMALL^2] (computed with
 * mpmath's chebyfit; degree 5 for float, 11 for double): within 1 ulp of
 * the correctly rounded tanh there.  Above, tanh(x) = 1 - 2 / (exp(2x) + 1),
 * within a few ulp: the subtraction cannot cancel more than a factor 2 for
 * |x| >= 0.625.  Coefficients from the highest degree down. */
#ifndef FA_TANH_CONSTS_H
#define FA_TANH_CONSTS_H

#define FA_TANH_SMALL2 0.390625 /* FA_TANH_SMALL = 0.625, squared */

#define FA_TANHF_NC 6
#define FA_TANHF_C                                                                          \
    { -0.005657135184380392f, 0.02058819145458637f, -0.05372010765662894f,                  \
      0.1333111405568977f, -0.3333325986294753f, 0.9999999960227217f }

#define FA_TANH_NC 12
#define FA_TANH_C                                                                           \
    { -1.6001499513001042e-05, 7.698563199045423e-05, -0.00022841018529512851,             \
      0.0005862314316050611, -0.0014549293858543903, 0.003591982521583925,                  \
      -0.008863220021256096, 0.021869487483410596, -0.053968253925945696,                   \
      0.13333333333245254, -0.33333333333332615, 1.0 }

#endif
