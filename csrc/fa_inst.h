/* Every kernel of one instruction-set path, for float and for double.  The
 * including file defines FA_ISA (the name suffix), FA_PRIMS (the primitives
 * header), FA_SIMD (its vector operations, if any), FA_MR (the micro-tile
 * height of the path), and FA_NR_F32 and FA_NR_F64 (its width). */
#include <math.h>
#include "fa_prim_store.h"
#include "fa_idot.h"

#define T float
#define FA_SFX f32
#define FA_IS_F32 1
#define FA_NR FA_NR_F32
#define FA_GEMM_NC FA_GEMM_NC_F32
#include "fa_kern_all.h"
#undef T
#undef FA_SFX
#undef FA_IS_F32
#undef FA_NR
#undef FA_GEMM_NC

#define T double
#define FA_SFX f64
#define FA_IS_F32 0
#define FA_NR FA_NR_F64
#define FA_GEMM_NC FA_GEMM_NC_F64
#include "fa_kern_all.h"
#undef T
#undef FA_SFX
#undef FA_IS_F32
#undef FA_NR
#undef FA_GEMM_NC
