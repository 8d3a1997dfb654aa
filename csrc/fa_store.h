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

static inline float fa_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE binary16: 1 sign, 5 exponent, 10 fraction bits. */
static inline float fa_f16_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, frac = h & 0x3ffu;
    if (exp == 0x1f) return fa_bits_f32(sign | 0x7f800000u | frac << 13); /* inf, NaN */
    if (exp != 0) return fa_bits_f32(sign | (exp + 112) << 23 | frac << 13);
    /* zero and subnormals: frac * 2^-24, exact in float */
    const float m = (float)frac * (1.0f / 16777216.0f);
    return sign ? -m : m;
}

/* bfloat16: the upper 16 bits of a float. */
static inline float fa_bf16_f32(uint16_t b) { return fa_bits_f32((uint32_t)b << 16); }

/* Element i of a row stored as st (not NATIVE), as float. */
static inline float fa_store_get(fa_store st, const void *p, fa_idx i)
{
    switch (st) {
    case FA_STORE_F16: return fa_f16_f32(((const uint16_t *)p)[i]);
    case FA_STORE_BF16: return fa_bf16_f32(((const uint16_t *)p)[i]);
    default: return (float)((const int8_t *)p)[i];
    }
}

#endif
