/* The integer products of fa_idot.h, once per instance: FA_IDOT(name)
 * names this instance's functions, FA_IDOT_TARGET gives them their target
 * and FA_DPBUSD(acc, u, s) adds to each int32 lane of acc the sum of its
 * four unsigned-by-signed byte products.  Included by fa_idot.h only. */

#if defined(__AVX2__)
/* acc + q . k over 32 bytes, four products per lane: |k| times q with k's
 * sign, so that the unsigned-by-signed multiply takes a code of -128 too */
static FA_ALWAYS_INLINE FA_IDOT_TARGET __m256i FA_IDOT(i8_step)(__m256i acc, __m256i q,
                                                                const int8_t *p)
{
    const __m256i k = _mm256_loadu_si256((const __m256i *)p);
    return FA_DPBUSD(acc, _mm256_abs_epi8(k), _mm256_sign_epi8(q, k));
}
#endif

/* The int8 sum of q[0..n) times row k_r (int8 codes) for nr <= 8 rows
 * k_r = k + r * rb (bytes): isum[r].  Inlined with nr = 8, the compiler
 * keeps the eight sums in registers. */
static FA_ALWAYS_INLINE FA_IDOT_TARGET void FA_IDOT(i8_sums)(const fa_idx nr, fa_idx n,
                                                             const int8_t *q, const int8_t *k,
                                                             fa_idx rb, int32_t *isum)
{
    fa_idx e0 = 0;
#if defined(FA_IDOT_ZMM)
    /* 64 bytes a step: (k + 128) . q, k's sign bit flipped to make it the
     * unsigned operand, less 128 times the sum of q's codes (one vpdpbusd
     * against ones): a third of the sign trick's instructions */
    e0 = n / 64 * 64;
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    __m512i acc[8], qsum = _mm512_setzero_si512();
    for (int r = 0; r < 8; ++r) acc[r] = _mm512_setzero_si512();
    for (fa_idx e = 0; e < e0; e += 64) {
        const __m512i qv = _mm512_loadu_si512((const void *)(q + e));
        qsum = fa_dpbusd512(qsum, ones, qv);
        for (fa_idx r = 0; r < nr; ++r)
            acc[r] = fa_dpbusd512(
                acc[r], _mm512_xor_si512(_mm512_loadu_si512((const void *)(k + r * rb + e)), flip), qv);
    }
    __m256i halves[8];
    for (int r = 0; r < 8; ++r)
        halves[r] = _mm256_add_epi32(_mm512_castsi512_si256(acc[r]), _mm512_extracti64x4_epi64(acc[r], 1));
    const __m256i offset = _mm256_set1_epi32(128 * _mm512_reduce_add_epi32(qsum));
    _mm256_storeu_si256((__m256i *)isum, _mm256_sub_epi32(fa_hsum8_epi32(halves), offset));
#elif defined(FA_IDOT_SDOT)
    e0 = n / 16 * 16;
    int32x4_t acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = vdupq_n_s32(0);
    for (fa_idx e = 0; e < e0; e += 16) {
        const int8x16_t qv = vld1q_s8(q + e);
        for (fa_idx r = 0; r < nr; ++r) acc[r] = vdotq_s32(acc[r], qv, vld1q_s8(k + r * rb + e));
    }
    for (int r = 0; r < 8; ++r) isum[r] = vaddvq_s32(acc[r]);
#elif defined(__AVX2__)
    e0 = n / 32 * 32;
    __m256i acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_si256();
    for (fa_idx e = 0; e < e0; e += 32) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + e));
        for (fa_idx r = 0; r < nr; ++r) acc[r] = FA_IDOT(i8_step)(acc[r], qv, k + r * rb + e);
    }
    _mm256_storeu_si256((__m256i *)isum, fa_hsum8_epi32(acc));
#else
    for (fa_idx r = 0; r < nr; ++r) isum[r] = 0;
