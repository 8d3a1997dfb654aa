/* The eight interleaved parts of fa_kern_all.h's sum and max of a float
 * row, over its whole groups of eight, as one 256-bit vector, for the AVX2
 * and AVX-512 paths: the same operations in the same order as the C loops,
 * which gcc compiled to eight scalar chains (threads-and-speed.md, "Lane
 * sums in vectors").  Each starts from
 * the parts given and returns where the groups end; the caller adds the
 * rest and combines the parts. */
#ifndef FA_PARTS_X86_H
#define FA_PARTS_X86_H
#include <immintrin.h>

static FA_ALWAYS_INLINE fa_idx fa_parts_sum_ps256(fa_idx n, const float *x, float *part)
{
    __m256 acc = _mm256_loadu_ps(part);
    fa_idx j = 0;
    for (; j + 8 <= n; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + j));
    _mm256_storeu_ps(part, acc);
    return j;
}

/* NaN ignored: MAXPS returns its second operand, the part, unless the
 * element is greater */
static FA_ALWAYS_INLINE fa_idx fa_parts_max_ps256(fa_idx n, const float *x, float *part)
{
    __m256 acc = _mm256_loadu_ps(part);
    fa_idx j = 0;
    for (; j + 8 <= n; j += 8) acc = _mm256_max_ps(_mm256_loadu_ps(x + j), acc);
    _mm256_storeu_ps(part, acc);
    return j;
}
#endif
