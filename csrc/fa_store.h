/* Elements stored in fewer bits (fa_store, fa_common.h), read as float: the
 * scalar conversions, for any CPU.  Each is exact: every binary16, bfloat16
 * and int8 value is a float. */
#ifndef FA_STORE_H
#define FA_STORE_H

#include <stdint.h>
#include <string.h>
#include "fa_common.h"

/* Bytes per element of a storage other than NATIVE. */
static inline fa_idx fa_store_size(fa_store st) { return st == FA_STORE_I8 ? 1 : 2; }

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

/* Element i of a row stored as st (not NATIVE), as float. */
static FA_ALWAYS_INLINE float fa_store_get(fa_store st, const void *p, fa_idx i)
{
    switch (st) {
    case FA_STORE_F16: return fa_f16_f32(((const uint16_t *)p)[i]);
    case FA_STORE_BF16: return fa_bf16_f32(((const uint16_t *)p)[i]);
    default: return (float)((const int8_t *)p)[i];
    }
}

#endif
