/* The one place the attention kernels read query, key and value elements,
 * whatever their storage (fa_store): in place when stored as T, else
 * converted to T a row or a tile at a time, never as a whole copy.  Every
 * conversion is exact, and the dot products and weighted sums read
 * converted and native rows with the same operations in the same order, so
 * a stored array gives the bits its conversion to T would.
 *
 * int8 and float8_e4m3fn rows (fa_store_scaled) stand for scale * codes:
 * the row kernel multiplies a key's dot product by its scale and a value
 * row's weight by its scale, the block kernel its converted tiles.  A Q4
 * element is its block's scale times its code, exactly, as loaded.
 *
 * Needs T, FA_NAME, prefetch_bytes and the primitives cvt_body, dot_body,
 * dot_lanes where FA_DOT_GROUP is defined, gemv_t_any. */

#ifndef FA_PLACEMENT
#define FA_PLACEMENT
/* Where key or value row j of an item lies (fa_attn_args' placement), in
 * elements from the item's start, for row stride ss and block stride bs:
 * dense j * ss, paged the row's place in its block. */
static FA_ALWAYS_INLINE fa_idx fa_kv_row(const fa_attn_args *a, fa_idx j, fa_idx ss, fa_idx bs)
{
    if (a->block_table == NULL) return j * ss;
    return (fa_idx)a->block_table[j / a->block_size] * bs + (j % a->block_size) * ss;
}

/* How many of the n rows from row j follow it at its row stride: all when
 * dense, else those up to the end of its block.  The kernels read a run at
 * a time, as they read a dense array, so that paging changes no result. */
static FA_ALWAYS_INLINE fa_idx fa_kv_run(const fa_attn_args *a, fa_idx j, fa_idx n)
{
    if (a->block_table == NULL) return n;
    const fa_idx left = a->block_size - j % a->block_size;
    return left < n ? left : n;
}

static FA_ALWAYS_INLINE fa_idx fa_key_at(const fa_attn_args *a, fa_idx j)
{
    return fa_kv_row(a, j, a->k_ss, a->k_bs);
}

static FA_ALWAYS_INLINE fa_idx fa_value_at(const fa_attn_args *a, fa_idx j)
{
    return fa_kv_row(a, j, a->v_ss, a->v_bs);
}

/* The scales of key and value row j (fa_store_scaled). */
static FA_ALWAYS_INLINE float fa_key_scale(const fa_attn_args *a, fa_idx j)
{
    return a->k_scale[fa_kv_row(a, j, a->ksc_s, a->ksc_bs)];
}

static FA_ALWAYS_INLINE float fa_value_scale(const fa_attn_args *a, fa_idx j)
{
    return a->v_scale[fa_kv_row(a, j, a->vsc_s, a->vsc_bs)];
}
#endif

/* dst[0..n) = elements src[e * es] of a row stored as st, as T */
static void FA_NAME(load_row)(fa_store st, fa_idx n, const void *src, fa_idx es, T *dst)
{
    if (es == 1) {
        switch (st) {
        case FA_STORE_F16: FA_NAME(cvt_body)(FA_STORE_F16, n, src, dst); return;
        case FA_STORE_BF16: FA_NAME(cvt_body)(FA_STORE_BF16, n, src, dst); return;
        case FA_STORE_I8: FA_NAME(cvt_body)(FA_STORE_I8, n, src, dst); return;
        case FA_STORE_F8E4M3: FA_NAME(cvt_body)(FA_STORE_F8E4M3, n, src, dst); return;
        case FA_STORE_F8E5M2: FA_NAME(cvt_body)(FA_STORE_F8E5M2, n, src, dst); return;
        case FA_STORE_Q4: FA_NAME(cvt_body)(FA_STORE_Q4, n, src, dst); return;
        default: FA_NAME(cvt_body)(FA_STORE_NATIVE, n, src, dst); return;
        }
    }
    for (fa_idx e = 0; e < n; ++e) dst[e] = FA_NAME(st_get)(st, src, e * es); /* not Q4 */
}