#endif
    for (fa_idx r = 0; e0 < n && r < nr; ++r) {
        const int8_t *kr = k + r * rb;
        int32_t sum = 0;
        for (fa_idx e = e0; e < n; ++e) sum += (int32_t)q[e] * kr[e];
        isum[r] += sum;
    }
}

#if defined(FA_IDOT_ZMM)
/* Lane r: the sum of the lanes of a[r], r < 16 (pairs of rows' lanes
 * interleaved and added, then pairs of those, then their 128-bit parts) */
static FA_ALWAYS_INLINE FA_IDOT_TARGET __m512i FA_IDOT(hsum16)(const __m512i *a)
{
    __m512i t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0x44),
                                _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0xee));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], 0x88),
                            _mm512_shuffle_i32x4(w[0], w[1], 0xdd));
}

/* s[r] = qd * (float)(q . k_r) for r < 16 (fa_idot_i8), n a multiple of
 * 64 (steps of 64 bytes; the inlined constant 2 of E = 128 unrolls them):
 * the sums of i8_sums, sixteen rows reduced together. */
static FA_ALWAYS_INLINE FA_IDOT_TARGET void FA_IDOT(i8_rows16)(const fa_idx steps, const int8_t *q,
                                                               __m512i offset, float qd,
                                                               const int8_t *k, fa_idx rb, float *s)
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[16];
    for (int r = 0; r < 16; ++r, k += rb) { /* a row at a time: one pointer */
        acc[r] = _mm512_setzero_si512();
        for (fa_idx i = 0; i < steps; ++i)
            acc[r] = fa_dpbusd512(acc[r], _mm512_xor_si512(_mm512_loadu_si512((const void *)(k + 64 * i)), flip),
                                  _mm512_loadu_si512((const void *)(q + 64 * i)));
    }
    const __m512i x = _mm512_sub_epi32(FA_IDOT(hsum16)(acc), offset);
    _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_set1_ps(qd), _mm512_cvtepi32_ps(x)));
}
#endif

/* fa_idot_i8 */
static FA_IDOT_TARGET void FA_IDOT(i8)(fa_idx nr, fa_idx n, const int8_t *q, float qd,
                                       const int8_t *k, fa_idx rb, float *s)
{
    int32_t isum[8];
    fa_idx r0 = 0;
#if defined(FA_IDOT_ZMM)
    if (nr >= 16 && n % 64 == 0) { /* sixteen rows at a time; 128 times the codes' sum too much */
        __m512i qsum = _mm512_setzero_si512();
        for (fa_idx e = 0; e < n; e += 64)
            qsum = fa_dpbusd512(qsum, _mm512_set1_epi8(1), _mm512_loadu_si512((const void *)(q + e)));
        const __m512i offset = _mm512_set1_epi32(128 * _mm512_reduce_add_epi32(qsum));
        for (; r0 + 16 <= nr; r0 += 16) {
            if (n == 128)
                FA_IDOT(i8_rows16)(2, q, offset, qd, k + r0 * rb, rb, s + r0);
            else
                FA_IDOT(i8_rows16)(n / 64, q, offset, qd, k + r0 * rb, rb, s + r0);
        }
    }
#endif
    for (; r0 < nr; r0 += 8) {
        const fa_idx m = nr - r0 < 8 ? nr - r0 : 8;
        if (m == 8)
            FA_IDOT(i8_sums)(8, n, q, k + r0 * rb, rb, isum);
        else
            FA_IDOT(i8_sums)(m, n, q, k + r0 * rb, rb, isum);
        for (fa_idx r = 0; r < m; ++r) s[r0 + r] = qd * (float)isum[r];
    }
}

