/* The AVX-512 path, compiled with -mavx512f -mavx2 -mfma and called only
 * when fa_cpu_has_avx512() says the CPU has them: the kernels of fa_inst_avx2.c
 * with 512-bit vectors. */
#include "fa_internal.h"
#if FA_HAVE_X86_SIMD
#define FA_ISA avx512
#define FA_SIMD "fa_vec_avx512.h"
#define FA_PRIMS "fa_prim_simd.h"
#define FA_MR 8
#define FA_NR_F32 32
#define FA_NR_F64 16
#include "fa_inst.h"
#else
typedef int fa_avx512_unused; /* ISO C forbids an empty translation unit */
#endif
