/* Integer dot products of the opt-in int8 mode (fa_attn_args.precision,
 * FA_PRECISION_INT8): a query row quantised to int8 against int8 or q4_0
 * key codes, and the weights of a group of keys rounded to 7 bits against
 * int8 value codes.  The sums are int32 and exact, so every path gives the
 * same sums; the few float steps after them are spelled out in
 * fa_idot_body.h, in order, and every path takes them in that order, so
 * every path gives the same scores too.  AVX2 bodies where the including
 * file is compiled for AVX2 (the AVX2 and AVX-512 paths), plain C
 * elsewhere (the compiler vectorises it for NEON); on the AVX-512 and NEON
 * paths a second instance with the CPU's dot-product instruction (AVX-512
 * VNNI's vpdpbusd, ARMv8.2's sdot), for the CPUs that have it.
 * The sign trick and the nibble split follow llama.cpp's q8_0 dot products
 * (ggml-cpu's quants.c). */
#ifndef FA_IDOT_H
#define FA_IDOT_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "fa_prim_store.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Largest E the integer products take: |sum| <= 128 * 127 * E must stay
 * an int32.  Beyond it the row kernel keeps the exact products. */
#define FA_IDOT_MAX_E ((fa_idx)1 << 16)
/* Query elements per scale against Q4 keys: a Q4 block. */
#define FA_IDOT_GROUP FA_Q4_BLOCK
/* Keys whose weights share one scale (a group of key positions j with the
 * same j / FA_IGROUP): the weights of a group rounded to 7 bits against
 * int8 values (unsigned times signed products, whose pairs stay within
 * int16). */
#define FA_IGROUP 32

/* Where fa_itile puts the sum x of row r and column j (ld apart):
 * FA_ITILE_SCORES: f[r ld + j] = alpha * (rv[r] * (cv[j] * (float)x)) +
 * sv[j], where `wide` NaN if that is not finite (a product past float's
 * range that the true score is not, or a non-finite operand: NaN sends the
 * query to the row kernel, which computes such scores again; -inf would
 * hide the key), and cm[j] (not NULL) raised to it (NaN ignored); FA_ITILE_ADD:
 * f[r ld + j] += cv[j] * (float)x; each product and sum rounded to float
 * in that order. */
enum { FA_ITILE_SCORES, FA_ITILE_ADD };
typedef struct {
    int form;
    fa_idx ld;
    float *f;
    const float *rv, *cv, *sv;
    float *cm;
    float alpha;
    int wide; /* the scales may take a score past float's range */
} fa_itile_out;

/* The sums x (m rows of nc, nc apart) of rows r0.. and columns j0.. put
 * as o says: loops the path's compiler vectorises, for every instance. */
static FA_ALWAYS_INLINE void fa_itile_finish(const fa_itile_out *o, fa_idx m, fa_idx nc,
                                             const int32_t *x, fa_idx r0, fa_idx j0)
{
    const float *cv = o->cv + j0;
    for (fa_idx r = 0; r < m; ++r) {
        float *f = o->f + (r0 + r) * o->ld + j0;
        const int32_t *xr = x + r * nc;
        if (o->form == FA_ITILE_ADD) {
            for (fa_idx j = 0; j < nc; ++j) f[j] = f[j] + cv[j] * (float)xr[j];
            continue;
        }
        const float a = o->alpha, rv = o->rv[r0 + r], *sv = o->sv + j0;
        if (o->wide)
            for (fa_idx j = 0; j < nc; ++j) {
                const float y = a * (rv * (cv[j] * (float)xr[j])) + sv[j];
                f[j] = y - y == 0 ? y : (float)NAN;
            }
        else
            for (fa_idx j = 0; j < nc; ++j) f[j] = a * (rv * (cv[j] * (float)xr[j])) + sv[j];
        if (o->cm == NULL) continue;
        float *cm = o->cm + j0;
        for (fa_idx j = 0; j < nc; ++j) cm[j] = f[j] > cm[j] ? f[j] : cm[j];
    }
}

/* Rows r < n of ld weights (w, rows ld apart) times their rows' scales
 * d[r], in place, a weight of 0 staying exactly 0 whatever its scale;
 * m[j] = the largest of column j (at least 0, NaN ignored), bad[j] = 1
 * where the column holds a NaN or a negative, else 0. */
