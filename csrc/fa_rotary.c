/* Rotary position embedding (Su et al. 2021, "RoFormer"), one row at a time:
 * memory-bound and applied once per token, so one portable loop serves every
 * path.  Each output is x_a c - x_b s or x_b c + x_a s, two products and one
 * sum, each rounded (C99 without contraction: no FMA), the arithmetic of the
 * formula in NumPy or PyTorch. */
#include "fastattn.h"

#define FA_ROTARY(T, NAME)                                                                     \
    static int NAME(fa_idx n, fa_idx half, int interleaved, const T *x, fa_idx xs, const T *c,         \
             const T *s, T *y, fa_idx ys)                                                      \
    {                                                                                          \
        if (n < 0 || half < 0 || 2 * half > n) return -1;                                      \
        const fa_idx step = interleaved ? 2 : 1, other = interleaved ? 1 : half;                \
        for (fa_idx i = 0; i < half; ++i) {                                                    \
            const fa_idx a = i * step, b = a + other;                                          \
            const T xa = x[a * xs], xb = x[b * xs];                                            \
            y[a * ys] = xa * c[i] - xb * s[i];                                                 \
            y[b * ys] = xb * c[i] + xa * s[i];                                                 \
        }                                                                                      \
        if (y != x || ys != xs)                                                                \
            for (fa_idx e = 2 * half; e < n; ++e) y[e * ys] = x[e * xs];                       \
        return 0;                                                                              \
    }

FA_ROTARY(float, rotary_f32)
FA_ROTARY(double, rotary_f64)

int fa_rotary(int elsize, fa_idx n, fa_idx half, int interleaved, const void *x, fa_idx xs,
              const void *c, const void *s, void *y, fa_idx ys)
{
    if (elsize == 4) return rotary_f32(n, half, interleaved, x, xs, c, s, y, ys);
    if (elsize == 8) return rotary_f64(n, half, interleaved, x, xs, c, s, y, ys);
    return -1;
}
