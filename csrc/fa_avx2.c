/* The AVX2 + FMA path, compiled with -mavx2 -mfma and called only when
 * fa_cpu_has_avx2_fma() says the CPU has both. */
#include "fa_internal.h"
#if FA_HAVE_X86_SIMD
#include <math.h>

#define FA_ISA avx2
#define FA_SIMD "fa_simd_avx2.h"
#define FA_PRIMS "fa_prims_simd.h"

#define T float
#define FA_SFX f32
#define FA_IS_F32 1
#define FA_NR 16
#define FA_GEMM_NC FA_GEMM_NC_F32
#include "fa_kernels_impl.h"
#undef T
#undef FA_SFX
#undef FA_IS_F32
#undef FA_NR
#undef FA_GEMM_NC

#define T double
#define FA_SFX f64
#define FA_IS_F32 0
#define FA_NR 8
#define FA_GEMM_NC FA_GEMM_NC_F64
#include "fa_kernels_impl.h"
#else
typedef int fa_avx2_unused; /* ISO C forbids an empty translation unit */
#endif
