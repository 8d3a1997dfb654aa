/* The sum and the maximum of a float row in eight interleaved parts
 * (fa_kernels_impl.h's sum and max, the same operations in the same order)
 * as one 256-bit vector of the eight parts, for the AVX2 and AVX-512 paths:
 * gcc compiled the C loops to eight scalar chains (a tenth of the row
 * kernel's time outside its products in int8 decoding on a Zen 4). */
#ifndef FA_PARTS_X86_H
#define FA_PARTS_X86_H
#include <immintrin.h>
#include <math.h>

static FA_ALWAYS_INLINE float fa_sum8_ps256(fa_idx n, const float *x)
{
    __m256 acc = _mm256_setzero_ps();
    fa_idx j = 0;
    for (; j + 8 <= n; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + j));
    float part[8];
    _mm256_storeu_ps(part, acc);
    for (; j < n; ++j) part[0] += x[j];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

/* NaN ignored: MAXPS returns its second operand, the part, unless the
 * element is greater */
static FA_ALWAYS_INLINE float fa_max8_ps256(fa_idx n, const float *x)
{
    __m256 acc = _mm256_set1_ps(-INFINITY);
    fa_idx j = 0;
    for (; j + 8 <= n; j += 8) acc = _mm256_max_ps(_mm256_loadu_ps(x + j), acc);
    float part[8];
    _mm256_storeu_ps(part, acc);
    for (; j < n; ++j) part[0] = x[j] > part[0] ? x[j] : part[0];
    float m = part[0];
    for (int t = 1; t < 8; ++t) m = part[t] > m ? part[t] : m;
    return m;
}
#endif
