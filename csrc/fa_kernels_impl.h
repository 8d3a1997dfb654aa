/* Every kernel for one element type and one instruction-set path, included
 * twice by fa_instantiate.h with T, FA_SFX, FA_IS_F32, FA_NR and FA_GEMM_NC
 * defined. */
#define FA_NAME(n) FA_CAT4(fa, n, FA_SFX, FA_ISA)

#include FA_PRIMS

/* sum of x[0..n) in eight interleaved partial sums: vectorises without
 * reassociation and keeps the rounding error of long rows small */
static T FA_NAME(sum)(fa_idx n, const T *x)
{
    T part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    fa_idx j = 0;
    for (; j + 8 <= n; j += 8)
        for (int t = 0; t < 8; ++t) part[t] += x[j + t];
    for (; j < n; ++j) part[0] += x[j];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

/* Ask the cache for a row of n elements ahead of its use, when they are
 * contiguous (es == 1); a prefetch never faults and changes no result. */
static FA_ALWAYS_INLINE void FA_NAME(prefetch_row)(const T *x, fa_idx n, fa_idx es)
{
    if (es != 1) return;
    for (fa_idx e = 0; e < n; e += 64 / (fa_idx)sizeof(T)) FA_PREFETCH(x + e);
}

#include "fa_gemm_impl.h"
#include "fa_softmax_impl.h"
#include "fa_scores_impl.h"
#include "fa_attn_impl.h"

void FA_NAME(exp_array)(fa_idx n, const T *x, T *y) { FA_NAME(vexp)(n, x, y); }

#undef FA_NAME
#undef FA_QB
#undef FA_KB
#undef FA_RB
#undef FA_EC
#undef FA_PREFETCH_BYTES
#undef FA_EP
#undef FA_EVP
#undef FA_ROWS_SCALARS