static void fa_fold_weights(fa_idx n, fa_idx ld, float *w, const float *d, float *m, float *bad)
{
    fa_idx j = 0;
#if defined(__AVX512F__)
    const __m512 zero = _mm512_setzero_ps();
    for (; j + 16 <= ld; j += 16) {
        __m512 mv = zero;
        __mmask16 b = 0;
        for (fa_idx r = 0; r < n; ++r) {
            float *x = w + r * ld + j;
            const __m512 v = _mm512_loadu_ps(x);
            const __m512 y = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(v, zero, _CMP_NEQ_UQ), v,
                                                 _mm512_set1_ps(d[r]));
            _mm512_storeu_ps(x, y);
            mv = _mm512_max_ps(y, mv);
            b |= _mm512_cmp_ps_mask(y, zero, _CMP_NGE_UQ);
        }
        _mm512_storeu_ps(m + j, mv);
        _mm512_storeu_ps(bad + j, _mm512_maskz_mov_ps(b, _mm512_set1_ps(1)));
    }
#elif defined(__AVX2__)
    const __m256 zero = _mm256_setzero_ps();
    for (; j + 8 <= ld; j += 8) {
        __m256 mv = zero, b = zero;
        for (fa_idx r = 0; r < n; ++r) {
            float *x = w + r * ld + j;
            const __m256 v = _mm256_loadu_ps(x);
            const __m256 y = _mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_NEQ_UQ),
                                           _mm256_mul_ps(v, _mm256_set1_ps(d[r])));
            _mm256_storeu_ps(x, y);
            mv = _mm256_max_ps(y, mv);
            b = _mm256_or_ps(b, _mm256_cmp_ps(y, zero, _CMP_NGE_UQ));
        }
        _mm256_storeu_ps(m + j, mv);
        _mm256_storeu_ps(bad + j, _mm256_and_ps(b, _mm256_set1_ps(1)));
    }
#endif
    for (; j < ld; ++j) {
        float mx = 0, b = 0;
        for (fa_idx r = 0; r < n; ++r) {
            float *x = w + r * ld + j;
            const float y = *x != 0 ? *x * d[r] : 0;
            *x = y;
            mx = y > mx ? y : mx;
            b = y >= 0 ? b : 1;
        }
        m[j] = mx;
        bad[j] = b;
    }
}

/* out = the codes of n <= 4 rows of ld weights (rows ld apart, ld a
 * multiple of 16) in quads of a column, out[4 j + u] = row u's weight j
 * times wr[j], rounded to nearest-even within 0..127 (NaN: 0); rows n..3
 * are zeros. */
static void fa_pack_weights(fa_idx n, fa_idx ld, const float *w, const float *wr, int8_t *out)
{
    fa_idx j = 0;
#if defined(__AVX512F__)
    const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(127);
    for (; j + 16 <= ld; j += 16) {
        __m512i c[4];
        const __m512 r = _mm512_loadu_ps(wr + j);
        for (fa_idx u = 0; u < 4; ++u) {
            const __m512 x = u < n ? _mm512_mul_ps(_mm512_loadu_ps(w + u * ld + j), r) : zero;
            c[u] = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(x, zero), top));
        }
        /* codes of 0..127: row u's is byte u of its column's int32 */
        const __m512i q = _mm512_ternarylogic_epi32(c[0], _mm512_slli_epi32(c[1], 8),
                                                    _mm512_slli_epi32(c[2], 16), 0xfe);
        _mm512_storeu_si512((void *)(out + 4 * j), _mm512_or_si512(q, _mm512_slli_epi32(c[3], 24)));
    }
#elif defined(__AVX2__)
    const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(127);
    const __m256i order = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (; j + 8 <= ld; j += 8) {
        __m256i x[4];
        const __m256 r = _mm256_loadu_ps(wr + j);
        for (fa_idx u = 0; u < 4; ++u) {
            const __m256 y = u < n ? _mm256_mul_ps(_mm256_loadu_ps(w + u * ld + j), r) : zero;
            x[u] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, zero), top));
        }
        /* rows 0-3 of columns 0-3 | of columns 4-7, as bytes, then in quads */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(x[0], x[1]),
                                             _mm256_packs_epi32(x[2], x[3]));
        _mm256_storeu_si256((__m256i *)(out + 4 * j), _mm256_shuffle_epi8(p, order));
    }
