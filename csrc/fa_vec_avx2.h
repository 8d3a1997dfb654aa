/* Vector operations of the AVX2 + FMA path for element type T (FA_IS_F32
 * selects float or double): 256-bit registers.  fa_prim_simd.h is written
 * against these names; fa_vec_avx512.h defines the same for 512 bits. */
#include <immintrin.h>
#include "fa_vec_parts_x86.h"

#if FA_IS_F32
#define V __m256
#define VI __m256i
#define VMASK __m256
#define VLEN 8
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, x) _mm256_storeu_ps(p, x)
#define VBCAST(p) _mm256_broadcast_ss(p)
#define VADD(x, y) _mm256_add_ps(x, y)
#define VSUB(x, y) _mm256_sub_ps(x, y)
#define VMUL(x, y) _mm256_mul_ps(x, y)
#define VDIV(x, y) _mm256_div_ps(x, y)
#define VFMA(x, y, z) _mm256_fmadd_ps(x, y, z)
#define VFNMA(x, y, z) _mm256_fnmadd_ps(x, y, z)
#define VMAX(x, y) _mm256_max_ps(x, y)
#define VMIN(x, y) _mm256_min_ps(x, y)
#define VROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VEQ(x, y) _mm256_cmp_ps(x, y, _CMP_EQ_OQ)
#define VLT(x, y) _mm256_cmp_ps(x, y, _CMP_LT_OQ)
#define VBLEND(x, y, m) _mm256_blendv_ps(x, y, m)
#define VCVTI(x) _mm256_cvtps_epi32(x)
#define VI_SET1(x) _mm256_set1_epi32(x)
#define VI_ADD(x, y) _mm256_add_epi32(x, y)
#define VI_SUB(x, y) _mm256_sub_epi32(x, y)
#define VI_SRAI(x, k) _mm256_srai_epi32(x, k)
#define VI_SRLI(x, k) _mm256_srli_epi32(x, k)
#define VI_SLLI(x, k) _mm256_slli_epi32(x, k)
#define VI_AS(x) _mm256_castsi256_ps(x)
#define VAS_I(x) _mm256_castps_si256(x)
/* sum of the lanes, as a tree in registers */
static FA_ALWAYS_INLINE float fa_reduce_add_ps256(__m256 x)
{
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#define VREDUCE(x) fa_reduce_add_ps256(x)
/* Lane j of the result: fa_reduce_add_ps256(v[j]) for j < 8, with the same
 * pairs (lanes i and i + 4, i and i + 2, i and i + 1), the 8 vectors summed
 * together in 21 operations rather than 8 x 6; the order of the pairs puts
 * key j in lane j at the end. */
static FA_ALWAYS_INLINE __m256 fa_reduce_rows_ps256(const __m256 *v)
{
    __m256 h[4], q[2];
    for (int u = 0; u < 4; ++u) /* lanes i and i + 4 of v[u] and v[u + 4] */
        h[u] = _mm256_add_ps(_mm256_permute2f128_ps(v[u], v[u + 4], 0x20),
                             _mm256_permute2f128_ps(v[u], v[u + 4], 0x31));
    for (int u = 0; u < 2; ++u) /* i and i + 2 */
        q[u] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * u], h[2 * u + 1], 0x44),
                             _mm256_shuffle_ps(h[2 * u], h[2 * u + 1], 0xee));
    return _mm256_add_ps(_mm256_shuffle_ps(q[0], q[1], 0x88), _mm256_shuffle_ps(q[0], q[1], 0xdd));
}
#define VREDUCE_ROWS(v) fa_reduce_rows_ps256(v)
#define FA_DOT_GROUP 8 /* VLEN: the rows VREDUCE_ROWS sums */
#define FA_PARTS_SUM(n, x, part) fa_parts_sum_ps256(n, x, part) /* sum and max's parts */
#define FA_PARTS_MAX(n, x, part) fa_parts_max_ps256(n, x, part)
/* VLEN elements stored in fewer bits, as floats (F16C, and AVX2 integer
 * widening): exact conversions, one or two instructions each */
#define VLOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VLOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VLOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
/* float8_e5m2: the top bytes of binary16s */
#define VLOAD_E5M2(p) _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(p))), 8))
/* VLEN bytes, each widened to a lane (for the float8 and 4-bit codes) */
#define VLOAD_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VI_AND(x, y) _mm256_and_si256(x, y)
#define VI_OR(x, y) _mm256_or_si256(x, y)
/* a binary16 (its bits) in every lane, as float */
#define VSET1_F16(h) _mm256_cvtph_ps(_mm_set1_epi16((short)(h)))
/* VLEN floats rounded to nearest-even binary16 and stored */
#define VSTORE_F16(p, x) _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT))
#else
#define V __m256d
#define VI __m256i
#define VMASK __m256d
#define VLEN 4
#define VZERO() _mm256_setzero_pd()
#define VSET1(x) _mm256_set1_pd(x)
#define VLOAD(p) _mm256_loadu_pd(p)
#define VSTORE(p, x) _mm256_storeu_pd(p, x)
#define VBCAST(p) _mm256_broadcast_sd(p)
#define VADD(x, y) _mm256_add_pd(x, y)
#define VSUB(x, y) _mm256_sub_pd(x, y)
#define VMUL(x, y) _mm256_mul_pd(x, y)
#define VDIV(x, y) _mm256_div_pd(x, y)
#define VFMA(x, y, z) _mm256_fmadd_pd(x, y, z)
#define VFNMA(x, y, z) _mm256_fnmadd_pd(x, y, z)
#define VMAX(x, y) _mm256_max_pd(x, y)
#define VMIN(x, y) _mm256_min_pd(x, y)
#define VROUND(x) _mm256_round_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VTRUNC(x) _mm256_round_pd(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC)
#define VEQ(x, y) _mm256_cmp_pd(x, y, _CMP_EQ_OQ)
#define VLT(x, y) _mm256_cmp_pd(x, y, _CMP_LT_OQ)
#define VBLEND(x, y, m) _mm256_blendv_pd(x, y, m)
#define VI_SLLI(x, k) _mm256_slli_epi64(x, k)
#define VI_AS(x) _mm256_castsi256_pd(x)
#define VAS_I(x) _mm256_castpd_si256(x)
static FA_ALWAYS_INLINE double fa_reduce_add_pd256(__m256d x)
{
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}
#define VREDUCE(x) fa_reduce_add_pd256(x)
#endif
