/* Machine peaks for the benchmarks: the portable loops and the dispatch to
 * the AVX2, AVX-512 and NEON ones (fa_peak_avx2.c, fa_peak_avx512.c,
 * fa_peak_neon.c), by the kernels' fa_isa.  Timing is the caller's: these functions only do a known
 * amount of work.  Reading uses the AVX2 loop on both x86 paths: memory, not
 * the vector width, limits it. */
#include "fa_peak_isa.h"

#define PORTABLE_CHAINS 32 /* independent multiply-add chains; the compiler may vectorise them */
#define PORTABLE_READ_ACC 16

static float fma_portable(fa_idx iters)
{
    float acc[PORTABLE_CHAINS];
    const float a = FA_PEAK_MUL, b = FA_PEAK_ADD;
    float total = 0.0f;
    fa_idx i;
    int j;
    for (j = 0; j < PORTABLE_CHAINS; j++) acc[j] = 1.0f + (float)j * 1e-3f;
    for (i = 0; i < iters; i++)
        for (j = 0; j < PORTABLE_CHAINS; j++) acc[j] = acc[j] * a + b;
    for (j = 0; j < PORTABLE_CHAINS; j++) total += acc[j];
    return total;
}

static float read_portable(fa_idx n, const float *x)
{
    float acc[PORTABLE_READ_ACC] = {0};
    float total = 0.0f;
    fa_idx i = 0;
    int j;
    for (; i + PORTABLE_READ_ACC <= n; i += PORTABLE_READ_ACC)
        for (j = 0; j < PORTABLE_READ_ACC; j++) acc[j] += x[i + j];
    for (; i < n; i++) acc[0] += x[i];
    for (j = 0; j < PORTABLE_READ_ACC; j++) total += acc[j];
    return total;
}

fa_idx fa_peak_fma_flops(fa_isa isa)
{
    switch (isa) {
#if FA_HAVE_X86_SIMD
    case FA_ISA_AVX2: return fa_peak_fma_flops_avx2();
    case FA_ISA_AVX512: return fa_peak_fma_flops_avx512();
#endif
#if FA_HAVE_NEON
    case FA_ISA_NEON: return fa_peak_fma_flops_neon();
#endif
    default: return 2 * PORTABLE_CHAINS; /* a multiply and an add per chain */
    }
}

float fa_peak_fma_f32(fa_isa isa, fa_idx iters)
{
    if (iters < 0) iters = 0;
    switch (isa) {
#if FA_HAVE_X86_SIMD
    case FA_ISA_AVX2: return fa_peak_fma_f32_avx2(iters);
    case FA_ISA_AVX512: return fa_peak_fma_f32_avx512(iters);
#endif
#if FA_HAVE_NEON
    case FA_ISA_NEON: return fa_peak_fma_f32_neon(iters);
#endif
    default: return fma_portable(iters);
    }
}

float fa_peak_read_f32(fa_isa isa, fa_idx n, const float *x)
{
    if (n <= 0 || x == NULL) return 0.0f;
#if FA_HAVE_X86_SIMD
    if (isa == FA_ISA_AVX2 || isa == FA_ISA_AVX512) return fa_peak_read_f32_avx2(n, x);
#endif
#if FA_HAVE_NEON
    if (isa == FA_ISA_NEON) return fa_peak_read_f32_neon(n, x);
#endif
    (void)isa;
    return read_portable(n, x);
}