#endif
    for (; j < ld; ++j)
        for (fa_idx u = 0; u < 4; ++u) {
            float y = u < n ? w[u * ld + j] * wr[j] : 0;
            y = y > 0 ? y : 0;
            y = y < 127 ? y : 127;
            out[4 * j + u] = (int8_t)rintf(y);
        }
}

/* max |x - mean| over n floats (mean NULL: none), NaN ignored (0 for
 * none); *nan set where x - mean holds a NaN.  In vectors on x86: the
 * maximum is exact in any order. */
static float fa_absmax_f32(fa_idx n, const float *x, const float *mean, int *nan)
{
    float amax = 0;
    int bad = 0;
    fa_idx e = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_setzero_ps();
    __mmask16 un = 0;
    for (; e + 16 <= n; e += 16) {
        __m512 y = _mm512_loadu_ps(x + e);
        if (mean != NULL) y = _mm512_sub_ps(y, _mm512_loadu_ps(mean + e));
        un |= _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
        mv = _mm512_max_ps(_mm512_abs_ps(y), mv); /* a NaN lane: mv kept */
    }
    amax = _mm512_reduce_max_ps(mv);
    bad = un != 0;
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mv = _mm256_setzero_ps(), un = _mm256_setzero_ps();
    for (; e + 8 <= n; e += 8) {
        __m256 y = _mm256_loadu_ps(x + e);
        if (mean != NULL) y = _mm256_sub_ps(y, _mm256_loadu_ps(mean + e));
        un = _mm256_or_ps(un, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
        mv = _mm256_max_ps(_mm256_andnot_ps(sign, y), mv); /* a NaN lane: mv kept */
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int t = 0; t < 8; ++t) amax = lanes[t] > amax ? lanes[t] : amax;
    bad = _mm256_movemask_ps(un) != 0;
#endif
    for (; e < n; ++e) {
        const float y = fabsf(mean != NULL ? x[e] - mean[e] : x[e]);
        bad |= y != y;
        amax = y > amax ? y : amax;
    }
    *nan = bad;
    return amax;
}

/* q8[0..ng * g) = x[0..n) (zeros past n) in int8 with one scale per group
 * of g elements: qd[i] = max |x| / 127 over group i, code = x / qd rounded
 * to nearest-even; qb[i] = 8 times the codes' sum (the offset of Q4's
 * codes, fa_idot_q4).  A group holding a NaN gets qd NaN, one holding an
 * inf qd inf, and both codes 0, so that its scores come out NaN as the
 * exact ones would; a group of zeros qd 0.  In vectors on x86 (the same
 * quotients, rounded as rintf rounds them): the block kernel rounds every
 * query block so, and a division a feature one at a time dominated it. */
static void fa_quantise_i8(fa_idx n, const float *x, fa_idx g, fa_idx ng, int8_t *q8, float *qd,
                           int32_t *qb)
{
    for (fa_idx i = 0; i < ng; ++i) {
        const fa_idx lo = i * g, hi = lo + g < n ? lo + g : n;
        int nan = 0;
        const float amax = hi > lo ? fa_absmax_f32(hi - lo, x + lo, NULL, &nan) : 0;
        const float d = nan ? (float)NAN : amax / 127.0f;
        const int coded = d > 0 && d < (float)INFINITY;
        int32_t sum = 0;
        fa_idx e = lo;
#if defined(__AVX512F__)
        const __m512 dv = _mm512_set1_ps(d);
        const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
        __m512i sv = _mm512_setzero_si512();
        for (; coded && e + 16 <= hi; e += 16) {
            __m512i c = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(x + e), dv));
            c = _mm512_max_epi32(_mm512_min_epi32(c, top), bottom);
            _mm_storeu_si128((__m128i *)(q8 + e), _mm512_cvtepi32_epi8(c));
            sv = _mm512_add_epi32(sv, c);
        }
        sum = _mm512_reduce_add_epi32(sv);
#elif defined(__AVX2__)
        const __m256 dv = _mm256_set1_ps(d);
        const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
        __m256i sv = _mm256_setzero_si256();
        for (; coded && e + 8 <= hi; e += 8) {
            __m256i c = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(x + e), dv));
            c = _mm256_max_epi32(_mm256_min_epi32(c, top), bottom);
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
            _mm_storel_epi64((__m128i *)(q8 + e), _mm_packs_epi16(w, w));
            sv = _mm256_add_epi32(sv, c);
        }
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, sv);
        for (int t = 0; t < 8; ++t) sum += lanes[t];
