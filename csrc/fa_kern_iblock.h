/* The block kernel's products in the int8 mode (fa_attn_args.precision
 * FA_PRECISION_INT8) against int8 keys and values: the query block rounded
 * to int8 once, each key block's scores as integer sums of the codes, and
 * its weights, with their value rows' scales folded in, rounded to 7 bits
 * per FA_WGROUP keys and summed with the value codes as integers
 * (SageAttention's int8 Q K^T, Zhang et al., ICLR 2025, with 8-bit P V as
 * its second version's).  Every sum is exact and every float step is
 * elementwise in a fixed order, so every path gives the same bits.
 *
 * Needs T (float), FA_NAME, FA_QB, FA_KB and the loaders of fa_kern_load.h. */

/* Keys whose weights share one scale: a group of key positions j with the
 * same j / FA_WGROUP.  The block kernel's key blocks then start at a
 * multiple of it (int8_begin). */
#define FA_WGROUP 64
#define FA_I8_E4(a) (((a)->E + 3) / 4) /* quads of a key row's codes */

/* Whether the block kernel takes this call's products as integers. */
static FA_ALWAYS_INLINE int FA_NAME(int8_block)(const fa_attn_args *a)
{
    return FA_IS_F32 && a->precision == FA_PRECISION_INT8 && a->kv_store == FA_STORE_I8 &&
           a->E > 0 && a->E <= FA_IDOT_MAX_E;
}

/* The int8 mode's scratch of the block kernel, from a 64-byte aligned
 * start (each array a whole number of 64 bytes). */
typedef struct {
    int8_t *q8;     /* FA_I8_E4 x FA_QB quads: the query block's codes, a column per query */
    float *qd;      /* FA_QB: their scales */
    float *qrow;    /* 8 x E: query rows, converted */
    int8_t *qcodes; /* 4 FA_I8_E4: its codes, zero padded */
    int32_t *ksum;  /* FA_KB: each key row's sum of codes */
    int8_t *kpanel; /* FA_KB x 4 FA_I8_E4: key rows copied, padded to quads */
    int8_t *vq;     /* FA_KB / 4 x Ev quads: a block's value codes, four keys per column */
    int8_t *wq;     /* FA_WGROUP / 4 x FA_QB quads: a group's weights */
    float *wu;      /* FA_QB: their scales */
    float *wr;      /* FA_QB: what rounds them to codes */
    float *vd;      /* FA_KB: the block's value scales */
    float *kd;      /* FA_KB: its key scales */
    float *qmax;    /* 2: the query block's largest |scale| and |key-mean term| */
    int dot;        /* the integer products' instance (fa_idot_cpu) */
} FA_NAME(iscratch);

#define FA_I8_PAD(n) (((size_t)(n) + FA_ALIGN - 1) / FA_ALIGN * FA_ALIGN)

static size_t FA_NAME(iblock_work)(const fa_attn_args *a)
{
    if (!FA_NAME(int8_block)(a)) return 0;
    const size_t e4 = (size_t)FA_I8_E4(a), qb = (size_t)FA_QB, kb = (size_t)FA_KB;
    return FA_I8_PAD(4 * e4 * qb) + FA_I8_PAD(4 * qb) + FA_I8_PAD(4 * 8 * (size_t)a->E) +
           FA_I8_PAD(4 * e4) + FA_I8_PAD(4 * kb) + FA_I8_PAD(kb * 4 * e4) +
           FA_I8_PAD(kb * (size_t)a->Ev) + FA_I8_PAD((size_t)FA_WGROUP * qb) +
           2 * FA_I8_PAD(4 * qb) + 2 * FA_I8_PAD(4 * kb) + FA_I8_PAD(8);
}