/* Rows to ask the cache for as the rows of a sweep are read: with row r,
 * the `bytes` bytes at p + r * rb, for r < count (p only ever formed then). */
#ifndef FA_AHEAD_ROWS
#define FA_AHEAD_ROWS
typedef struct {
    const char *p;
    fa_idx rb, bytes, count;
} fa_ahead_rows;
#endif

/* With row r of a sweep: the rows of l1 asked for into L1, those of l2[0]
 * and l2[1] into L2. */
static FA_ALWAYS_INLINE void FA_NAME(fetch_rows)(fa_idx r, const fa_ahead_rows *l1,
                                                 const fa_ahead_rows *l2)
{
    if (r < l1->count) FA_NAME(prefetch_bytes)(l1->p + r * l1->rb, l1->bytes);
    for (int u = 0; u < 2; ++u)
        if (r < l2[u].count)
            for (fa_idx e = 0; e < l2[u].bytes; e += 64) FA_PREFETCH_L2(l2[u].p + r * l2[u].rb + e);
}

/* fetch_rows for rows r0..r0+m-1: a stream whose rows follow each other
 * (rb == bytes, a dense cache) asked for as one range, a line per
 * prefetch, where row by row cost several instructions per line. */
static FA_ALWAYS_INLINE void FA_NAME(fetch_run)(fa_idx r0, fa_idx m, const fa_ahead_rows *l1,
                                                const fa_ahead_rows *l2)
{
    const fa_ahead_rows *s[3] = {l1, l2, l2 + 1};
    for (int u = 0; u < 3; ++u) {
        const fa_ahead_rows *x = s[u];
        const fa_idx end = r0 + m < x->count ? r0 + m : x->count;
        if (r0 >= end) continue;
        if (x->rb != x->bytes) {
            for (fa_idx r = r0; r < end; ++r)
                for (fa_idx e = 0; e < x->bytes; e += 64)
                    u == 0 ? FA_PREFETCH(x->p + r * x->rb + e) : FA_PREFETCH_L2(x->p + r * x->rb + e);
            continue;
        }
        const char *p = x->p + r0 * x->rb, *q = x->p + end * x->rb;
        for (; p < q; p += 64)
            u == 0 ? FA_PREFETCH(p) : FA_PREFETCH_L2(p);
    }
}

/* s[t * ld + r] = sum over c < n of x[t * ldx + c] * y_r[c], for the nq
 * rows of x and the nr rows y_r = y + r * rs (each contiguous, stored as
 * st): each row of y is read once for all the rows of x (float8_e4m3fn's
 * converted once: dot_rows_body), FA_DOT_GROUP rows at a time where the
 * path sums their lanes together (dot_lanes), the same bits as one at a
 * time.  The rows of l1 and l2 are asked for with row r (fetch_rows).  One
 * loop for all the rows, so that its bounds and strides stay in
 * registers. */