/* fa_idot_q4 */
static FA_IDOT_TARGET void FA_IDOT(q4)(fa_idx nr, fa_idx nb, const int8_t *q, const float *qd,
                                       const int32_t *qb, const uint8_t *k, fa_idx rb, float *s)
{
    fa_idx r0 = 0;
#if defined(__AVX2__)
    for (; r0 + 8 <= nr; r0 += 8) {
        const uint8_t *k0 = k + r0 * rb;
        __m256 acc = _mm256_setzero_ps();
        for (fa_idx b = 0; b < nb; ++b) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + b * FA_Q4_BLOCK));
            const uint8_t *blk = k0 + b * FA_Q4_BLOCK_BYTES;
            __m256i lanes[8];
            uint16_t d[8];
            for (int r = 0; r < 8; ++r) {
                lanes[r] = FA_DPBUSD(_mm256_setzero_si256(), fa_q4_codes(blk + r * rb + 2), qv);
                memcpy(d + r, blk + r * rb, sizeof d[r]);
            }
            const __m256i x = _mm256_sub_epi32(fa_hsum8_epi32(lanes), _mm256_set1_epi32(qb[b]));
            const __m256 dq = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d)),
                                            _mm256_set1_ps(qd[b]));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(dq, _mm256_cvtepi32_ps(x)));
        }
        _mm256_storeu_ps(s + r0, acc);
    }
#endif
    for (; r0 < nr; ++r0) {
        float acc = 0;
        for (fa_idx b = 0; b < nb; ++b) {
            const uint8_t *blk = k + r0 * rb + b * FA_Q4_BLOCK_BYTES;
            const int8_t *qv = q + b * FA_Q4_BLOCK;
#if defined(FA_IDOT_SDOT)
            const uint8x16_t codes = vld1q_u8(blk + 2); /* 0..15: signed bytes too */
            const int32x4_t lo = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(vandq_u8(
                                               codes, vdupq_n_u8(15))), vld1q_s8(qv));
            const int32_t sum = vaddvq_s32(vdotq_s32(
                lo, vreinterpretq_s8_u8(vshrq_n_u8(codes, 4)), vld1q_s8(qv + 16)));
#else
            int32_t sum = 0;
            for (int e = 0; e < FA_Q4_BLOCK / 2; ++e)
                sum += (int32_t)qv[e] * (blk[2 + e] & 15) + (int32_t)qv[e + 16] * (blk[2 + e] >> 4);
#endif
            acc = acc + (fa_q4_scale(blk) * qd[b]) * (float)(sum - qb[b]);
        }
        s[r0] = acc;
    }
}

#if defined(__AVX2__)
/* ot[0 .. 32 nw) += u * the sums of n rows' columns c0.. (fa_igemv_i8) for
 * nw chunks of 32 columns at once: four rows' codes of every chunk read in
 * turn, so that the rows stream through the caches in order (a chunk at a
 * time went down each group's 32 rows as many times, which the hardware
 * prefetcher follows worse). */
static FA_ALWAYS_INLINE FA_IDOT_TARGET void FA_IDOT(igemv_cols)(const int nw, fa_idx n,
                                                                const uint8_t *w,
                                                                const int8_t *const *rows,
                                                                fa_idx c0, float u, float *ot)
{
    __m256i s[4][4], q[4];
    for (int c = 0; c < nw; ++c)
        for (int i = 0; i < 4; ++i) s[c][i] = _mm256_setzero_si256();
    for (fa_idx r = 0; r < n; r += 4) {
        const __m256i wq = fa_quad_weights(w, (int)r);
        for (int c = 0; c < nw; ++c) {
            const fa_idx at = c0 + 32 * (fa_idx)c;
            fa_quads(_mm256_loadu_si256((const __m256i *)(rows[r] + at)),
                     _mm256_loadu_si256((const __m256i *)(rows[r + 1] + at)),
                     _mm256_loadu_si256((const __m256i *)(rows[r + 2] + at)),
                     _mm256_loadu_si256((const __m256i *)(rows[r + 3] + at)), q);
            for (int i = 0; i < 4; ++i) s[c][i] = FA_DPBUSD(s[c][i], wq, q[i]);
        }
    }
    for (int c = 0; c < nw; ++c) fa_quads_add(s[c], u, ot + c0 + 32 * c);
}
#endif