static FA_NAME(iscratch) FA_NAME(iblock_carve)(const fa_attn_args *a, void *work)
{
    FA_NAME(iscratch) s;
    const size_t e4 = (size_t)FA_I8_E4(a), qb = (size_t)FA_QB, kb = (size_t)FA_KB;
    char *p = (char *)work;
    s.q8 = (int8_t *)p, p += FA_I8_PAD(4 * e4 * qb);
    s.qd = (float *)p, p += FA_I8_PAD(4 * qb);
    s.qrow = (float *)p, p += FA_I8_PAD(4 * 8 * (size_t)a->E);
    s.qcodes = (int8_t *)p, p += FA_I8_PAD(4 * e4);
    s.ksum = (int32_t *)p, p += FA_I8_PAD(4 * kb);
    s.kpanel = (int8_t *)p, p += FA_I8_PAD(kb * 4 * e4);
    s.vq = (int8_t *)p, p += FA_I8_PAD(kb * (size_t)a->Ev);
    s.wq = (int8_t *)p, p += FA_I8_PAD((size_t)FA_WGROUP * qb);
    s.wu = (float *)p, p += FA_I8_PAD(4 * qb);
    s.wr = (float *)p, p += FA_I8_PAD(4 * qb);
    s.vd = (float *)p, p += FA_I8_PAD(4 * kb);
    s.kd = (float *)p, p += FA_I8_PAD(4 * kb);
    s.qmax = (float *)p;
    s.dot = !a->int8_base && fa_idot_cpu();
    return s;
}

/* The first key of the sweep from s_begin: down to a multiple of
 * FA_WGROUP, so that every group of weights is whole but where the keys
 * end (the keys before s_begin are hidden: the stage gives them -inf). */
static fa_idx FA_NAME(int8_begin)(fa_idx s_begin)
{
    return s_begin / FA_WGROUP * FA_WGROUP;
}

#if FA_IS_F32
/* The codes of the block's nc query columns (column j: head j % G at
 * position i0 + j / G), each row rounded to int8 with one scale
 * (fa_quantise_i8, as the row kernel rounds them), packed in quads of a
 * column; columns nc..ld-1 are zeros.  shift[j]: the column's term of the
 * key mean (mean_shift), 0 without. */
static void FA_NAME(int8_queries)(const fa_attn_args *a, const FA_NAME(iscratch) *s,
                                  const void *q, fa_idx i0, fa_idx G, fa_idx nc, fa_idx ld,
                                  T *shift)
{
    const fa_idx E = a->E, E4 = FA_I8_E4(a);
    memset(s->q8, 0, (size_t)(4 * E4 * ld));
    for (fa_idx j = 0; j < ld; ++j) s->qd[j] = shift[j] = 0;
    for (fa_idx e = E; e < 4 * E4; ++e) s->qcodes[e] = 0; /* past E: never written */
    for (fa_idx j0 = 0; j0 < nc; j0 += 8) { /* eight rows at a time: their shifts together */
        const fa_idx n = nc - j0 < 8 ? nc - j0 : 8;
        for (fa_idx r = 0; r < n; ++r) {
            const fa_idx j = j0 + r;
            int32_t offset; /* Q4 keys' offset: not used */
            float *row = s->qrow + r * E;
            FA_NAME(load_row)(a->q_store, E,
                              FA_NAME(st_at)(a->q_store, q, j % G * a->q_hs + (i0 + j / G) * a->q_ls),
                              a->q_es, row);
            fa_quantise_i8(E, row, E, 1, s->qcodes, s->qd + j, &offset);
            for (fa_idx t = 0; t < E4; ++t) memcpy(s->q8 + 4 * (t * ld + j), s->qcodes + 4 * t, 4);
        }
        if (a->k_mean != NULL) FA_NAME(mean_shifts)(a, n, s->qrow, E, 1, 1, shift + j0);
    }
    float qm = 0, sm = 0; /* NaN ignored: its scores are NaN anyway */
    for (fa_idx j = 0; j < nc; ++j) {
        qm = fabsf(s->qd[j]) > qm ? fabsf(s->qd[j]) : qm;
        sm = fabsf(shift[j]) > sm ? fabsf(shift[j]) : sm;
    }
    s->qmax[0] = qm;
    s->qmax[1] = sm;
}