static FA_ALWAYS_INLINE void FA_NAME(dots_any)(const fa_store st, fa_idx nq, fa_idx nr, fa_idx n,
                                               const T *x, fa_idx ldx, const void *y,
                                               fa_idx rs, T *s, fa_idx ld,
                                               const fa_ahead_rows *l1, const fa_ahead_rows *l2,
                                               int cached)
{
    const fa_idx rb = rs * FA_NAME(st_bytes)(st);
    /* float8_e4m3fn's conversion takes 7 vector operations: each vector of
     * a row converted once for all the rows of x.  For the others (1-2)
     * that loop was slower (threads-and-speed.md, "Rows converted once per
     * head group"). */
    const int shared = nq > 1 && st == FA_STORE_F8E4M3 && FA_NAME(rows_shared)(st);
    fa_idx r = 0;
#ifndef FA_DOT_GROUP
    (void)cached; /* only the paths that sum rows' lanes together read rows so */
#else
    /* rows in cache already (cached: nothing is asked for ahead) */
    for (; cached && !shared && r + FA_DOT_GROUP <= nr; r += FA_DOT_GROUP) {
        const char *rows = (const char *)y + r * rb;
        if (n == 128)
            FA_NAME(dots_cached)(st, nq, 128, x, ldx, rows, rb, s + r, ld);
        else if (n == 64)
            FA_NAME(dots_cached)(st, nq, 64, x, ldx, rows, rb, s + r, ld);
        else
            FA_NAME(dots_cached)(st, nq, n, x, ldx, rows, rb, s + r, ld);
    }
    /* not rows stored as T, whose sweep waits for memory rather than for
     * arithmetic: it was slower so (threads-and-speed.md, same section) */
    for (; !shared && st != FA_STORE_NATIVE && r + FA_DOT_GROUP <= nr; r += FA_DOT_GROUP)
        for (fa_idx t = 0; t < nq; ++t) {
            T lanes[FA_DOT_GROUP * FA_DOT_GROUP];
            const char *rows = (const char *)y + r * rb;
            fa_idx c = 0;
            for (fa_idx i = 0; i < FA_DOT_GROUP; ++i) {
                if (t == 0) FA_NAME(fetch_rows)(r + i, l1, l2);
                c = FA_NAME(dot_lanes)(st, n, x + t * ldx, rows + i * rb, lanes + i * FA_DOT_GROUP);
            }
            FA_NAME(dot_lanes_sum)(st, c, n, x + t * ldx, rows, rb, lanes, s + t * ld + r);
        }
#endif
    for (; r < nr; ++r) {
        const char *row = (const char *)y + r * rb;
        FA_NAME(fetch_rows)(r, l1, l2);
        if (shared)
            for (fa_idx t0 = 0; t0 < nq; t0 += 4) {
                const T *xt = x + t0 * ldx;
                T *st0 = s + t0 * ld + r;
                switch (nq - t0 < 4 ? nq - t0 : 4) {
                case 4: FA_NAME(dot_rows_body)(4, st, n, xt, ldx, row, st0, ld); break;
                case 3: FA_NAME(dot_rows_body)(3, st, n, xt, ldx, row, st0, ld); break;
                case 2: FA_NAME(dot_rows_body)(2, st, n, xt, ldx, row, st0, ld); break;
                default: FA_NAME(dot_rows_body)(1, st, n, xt, ldx, row, st0, ld); break;
                }
            }
        else
            for (fa_idx t = 0; t < nq; ++t) s[t * ld + r] = FA_NAME(dot_body)(st, n, x + t * ldx, row);
    }
}

/* One row of x (a decoding step of multi-head attention) gets a loop of its
 * own, without the loop over the rows of x: in the shared loop the compiler
 * kept the bounds and strides on the stack, some 40 instructions a row. */
static FA_ALWAYS_INLINE void FA_NAME(dots_nq)(const fa_store st, fa_idx nq, fa_idx nr, fa_idx n,
                                              const T *x, fa_idx ldx, const void *y, fa_idx rs,
                                              T *s, fa_idx ld, const fa_ahead_rows *l1,
                                              const fa_ahead_rows *l2, int cached)
{
    if (nq == 1)
        FA_NAME(dots_any)(st, 1, nr, n, x, ldx, y, rs, s, ld, l1, l2, cached);
    else
        FA_NAME(dots_any)(st, nq, nr, n, x, ldx, y, rs, s, ld, l1, l2, cached);
}