/* fa_row_code_sums */
static FA_IDOT_TARGET void FA_IDOT(row_sums)(fa_idx m, fa_idx n, const int8_t *a, fa_idx rs,
                                             int32_t *sums)
{
    fa_idx r = 0;
#if defined(FA_IDOT_ZMM) || defined(FA_IDOT_VNNI)
    /* eight rows at a time, 32 codes a step against ones */
    const __m256i ones = _mm256_set1_epi8(1);
    const fa_idx e0 = n / 32 * 32;
    for (; r + 8 <= m; r += 8) {
        __m256i acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_si256();
        for (fa_idx e = 0; e < e0; e += 32)
            for (int i = 0; i < 8; ++i)
                acc[i] = FA_DPBUSD(acc[i], ones,
                                   _mm256_loadu_si256((const __m256i *)(a + (r + i) * rs + e)));
        _mm256_storeu_si256((__m256i *)(sums + r), fa_hsum8_epi32(acc));
        for (int i = 0; i < 8; ++i)
            for (fa_idx e = e0; e < n; ++e) sums[r + i] += a[(r + i) * rs + e];
    }
#endif
    for (; r < m; ++r) {
        int32_t sum = 0;
        for (fa_idx e = 0; e < n; ++e) sum += a[r * rs + e];
        sums[r] = sum;
    }
}