/* st[r * ld + j] = the score of key s0 + r and query column j, for the nk
 * keys of a block: scale * (k_scale * (qd * (float)(q . k))), the row
 * kernel's expression (fa_idot_i8, rows_logits), plus shift[j] (the key
 * mean's term, step 1 of the per-score stage; zeros without), and bm[j]
 * (not NULL) raised to each. */
static void FA_NAME(int8_logits)(const fa_attn_args *a, const FA_NAME(iscratch) *s,
                                 const void *k, fa_idx s0, fa_idx nk, fa_idx ld, const T *shift,
                                 T *st, T *bm)
{
    const fa_idx E = a->E, E4 = FA_I8_E4(a);
    const int8_t *kr;
    fa_idx rs;
    if (a->k_es == 1 && E % 4 == 0 && fa_kv_run(a, s0, nk) == nk) { /* in place */
        kr = (const int8_t *)k + fa_key_at(a, s0);
        rs = a->k_ss;
    } else { /* copied, a run of rows in one block at a time, padded with zeros */
        for (fa_idx r = 0; r < nk; ++r) {
            const int8_t *row = (const int8_t *)k + fa_key_at(a, s0 + r);
            int8_t *p = s->kpanel + r * 4 * E4;
            for (fa_idx e = 0; e < E; ++e) p[e] = row[e * a->k_es];
            for (fa_idx e = E; e < 4 * E4; ++e) p[e] = 0;
        }
        kr = s->kpanel;
        rs = 4 * E4;
    }
    if (fa_itile_reads_sums(s->dot)) /* VNNI's sign correction */
        fa_row_code_sums(s->dot, nk, E, kr, rs, s->ksum);
    float km = 0;
    for (fa_idx r = 0; r < nk; ++r) {
        s->kd[r] = fa_key_scale(a, s0 + r);
        km = fabsf(s->kd[r]) > km ? fabsf(s->kd[r]) : km;
    }
    /* bounds on each step of a score, (cv x) then rv (cv x) then alpha
     * rv (cv x) + sv (|x| = |q . k| <= 127 x 127 x E): below them, no score
     * needs the tiles' check for one past float's range */
    const float b1 = s->qmax[0] * (127.0f * 127.0f * 4.0f * (float)E4), b2 = km * b1,
                b3 = fabsf((float)a->scale) * b2 + s->qmax[1];
    const int wide = !(b1 <= FLT_MAX / 4 && b2 <= FLT_MAX / 4 && b3 <= FLT_MAX / 4);
    const fa_itile_out o = {FA_ITILE_SCORES, ld, st, s->kd, s->qd, shift, bm, (float)a->scale, wide};
    fa_itile(s->dot, nk, ld, E4, kr, rs, 4, s->q8, ld, 1, s->ksum, &o);
}

/* The value codes of keys s0..s0+nk-1 in quads of four keys per column:
 * vq[4 (t Ev + c) + u] = code c of key s0 + 4 t + u (0 past the block). */
static void FA_NAME(int8_value_quads)(const fa_attn_args *a, const FA_NAME(iscratch) *s,
                                      const void *v, fa_idx s0, fa_idx nk)
{
    const fa_idx Ev = a->Ev;
    for (fa_idx t = 0; 4 * t < nk; ++t) {
        const int8_t *rows[4];
        int whole = a->v_es == 1;
        for (int u = 0; u < 4; ++u) {
            const fa_idx j = 4 * t + u;
            rows[u] = j < nk ? (const int8_t *)v + fa_value_at(a, s0 + j) : NULL;
            whole &= rows[u] != NULL;
        }
        int8_t *out = s->vq + 4 * t * Ev;
        fa_idx c = 0;
#if defined(__AVX2__)
        for (; whole && c + 32 <= Ev; c += 32) {
            __m256i x[4];
            fa_quads(_mm256_loadu_si256((const __m256i *)(rows[0] + c)),
                     _mm256_loadu_si256((const __m256i *)(rows[1] + c)),
                     _mm256_loadu_si256((const __m256i *)(rows[2] + c)),
                     _mm256_loadu_si256((const __m256i *)(rows[3] + c)), x);
            __m256i *o = (__m256i *)(out + 4 * c);
            _mm256_storeu_si256(o, _mm256_permute2x128_si256(x[0], x[1], 0x20));
            _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(x[2], x[3], 0x20));
            _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(x[0], x[1], 0x31));
            _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(x[2], x[3], 0x31));
        }