static void FA_NAME(dots)(fa_store st, fa_idx nq, fa_idx nr, fa_idx n, const T *x, fa_idx ldx,
                          const void *y, fa_idx rs, T *s, fa_idx ld, const fa_ahead_rows *l1,
                          const fa_ahead_rows *l2, int cached)
{
#if FA_IS_F32
    switch (st) {
    case FA_STORE_F16:
        FA_NAME(dots_nq)(FA_STORE_F16, nq, nr, n, x, ldx, y, rs, s, ld, l1, l2, cached);
        return;
    case FA_STORE_BF16:
        FA_NAME(dots_nq)(FA_STORE_BF16, nq, nr, n, x, ldx, y, rs, s, ld, l1, l2, cached);
        return;
    case FA_STORE_I8:
        FA_NAME(dots_nq)(FA_STORE_I8, nq, nr, n, x, ldx, y, rs, s, ld, l1, l2, cached);
        return;
    case FA_STORE_F8E4M3:
        FA_NAME(dots_nq)(FA_STORE_F8E4M3, nq, nr, n, x, ldx, y, rs, s, ld, l1, l2, cached);
        return;
    case FA_STORE_F8E5M2:
        FA_NAME(dots_nq)(FA_STORE_F8E5M2, nq, nr, n, x, ldx, y, rs, s, ld, l1, l2, cached);
        return;
    case FA_STORE_Q4:
        FA_NAME(dots_nq)(FA_STORE_Q4, nq, nr, n, x, ldx, y, rs, s, ld, l1, l2, cached);
        return;
    default: break;
    }
#else
    (void)st;
#endif
    FA_NAME(dots_nq)(FA_STORE_NATIVE, nq, nr, n, x, ldx, y, rs, s, ld, l1, l2, cached);
}

/* o[c] += sum over r < nk of p[r] * x[r * rs + c] (rows contiguous), for
 * c < n, skipping rows of weight exactly 0; x stored as T, or as st */
static void FA_NAME(gemv_t)(fa_idx nk, fa_idx n, const T *p, const T *x, fa_idx rs, T *o)
{
    FA_NAME(gemv_t_any)(FA_STORE_NATIVE, nk, n, p, x, rs, o);
}

/* gemv_t for the nq rows of weights p + t * ldp into the rows o + t * ldo
 * (nq query heads sharing x), x stored as st: each row of x read once for
 * them all (gemv_t_rows_any), the bits of a gemv_t_any per row. */
static void FA_NAME(gemv_t_st)(fa_store st, fa_idx nq, fa_idx nk, fa_idx n, const T *p,
                               fa_idx ldp, const void *x, fa_idx rs, T *o, fa_idx ldo, int cached)
{
    /* value rows in cache (cached) are bound by instructions: Ev of 64 and
     * 128 as constants, so that the loops over them unroll (the same
     * products in the same order) */
    if (cached && st == FA_STORE_NATIVE && n == 128) {
        FA_NAME(gemv_t_rows_any)(FA_STORE_NATIVE, nq, nk, 128, p, ldp, x, rs, o, ldo);
        return;
    }
    if (cached && st == FA_STORE_NATIVE && n == 64) {
        FA_NAME(gemv_t_rows_any)(FA_STORE_NATIVE, nq, nk, 64, p, ldp, x, rs, o, ldo);
        return;
    }
#if FA_IS_F32
    switch (st) {
    case FA_STORE_F16: FA_NAME(gemv_t_rows_any)(FA_STORE_F16, nq, nk, n, p, ldp, x, rs, o, ldo); return;
    case FA_STORE_BF16: FA_NAME(gemv_t_rows_any)(FA_STORE_BF16, nq, nk, n, p, ldp, x, rs, o, ldo); return;
    case FA_STORE_I8: FA_NAME(gemv_t_rows_any)(FA_STORE_I8, nq, nk, n, p, ldp, x, rs, o, ldo); return;
    case FA_STORE_F8E4M3: FA_NAME(gemv_t_rows_any)(FA_STORE_F8E4M3, nq, nk, n, p, ldp, x, rs, o, ldo); return;
    case FA_STORE_F8E5M2: FA_NAME(gemv_t_rows_any)(FA_STORE_F8E5M2, nq, nk, n, p, ldp, x, rs, o, ldo); return;
    case FA_STORE_Q4: FA_NAME(gemv_t_rows_any)(FA_STORE_Q4, nq, nk, n, p, ldp, x, rs, o, ldo); return;
    default: break;
    }
#else
    (void)st;
#endif
    FA_NAME(gemv_t_rows_any)(FA_STORE_NATIVE, nq, nk, n, p, ldp, x, rs, o, ldo);
}