#endif
        for (; e < lo + g; ++e) {
            float c = coded && e < hi ? rintf(x[e] / d) : 0;
            c = c > 127 ? 127 : c < -127 ? -127 : c;
            q8[e] = (int8_t)c;
            sum += q8[e];
        }
        qd[i] = d;
        qb[i] = 8 * sum;
    }
}

#if defined(__AVX2__)

/* The lane sums of a[0..8), one per lane */
static FA_ALWAYS_INLINE __m256i fa_hsum8_epi32(const __m256i *a)
{
    const __m256i t0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i t1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20),
                            _mm256_permute2x128_si256(t0, t1, 0x31));
}

/* The 32 codes of a Q4 block's 16 bytes, in order: low nibbles, then high */
static FA_ALWAYS_INLINE __m256i fa_q4_codes(const uint8_t *p)
{
    const __m128i x = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0f));
}

/* The four rows x0..x3 of 32 bytes as four vectors of their columns'
 * byte quads (row 0, 1, 2, 3 of one column per int32), columns in the
 * order fa_quads_add puts back. */
static FA_ALWAYS_INLINE void fa_quads(__m256i x0, __m256i x1, __m256i x2, __m256i x3, __m256i *q)
{
    const __m256i a = _mm256_unpacklo_epi8(x0, x1), b = _mm256_unpackhi_epi8(x0, x1);
    const __m256i c = _mm256_unpacklo_epi8(x2, x3), d = _mm256_unpackhi_epi8(x2, x3);
    q[0] = _mm256_unpacklo_epi16(a, c); /* columns 0-3 | 16-19 */
    q[1] = _mm256_unpackhi_epi16(a, c); /* 4-7 | 20-23 */
    q[2] = _mm256_unpacklo_epi16(b, d); /* 8-11 | 24-27 */
    q[3] = _mm256_unpackhi_epi16(b, d); /* 12-15 | 28-31 */
}

/* ot[0..32) = ot + u * (float)sum, the four sums of fa_quads' column order
 * put back in column order, each product and sum rounded to float as the
 * scalar loop of fa_igemv_i8 rounds them */
static FA_ALWAYS_INLINE void fa_quads_add(const __m256i *s, float u, float *ot)
{
    const __m256i c[4] = {_mm256_permute2x128_si256(s[0], s[1], 0x20),
                          _mm256_permute2x128_si256(s[2], s[3], 0x20),
                          _mm256_permute2x128_si256(s[0], s[1], 0x31),
                          _mm256_permute2x128_si256(s[2], s[3], 0x31)};
    const __m256 uv = _mm256_set1_ps(u);
    for (int i = 0; i < 4; ++i)
        _mm256_storeu_ps(ot + 8 * i, _mm256_add_ps(_mm256_loadu_ps(ot + 8 * i),
                                                   _mm256_mul_ps(uv, _mm256_cvtepi32_ps(c[i]))));
}

/* The weights of four rows as the bytes of every int32 lane. */
static FA_ALWAYS_INLINE __m256i fa_quad_weights(const void *w, int r)
{
    int32_t x;
    memcpy(&x, (const char *)w + r, sizeof x);
    return _mm256_set1_epi32(x);
}
#endif

/* Every instance's FA_DPBUSD(acc, u, s): acc plus, in each int32 lane, the
 * sum of its four unsigned-by-signed byte products.  AVX2 sums them in
 * pairs to int16 first: no pair of these operands reaches int16's limit
 * (at most 2 x 128 x 127 or 2 x 15 x 127), so no sum saturates, and the
 * instances agree. */