/* fa_igemv_i8 */
static FA_IDOT_TARGET void FA_IDOT(igemv_i8)(fa_idx n, const uint8_t *w, const int8_t *const *rows,
                                             fa_idx nc, float u, float *ot)
{
    fa_idx c1 = 0; /* the columns summed in vectors */
#if defined(FA_IDOT_ZMM)
    /* sixteen accumulators: the 32 registers of AVX-512 VL */
    for (; c1 + 128 <= nc; c1 += 128) FA_IDOT(igemv_cols)(4, n, w, rows, c1, u, ot);
#endif
#if defined(__AVX2__) && !defined(FA_IDOT_SDOT)
    for (; c1 + 64 <= nc; c1 += 64) FA_IDOT(igemv_cols)(2, n, w, rows, c1, u, ot);
    for (; c1 + 32 <= nc; c1 += 32) FA_IDOT(igemv_cols)(1, n, w, rows, c1, u, ot);
#endif
#if defined(FA_IDOT_SDOT)
    /* 16 columns at a time: four rows' codes zipped into each column's
     * quad, dotted with the four weights (0..127: signed bytes too) */
    for (; c1 + 16 <= nc; c1 += 16) {
        int32x4_t s[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
        for (fa_idx r = 0; r < n; r += 4) {
            int32_t quad;
            memcpy(&quad, w + r, sizeof quad);
            const int8x16_t wq = vreinterpretq_s8_s32(vdupq_n_s32(quad));
            const int8x16_t x0 = vld1q_s8(rows[r] + c1), x1 = vld1q_s8(rows[r + 1] + c1);
            const int8x16_t x2 = vld1q_s8(rows[r + 2] + c1), x3 = vld1q_s8(rows[r + 3] + c1);
            const int16x8_t a = vreinterpretq_s16_s8(vzip1q_s8(x0, x1));
            const int16x8_t b = vreinterpretq_s16_s8(vzip2q_s8(x0, x1));
            const int16x8_t c = vreinterpretq_s16_s8(vzip1q_s8(x2, x3));
            const int16x8_t d = vreinterpretq_s16_s8(vzip2q_s8(x2, x3));
            s[0] = vdotq_s32(s[0], vreinterpretq_s8_s16(vzip1q_s16(a, c)), wq); /* columns 0-3 */
            s[1] = vdotq_s32(s[1], vreinterpretq_s8_s16(vzip2q_s16(a, c)), wq); /* 4-7 */
            s[2] = vdotq_s32(s[2], vreinterpretq_s8_s16(vzip1q_s16(b, d)), wq); /* 8-11 */
            s[3] = vdotq_s32(s[3], vreinterpretq_s8_s16(vzip2q_s16(b, d)), wq); /* 12-15 */
        }
        const float32x4_t uv = vdupq_n_f32(u);
        for (int i = 0; i < 4; ++i) {
            float *o = ot + c1 + 4 * i;
            vst1q_f32(o, vaddq_f32(vld1q_f32(o), vmulq_f32(uv, vcvtq_f32_s32(s[i]))));
        }
    }
#endif
    for (fa_idx c0 = c1; c0 < nc; c0 += 32) { /* the rest, 32 columns at a time */
        const fa_idx m = nc - c0 < 32 ? nc - c0 : 32;
        int32_t acc[32] = {0};
        for (fa_idx r = 0; r < n; ++r)
            for (fa_idx c = 0; c < m; ++c) acc[c] += (int32_t)w[r] * rows[r][c0 + c];
        for (fa_idx c = 0; c < m; ++c) ot[c0 + c] = ot[c0 + c] + u * (float)acc[c];
    }
}

/* fa_itile's register tiles: the sums of up to 8 rows (at most 4 but on
 * 512-bit vectors) times 16 or 32 columns of B, sb: B signed (else 0..127,
 * whose products need no sign trick) */
#if defined(FA_IDOT_ZMM)
/* fa_itile_finish of an 8 x 32 tile's sums from their registers, the same
 * steps in the same order (vmaxps keeps its second operand, cm, for a NaN
 * as fa_itile_finish does): through memory, the sums' stores and reloads
 * took as long as half the products on 512-bit units. */
static FA_ALWAYS_INLINE FA_IDOT_TARGET void FA_IDOT(tile_finish)(const fa_itile_out *o,
                                                                 const fa_idx mr, const int w,
                                                                 __m512i (*acc)[2], const int sb,
                                                                 const int32_t *asum, fa_idx r0,
                                                                 fa_idx j0)
{
    __m512 cv[2], sv[2], cm[2];
    for (int i = 0; i < w; ++i) cv[i] = _mm512_loadu_ps(o->cv + j0 + 16 * i);
    for (fa_idx r = 0; sb && r < mr; ++r) /* B's flipped sign bit */
        for (int i = 0; i < w; ++i) acc[r][i] = _mm512_sub_epi32(acc[r][i], _mm512_set1_epi32(128 * asum[r]));
    float *f = o->f + r0 * o->ld + j0;
    if (o->form == FA_ITILE_ADD) {
        for (fa_idx r = 0; r < mr; ++r, f += o->ld)
            for (int i = 0; i < w; ++i)
                _mm512_storeu_ps(f + 16 * i,
                                 _mm512_add_ps(_mm512_loadu_ps(f + 16 * i),
                                               _mm512_mul_ps(cv[i], _mm512_cvtepi32_ps(acc[r][i]))));
        return;
    }
    const __m512 alpha = _mm512_set1_ps(o->alpha), zero = _mm512_setzero_ps();
    for (int i = 0; i < w; ++i) {
        sv[i] = _mm512_loadu_ps(o->sv + j0 + 16 * i);
        cm[i] = o->cm != NULL ? _mm512_loadu_ps(o->cm + j0 + 16 * i) : zero;
    }
    for (fa_idx r = 0; r < mr; ++r, f += o->ld) {
        const __m512 rv = _mm512_set1_ps(o->rv[r0 + r]);
        for (int i = 0; i < w; ++i) {
            const __m512 x = _mm512_cvtepi32_ps(acc[r][i]);
            __m512 y = _mm512_add_ps(_mm512_mul_ps(alpha, _mm512_mul_ps(rv, _mm512_mul_ps(cv[i], x))),
                                     sv[i]);
            if (o->wide) /* NaN where not finite */
                y = _mm512_mask_mov_ps(_mm512_set1_ps(NAN),
                                       _mm512_cmp_ps_mask(_mm512_sub_ps(y, y), zero, _CMP_EQ_OQ), y);
            _mm512_storeu_ps(f + 16 * i, y);
            cm[i] = _mm512_max_ps(y, cm[i]);
        }
    }
    for (int i = 0; o->cm != NULL && i < w; ++i) _mm512_storeu_ps(o->cm + j0 + 16 * i, cm[i]);
}

static FA_ALWAYS_INLINE FA_IDOT_TARGET void FA_IDOT(tile_regs)(const fa_idx mr, const int w,
                                                               const int sb, fa_idx n4,
                                                               const int8_t *a, fa_idx rs,
                                                               fa_idx cs, const int8_t *b,
                                                               fa_idx ldb, const int32_t *asum,
                                                               const fa_itile_out *o, fa_idx r0,
                                                               fa_idx j0)
{
    /* B's sign bit flipped makes it vpdpbusd's unsigned operand: 128 times
     * each row's sum of codes too much, taken off at the end */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[8][2];
    for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    const int8_t *bt = b;
    const fa_idx bstep = 4 * ldb;
    for (fa_idx t = 0; t < n4; ++t, bt += bstep, a += cs) {
        __m512i bv[2];
        for (int i = 0; i < w; ++i) {
            bv[i] = _mm512_loadu_si512((const void *)(bt + 64 * i));
            if (sb) bv[i] = _mm512_xor_si512(bv[i], flip);
        }
        const int8_t *ar = a;
        for (fa_idx r = 0; r < mr; ++r, ar += rs) {
            int32_t x;
            memcpy(&x, ar, sizeof x);
            const __m512i av = _mm512_set1_epi32(x);
            for (int i = 0; i < w; ++i) acc[r][i] = fa_dpbusd512(acc[r][i], bv[i], av);
        }
    }
    FA_IDOT(tile_finish)(o, mr, w, acc, sb, asum, r0, j0);
}
#define FA_ITILE_ROWS 8
#define FA_ITILE_COLS 32
#elif defined(FA_IDOT_SDOT)
static FA_ALWAYS_INLINE FA_IDOT_TARGET void FA_IDOT(tile_regs)(const fa_idx mr, const int w,
                                                               const int sb, fa_idx n4,
                                                               const int8_t *a, fa_idx rs,
                                                               fa_idx cs, const int8_t *b,
                                                               fa_idx ldb, const int32_t *asum,
                                                               const fa_itile_out *o, fa_idx r0,
                                                               fa_idx j0)
{
    /* signed by signed: weights of 0..127 are signed bytes too */
    (void)w, (void)sb, (void)asum;
    int32x4_t acc[4][4];
    for (int r = 0; r < 4; ++r)
        for (int i = 0; i < 4; ++i) acc[r][i] = vdupq_n_s32(0);
    for (fa_idx t = 0; t < n4; ++t) {
        const int8_t *bt = b + 4 * t * ldb;
        int8x16_t bv[4];
        for (int i = 0; i < 4; ++i) bv[i] = vld1q_s8(bt + 16 * i);
        for (fa_idx r = 0; r < mr; ++r) {
            int32_t x;
            memcpy(&x, a + r * rs + t * cs, sizeof x);
            const int8x16_t av = vreinterpretq_s8_s32(vdupq_n_s32(x));
            for (int i = 0; i < 4; ++i) acc[r][i] = vdotq_s32(acc[r][i], bv[i], av);
        }
    }
    int32_t x[4 * 16];
    for (fa_idx r = 0; r < mr; ++r)
        for (int i = 0; i < 4; ++i) vst1q_s32(x + r * 16 + 4 * i, acc[r][i]);
    fa_itile_finish(o, mr, 16, x, r0, j0);
}
#define FA_ITILE_ROWS 4
#define FA_ITILE_COLS 16
#elif defined(__AVX2__)
/* The ZMM tile_finish on 256-bit vectors: a 4 x 16 tile, asum (not NULL)
 * the rows' code sums, 128 times each too much in its sums */
static FA_ALWAYS_INLINE FA_IDOT_TARGET void FA_IDOT(tile_finish)(const fa_itile_out *o,
                                                                 const fa_idx mr,
                                                                 __m256i (*acc)[2],
                                                                 const int32_t *asum, fa_idx r0,
                                                                 fa_idx j0)
{
    __m256 cv[2], sv[2], cm[2];
    for (int i = 0; i < 2; ++i) cv[i] = _mm256_loadu_ps(o->cv + j0 + 8 * i);
    for (fa_idx r = 0; asum != NULL && r < mr; ++r)
        for (int i = 0; i < 2; ++i) acc[r][i] = _mm256_sub_epi32(acc[r][i], _mm256_set1_epi32(128 * asum[r]));
    float *f = o->f + r0 * o->ld + j0;
    if (o->form == FA_ITILE_ADD) {
        for (fa_idx r = 0; r < mr; ++r, f += o->ld)
            for (int i = 0; i < 2; ++i)
                _mm256_storeu_ps(f + 8 * i,
                                 _mm256_add_ps(_mm256_loadu_ps(f + 8 * i),
                                               _mm256_mul_ps(cv[i], _mm256_cvtepi32_ps(acc[r][i]))));
        return;
    }
    const __m256 alpha = _mm256_set1_ps(o->alpha), zero = _mm256_setzero_ps();
    for (int i = 0; i < 2; ++i) {
        sv[i] = _mm256_loadu_ps(o->sv + j0 + 8 * i);
        cm[i] = o->cm != NULL ? _mm256_loadu_ps(o->cm + j0 + 8 * i) : zero;
    }
    for (fa_idx r = 0; r < mr; ++r, f += o->ld) {
        const __m256 rv = _mm256_set1_ps(o->rv[r0 + r]);
        for (int i = 0; i < 2; ++i) {
            const __m256 x = _mm256_cvtepi32_ps(acc[r][i]);
            __m256 y = _mm256_add_ps(_mm256_mul_ps(alpha, _mm256_mul_ps(rv, _mm256_mul_ps(cv[i], x))),
                                     sv[i]);
            if (o->wide) /* NaN where not finite */
                y = _mm256_blendv_ps(_mm256_set1_ps(NAN), y,
                                     _mm256_cmp_ps(_mm256_sub_ps(y, y), zero, _CMP_EQ_OQ));
            _mm256_storeu_ps(f + 8 * i, y);
            cm[i] = _mm256_max_ps(y, cm[i]);
        }
    }
    for (int i = 0; o->cm != NULL && i < 2; ++i) _mm256_storeu_ps(o->cm + j0 + 8 * i, cm[i]);
}

static FA_ALWAYS_INLINE FA_IDOT_TARGET void FA_IDOT(tile_regs)(const fa_idx mr, const int w,
                                                               const int sb, fa_idx n4,
                                                               const int8_t *a, fa_idx rs,
                                                               fa_idx cs, const int8_t *b,
                                                               fa_idx ldb, const int32_t *asum,
                                                               const fa_itile_out *o, fa_idx r0,
                                                               fa_idx j0)
{
    (void)w;
    __m256i acc[4][2];
    for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (fa_idx t = 0; t < n4; ++t) {
        const int8_t *bt = b + 4 * t * ldb;
        __m256i b0 = _mm256_loadu_si256((const __m256i *)bt);
        __m256i b1 = _mm256_loadu_si256((const __m256i *)(bt + 32));
#if defined(FA_IDOT_VNNI)
        if (sb) { /* as the ZMM tiles: B's sign bit flipped, asum taken off at the end */
            b0 = _mm256_xor_si256(b0, _mm256_set1_epi8((char)0x80));
            b1 = _mm256_xor_si256(b1, _mm256_set1_epi8((char)0x80));
        }
#endif
        for (fa_idx r = 0; r < mr; ++r) {
            int32_t x;
            memcpy(&x, a + r * rs + t * cs, sizeof x);
            const __m256i av = _mm256_set1_epi32(x);
#if !defined(FA_IDOT_VNNI)
            if (sb) { /* the sign trick: |a| by b with a's sign */
                const __m256i ua = _mm256_abs_epi8(av);
                acc[r][0] = FA_DPBUSD(acc[r][0], ua, _mm256_sign_epi8(b0, av));
                acc[r][1] = FA_DPBUSD(acc[r][1], ua, _mm256_sign_epi8(b1, av));
                continue;
            }
#endif
            acc[r][0] = FA_DPBUSD(acc[r][0], b0, av);
            acc[r][1] = FA_DPBUSD(acc[r][1], b1, av);
        }
    }
#if defined(FA_IDOT_VNNI)
    FA_IDOT(tile_finish)(o, mr, acc, sb ? asum : NULL, r0, j0);
#else
    (void)asum;
    FA_IDOT(tile_finish)(o, mr, acc, NULL, r0, j0);
#endif
}
#define FA_ITILE_ROWS 4
#define FA_ITILE_COLS 16
#else
static FA_ALWAYS_INLINE void FA_IDOT(tile_regs)(const fa_idx mr, const int w, const int sb,
                                                fa_idx n4, const int8_t *a, fa_idx rs, fa_idx cs,
                                                const int8_t *b, fa_idx ldb,
                                                const int32_t *asum, const fa_itile_out *o,
                                                fa_idx r0, fa_idx j0)
{
    (void)w, (void)sb, (void)asum;
    int32_t x[4 * 16] = {0};
    for (fa_idx r = 0; r < mr; ++r)
        for (fa_idx t = 0; t < n4; ++t) {
            const int8_t *ar = a + r * rs + t * cs, *bt = b + 4 * t * ldb;
            for (int j = 0; j < 16; ++j)
                for (int u = 0; u < 4; ++u) x[r * 16 + j] += (int32_t)ar[u] * bt[4 * j + u];
        }
    fa_itile_finish(o, mr, 16, x, r0, j0);
}
#define FA_ITILE_ROWS 4
#define FA_ITILE_COLS 16
#endif

/* fa_itile */
static FA_IDOT_TARGET void FA_IDOT(tile)(fa_idx m, fa_idx nc, fa_idx n4, const int8_t *a,
                                         fa_idx rs, fa_idx cs, const int8_t *b, fa_idx ldb,
                                         int sb, const int32_t *asum, const fa_itile_out *o)
{
    for (fa_idx j = 0; j < nc; j += FA_ITILE_COLS) {
        const int w = nc - j >= FA_ITILE_COLS ? FA_ITILE_COLS / 16 : 1;
        for (fa_idx r = 0; r < m; r += FA_ITILE_ROWS) {
            const fa_idx mr = m - r < FA_ITILE_ROWS ? m - r : FA_ITILE_ROWS;
            const int8_t *ar = a + r * rs, *bj = b + 4 * j;
            const int32_t *sr = asum != NULL ? asum + r : NULL;
            if (mr == FA_ITILE_ROWS && w == FA_ITILE_COLS / 16 && sb)
                FA_IDOT(tile_regs)(FA_ITILE_ROWS, FA_ITILE_COLS / 16, 1, n4, ar, rs, cs, bj, ldb,
                                   sr, o, r, j);
            else if (mr == FA_ITILE_ROWS && w == FA_ITILE_COLS / 16)
                FA_IDOT(tile_regs)(FA_ITILE_ROWS, FA_ITILE_COLS / 16, 0, n4, ar, rs, cs, bj, ldb,
                                   sr, o, r, j);
            else
                FA_IDOT(tile_regs)(mr, w, sb, n4, ar, rs, cs, bj, ldb, sr, o, r, j);
        }
    }
}
#undef FA_ITILE_ROWS
#undef FA_ITILE_COLS
