/* Every kernel for one element type and one instruction-set path, included
 * twice by fa_inst.h with T, FA_SFX, FA_IS_F32, FA_NR and FA_GEMM_NC
 * defined. */
#define FA_NAME(n) FA_CAT4(fa, n, FA_SFX, FA_ISA)

/* Elements of an array stored as st (fa_store): its element size, the
 * address of element off, and element i as T.  The double kernels only
 * ever see NATIVE (fa_api.c checks). */
static FA_ALWAYS_INLINE fa_idx FA_NAME(st_bytes)(const fa_store st)
{
    return st == FA_STORE_NATIVE ? (fa_idx)sizeof(T) : fa_store_size(st);
}

static FA_ALWAYS_INLINE const void *FA_NAME(st_at)(const fa_store st, const void *base, fa_idx off)
{
    return (const char *)base + off * FA_NAME(st_bytes)(st);
}

/* The address of element c of a row at p (c a multiple of FA_Q4_BLOCK for
 * Q4, whose elements are not whole bytes), and the bytes of n elements. */
static FA_ALWAYS_INLINE const void *FA_NAME(st_col)(const fa_store st, const void *p, fa_idx c)
{
    if (st == FA_STORE_Q4) return (const void *)fa_q4_block(p, c);
    return FA_NAME(st_at)(st, p, c);
}

static FA_ALWAYS_INLINE fa_idx FA_NAME(st_row_bytes)(const fa_store st, fa_idx n)
{
    return st == FA_STORE_NATIVE ? n * (fa_idx)sizeof(T) : fa_store_row_bytes(st, n);
}

static FA_ALWAYS_INLINE T FA_NAME(st_get)(const fa_store st, const void *p, fa_idx i)
{
    return st == FA_STORE_NATIVE ? ((const T *)p)[i] : (T)fa_store_get(st, p, i);
}

#include FA_PRIMS

/* sum of x[0..n) in eight interleaved partial sums: vectorises without
 * reassociation and keeps the rounding error of long rows small (the parts
 * in vectors where the path has FA_PARTS_SUM: compilers kept them in
 * scalar registers) */
static T FA_NAME(sum)(fa_idx n, const T *x)
{
    T part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    fa_idx j = 0;
#if defined(FA_PARTS_SUM) && FA_IS_F32
    j = FA_PARTS_SUM(n, x, part);
#else
    for (; j + 8 <= n; j += 8)
        for (int t = 0; t < 8; ++t) part[t] += x[j + t];
#endif
    for (; j < n; ++j) part[0] += x[j];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

/* The largest of x[0..n), NaN ignored (-inf when there is none), in eight
 * interleaved parts as sum: eight independent chains of comparisons, where
 * one running maximum waited for each comparison before the next. */
static T FA_NAME(max)(fa_idx n, const T *x)
{
    const T ninf = -(T)INFINITY;
    T part[8] = {ninf, ninf, ninf, ninf, ninf, ninf, ninf, ninf};
    fa_idx j = 0;
#if defined(FA_PARTS_MAX) && FA_IS_F32
    j = FA_PARTS_MAX(n, x, part);
#else
    for (; j + 8 <= n; j += 8)
        for (int t = 0; t < 8; ++t) part[t] = x[j + t] > part[t] ? x[j + t] : part[t];
#endif
    for (; j < n; ++j) part[0] = x[j] > part[0] ? x[j] : part[0];
    T m = part[0];
    for (int t = 1; t < 8; ++t) m = part[t] > m ? part[t] : m;
    return m;
}

/* Ask the cache for n bytes from x ahead of their use; a prefetch never
 * faults and changes no result.  Four lines per turn: the row kernel asks
 * for a key row (8 lines of 128 floats) with every row it reads, and a loop
 * turn per line cost as many instructions as the row's dot product. */
static FA_ALWAYS_INLINE void FA_NAME(prefetch_bytes)(const void *x, fa_idx n)
{
    const char *p = (const char *)x;
    fa_idx e = 0;
    for (; e + 256 <= n; e += 256) {
        FA_PREFETCH(p + e);
        FA_PREFETCH(p + e + 64);
        FA_PREFETCH(p + e + 128);
        FA_PREFETCH(p + e + 192);
    }
    for (; e < n; e += 64) FA_PREFETCH(p + e);
}

#include "fa_kern_load.h"
#include "fa_kern_gemm.h"
#include "fa_kern_softmax.h"
#include "fa_kern_scores.h"
#include "fa_kern_attn.h"
#include "fa_kern_grad.h"

/* y = exp(x): mode 0 the general exp; 1 and 2 the softmax's (exp_block,
 * for x <= ln 256, hidden lanes skipped with mode 2), whose error bounds
 * the tests check */
void FA_NAME(exp_array)(fa_idx n, const T *x, T *y, int mode)
{
    if (mode == 0) {
        FA_NAME(vexp)(n, x, y);
        return;
    }
    T zero[FA_NR] = {0}, sum[FA_NR];
    for (fa_idx j = 0; j < n; j += FA_NR) { /* rows of NR, the last padded */
        T row[FA_NR] = {0};
        const fa_idx w = n - j < FA_NR ? n - j : FA_NR;
        for (fa_idx t = 0; t < w; ++t) row[t] = x[j + t];
        FA_NAME(exp_block)(0, 1, FA_NR, FA_NR, row, zero, sum, mode == 2);
        for (fa_idx t = 0; t < w; ++t) y[j + t] = row[t];
    }
}

#undef FA_NAME
#undef FA_DOT_GROUP
#undef FA_PARTS_SUM
#undef FA_PARTS_MAX
#undef FA_QB
#undef FA_KB
#undef FA_WGROUP
#undef FA_I8_E4
#undef FA_I8_PAD
#undef FA_RB
#undef FA_EC
#undef FA_PREFETCH_BYTES
#undef FA_BLOCK_AHEAD_BYTES
#undef FA_VALUE_AHEAD_ROWS
#undef FA_EP
#undef FA_EVP
#undef FA_ROWS_SCALARS
#undef FA_STATE_ROW