#endif
        for (; c < Ev; ++c)
            for (int u = 0; u < 4; ++u)
                out[4 * c + u] = rows[u] != NULL ? rows[u][c * a->v_es] : 0;
    }
}

/* ot[c * ld + j] += the weights st[r * ld + j] of the nk keys from s0 (0
 * for the keys a column does not see) times their value rows, a group of
 * FA_WGROUP keys at a time in order: each weight times its row's scale
 * (exactly 0 when the weight is, whatever the scale), those of a column
 * rounded to 0..127 against their largest (u = largest / 127), the codes
 * summed as integers and added as u * sum.  A column whose weights are not
 * finite, or whose u is below FLT_MIN, adds each weight times its row
 * exactly instead, in order. */
static void FA_NAME(int8_values)(const fa_attn_args *a, const FA_NAME(iscratch) *s,
                                 const void *v, fa_idx s0, fa_idx nk, fa_idx ld, T *st, T *ot)
{
    const fa_idx Ev = a->Ev;
    FA_NAME(int8_value_quads)(a, s, v, s0, nk);
    for (fa_idx r = 0; r < nk; ++r) s->vd[r] = fa_value_scale(a, s0 + r);
    for (fa_idx g0 = 0; g0 < nk; g0 += FA_WGROUP) {
        const fa_idx n = nk - g0 < FA_WGROUP ? nk - g0 : FA_WGROUP, n4 = (n + 3) / 4;
        T *w = st + g0 * ld;
        fa_fold_weights(n, ld, w, s->vd + g0, s->wu, s->wr);
        /* wr[j] = 127 / largest and wu[j] = largest / 127, or both 0 for a
         * column summed exactly (a NaN or a negative, flagged in wr) or with
         * no weight */
        int exact = 0;
        for (fa_idx j = 0; j < ld; ++j) { /* branch-free, so that it vectorises */
            const T m = s->wu[j], u = m / 127, flagged = s->wr[j];
            const int ok = (flagged == 0) & (m - m == 0) & (u >= FLT_MIN);
            exact += (ok == 0) & ((m != 0) | (flagged != 0));
            s->wr[j] = ok ? 127 / m : 0;
            s->wu[j] = ok ? u : 0;
        }
        for (fa_idx t = 0; t < n4; ++t)
            fa_pack_weights(n - 4 * t < 4 ? n - 4 * t : 4, ld, w + 4 * t * ld, s->wr,
                            s->wq + 4 * t * ld);
        const fa_itile_out o = {FA_ITILE_ADD, ld, ot, NULL, s->wu, NULL, NULL, 0, 0};
        fa_itile(s->dot, Ev, ld, n4, s->vq + 4 * (g0 / 4) * Ev, 4, 4 * Ev, s->wq, ld, 0, NULL, &o);
        for (fa_idx j = 0; exact && j < ld; ++j) {
            if (s->wu[j] > 0) continue;
            for (fa_idx r = 0; r < n; ++r) { /* NaN weights (a NaN score) included */
                const T x = w[r * ld + j];
                if (x == 0) continue;
                const int8_t *row = (const int8_t *)v + fa_value_at(a, s0 + g0 + r);
                for (fa_idx c = 0; c < Ev; ++c) ot[c * ld + j] += x * (T)row[c * a->v_es];
            }
        }
    }
}
#endif
