/* Public entry points: check what the caller passes, then dispatch to the
 * instruction-set path it asked for (the portable one when the build has no
 * other). */
#include <math.h>

#include "fa_internal.h"
#include "fa_prim_store.h"

#if FA_HAVE_NEON && defined(__linux__)
#include <sys/auxv.h>
/* the kernel's bits (asm/hwcap.h), for C libraries whose headers lack them */
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1UL << 1)
#endif
#ifndef HWCAP_ASIMDHP
#define HWCAP_ASIMDHP (1UL << 10)
#endif
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1UL << 14)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)
#endif
#endif

#if FA_HAVE_X86_SIMD && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
/* F16C (the float16 conversions the AVX2 path loads half floats with): every
 * CPU with AVX2 has it; CPUID leaf 1, ECX bit 29, asked directly because
 * older compilers' __builtin_cpu_supports does not know the name */
static int cpu_has_f16c(void)
{
    unsigned eax, ebx, ecx, edx;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
}
#endif

int fa_cpu_has_avx2_fma(void)
{
#if FA_HAVE_X86_SIMD && (defined(__GNUC__) || defined(__clang__))
    /* libgcc and compiler-rt also check that the OS saves the vector state */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
#else
    return 0;
#endif
}

int fa_cpu_has_avx512(void)
{
#if FA_HAVE_X86_SIMD && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return fa_cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

/* Without CPUID, which a VM may trap at a cost of microseconds: the kernels
 * ask per call.  Every CPU with AVX-512 has AVX2, FMA and F16C. */
int fa_cpu_has_avx512_vnni(void)
{
#if FA_HAVE_X86_SIMD && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

/* Asked per call too, so from libgcc's or compiler-rt's table; 0 where
 * the build has no AVX-VNNI instance (FA_HAVE_AVX_VNNI). */
int fa_cpu_has_avx_vnni(void)
{
#if FA_HAVE_AVX_VNNI
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni");
#else
    return 0;
#endif
}

/* Linux reports the CPU's features in the auxiliary vector; elsewhere
 * (macOS on Apple silicon) every aarch64 CPU has Advanced SIMD, and the
 * half-precision features are left unreported. */
int fa_cpu_has_neon(void)
{
#if FA_HAVE_NEON && defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0;
#elif FA_HAVE_NEON
    return 1;
#else
    return 0;
#endif
}

int fa_cpu_has_neon_fp16(void)
{
#if FA_HAVE_NEON && defined(__linux__)
    return fa_cpu_has_neon() && (getauxval(AT_HWCAP) & HWCAP_ASIMDHP) != 0;
#else
    return 0;
#endif
}

int fa_cpu_has_neon_bf16(void)
{
#if FA_HAVE_NEON && defined(__linux__)
    return fa_cpu_has_neon() && (getauxval(AT_HWCAP2) & HWCAP2_BF16) != 0;
#else
    return 0;
#endif
}

int fa_cpu_has_neon_dotprod(void)
{
#if FA_HAVE_NEON && defined(__linux__)
    return fa_cpu_has_neon() && (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
    return 0;
#endif
}

#if FA_HAVE_X86_SIMD
#define FA_DISPATCH(isa, name, sfx, args)                                    \
    do {                                                                     \
        if ((isa) == FA_ISA_AVX512) FA_CAT4(fa, name, sfx, avx512) args;     \
        else if ((isa) == FA_ISA_AVX2) FA_CAT4(fa, name, sfx, avx2) args;    \
        else FA_CAT4(fa, name, sfx, portable) args;                          \
    } while (0)
#elif FA_HAVE_NEON
#define FA_DISPATCH(isa, name, sfx, args)                                    \
    do {                                                                     \
        if ((isa) == FA_ISA_NEON) FA_CAT4(fa, name, sfx, neon) args;         \
        else FA_CAT4(fa, name, sfx, portable) args;                          \
    } while (0)
#else
#define FA_DISPATCH(isa, name, sfx, args) FA_CAT4(fa, name, sfx, portable) args
#endif

/* The float (elsize 4) or double (8) kernels of a path. */
#define FA_DISPATCH_ES(isa, elsize, name, args)                              \
    do {                                                                     \
        if ((elsize) == 4) FA_DISPATCH(isa, name, f32, args);                \
        else FA_DISPATCH(isa, name, f64, args);                              \
    } while (0)

static int elsize_ok(int elsize) { return elsize == 4 || elsize == 8; }

fa_idx fa_gemm_mc(int elsize) { (void)elsize; return FA_GEMM_MC; }
fa_idx fa_gemm_nc(int elsize) { return elsize == 4 ? FA_GEMM_NC_F32 : FA_GEMM_NC_F64; }

size_t fa_gemm_work_bytes(int elsize)
{
    /* NC is a multiple of every path's NR, so the padded B panels fit */
    const size_t nr = FA_NR_BYTES_MAX / (size_t)elsize;
    return (size_t)elsize * (FA_GEMM_MC * FA_GEMM_KC + FA_GEMM_KC * (size_t)fa_gemm_nc(elsize) + FA_MR_MAX * nr) +
           FA_ALIGN;
}

static int gemm_ok(const fa_gemm_args *g, fa_idx i0, fa_idx i1, fa_idx j0, fa_idx j1, int elsize)
{
    return g->M >= 0 && g->N >= 0 && g->K >= 0 && 0 <= i0 && i0 <= i1 && i1 <= g->M &&
           0 <= j0 && j0 <= j1 && j1 <= g->N && i1 - i0 <= FA_GEMM_MC && j1 - j0 <= fa_gemm_nc(elsize);
}

int fa_gemm(fa_isa isa, int elsize, const fa_gemm_args *g, const void *a, const void *b,
            void *c, fa_idx i0, fa_idx i1, fa_idx j0, fa_idx j1, void *work)
{
    if (!elsize_ok(elsize) || !gemm_ok(g, i0, i1, j0, j1, elsize)) return -1;
    FA_DISPATCH_ES(isa, elsize, gemm, (g, a, b, c, i0, i1, j0, j1, work));
    return 0;
}

size_t fa_softmax_work_bytes(fa_idx n, int elsize) { return (size_t)(n > 0 ? n : 1) * (size_t)elsize + FA_ALIGN; }

int fa_softmax_row(fa_isa isa, int elsize, fa_idx n, const void *x, fa_idx xs,
                   fa_mask_kind mk, const void *mask, fa_idx ms, void *out, fa_idx os,
                   void *work)
{
    if (!elsize_ok(elsize) || n < 0) return -1;
    FA_DISPATCH_ES(isa, elsize, softmax_row, (n, x, xs, mk, mask, ms, out, os, work));
    return 0;
}

fa_idx fa_attn_query_block(int elsize) { return FA_QB_BYTES / elsize; }

static int attn_features_ok(const fa_attn_args *a)
{
    return a->E >= 0 && a->Ev >= 0 && a->E <= FA_ATTN_MAX_FEATURES && a->Ev <= FA_ATTN_MAX_FEATURES;
}

size_t fa_attn_work_bytes(const fa_attn_args *a, int elsize)
{
    if (!attn_features_ok(a)) return 0;
    /* the same on every path */
    return elsize == 4 ? fa_attn_work_f32_portable(a) : fa_attn_work_f64_portable(a);
}

/* Rows i0..i1-1 of `heads` query heads: at most a query block of rows in
 * all (the block kernel folds more than FA_ROWS_MAX of them into its
 * columns), one mask for all of them. */
static int rows_ok(const fa_attn_args *a, fa_idx i0, fa_idx i1, int elsize)
{
    const fa_idx qb = fa_attn_query_block(elsize);
    return 0 <= i0 && i0 <= i1 && i1 <= a->L && i1 - i0 <= qb &&
           (a->heads <= 1 || (a->heads <= qb && a->heads * (i1 - i0) <= qb));
}

/* What the row kernel alone takes (split keys, their merge and repair):
 * at most FA_ROWS_MAX rows of every head. */
static int row_kernel_ok(const fa_attn_args *a, fa_idx i0, fa_idx i1)
{
    return i1 - i0 <= FA_ROWS_MAX && (a->heads <= 1 || a->heads * (i1 - i0) <= FA_ROWS_MAX);
}

/* far past any length, and far from overflowing i + offset -+ window */
#define FA_MAX_WINDOW ((fa_idx)1 << 60)

/* Storage the kernels of this element size read: the double ones only
 * their own; int8 and float8 only for keys and values, int8 and e4m3 with
 * their scales; Q4 keys and values packed (element stride 1). */
static int store_ok(const fa_attn_args *a, int elsize)
{
    if (elsize != 4) return a->q_store == FA_STORE_NATIVE && a->kv_store == FA_STORE_NATIVE;
    return (a->q_store == FA_STORE_NATIVE || a->q_store == FA_STORE_F16 ||
            a->q_store == FA_STORE_BF16) &&
           (a->kv_store == FA_STORE_NATIVE || a->kv_store == FA_STORE_F16 ||
            a->kv_store == FA_STORE_BF16 || a->kv_store == FA_STORE_F8E5M2 ||
            (fa_store_scaled(a->kv_store) && a->k_scale != NULL && a->v_scale != NULL) ||
            /* int4 rows are contiguous bytes; no row (S = 0: an empty
             * cache, whose strides NumPy may give as 0) is read at all */
            (a->kv_store == FA_STORE_Q4 &&
             (a->S == 0 || ((a->E == 0 || a->k_es == 1) && (a->Ev == 0 || a->v_es == 1)))));
}

/* The arguments, storage aside (the merge reads no key nor value). */
static int attn_shape_ok(const fa_attn_args *a, fa_idx i0, fa_idx i1, const fa_attn_next *next,
                         int elsize)
{
    return a->L >= 0 && a->S >= 0 && attn_features_ok(a) && rows_ok(a, i0, i1, elsize) &&
           (next == NULL || rows_ok(a, next->i0, next->i1, elsize)) &&
           (a->mask_kind == FA_MASK_NONE || a->mask_kind == FA_MASK_BOOL ||
            a->mask_kind == FA_MASK_ADD) && a->m_s0 >= 0 &&
           -1 <= a->window_left && a->window_left <= FA_MAX_WINDOW && -1 <= a->window_right &&
           a->window_right <= FA_MAX_WINDOW && a->softcap >= 0 &&
           a->sink == a->sink && a->sink < INFINITY &&
           (a->block_table == NULL || a->block_size >= 1) &&
           (a->precision == FA_PRECISION_EXACT || a->precision == FA_PRECISION_INT8);
}

static int attn_ok(const fa_attn_args *a, fa_idx i0, fa_idx i1, const fa_attn_next *next,
                   int elsize)
{
    return attn_shape_ok(a, i0, i1, next, elsize) && store_ok(a, elsize);
}

/* The path an attention call's kernels take: isa, except that decoding
 * (at most FA_ROWS_MAX query rows, the row kernel throughout) whose E or Ev
 * is not a whole number of 512-bit vectors runs the AVX2 kernels on an
 * AVX-512 CPU.  The row kernel sums what is left past the last whole
 * vector element by element, where 256-bit vectors still cover half a
 * 512-bit one (threads-and-speed.md, "Part vectors on AVX-512").  A pure
 * function of the arguments: every piece of a call (attn, part, merge,
 * weights, repair) and every batch item of the same shape takes the same
 * path. */
static fa_isa attn_isa(fa_isa isa, const fa_attn_args *a, int elsize)
{
    const fa_idx v = 64 / elsize;
    if (isa == FA_ISA_AVX512 && a->L <= FA_ROWS_MAX && (a->E % v != 0 || a->Ev % v != 0))
        return FA_ISA_AVX2;
    return isa;
}

int fa_attn(fa_isa isa, int elsize, const fa_attn_args *a, const void *q, const void *k,
            const void *v, const void *mask, void *out, void *w, void *lse, fa_idx i0,
            fa_idx i1, const fa_attn_next *next, void *work)
{
    if (!elsize_ok(elsize) || !attn_ok(a, i0, i1, next, elsize) || (w != NULL && a->heads > 1))
        return -1;
    isa = attn_isa(isa, a, elsize);
    FA_DISPATCH_ES(isa, elsize, attn, (a, q, k, v, mask, out, w, lse, i0, i1, next, work));
    return 0;
}

size_t fa_attn_grad_work_bytes(const fa_attn_args *a, int elsize)
{
    if (!attn_features_ok(a) || !elsize_ok(elsize)) return 0;
    return elsize == 4 ? fa_grad_work_f32_portable(a) : fa_grad_work_f64_portable(a);
}

/* The backward pass reads the forward's operands as they are: dense, as T,
 * exact; any number of query heads per key/value head, taken one after the
 * other (not folded into a query block's columns as the forward's are). */
static int grad_ok(const fa_attn_args *a, int elsize)
{
    fa_attn_args one = *a;
    one.heads = 1;
    return elsize_ok(elsize) && attn_shape_ok(&one, 0, 0, NULL, elsize) &&
           a->q_store == FA_STORE_NATIVE && a->kv_store == FA_STORE_NATIVE &&
           a->block_table == NULL && a->precision == FA_PRECISION_EXACT && a->k_mean == NULL;
}

fa_idx fa_attn_grad_chunk_keys(const fa_attn_args *a, fa_idx kv_heads)
{
    const fa_idx blocks = (a->S + FA_KEY_BLOCK - 1) / FA_KEY_BLOCK;
    const fa_idx heads = kv_heads > 1 ? kv_heads : 1;
    fa_idx chunks = (FA_ATTN_GRAD_TASKS + heads - 1) / heads;
    chunks = chunks < FA_ATTN_GRAD_CHUNKS ? chunks : FA_ATTN_GRAD_CHUNKS;
    const fa_idx per = (blocks + chunks - 1) / chunks;
    return FA_KEY_BLOCK * (per > 1 ? per : 1);
}

int fa_attn_grad(fa_isa isa, int elsize, const fa_attn_args *a, const fa_grad_args *g,
                 const void *q, const void *k, const void *v, const void *mask,
                 const void *dout, const void *out, const void *lse, const void *rnorm,
                 void *dk, void *dv, void *dqt, void *psum, fa_idx s0, fa_idx s1, void *work)
{
    if (!grad_ok(a, elsize) || s0 < 0 || s1 < s0 || s1 > a->S) return -1;
    if (elsize == 4)
        FA_DISPATCH(isa, attn_grad, f32, (a, g, q, k, v, mask, (const float *)dout,
                                          (const float *)out, (const float *)lse,
                                          (const float *)rnorm, (float *)dk, (float *)dv,
                                          (float *)dqt, (float *)psum, s0, s1, work));
    else
        FA_DISPATCH(isa, attn_grad, f64, (a, g, q, k, v, mask, (const double *)dout,
                                          (const double *)out, (const double *)lse,
                                          (const double *)rnorm, (double *)dk, (double *)dv,
                                          (double *)dqt, (double *)psum, s0, s1, work));
    return 0;
}

int fa_attn_grad_merge(fa_isa isa, int elsize, fa_idx nchunks, fa_idx E, fa_idx nq,
                       double scale, const void *parts, fa_idx part_s, const void *sums,
                       fa_idx sum_s, void *dq, fa_idx dq_ls, fa_idx dq_es, void *psum,
                       fa_idx psum_s)
{
    if (!elsize_ok(elsize) || nchunks < 1 || E < 0 || nq < 0 ||
        nq > fa_attn_query_block(elsize))
        return -1;
    if (elsize == 4)
        FA_DISPATCH(isa, attn_grad_merge, f32,
                    (nchunks, E, nq, (float)scale, (const float *)parts, part_s,
                     (const float *)sums, sum_s, (float *)dq, dq_ls, dq_es, (float *)psum, psum_s));
    else
        FA_DISPATCH(isa, attn_grad_merge, f64,
                    (nchunks, E, nq, scale, (const double *)parts, part_s, (const double *)sums,
                     sum_s, (double *)dq, dq_ls, dq_es, (double *)psum, psum_s));
    return 0;
}

/* Decoding-like calls split their keys in pieces of FA_SPLIT_KEYS keys
 * (doubled until a call has at most FA_ATTN_SPLITS_MAX) at multiples of their
 * size, by the shape of one (batch, head) alone: a batch item then gives
 * the same bits alone as inside any batch, few items still keep every
 * thread busy, and sequences of different lengths whose keys lie in the
 * same blocks split them alike, so that one read serves them all
 * (fa_attn_parts). */
#define FA_SPLIT_KEYS 1024

fa_idx fa_attn_split_keys(const fa_attn_args *a)
{
    if (a->L > FA_ROWS_MAX || a->S < 2 * FA_SPLIT_KEYS) return a->S > 1 ? a->S : 1;
    fa_idx n = FA_SPLIT_KEYS;
    while ((a->S + n - 1) / n > FA_ATTN_SPLITS_MAX) n *= 2;
    return n;
}

fa_idx fa_attn_splits(const fa_attn_args *a)
{
    const fa_idx n = fa_attn_split_keys(a);
    return a->S > n ? (a->S + n - 1) / n : 1;
}

fa_idx fa_attn_group(fa_isa isa, int elsize, const fa_attn_args *a, fa_idx group)
{
    const fa_idx L = a->L > 1 ? a->L : 1, qb = fa_attn_query_block(elsize);
    const fa_idx fold = group < qb / L ? group : qb / L;
    /* the int8 mode's integer rows are the row kernel's; the portable block
     * kernel (products in scalar C) loses to the row kernel's 4-row groups,
     * so it folds only rows that would go to it anyway (threads-and-speed.md) */
    const int integer = a->precision == FA_PRECISION_INT8 &&
                        (a->kv_store == FA_STORE_I8 || a->kv_store == FA_STORE_Q4);
    if (L * group > FA_ROWS_MAX && fold * L >= 8 && !integer &&
        (isa != FA_ISA_PORTABLE || L > FA_ROWS_MAX))
        return fold;
    if (L > FA_ROWS_MAX || group < 1) return 1;
    return group < FA_ROWS_MAX / L ? group : FA_ROWS_MAX / L;
}

fa_idx fa_attn_state_len(const fa_attn_args *a, fa_idx i0, fa_idx i1)
{
    return (a->heads > 1 ? a->heads : 1) * (i1 - i0) * (FA_STATE_HEAD + a->Ev);
}

static int part_ok(const fa_attn_args *a, fa_idx i0, fa_idx i1, fa_idx s_lo, fa_idx s_hi,
                   int elsize)
{
    return elsize_ok(elsize) && attn_ok(a, i0, i1, NULL, elsize) && row_kernel_ok(a, i0, i1) &&
           0 <= s_lo && s_lo <= s_hi && s_hi <= a->S;
}

int fa_attn_part(fa_isa isa, int elsize, const fa_attn_args *a, const void *q, const void *k,
                 const void *v, const void *mask, fa_idx i0, fa_idx i1, fa_idx s_lo,
                 fa_idx s_hi, void *state, void *work)
{
    if (!part_ok(a, i0, i1, s_lo, s_hi, elsize)) return -1;
    isa = attn_isa(isa, a, elsize);
    FA_DISPATCH_ES(isa, elsize, attn_part, (a, q, k, v, mask, i0, i1, s_lo, s_hi, state, work));
    return 0;
}

int fa_attn_parts(fa_isa isa, int elsize, fa_idx n, const fa_attn_args *a, const void *const *q,
                  const void *const *k, const void *const *v, const void *const *mask,
                  fa_idx s_lo, fa_idx s_hi, void *const *state, void *work)
{
    if (n < 1 || n > FA_ATTN_PARTS_MAX) return -1;
    const size_t stride = fa_attn_work_bytes(&a[0], elsize);
    const fa_isa path = attn_isa(isa, &a[0], elsize);
    for (fa_idx c = 0; c < n; ++c)
        if (!part_ok(&a[c], 0, a[c].L, s_lo, s_hi, elsize) ||
            fa_attn_work_bytes(&a[c], elsize) != stride || attn_isa(isa, &a[c], elsize) != path)
            return -1;
    if (elsize == 4)
        FA_DISPATCH(path, attn_parts, f32, (n, a, q, k, v, mask, s_lo, s_hi, (float *const *)state, work, stride));
    else
        FA_DISPATCH(path, attn_parts, f64, (n, a, q, k, v, mask, s_lo, s_hi, (double *const *)state, work, stride));
    return 0;
}

int fa_attn_merge(fa_isa isa, int elsize, const fa_attn_args *a, fa_idx nsplit,
                  const void *states, void *out, void *ml, fa_idx i0, fa_idx i1)
{
    if (!elsize_ok(elsize) || nsplit < 1 || !attn_shape_ok(a, i0, i1, NULL, elsize) ||
        !row_kernel_ok(a, i0, i1))
        return -1;
    isa = attn_isa(isa, a, elsize);
    FA_DISPATCH_ES(isa, elsize, attn_merge, (a, nsplit, states, out, ml, i0, i1));
    return 0;
}

int fa_attn_weights(fa_isa isa, int elsize, const fa_attn_args *a, const void *q,
                    const void *k, const void *mask, const void *ml, void *w, fa_idx i0,
                    fa_idx i1, void *work)
{
    if (!part_ok(a, i0, i1, 0, a->S, elsize) || a->heads > 1) return -1;
    isa = attn_isa(isa, a, elsize);
    FA_DISPATCH_ES(isa, elsize, attn_weights, (a, q, k, mask, ml, w, i0, i1, work));
    return 0;
}

int fa_attn_repair(fa_isa isa, int elsize, const fa_attn_args *a, const void *q,
                   const void *k, const void *v, const void *mask, fa_idx nsplit,
                   const void *states, void *out, void *lse, fa_idx i0, fa_idx i1, void *work)
{
    if (!elsize_ok(elsize) || nsplit < 1 || !attn_ok(a, i0, i1, NULL, elsize) ||
        !row_kernel_ok(a, i0, i1))
        return -1;
    isa = attn_isa(isa, a, elsize);
    FA_DISPATCH_ES(isa, elsize, attn_repair,
                   (a, q, k, v, mask, nsplit, states, out, lse, i0, i1, work));
    return 0;
}

int fa_narrow_f32(fa_isa isa, fa_store st, fa_idx n, const float *x, void *y)
{
    if (n < 0 || (st != FA_STORE_F16 && st != FA_STORE_BF16)) return -1;
    FA_DISPATCH(isa, narrow, f32, (st, n, x, y));
    return 0;
}

fa_idx fa_int8_rows(fa_isa isa, fa_idx rows, fa_idx n, const float *x, const float *mean,
                      int8_t *codes, float *scales)
{
    if (rows < 0 || n < 0) return -1;
    fa_idx spoilt = 0;
    FA_DISPATCH(isa, int8_rows, f32, (rows, n, x, mean, codes, scales, &spoilt));
    return spoilt;
}

int fa_col_sums(fa_isa isa, fa_idx rows, fa_idx n, const float *x, double *sums)
{
    if (rows < 0 || n < 0) return -1;
    FA_DISPATCH(isa, col_sums, f32, (rows, n, x, sums));
    return 0;
}

int fa_exp(fa_isa isa, int elsize, fa_idx n, const void *x, void *y, int mode)
{
    if (!elsize_ok(elsize) || n < 0) return -1;
    FA_DISPATCH_ES(isa, elsize, exp_array, (n, x, y, mode));
    return 0;
}