#define FA_IDOT(name) fa_idot_##name##_base
#define FA_IDOT_TARGET
#define FA_DPBUSD(acc, u, s) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#include "fa_idot_body.h"
#undef FA_IDOT
#undef FA_IDOT_TARGET
#undef FA_DPBUSD

/* A second instance with the CPU's own dot-product instruction, only
 * these functions compiled for it (the rest of the path runs without),
 * taken where fa_idot_cpu() says the CPU has it:
 * - the AVX-512 path: AVX-512 VNNI's vpdpbusd (fa_cpu_has_avx512_vnni);
 * - the AVX2 path: AVX-VNNI's, the same instruction VEX-encoded, on
 *   registers 0-15 (fa_cpu_has_avx_vnni);
 * - the NEON path: ARMv8.2's sdot, signed by signed, four products a lane
 *   (fa_cpu_has_neon_dotprod), on Linux with gcc, whose target attribute
 *   names the extension so. */
#if defined(__AVX2__) && defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
#define FA_IDOT_DOT 1
#define FA_IDOT_ZMM 1
#define FA_IDOT(name) fa_idot_##name##_dot
/* BW for the byte shuffles on registers 16-31 (else copied to 0-15) */
#define FA_IDOT_TARGET __attribute__((target("avx512vnni,avx512vl,avx512bw")))
/* vpdpbusd in place: of the intrinsics' accumulator gcc 12 makes a copy
 * per product in the decoding loops and the key tiles (in a register or
 * on the stack). */
static FA_ALWAYS_INLINE FA_IDOT_TARGET __m256i fa_dpbusd256(__m256i acc, __m256i u, __m256i s)
{
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}
static FA_ALWAYS_INLINE FA_IDOT_TARGET __m512i fa_dpbusd512(__m512i acc, __m512i u, __m512i s)
{
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}
#define FA_DPBUSD(acc, u, s) fa_dpbusd256((acc), (u), (s))
#elif defined(__AVX2__) && FA_HAVE_AVX_VNNI
#define FA_IDOT_DOT 1
#define FA_IDOT_VNNI 1
#define FA_IDOT(name) fa_idot_##name##_dot
#define FA_IDOT_TARGET __attribute__((target("avxvnni")))
/* AVX-VNNI's vpdpbusd, VEX-encoded ({vex}, spelled %{vex%} in an asm
 * template), in place as fa_dpbusd256 */
static FA_ALWAYS_INLINE FA_IDOT_TARGET __m256i fa_vdpbusd256(__m256i acc, __m256i u, __m256i s)
{
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
    return acc;
}
#define FA_DPBUSD(acc, u, s) fa_vdpbusd256((acc), (u), (s))
#elif FA_HAVE_NEON && defined(FA_SIMD) && defined(__linux__) && defined(__GNUC__) && \
    !defined(__clang__)
#include <arm_neon.h>
#define FA_IDOT_DOT 1
#define FA_IDOT_SDOT 1
#define FA_IDOT(name) fa_idot_##name##_dot
#define FA_IDOT_TARGET __attribute__((target("arch=armv8.2-a+dotprod")))
#else
#define FA_IDOT_DOT 0
#endif
#if FA_IDOT_DOT
#include "fa_idot_body.h"
#undef FA_IDOT
#undef FA_IDOT_TARGET
#undef FA_DPBUSD
#undef FA_IDOT_ZMM
#undef FA_IDOT_VNNI
#undef FA_IDOT_SDOT
#endif

/* The instance the kernel asks for: dot (fa_idot_cpu) for the CPU's own
 * instruction, the base one otherwise. */
#if FA_IDOT_DOT
#define FA_IDOT_PICK(dot, name, args)                   \
    do {                                                \
        if (dot) fa_idot_##name##_dot args;             \
        else fa_idot_##name##_base args;                \
    } while (0)
#else
#define FA_IDOT_PICK(dot, name, args) ((void)(dot), fa_idot_##name##_base args)
#endif

