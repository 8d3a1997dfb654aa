/* Per-instruction-set loops behind the fa_peak_* entry points of fa_peak.h. */
#ifndef FA_PEAK_ISA_H
#define FA_PEAK_ISA_H

#include "fa_internal.h"
#include "fa_peak.h"

/* Every chain computes x <- x * MUL + ADD, which converges to ADD / (1 - MUL)
 * = 1: the values stay normal (no denormal slow-down, no overflow) for any
 * number of iterations. */
#define FA_PEAK_MUL 0.999f
#define FA_PEAK_ADD 0.001f

#if FA_HAVE_X86_SIMD
fa_idx fa_peak_fma_flops_avx2(void);
float fa_peak_fma_f32_avx2(fa_idx iters);
float fa_peak_read_f32_avx2(fa_idx n, const float *x);
fa_idx fa_peak_fma_flops_avx512(void);
float fa_peak_fma_f32_avx512(fa_idx iters);
#endif
#if FA_HAVE_NEON
fa_idx fa_peak_fma_flops_neon(void);
float fa_peak_fma_f32_neon(fa_idx iters);
float fa_peak_read_f32_neon(fa_idx n, const float *x);
#endif

#endif
