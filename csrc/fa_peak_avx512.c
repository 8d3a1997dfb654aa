/* AVX-512 FMA peak loop, compiled with -mavx512f and called only when
 * fa_cpu_has_avx512() says the CPU has it. */
#include "fa_peak_isa.h"
#if FA_HAVE_X86_SIMD
#include <immintrin.h>

/* 16 independent accumulators of the 32 zmm registers: enough for two
 * 512-bit FMA units with a latency of up to 8 cycles. */
#define CHAINS 16

fa_idx fa_peak_fma_flops_avx512(void) { return CHAINS * 16 * 2; }

float fa_peak_fma_f32_avx512(fa_idx iters)
{
    const __m512 a = _mm512_set1_ps(FA_PEAK_MUL), b = _mm512_set1_ps(FA_PEAK_ADD);
    __m512 c[CHAINS];
    fa_idx i;
    int j;
    for (j = 0; j < CHAINS; j++) c[j] = _mm512_set1_ps(1.0f + 0.01f * (float)j);
    for (i = 0; i < iters; i++)
        for (j = 0; j < CHAINS; j++) c[j] = _mm512_fmadd_ps(c[j], a, b);
    for (j = 1; j < CHAINS; j++) c[0] = _mm512_add_ps(c[0], c[j]);
    return _mm512_reduce_add_ps(c[0]);
}
#else
typedef int fa_peak_avx512_unused; /* ISO C forbids an empty translation unit */
#endif
