/* NEON peak loops, called only when fa_cpu_has_neon() says the CPU has
 * Advanced SIMD. */
#include "fa_peak_isa.h"
#if FA_HAVE_NEON
#include <arm_neon.h>

/* 16 independent accumulators of the 32 registers: more than latency x
 * issue width of the FMA pipes of current cores (4 cycles x 2 pipes on a
 * Cortex-A76 or Neoverse-N1, 4 x 4 on a Neoverse-V1/V2 or Apple core). */
#define CHAINS 16
#define READ_ACC 8 /* 8 loads of 16 bytes in flight per iteration */

fa_idx fa_peak_fma_flops_neon(void) { return CHAINS * 4 * 2; }

float fa_peak_fma_f32_neon(fa_idx iters)
{
    const float32x4_t a = vdupq_n_f32(FA_PEAK_MUL), b = vdupq_n_f32(FA_PEAK_ADD);
    float32x4_t c[CHAINS];
    fa_idx i;
    int j;
    for (j = 0; j < CHAINS; j++) c[j] = vdupq_n_f32(1.0f + 0.01f * (float)j);
    for (i = 0; i < iters; i++)
        for (j = 0; j < CHAINS; j++) c[j] = vfmaq_f32(b, c[j], a);
    for (j = 1; j < CHAINS; j++) c[0] = vaddq_f32(c[0], c[j]);
    return vaddvq_f32(c[0]);
}

float fa_peak_read_f32_neon(fa_idx n, const float *x)
{
    float32x4_t s[READ_ACC];
    float total = 0.0f;
    fa_idx i = 0;
    int j;
    for (j = 0; j < READ_ACC; j++) s[j] = vdupq_n_f32(0.0f);
    for (; i + 4 * READ_ACC <= n; i += 4 * READ_ACC)
        for (j = 0; j < READ_ACC; j++) s[j] = vaddq_f32(s[j], vld1q_f32(x + i + 4 * j));
    for (j = 1; j < READ_ACC; j++) s[0] = vaddq_f32(s[0], s[j]);
    total = vaddvq_f32(s[0]);
    for (; i < n; i++) total += x[i];
    return total;
}
#else
typedef int fa_peak_neon_unused; /* ISO C forbids an empty translation unit */
#endif
