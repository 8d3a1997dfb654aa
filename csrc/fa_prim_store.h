/* Elements stored in fewer bits (fa_store, fa_common.h), read as float: the
 * scalar conversions, for any CPU.  Each is exact: every binary16, bfloat16,
 * int8, float8 and q4_0 value is a float. */
#ifndef FA_STORE_H
#define FA_STORE_H

#include <stdint.h>
#include <string.h>
#include "fa_common.h"

/* Bytes per element of a storage other than NATIVE: the unit of its
 * strides (a byte for Q4, whose elements are half bytes in blocks). */
static inline fa_idx fa_store_size(fa_store st)
{
    return st == FA_STORE_F16 || st == FA_STORE_BF16 ? 2 : 1;
}

/* Bytes of a row of n elements stored as st (not NATIVE). */
static inline fa_idx fa_store_row_bytes(fa_store st, fa_idx n)
{
    if (st == FA_STORE_Q4) return (n + FA_Q4_BLOCK - 1) / FA_Q4_BLOCK * FA_Q4_BLOCK_BYTES;
    return n * fa_store_size(st);
}

/* Storage whose rows stand for a scale per row times their codes. */
static inline int fa_store_scaled(fa_store st) { return st == FA_STORE_I8 || st == FA_STORE_F8E4M3; }

/* The float of these bits and the bits of this float (C99 allows a union's
 * other member to be read; it vectorises where memcpy did not). */
typedef union {
    uint32_t u;
    float f;
} fa_f32_bits;

static FA_ALWAYS_INLINE float fa_bits_f32(uint32_t u)
{
    const fa_f32_bits b = {u};
    return b.f;
}

static FA_ALWAYS_INLINE uint32_t fa_f32_bits_of(float f)
{
    fa_f32_bits b;
    b.f = f;
    return b.u;
}

/* IEEE binary16: 1 sign, 5 exponent, 10 fraction bits.  Without branches,
 * so that loops of it vectorise: the bits moved to a float's places, then
 * times 2^112, which rebiases the exponent and turns a subnormal into the
 * normal float it stands for, exactly (no -ffast-math: no flush to zero);
 * inf and NaN get the top exponent back. */
static FA_ALWAYS_INLINE float fa_f16_f32(uint16_t half)
{
    const uint32_t h = half;
    const float f = fa_bits_f32((h & 0x7fffu) << 13) * 0x1p112f;
    /* all ones when the exponent is (0x7c00 + 0x400 carries into bit 15) */
    const uint32_t infnan = (0u - (((h & 0x7c00u) + 0x400u) >> 15)) & 0x7f800000u;
    return fa_bits_f32(fa_f32_bits_of(f) | infnan | (h & 0x8000u) << 16);
}

/* bfloat16: the upper 16 bits of a float. */
static FA_ALWAYS_INLINE float fa_bf16_f32(uint16_t b) { return fa_bits_f32((uint32_t)b << 16); }

/* A float rounded to nearest-even binary16: subnormals, overflow to inf
 * (from 65520 up) and NaN (kept NaN, quiet) as IEEE 754 says. */
static inline uint16_t fa_f32_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520, inf included */
    if (a < 0x38800000u) { /* below 2^-14: a multiple of 2^-24 */
        if (a < 0x33000000u) return (uint16_t)sign; /* below 2^-25 */
        const uint32_t shift = 126 - (a >> 23), m = (a & 0x7fffffu) | 0x800000u;
        const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        uint32_t r = m >> shift;
        r += rest > half || (rest == half && (r & 1u));
        return (uint16_t)(sign | r);
    }
    uint32_t h = (a - 0x38000000u) >> 13; /* exponent 127 -> 15, 10 fraction bits */
    const uint32_t rest = a & 0x1fffu;
    h += rest > 0x1000u || (rest == 0x1000u && (h & 1u)); /* a carry steps the exponent */
    return (uint16_t)(sign | h);
}

/* A float rounded to nearest-even bfloat16; NaN kept NaN (quiet). */
static inline uint16_t fa_f32_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* float8_e4m3fn: its 7 bits of magnitude moved to a float's places (the
 * exponent's low 4 bits and the fraction's top 3) and times 2^120, which
 * rebiases the exponent (7 -> 127) and makes a subnormal exact, as for
 * binary16; S.1111.111 is NaN, the only code beyond 448 (there is no inf). */
static FA_ALWAYS_INLINE float fa_e4m3_f32(uint8_t b)
{
    const uint32_t m = b & 0x7fu;
    const float f = fa_bits_f32(m << 20) * 0x1p120f;
    const uint32_t nan = (0u - ((m + 1u) >> 7)) & 0x7fc00000u;
    return fa_bits_f32(fa_f32_bits_of(f) | nan | (uint32_t)(b & 0x80u) << 24);
}

/* float8_e5m2: the top byte of a binary16. */
static FA_ALWAYS_INLINE float fa_e5m2_f32(uint8_t b) { return fa_f16_f32((uint16_t)(b << 8)); }

/* The start of the Q4 block of element i (>= 0) of a row at p: an
 * unsigned division, a shift (i is never negative). */
static FA_ALWAYS_INLINE const uint8_t *fa_q4_block(const void *p, fa_idx i)
{
    return (const uint8_t *)p + (size_t)i / FA_Q4_BLOCK * FA_Q4_BLOCK_BYTES;
}

/* The scale d of the Q4 block at blk (a binary16, possibly unaligned). */
static FA_ALWAYS_INLINE float fa_q4_scale(const uint8_t *blk)
{
    uint16_t d;
    memcpy(&d, blk, sizeof d);
    return fa_f16_f32(d);
}

/* Element i of a Q4 row. */
static FA_ALWAYS_INLINE float fa_q4_get(const void *p, fa_idx i)
{
    const uint8_t *blk = fa_q4_block(p, i);
    const fa_idx j = i & (FA_Q4_BLOCK - 1);
    const uint8_t b = blk[2 + (j & 15)];
    const int c = j & 16 ? b >> 4 : b & 15;
    return (float)(c - 8) * fa_q4_scale(blk);
}

/* Element i of a row stored as st (not NATIVE), as float. */
static FA_ALWAYS_INLINE float fa_store_get(fa_store st, const void *p, fa_idx i)
{
    switch (st) {
    case FA_STORE_F16: return fa_f16_f32(((const uint16_t *)p)[i]);
    case FA_STORE_BF16: return fa_bf16_f32(((const uint16_t *)p)[i]);
    case FA_STORE_F8E4M3: return fa_e4m3_f32(((const uint8_t *)p)[i]);
    case FA_STORE_F8E5M2: return fa_e5m2_f32(((const uint8_t *)p)[i]);
    case FA_STORE_Q4: return fa_q4_get(p, i);
    default: return (float)((const int8_t *)p)[i];
    }
}

#endif
