/* AVX2 + FMA peak loops, compiled with -mavx2 -mfma and called only when
 * fa_cpu_has_avx2_fma() says the CPU has both. */
#include "fa_peak_isa.h"
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
    __m256 c[CHAINS];
    float lanes[8], total = 0.0f;
    fa_idx i;
    int j;
    for (j = 0; j < CHAINS; j++) c[j] = _mm256_set1_ps(1.0f + 0.01f * (float)j);
    for (i = 0; i < iters; i++)
        for (j = 0; j < CHAINS; j++) c[j] = _mm256_fmadd_ps(c[j], a, b);
    for (j = 1; j < CHAINS; j++) c[0] = _mm256_add_ps(c[0], c[j]);
    _mm256_storeu_ps(lanes, c[0]);
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
