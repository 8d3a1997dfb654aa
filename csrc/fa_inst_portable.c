/* The portable path: C99 for any CPU (with 16-byte GNU vectors where the
 * compiler has them), vectorised by the compiler for the baseline the build
 * targets. */
#include "fa_internal.h"

#define FA_ISA portable
#define FA_PRIMS "fa_prim_portable.h"
#define FA_MR 6
#define FA_NR_F32 16
#define FA_NR_F64 8
#include "fa_inst.h"
