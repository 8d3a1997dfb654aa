/* Vector operations of the AVX-512 path for element type T (FA_IS_F32
 * selects float or double): 512-bit registers, comparisons into mask
 * registers.  The same names as fa_vec_avx2.h. */
#include <immintrin.h>
#include "fa_vec_parts_x86.h"

#if FA_IS_F32
#define V __m512
#define VI __m512i
#define VMASK __mmask16
#define VLEN 16
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, x) _mm512_storeu_ps(p, x)
#define VBCAST(p) _mm512_set1_ps(*(p))
#define VADD(x, y) _mm512_add_ps(x, y)
#define VSUB(x, y) _mm512_sub_ps(x, y)
#define VMUL(x, y) _mm512_mul_ps(x, y)
#define VDIV(x, y) _mm512_div_ps(x, y)
#define VFMA(x, y, z) _mm512_fmadd_ps(x, y, z)
#define VFNMA(x, y, z) _mm512_fnmadd_ps(x, y, z)
#define VMAX(x, y) _mm512_max_ps(x, y)
#define VMIN(x, y) _mm512_min_ps(x, y)
#define VROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VEQ(x, y) _mm512_cmp_ps_mask(x, y, _CMP_EQ_OQ)
#define VLT(x, y) _mm512_cmp_ps_mask(x, y, _CMP_LT_OQ)
#define VBLEND(x, y, m) _mm512_mask_blend_ps(m, x, y)
#define VCVTI(x) _mm512_cvtps_epi32(x)
#define VI_SET1(x) _mm512_set1_epi32(x)
#define VI_ADD(x, y) _mm512_add_epi32(x, y)
#define VI_SUB(x, y) _mm512_sub_epi32(x, y)
#define VI_SRAI(x, k) _mm512_srai_epi32(x, k)
#define VI_SRLI(x, k) _mm512_srli_epi32(x, k)
#define VI_SLLI(x, k) _mm512_slli_epi32(x, k)
#define VI_AS(x) _mm512_castsi512_ps(x)
#define VAS_I(x) _mm512_castps_si512(x)
/* Sums of lanes as trees of pairs, written out (not the compiler's
 * _mm512_reduce_add_ps, whose tree it may choose): lanes i and i + 8, then
 * i and i + 4, i and i + 2, i and i + 1. */
static FA_ALWAYS_INLINE float fa_avx512_reduce_add_ps(__m512 x)
{
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
/* Lane j of the result: fa_avx512_reduce_add_ps(v[j]) for j < 16, with the
 * same pairs, the 16 vectors summed together in 45 operations rather than
 * 16 x 9.  Each step adds the two halves of pairs of vectors (keys a, b),
 * leaving each key half as many lanes; the order of the pairs puts key j
 * in lane j at the end. */
static FA_ALWAYS_INLINE __m512 fa_avx512_reduce_rows_ps(const __m512 *v)
{
    static const int first[8] = {0, 8, 1, 9, 2, 10, 3, 11}; /* with v[first + 4] */
    __m512 h[8], q[4], e[2];
    for (int u = 0; u < 8; ++u) { /* lanes i and i + 8 */
        const __m512 a = v[first[u]], b = v[first[u] + 4];
        h[u] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    }
    for (int u = 0; u < 4; ++u) /* i and i + 4 */
        q[u] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * u], h[2 * u + 1], 0x88),
                             _mm512_shuffle_f32x4(h[2 * u], h[2 * u + 1], 0xdd));
    for (int u = 0; u < 2; ++u) /* i and i + 2 */
        e[u] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * u], q[2 * u + 1], 0x44),
                             _mm512_shuffle_ps(q[2 * u], q[2 * u + 1], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xdd));
}
#define VREDUCE(x) fa_avx512_reduce_add_ps(x)
#define VREDUCE_ROWS(v) fa_avx512_reduce_rows_ps(v)
#define FA_DOT_GROUP 16 /* VLEN: the rows VREDUCE_ROWS sums */
#define FA_PARTS_SUM(n, x, part) fa_parts_sum_ps256(n, x, part) /* sum and max's parts */
#define FA_PARTS_MAX(n, x, part) fa_parts_max_ps256(n, x, part)
#define VSCALEF(x, n) _mm512_scalef_ps(x, n) /* x * 2^n, one rounding, subnormals too */
/* VLEN elements stored in fewer bits, as floats: exact conversions */
#define VLOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VLOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define VLOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
/* float8_e5m2: the top bytes of binary16s */
#define VLOAD_E5M2(p) \
    _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p))), 8))
/* VLEN bytes, each widened to a lane (for the float8 and 4-bit codes) */
#define VLOAD_U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VI_AND(x, y) _mm512_and_si512(x, y)
#define VI_OR(x, y) _mm512_or_si512(x, y)
/* a binary16 (its bits) in every lane, as float */
#define VSET1_F16(h) _mm512_cvtph_ps(_mm256_set1_epi16((short)(h)))
/* VLEN q4_0 elements: the nibbles of 16 bytes at p (high ones when hi),
 * each picking d * (c - 8) from a table of the 16 (VPERMPS reads an index's
 * low 4 bits: no mask, no conversion) */
#define VLOAD_Q4(p, hi, d) fa_avx512_load_q4(p, hi, d)
#ifndef FA_AVX512_LOAD_Q4
#define FA_AVX512_LOAD_Q4
static FA_ALWAYS_INLINE __m512 fa_avx512_load_q4(const uint8_t *p, int hi, uint16_t d)
{
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    if (hi) c = _mm512_srli_epi32(c, 4);
    const __m512 codes = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    return _mm512_permutexvar_ps(c, _mm512_mul_ps(codes, VSET1_F16(d))); /* exact products */
}
#endif
/* VLEN floats rounded to nearest-even binary16 and stored */
#define VSTORE_F16(p, x) _mm256_storeu_si256((__m256i *)(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT))
#else
#define V __m512d
#define VI __m512i
#define VMASK __mmask8
#define VLEN 8
#define VZERO() _mm512_setzero_pd()
#define VSET1(x) _mm512_set1_pd(x)
#define VLOAD(p) _mm512_loadu_pd(p)
#define VSTORE(p, x) _mm512_storeu_pd(p, x)
#define VBCAST(p) _mm512_set1_pd(*(p))
#define VADD(x, y) _mm512_add_pd(x, y)
#define VSUB(x, y) _mm512_sub_pd(x, y)
#define VMUL(x, y) _mm512_mul_pd(x, y)
#define VDIV(x, y) _mm512_div_pd(x, y)
#define VFMA(x, y, z) _mm512_fmadd_pd(x, y, z)
#define VFNMA(x, y, z) _mm512_fnmadd_pd(x, y, z)
#define VMAX(x, y) _mm512_max_pd(x, y)
#define VMIN(x, y) _mm512_min_pd(x, y)
#define VROUND(x) _mm512_roundscale_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VTRUNC(x) _mm512_roundscale_pd(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC)
#define VEQ(x, y) _mm512_cmp_pd_mask(x, y, _CMP_EQ_OQ)
#define VLT(x, y) _mm512_cmp_pd_mask(x, y, _CMP_LT_OQ)
#define VBLEND(x, y, m) _mm512_mask_blend_pd(m, x, y)
#define VI_SLLI(x, k) _mm512_slli_epi64(x, k)
#define VI_AS(x) _mm512_castsi512_pd(x)
#define VAS_I(x) _mm512_castpd_si512(x)
#define VREDUCE(x) _mm512_reduce_add_pd(x)
#define VSCALEF(x, n) _mm512_scalef_pd(x, n)
#endif
