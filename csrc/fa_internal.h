/* Per-path kernel entry points behind the dispatch of fa_api.c. */
#ifndef FA_INTERNAL_H
#define FA_INTERNAL_H

#include <stdint.h>
#include "fastattn.h"

/* Scratch from the caller is aligned here to 64 bytes, so that no vector
 * load or store of it straddles a cache line (a split 512-bit store stalls
 * the load that follows it); every work size counts these extra bytes. */
#define FA_ALIGN 64
#define FA_ALIGNED(p) ((void *)(((uintptr_t)(p) + FA_ALIGN - 1) & ~(uintptr_t)(FA_ALIGN - 1)))
/* n elements of size es rounded up to whole multiples of FA_ALIGN bytes */
#define FA_PAD(n, es) ((((n) * (es) + FA_ALIGN - 1) / FA_ALIGN) * FA_ALIGN / (es))

#if defined(__x86_64__) || defined(_M_X64)
#define FA_HAVE_X86_SIMD 1 /* the AVX2 and AVX-512 paths are compiled in */
#else
#define FA_HAVE_X86_SIMD 0
#endif

/* The int8 mode's AVX-VNNI instance on the AVX2 path: a compiler that
 * knows the feature (its target attribute, libgcc's or compiler-rt's CPU
 * table) and an assembler that knows the instruction (binutils 2.36;
 * setup.py defines FA_NO_AVX_VNNI where its probe fails). */
