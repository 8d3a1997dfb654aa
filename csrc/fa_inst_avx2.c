/* The AVX2 + FMA path, compiled with -mavx2 -mfma and called only when
 * fa_cpu_has_avx2_fma() says the CPU has both. */
#include "fa_internal.h"
#if FA_HAVE_X86_SIMD
#define FA_ISA avx2
#define FA_SIMD "fa_vec_avx2.h"
#define FA_PRIMS "fa_prim_simd.h"
#define FA_MR 6
#define FA_NR_F32 16
#define FA_NR_F64 8
#include "fa_inst.h"
#else
typedef int fa_avx2_unused; /* ISO C forbids an empty translation unit */
#endif
