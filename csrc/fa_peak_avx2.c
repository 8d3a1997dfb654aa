/* AVX2 + FMA peak loops, compiled with -mavx2 -mfma and called only when
 * fa_cpu_has_avx2_fma() says the CPU has both. */
#include "fa_peak.h"
#if FA_HAVE_X86_SIMD
#include <immintrin.h>

/* 12 independent accumulators: more than latency x issue width of the FMA
 * units of current x86 cores (4 cycles x 2 units), and with the two
 * constants still within the 16 ymm registers. */
#define CHAINS 12
#define READ_ACC 8 /* 8 loads of 32 bytes in flight per iteration */

fa_idx fa_peak_fma_flops_avx2(void) { return CHAINS * 8 * 2; }

float fa_peak_fma_f32_avx2(fa_idx iters)
{
    const __m256 a = _mm256_set1_ps(FA_PEAK_MUL), b = _mm256_set1_ps(FA_PEAK_ADD);
    __m256 c0 = _mm256_set1_ps(1.00f), c1 = _mm256_set1_ps(1.01f), c2 = _mm256_set1_ps(1.02f),
           c3 = _mm256_set1_ps(1.03f), c4 = _mm256_set1_ps(1.04f), c5 = _mm256_set1_ps(1.05f),
           c6 = _mm256_set1_ps(1.06f), c7 = _mm256_set1_ps(1.07f), c8 = _mm256_set1_ps(1.08f),
           c9 = _mm256_set1_ps(1.09f), c10 = _mm256_set1_ps(1.10f), c11 = _mm256_set1_ps(1.11f);
    float lanes[8], total = 0.0f;
    fa_idx i;
    int j;
    for (i = 0; i < iters; i++) {
        c0 = _mm256_fmadd_ps(c0, a, b);
        c1 = _mm256_fmadd_ps(c1, a, b);
        c2 = _mm256_fmadd_ps(c2, a, b);
        c3 = _mm256_fmadd_ps(c3, a, b);
        c4 = _mm256_fmadd_ps(c4, a, b);
        c5 = _mm256_fmadd_ps(c5, a, b);
        c6 = _mm256_fmadd_ps(c6, a, b);
        c7 = _mm256_fmadd_ps(c7, a, b);
        c8 = _mm256_fmadd_ps(c8, a, b);
        c9 = _mm256_fmadd_ps(c9, a, b);
        c10 = _mm256_fmadd_ps(c10, a, b);
        c11 = _mm256_fmadd_ps(c11, a, b);
    }
    c0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                       _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)));
    c0 = _mm256_add_ps(c0, _mm256_add_ps(_mm256_add_ps(c8, c9), _mm256_add_ps(c10, c11)));
    _mm256_storeu_ps(lanes, c0);
    for (j = 0; j < 8; j++) total += lanes[j];
    return total;
}

float fa_peak_read_f32_avx2(fa_idx n, const float *x)
{
    __m256 s[READ_ACC];
    float lanes[8], total = 0.0f;
    fa_idx i = 0;
    int j;
    for (j = 0; j < READ_ACC; j++) s[j] = _mm256_setzero_ps();
    for (; i + 8 * READ_ACC <= n; i += 8 * READ_ACC)
        for (j = 0; j < READ_ACC; j++) s[j] = _mm256_add_ps(s[j], _mm256_loadu_ps(x + i + 8 * j));
    for (j = 1; j < READ_ACC; j++) s[0] = _mm256_add_ps(s[0], s[j]);
    _mm256_storeu_ps(lanes, s[0]);
    for (j = 0; j < 8; j++) total += lanes[j];
    for (; i < n; i++) total += x[i];
    return total;
}
#else
typedef int fa_peak_avx2_unused; /* ISO C forbids an empty translation unit */
#endif