#if FA_HAVE_X86_SIMD && !defined(FA_NO_AVX_VNNI) &&                          \
    ((defined(__clang__) && __clang_major__ >= 16) ||                       \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define FA_HAVE_AVX_VNNI 1
#else
#define FA_HAVE_AVX_VNNI 0
#endif

#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define FA_HAVE_NEON 1 /* the NEON path is compiled in */
#else
#define FA_HAVE_NEON 0
#endif

/* Cache blocks of the matrix product: an A block of MC x KC and a B panel of
 * KC x NC, 96 KB and 256 KB, sized for a 1 MB L2.  MC is a multiple of every
 * path's MR, NC of every path's NR. */
#define FA_GEMM_MC 96
#define FA_GEMM_KC 256
#define FA_GEMM_NC_F32 256
#define FA_GEMM_NC_F64 128

/* Query rows per block of the attention kernel (256 bytes of a column), the
 * same on every path so that the split of work does not depend on it. */
#define FA_QB_BYTES 256

/* Query blocks of at most this many rows go to the row kernel, and may be
 * split along the keys (fa_attn_part / fa_attn_merge). */
#define FA_ROWS_MAX 4
/* Keys per block of the block kernel and of the gradients' sweeps. */
#define FA_KEY_BLOCK 128
/* Values of a piece's state before a row's output: its maximum and sum. */
#define FA_STATE_HEAD 2

#define FA_CAT4_(a, b, c, d) a##_##b##_##c##_##d
#define FA_CAT4(a, b, c, d) FA_CAT4_(a, b, c, d)

#define FA_DECLARE(T, SFX, ISA)                                                          \
    void FA_CAT4(fa, gemm, SFX, ISA)(const fa_gemm_args *g, const T *a, const T *b,       \
                                     T *c, fa_idx i0, fa_idx i1, fa_idx j0, fa_idx j1,    \
                                     void *work);                                         \
    void FA_CAT4(fa, softmax_row, SFX, ISA)(fa_idx n, const T *x, fa_idx xs,              \
                                            fa_mask_kind mk, const void *mask, fa_idx ms, \
                                            T *out, fa_idx os, void *work);               \
    size_t FA_CAT4(fa, attn_work, SFX, ISA)(const fa_attn_args *a);                       \
    void FA_CAT4(fa, attn, SFX, ISA)(const fa_attn_args *a, const void *q, const void *k, \
                                     const void *v, const void *mask, T *out, T *w, T *lse,  \
                                     fa_idx i0, fa_idx i1, const fa_attn_next *next,      \
                                     void *work);                                         \
    void FA_CAT4(fa, attn_part, SFX, ISA)(const fa_attn_args *a, const void *q,           \
                                          const void *k, const void *v, const void *mask, \
                                          fa_idx i0, fa_idx i1, fa_idx s_lo, fa_idx s_hi, \
                                          T *state, void *work);                          \
    void FA_CAT4(fa, attn_parts, SFX, ISA)(fa_idx n, const fa_attn_args *a,                \
                                           const void *const *q, const void *const *k,    \
                                           const void *const *v,                          \
                                           const void *const *mask, fa_idx s_lo,          \
                                           fa_idx s_hi, T *const *state, void *work,      \
                                           size_t stride);                                \
    void FA_CAT4(fa, attn_merge, SFX, ISA)(const fa_attn_args *a, fa_idx nsplit,          \
                                           const T *states, T *out, T *ml, fa_idx i0,      \
                                           fa_idx i1);                                     \
    void FA_CAT4(fa, attn_weights, SFX, ISA)(const fa_attn_args *a, const void *q,         \
                                             const void *k, const void *mask, const T *ml, \
                                             T *w, fa_idx i0, fa_idx i1, void *work);      \
    void FA_CAT4(fa, attn_repair, SFX, ISA)(const fa_attn_args *a, const void *q,          \
                                            const void *k, const void *v, const void *mask, \
                                            fa_idx nsplit, const T *states, T *out, T *lse, \
                                            fa_idx i0, fa_idx i1, void *work);              \
    void FA_CAT4(fa, exp_array, SFX, ISA)(fa_idx n, const T *x, T *y, int mode);          \
    size_t FA_CAT4(fa, grad_work, SFX, ISA)(const fa_attn_args *a);                       \
    void FA_CAT4(fa, attn_grad, SFX, ISA)(const fa_attn_args *a, const fa_grad_args *g,   \
                                          const void *q, const void *k, const void *v,    \
                                          const void *mask, const T *dout, const T *out,   \
                                          const T *lse, const T *rnorm, T *dk, T *dv,      \
                                          T *dqt, T *psum, fa_idx s0, fa_idx s1,           \
                                          void *work);                                     \
    void FA_CAT4(fa, attn_grad_merge, SFX, ISA)(fa_idx nchunks, fa_idx E, fa_idx nq, T scale, \
                                                const T *parts, fa_idx part_s, const T *sums, \
                                                fa_idx sum_s, T *dq, fa_idx dq_ls,            \
                                                fa_idx dq_es, T *psum, fa_idx psum_s);

#define FA_DECLARE_NARROW(ISA) \
    void FA_CAT4(fa, narrow, f32, ISA)(fa_store st, fa_idx n, const float *x, void *y); \
    void FA_CAT4(fa, int8_rows, f32, ISA)(fa_idx rows, fa_idx n, const float *x,          \
                                            const float *mean, int8_t *codes, float *scales, \
                                            fa_idx *spoilt);                              \
    void FA_CAT4(fa, col_sums, f32, ISA)(fa_idx rows, fa_idx n, const float *x, double *sums);

FA_DECLARE_NARROW(portable)
#if FA_HAVE_X86_SIMD
FA_DECLARE_NARROW(avx2)
FA_DECLARE_NARROW(avx512)
#endif
#if FA_HAVE_NEON
FA_DECLARE_NARROW(neon)
#endif

FA_DECLARE(float, f32, portable)
FA_DECLARE(double, f64, portable)
#if FA_HAVE_X86_SIMD
FA_DECLARE(float, f32, avx2)
FA_DECLARE(double, f64, avx2)
FA_DECLARE(float, f32, avx512)
FA_DECLARE(double, f64, avx512)
#endif
#if FA_HAVE_NEON
FA_DECLARE(float, f32, neon)
FA_DECLARE(double, f64, neon)
#endif

#endif
