/* Shared definitions for the fastattn C99 kernels (no Python headers). */
#ifndef FA_COMMON_H
#define FA_COMMON_H

#include <stddef.h>

/* Element counts, indices and strides.  Strides are in elements, never
 * bytes, and may be zero (broadcast) or negative (reversed views). */
typedef ptrdiff_t fa_idx;

/* Instruction-set paths.  The caller picks one; the kernels hold no state. */
typedef enum {
    FA_ISA_PORTABLE = 0,
    FA_ISA_AVX2 = 1,
    FA_ISA_AVX512 = 2,
    FA_ISA_NEON = 3 /* aarch64 Advanced SIMD, fp32 and fp64 */
} fa_isa;

/* How a mask is stored.  BOOL: one byte per entry, nonzero = may attend
 * (PyTorch SDPA convention).  ADD: same dtype as the scores, added to the
 * scaled scores; -inf hides the key whatever the score is. */
typedef enum { FA_MASK_NONE = 0, FA_MASK_BOOL = 1, FA_MASK_ADD = 2 } fa_mask_kind;

/* How query, key and value elements are stored.  NATIVE: the kernel's own
 * type (float or double).  The others are read by the float kernels only,
 * converted exactly to float as they are loaded: F16 IEEE binary16, BF16
 * bfloat16 (the top half of a float).  Keys and values only:
 *  - I8 int8 codes and F8E4M3 float8_e4m3fn codes (OCP FP8: 4 exponent bits
 *    of bias 7, 3 fraction bits, no inf, S.1111.111 NaN), whose row j stands
 *    for scale[j] * code (fa_attn_args holds the scales);
 *  - F8E5M2 float8_e5m2 (the top byte of a binary16), no scale;
 *  - Q4 rows of 4-bit codes in blocks of 32 elements, llama.cpp's q4_0
 *    layout: 18 bytes per block, a binary16 scale d then 16 bytes whose byte
 *    b holds element b in its low nibble and element b + 16 in its high one,
 *    a nibble c standing for d * (c - 8).  A row of n elements is
 *    ceil(n / 32) whole blocks; its strides count bytes, its elements are
 *    contiguous.  d * (c - 8) is exact in float (11 + 4 significant bits). */
typedef enum {
    FA_STORE_NATIVE = 0,
    FA_STORE_F16 = 1,
    FA_STORE_BF16 = 2,
    FA_STORE_I8 = 3,
    FA_STORE_F8E4M3 = 4,
    FA_STORE_F8E5M2 = 5,
    FA_STORE_Q4 = 6
} fa_store;

/* How the attention kernels compute their products.  EXACT: in the
 * kernel's type, every stored element converted exactly.  INT8 (opt-in):
 * against int8 and Q4 keys, the row kernel rounds each query row to int8
 * and sums integer products for the scores, and against int8 values
 * rounds each group of 32 keys' weights to 7 bits and sums integer
 * products for the output (fa_idot.h); other caches, and the block
 * kernel, stay exact. */
typedef enum { FA_PRECISION_EXACT = 0, FA_PRECISION_INT8 = 1 } fa_precision;

/* Bytes of a Q4 block, and the elements it holds. */
#define FA_Q4_BLOCK_BYTES 18
#define FA_Q4_BLOCK 32

/* Micro-tile: MR rows by NR columns, both set per path (fa_inst.h):
 * NR is two vectors (64 bytes on the portable and AVX2 paths, 128 bytes on
 * AVX-512, 32 bytes on NEON), MR what the registers hold (6 with 16 vector
 * registers, 8 with 32).  These are the largest. */
#define FA_MR_MAX 8
#define FA_NR_BYTES_MAX 128

/* Bodies specialised by a constant argument (a tile height) must be inlined
 * for the constant to reach them. */
#if defined(__GNUC__) || defined(__clang__)
#define FA_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define FA_ALWAYS_INLINE inline
#endif

/* Ask the cache for the line at p: a hint that never faults and changes no
 * result. */
#if defined(__GNUC__) || defined(__clang__)
#define FA_PREFETCH(p) __builtin_prefetch(p)
#define FA_PREFETCH_L2(p) __builtin_prefetch(p, 0, 2) /* into L2, not L1 */
#else
#define FA_PREFETCH(p) ((void)(p))
#define FA_PREFETCH_L2(p) ((void)(p))
#endif

#define FA_CAT3_(a, b, c) a##_##b##_##c
#define FA_CAT3(a, b, c) FA_CAT3_(a, b, c)

#endif