/* Whether this path's kernels take the dot-product instance on this CPU. */
static inline int fa_idot_cpu(void)
{
#if FA_IDOT_DOT && FA_HAVE_NEON
    return fa_cpu_has_neon_dotprod();
#elif FA_IDOT_DOT && defined(__AVX512F__)
    return fa_cpu_has_avx512_vnni();
#elif FA_IDOT_DOT
    return fa_cpu_has_avx_vnni();
#else
    return 0;
#endif
}

/* Whether fa_itile's instance dot reads asum: only vpdpbusd's, whose
 * unsigned operand is B with its sign bit flipped (the sign trick and sdot
 * need no correction). */
static inline int fa_itile_reads_sums(int dot)
{
#if FA_IDOT_DOT && !FA_HAVE_NEON
    return dot;
#else
    return (void)dot, 0;
#endif
}

/* s[r] = qd * (float)(q . k_r) for nr rows of n int8 codes, k_r = k + r * rb
 * (n <= FA_IDOT_MAX_E). */
static inline void fa_idot_i8(int dot, fa_idx nr, fa_idx n, const int8_t *q, float qd,
                              const int8_t *k, fa_idx rb, float *s)
{
    FA_IDOT_PICK(dot, i8, (nr, n, q, qd, k, rb, s));
}

/* For nr Q4 rows k_r = k + r * rb of nb blocks each, whose block b is
 * d_rb times (codes - 8), against q (nb * 32 codes) with scales qd[b] and
 * offsets qb[b] (fa_quantise_i8):
 *   s[r] = sum over b, in order from 0, of (d_rb * qd[b]) * (float)(c_rb . q_b - qb[b])
 * with each product and sum rounded to float (the order every path keeps). */
static inline void fa_idot_q4(int dot, fa_idx nr, fa_idx nb, const int8_t *q, const float *qd,
                              const int32_t *qb, const uint8_t *k, fa_idx rb, float *s)
{
    FA_IDOT_PICK(dot, q4, (nr, nb, q, qd, qb, k, rb, s));
}

/* ot[c] = ot[c] + u * (float)acc[c] for c < nc, acc[c] = the sum over
 * r < n of w[r] * rows[r][c]: int8 codes, weights 0..127; n a multiple
 * of 4 (rows past the group's have weight 0 and point at one of its rows).
 * The sums go from registers to the output: through memory they cost a
 * failed store forwarding each. */
static inline void fa_igemv_i8(int dot, fa_idx n, const uint8_t *w, const int8_t *const *rows,
                               fa_idx nc, float u, float *ot)
{
    FA_IDOT_PICK(dot, igemv_i8, (n, w, rows, nc, u, ot));
}

/* sums[r] = the sum of the n codes of row r < m (rows rs bytes apart):
 * fa_itile's asum. */
static inline void fa_row_code_sums(int dot, fa_idx m, fa_idx n, const int8_t *a, fa_idx rs,
                                    int32_t *sums)
{
    FA_IDOT_PICK(dot, row_sums, (m, n, a, rs, sums));
}

/* A register-tiled integer matrix product, the block kernel's (the int8
 * mode's scores and weighted values a block at a time): the sums
 *   x(r, j) = sum over t < n4, u < 4 of a[r * rs + t * cs + u] * B(t, j, u)
 * for r < m and j < nc (a multiple of 16), B(t, j, u) = b[4 * (t * ldb + j) + u],
 * put as o says (fa_itile_finish): a's rows as int8 codes in quads of one row
 * (a key row, or four keys' codes of one value column), B's columns
 * (queries) in quads of one column.  sb: B holds int8 codes, and asum[r] is
 * the sum of row r's codes where fa_itile_reads_sums(dot) (vpdpbusd takes
 * B's sign bit flipped, 128 asum[r] too much); else B holds weights of
 * 0..127 and asum is not read. */
static inline void fa_itile(int dot, fa_idx m, fa_idx nc, fa_idx n4, const int8_t *a, fa_idx rs,
                            fa_idx cs, const int8_t *b, fa_idx ldb, int sb, const int32_t *asum,
                            const fa_itile_out *o)
{
    FA_IDOT_PICK(dot, tile, (m, nc, n4, a, rs, cs, b, ldb, sb, asum, o));
}

#endif
