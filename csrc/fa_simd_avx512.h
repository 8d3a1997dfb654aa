/* Vector operations of the AVX-512 path for element type T (FA_IS_F32
 * selects float or double): 512-bit registers, comparisons into mask
 * registers.  The same names as fa_simd_avx2.h. */
#include <immintrin.h>

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
#define VREDUCE(x) _mm512_reduce_add_ps(x) /* a tree of shuffles and adds */
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
