/* Vector operations of the aarch64 NEON (Advanced SIMD) path for element
 * type T (FA_IS_F32 selects float or double): 128-bit registers, 32 of them.
 * The same names as fa_vec_avx2.h, plus the by-element multiply-add (FMLA
 * Vd, Vn, Vm.S[lane]) and a VLEN x VLEN transpose that fa_prim_simd.h uses
 * where they are defined.
 *
 * VMAX and VMIN keep the x86 rule (the second operand when either is NaN),
 * which the micro-kernel's column maximum relies on to ignore NaN scores:
 * NEON's FMAX propagates NaN and FMAXNM returns the number, so neither alone
 * is the same; a compare and a bit select are. */
#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

#if FA_IS_F32
#define V float32x4_t
#define VI int32x4_t
#define VMASK uint32x4_t
#define VLEN 4
#define VZERO() vdupq_n_f32(0.0f)
#define VSET1(x) vdupq_n_f32(x)
#define VLOAD(p) vld1q_f32(p)
#define VSTORE(p, x) vst1q_f32(p, x)
#define VBCAST(p) vld1q_dup_f32(p)
#define VADD(x, y) vaddq_f32(x, y)
#define VSUB(x, y) vsubq_f32(x, y)
#define VMUL(x, y) vmulq_f32(x, y)
#define VDIV(x, y) vdivq_f32(x, y)
#define VFMA(x, y, z) vfmaq_f32(z, x, y)
#define VFNMA(x, y, z) vfmsq_f32(z, x, y)
#define VFMA_LANE(c, b, a, lane) vfmaq_laneq_f32(c, b, a, lane) /* c + b * a[lane] */
#define VMAX(x, y) vbslq_f32(vcgtq_f32(x, y), x, y)
#define VMIN(x, y) vbslq_f32(vcltq_f32(x, y), x, y)
#define VROUND(x) vrndnq_f32(x) /* to nearest, ties to even */
#define VEQ(x, y) vceqq_f32(x, y)
#define VLT(x, y) vcltq_f32(x, y) /* false when either is NaN */
#define VBLEND(x, y, m) vbslq_f32(m, y, x)
#define VCVTI(x) vcvtnq_s32_f32(x)
#define VI_SET1(x) vdupq_n_s32(x)
#define VI_ADD(x, y) vaddq_s32(x, y)
#define VI_SUB(x, y) vsubq_s32(x, y)
#define VI_SRAI(x, k) vshrq_n_s32(x, k)
#define VI_SRLI(x, k) vreinterpretq_s32_u32(vshrq_n_u32(vreinterpretq_u32_s32(x), k))
#define VI_SLLI(x, k) vshlq_n_s32(x, k)
#define VI_AS(x) vreinterpretq_f32_s32(x)
#define VAS_I(x) vreinterpretq_s32_f32(x)
/* pairwise, written out: (x0 + x1) + (x2 + x3) */
#define VREDUCE(x) vpadds_f32(vget_low_f32(vpaddq_f32(x, x)))
/* lane j: VREDUCE(v[j]) for j < 4, with the same pairs */
#define VREDUCE_ROWS(v) vpaddq_f32(vpaddq_f32((v)[0], (v)[1]), vpaddq_f32((v)[2], (v)[3]))
#define FA_DOT_GROUP 4 /* VLEN: the rows VREDUCE_ROWS sums */
#define FA_PARTS_SUM(n, x, part) fa_neon_parts_sum(n, x, part) /* sum and max's parts */
#define FA_PARTS_MAX(n, x, part) fa_neon_parts_max(n, x, part)
#define VTILE_T(r) fa_neon_transpose_f32(r)
/* VLEN elements stored in fewer bits, as floats: exact conversions (FCVTL
 * is ARMv8.0; bfloat16 is the upper half of a float) */
#define VLOAD_F16(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))
#define VLOAD_BF16(p) vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))
#define VLOAD_I8(p) fa_neon_load_i8(p)
/* float8_e5m2: the top bytes of binary16s */
#define VLOAD_E5M2(p) \
    vcvt_f32_f16(vreinterpret_f16_u16(vshl_n_u16(vget_low_u16(vmovl_u8(fa_neon_load_4u8(p))), 8)))
/* VLEN bytes, each widened to a lane (for the float8 and 4-bit codes) */
#define VLOAD_U8(p) vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(fa_neon_load_4u8(p)))))
#define VI_AND(x, y) vandq_s32(x, y)
#define VI_OR(x, y) vorrq_s32(x, y)
/* a binary16 (its bits) in every lane, as float */
#define VSET1_F16(h) vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h)))
/* VLEN floats rounded to nearest-even binary16 and stored */
#define VSTORE_F16(p, x) vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x))) /* FPCR: nearest-even */
#ifndef FA_NEON_LOAD_I8
#define FA_NEON_LOAD_I8
static FA_ALWAYS_INLINE float32x4_t fa_neon_load_i8(const int8_t *p)
{
    int32_t w;
    memcpy(&w, p, sizeof w); /* 4 bytes, no more: the row may end there */
    const int8x8_t b = vreinterpret_s8_s32(vdup_n_s32(w));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(b))));
}