/* A tile of key or value rows as T, read through p + r * ss + e * es. */
typedef struct {
    const T *p;
    fa_idx ss, es;
} FA_NAME(tile);

/* Rows s0..s0+nk-1 (n features each) of the key or value x with row,
 * feature and block strides ss, es and bs (fa_attn_args' placement), and
 * row scales sc (fa_store_scaled) at rows sc_s and blocks sc_bs apart: in
 * place when stored as T and in one block, else copied or converted into
 * panel (nk x ld), scaled rows times their scale. */
static FA_NAME(tile) FA_NAME(load_tile)(const fa_attn_args *a, const void *x, fa_idx ss,
                                        fa_idx es, fa_idx bs, fa_idx n, const float *sc,
                                        fa_idx sc_s, fa_idx sc_bs, fa_idx s0, fa_idx nk,
                                        T *panel, fa_idx ld)
{
    FA_NAME(tile) t = {panel, ld, 1};
    if (a->kv_store == FA_STORE_NATIVE && fa_kv_run(a, s0, nk) == nk) {
        t.p = (const T *)x + fa_kv_row(a, s0, ss, bs);
        t.ss = ss;
        t.es = es;
        return t;
    }
    for (fa_idx r = 0; r < nk; ++r) {
        T *row = panel + r * ld;
        const fa_idx j = s0 + r;
        FA_NAME(load_row)(a->kv_store, n, FA_NAME(st_at)(a->kv_store, x, fa_kv_row(a, j, ss, bs)),
                          es, row);
        if (fa_store_scaled(a->kv_store)) {
            const T f = (T)sc[fa_kv_row(a, j, sc_s, sc_bs)];
            for (fa_idx e = 0; e < n; ++e) row[e] *= f;
        }
    }
    return t;
}

static FA_NAME(tile) FA_NAME(key_tile)(const fa_attn_args *a, const void *k, fa_idx s0, fa_idx nk,
                                       T *panel)
{
    return FA_NAME(load_tile)(a, k, a->k_ss, a->k_es, a->k_bs, a->E, a->k_scale, a->ksc_s,
                              a->ksc_bs, s0, nk, panel, FA_PAD(a->E, (fa_idx)sizeof(T)));
}

static FA_NAME(tile) FA_NAME(value_tile)(const fa_attn_args *a, const void *v, fa_idx s0,
                                         fa_idx nk, T *panel)
{
    return FA_NAME(load_tile)(a, v, a->v_ss, a->v_es, a->v_bs, a->Ev, a->v_scale, a->vsc_s,
                              a->vsc_bs, s0, nk, panel, FA_PAD(a->Ev, (fa_idx)sizeof(T)));
}

#if FA_IS_F32
/* c = (x - mean) * f * inv rounded to nearest-even, each product rounded
 * to float in that order; every |result| <= 127, so narrowing is exact. */
static void FA_NAME(int8_row_codes)(fa_idx n, const float *x, const float *mean, float f,
                                    float inv, int8_t *c)
{
    fa_idx e = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
    { /* 32 codes a step, packed twice and put back in order: one store where
       * the 8-code step below made four (AVX-512 narrows with vpmovdb) */
        const __m256 fv = _mm256_set1_ps(f), iv = _mm256_set1_ps(inv);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (; e + 32 <= n; e += 32) {
            __m256i q[4];
            for (int i = 0; i < 4; ++i) {
                __m256 y = _mm256_loadu_ps(x + e + 8 * i);
                if (mean != NULL) y = _mm256_sub_ps(y, _mm256_loadu_ps(mean + e + 8 * i));
                q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(y, fv), iv));
            }
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                 _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(c + e), _mm256_permutevar8x32_epi32(p, order));
        }
    }
