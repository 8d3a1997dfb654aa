/* The aarch64 NEON path: the kernels of fa_inst_avx2.c with 128-bit vectors and
 * by-element FMLA, called when fa_cpu_has_neon() says the CPU has Advanced
 * SIMD.  Advanced SIMD is part of the ARMv8-A baseline, so no extra flags.
 *
 * Micro-tile 8 x 8 floats (8 x 4 doubles): 8 rows of 2 vectors are 16
 * accumulators of the 32 registers; the by-element forms load the A values
 * as vectors too, 2 of a column (8 when they run along k, then 26 registers
 * in all with the 2 of B), and leave room for the compiler's double
 * buffering of B.  A wider tile of 3 vectors (8 x 12, 24 accumulators)
 * would break the rule of every path that NR is two vectors and divides the
 * cache blocks; a taller one (12 x 8) overflows FA_MR_MAX, to which every
 * path's scratch is sized.  Per k step the 8 x 8 tile does 16 FMLA for 4
 * vector loads (2 of B, 2 of A): the two FMA pipes of a Cortex-A76 or a
 * Neoverse-N1 (latency 4, so 8 independent chains suffice) stay the limit,
 * the two load pipes are half busy. */
#include "fa_internal.h"
#if FA_HAVE_NEON
#define FA_ISA neon
#define FA_SIMD "fa_vec_neon.h"
#define FA_PRIMS "fa_prim_simd.h"
#define FA_MR 8
#define FA_NR_F32 8
#define FA_NR_F64 4
#include "fa_inst.h"
#else
typedef int fa_neon_unused; /* ISO C forbids an empty translation unit */
#endif
