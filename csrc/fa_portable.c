/* The portable path: plain C99 for any CPU, vectorised by the compiler for
 * the baseline the build targets. */
#include <math.h>
#include "fa_internal.h"

#define FA_ISA portable
#define FA_PRIMS "fa_prims_portable.h"

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