#endif
#if defined(__AVX512F__)
    const __m512 fv = _mm512_set1_ps(f), iv = _mm512_set1_ps(inv);
    for (; e + 16 <= n; e += 16) {
        __m512 y = _mm512_loadu_ps(x + e);
        if (mean != NULL) y = _mm512_sub_ps(y, _mm512_loadu_ps(mean + e));
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(y, fv), iv));
        _mm_storeu_si128((__m128i *)(c + e), _mm512_cvtepi32_epi8(q));
    }
#elif defined(__AVX2__)
    const __m256 fv = _mm256_set1_ps(f), iv = _mm256_set1_ps(inv);
    for (; e + 8 <= n; e += 8) {
        __m256 y = _mm256_loadu_ps(x + e);
        if (mean != NULL) y = _mm256_sub_ps(y, _mm256_loadu_ps(mean + e));
        const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(y, fv), iv));
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(c + e), _mm_packs_epi16(w, w));
    }
#endif
    for (; e < n; ++e) c[e] = (int8_t)rintf((mean != NULL ? x[e] - mean[e] : x[e]) * f * inv);
}

/* fa_int8_rows (fastattn.h), one path's: the row's largest |x - mean|,
 * then its codes from x - mean again (the same floats) */
void FA_NAME(int8_rows)(fa_idx rows, fa_idx n, const float *x, const float *mean, int8_t *codes,
                        float *scales, fa_idx *spoilt)
{
    for (fa_idx r = 0; r < rows; ++r) {
        const float *xr = x + r * n;
        int8_t *cr = codes + r * n;
        int nan;
        const float amax = fa_absmax_f32(n, xr, mean, &nan);
        const int bad = nan || !(amax <= FLT_MAX);
        if (bad || amax == 0) { /* a NaN scale, or a row of zeros: codes 0 */
            for (fa_idx e = 0; e < n; ++e) cr[e] = 0;
        } else { /* |y| <= amax: no code past 127; a row too small for 127 / amax
                  * scaled by 2^64 first (exactly: a power of two) */
            const float f = amax < 127.0f / FLT_MAX ? 18446744073709551616.0f : 1;
            FA_NAME(int8_row_codes)(n, xr, mean, f, 127.0f / (amax * f), cr);
        }
        scales[r] = bad ? (float)NAN : amax / 127.0f;
        if (bad) { /* spoilt by the mean: x finite throughout */
            int finite = 1;
            for (fa_idx e = 0; e < n; ++e) finite &= xr[e] - xr[e] == 0;
            *spoilt += finite;
        }
    }
}

/* fa_col_sums (fastattn.h), one path's: FA_COL_SUMS columns at a time in
 * registers, each column's sum in order along the rows (numpy's order), the
 * path's vectors running across the columns. */
#define FA_COL_SUMS 64
void FA_NAME(col_sums)(fa_idx rows, fa_idx n, const float *x, double *sums)
{
    for (fa_idx c0 = 0; c0 < n; c0 += FA_COL_SUMS) {
        const fa_idx nc = n - c0 < FA_COL_SUMS ? n - c0 : FA_COL_SUMS;
        double acc[FA_COL_SUMS] = {0};
        if (nc == FA_COL_SUMS)
            for (fa_idx s = 0; s < rows; ++s)
                for (fa_idx c = 0; c < FA_COL_SUMS; ++c) acc[c] += x[s * n + c0 + c];
        else
            for (fa_idx s = 0; s < rows; ++s)
                for (fa_idx c = 0; c < nc; ++c) acc[c] += x[s * n + c0 + c];
        for (fa_idx c = 0; c < nc; ++c) sums[c0 + c] = acc[c];
    }
}

/* The other way, for outputs: y[0..n) = x[0..n) rounded to nearest-even F16
 * or BF16 (contiguous). */
void FA_NAME(narrow)(fa_store st, fa_idx n, const float *x, void *y)
{
    if (st == FA_STORE_F16) {
        FA_NAME(narrow_f16)(n, x, (uint16_t *)y);
        return;
    }
    for (fa_idx j = 0; j < n; ++j) ((uint16_t *)y)[j] = fa_f32_bf16(x[j]);
}
#endif
