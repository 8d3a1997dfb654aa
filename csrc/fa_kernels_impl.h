/* Every kernel for one element type and one instruction-set path.  The
 * including file defines T, FA_SFX, FA_ISA, FA_IS_F32, FA_NR and
 * FA_GEMM_NC, and names the primitives of its path in FA_PRIMS. */
#define FA_NAME(n) FA_CAT4(fa, n, FA_SFX, FA_ISA)

#include FA_PRIMS

#include "fa_gemm_impl.h"
#include "fa_softmax_impl.h"
#include "fa_attn_impl.h"

void FA_NAME(exp_array)(fa_idx n, const T *x, T *y) { FA_NAME(vexp)(n, x, y); }

#undef FA_NAME
#undef FA_QB
#undef FA_KB
#undef FA_RB
#undef FA_EP
#undef FA_EVP
#undef FA_ROWS_SCALARS