/* 4 bytes at p in the low half of a vector (no more are read) */
static FA_ALWAYS_INLINE uint8x8_t fa_neon_load_4u8(const uint8_t *p)
{
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return vreinterpret_u8_u32(vdup_n_u32(w));
}

/* The eight parts of fa_kern_all.h's sum and max as two vectors
 * (fa_vec_parts_x86.h says why and how) */
static FA_ALWAYS_INLINE fa_idx fa_neon_parts_sum(fa_idx n, const float *x, float *part)
{
    float32x4_t lo = vld1q_f32(part), hi = vld1q_f32(part + 4);
    fa_idx j = 0;
    for (; j + 8 <= n; j += 8) {
        lo = vaddq_f32(lo, vld1q_f32(x + j));
        hi = vaddq_f32(hi, vld1q_f32(x + j + 4));
    }
    vst1q_f32(part, lo);
    vst1q_f32(part + 4, hi);
    return j;
}

/* NaN ignored: a part changes only where the element is greater */
static FA_ALWAYS_INLINE fa_idx fa_neon_parts_max(fa_idx n, const float *x, float *part)
{
    float32x4_t lo = vld1q_f32(part), hi = vld1q_f32(part + 4);
    fa_idx j = 0;
    for (; j + 8 <= n; j += 8) {
        const float32x4_t a = vld1q_f32(x + j), b = vld1q_f32(x + j + 4);
        lo = vbslq_f32(vcgtq_f32(a, lo), a, lo);
        hi = vbslq_f32(vcgtq_f32(b, hi), b, hi);
    }
    vst1q_f32(part, lo);
    vst1q_f32(part + 4, hi);
    return j;
}
#endif
#ifndef FA_NEON_TRANSPOSE_F32
#define FA_NEON_TRANSPOSE_F32
/* r[u] = column u of the 4 x 4 tile whose rows were r[0..3] */
static FA_ALWAYS_INLINE void fa_neon_transpose_f32(float32x4_t r[4])
{
    const float32x4_t t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
    const float32x4_t t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
    r[0] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[1] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
    r[2] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[3] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
}
#endif
#else
#define V float64x2_t
#define VI int64x2_t
#define VMASK uint64x2_t
#define VLEN 2
#define VZERO() vdupq_n_f64(0.0)
#define VSET1(x) vdupq_n_f64(x)
#define VLOAD(p) vld1q_f64(p)
#define VSTORE(p, x) vst1q_f64(p, x)
#define VBCAST(p) vld1q_dup_f64(p)
#define VADD(x, y) vaddq_f64(x, y)
#define VSUB(x, y) vsubq_f64(x, y)
#define VMUL(x, y) vmulq_f64(x, y)
#define VDIV(x, y) vdivq_f64(x, y)
#define VFMA(x, y, z) vfmaq_f64(z, x, y)
#define VFNMA(x, y, z) vfmsq_f64(z, x, y)
#define VFMA_LANE(c, b, a, lane) vfmaq_laneq_f64(c, b, a, lane)
#define VMAX(x, y) vbslq_f64(vcgtq_f64(x, y), x, y)
#define VMIN(x, y) vbslq_f64(vcltq_f64(x, y), x, y)
#define VROUND(x) vrndnq_f64(x)
#define VTRUNC(x) vrndq_f64(x) /* toward zero */
#define VEQ(x, y) vceqq_f64(x, y)
#define VLT(x, y) vcltq_f64(x, y)
#define VBLEND(x, y, m) vbslq_f64(m, y, x)
#define VI_SLLI(x, k) vshlq_n_s64(x, k)
#define VI_AS(x) vreinterpretq_f64_s64(x)
#define VAS_I(x) vreinterpretq_s64_f64(x)
#define VREDUCE(x) vaddvq_f64(x)
#define VTILE_T(r) fa_neon_transpose_f64(r)
#ifndef FA_NEON_TRANSPOSE_F64
#define FA_NEON_TRANSPOSE_F64
static FA_ALWAYS_INLINE void fa_neon_transpose_f64(float64x2_t r[2])
{
    const float64x2_t t0 = vtrn1q_f64(r[0], r[1]);
    r[1] = vtrn2q_f64(r[0], r[1]);
    r[0] = t0;
}
#endif
#endif
