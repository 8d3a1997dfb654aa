/* Attention a few query rows at a time, for element type T: decoding (one
 * new token against a long key/value cache) and rows whose output the block
 * kernel found non-finite.  Each row of K and V is read once per key block
 * for all the rows: dot products give the scores, an online softmax runs
 * along the keys, and gemv_t adds the value rows, skipping keys whose weight
 * is exactly zero, so that a non-finite value at a hidden key never reaches
 * the output.
 *
 * Needs T, FA_NAME, the per-score stage (fa_kern_scores.h) and the
 * loaders of fa_kern_load.h, and vexp, sum, max, prefetch_bytes. */

/* Keys per block.  Each block's key rows are read, then its value rows:
 * the longer each run, the more of the read bandwidth decoding gets (see
 * threads-and-speed.md, "Key blocks of the row kernel").  Weights of
 * FA_ROWS_MAX rows: 16 KB of float32. */
#define FA_RB 1024
/* How far ahead the key rows are prefetched (with FA_PREFETCH_KEYS):
 * further ahead, the prefetches wait for fill buffers that the value rows'
 * misses hold (see threads-and-speed.md, "Prefetch distance"). */
#define FA_PREFETCH_BYTES 2048
/* ... or this far, with FA_PREFETCH_FAR: which distance is faster depends
 * on the CPU, so fastattn/_tuning.py measures both (threads-and-speed.md,
 * "Prefetch distance"). */
#define FA_PREFETCH_FAR_BYTES 8192
/* Paged keys (fa_attn_args' placement) are asked into L2 this far ahead,
 * across blocks, and the next block's first FA_VALUE_AHEAD_ROWS value rows
 * as each block's are summed (rows_values): each block starts a new stream
 * that the hardware prefetcher learns only after a few misses (see
 * threads-and-speed.md, "Paged decoding's look-ahead"). */
#define FA_BLOCK_AHEAD_BYTES 16384
#define FA_VALUE_AHEAD_ROWS 16

/* Row strides of the scratch arrays: whole multiples of 64 bytes. */
#define FA_EP(a) FA_PAD((a)->E, (fa_idx)sizeof(T))
#define FA_EVP(a) FA_PAD((a)->Ev, (fa_idx)sizeof(T))
#define FA_ROWS_SCALARS FA_PAD(3 * FA_ROWS_MAX, (fa_idx)sizeof(T))
/* A tile of value rows whose features are strided is copied FA_VT_ROWS x
 * FA_VT_COLS at a time (FA_VT_COLS a multiple of every path's vector). */
#define FA_VT_ROWS 64
#define FA_VT_COLS 64
#define FA_GATHER(a) (FA_EP(a) > FA_VT_ROWS * FA_VT_COLS ? FA_EP(a) : FA_VT_ROWS * FA_VT_COLS)

/* Whether the row kernel takes this call's scores from integer dot
 * products (fa_idot.h): the int8 mode against int8 keys, as the block
 * kernel (fa_kern_iblock.h); against Q4 keys, which the block kernel reads
 * exactly, only for calls of at most FA_ROWS_MAX rows, so that a longer
 * call's last rows and the rows it repairs stay exact with the others. */
static FA_ALWAYS_INLINE int FA_NAME(int8_dots)(const fa_attn_args *a)
{
    return FA_IS_F32 && a->precision == FA_PRECISION_INT8 && a->E > 0 &&
           a->E <= FA_IDOT_MAX_E &&
           (a->kv_store == FA_STORE_I8 || (a->kv_store == FA_STORE_Q4 && a->L <= FA_ROWS_MAX));
}

/* The query's int8 codes per row (E rounded up to a Q4 block) and its
 * groups of one scale: the whole row against int8 keys, a Q4 block
 * against Q4 keys, whose scales they multiply. */
#define FA_Q8_LD(a) ((((a)->E + FA_IDOT_GROUP - 1) / FA_IDOT_GROUP) * FA_IDOT_GROUP)
#define FA_Q8_GROUPS(a) ((a)->kv_store == FA_STORE_Q4 ? FA_Q8_LD(a) / FA_IDOT_GROUP : 1)

/* Scratch of the row kernel, from a 64-byte aligned start: the int8
 * query's codes, scales and offsets after the rest, in the int8 mode. */
static size_t FA_NAME(rows_work)(const fa_attn_args *a)
{
    const size_t rest = sizeof(T) * (size_t)(FA_ROWS_MAX * (FA_EP(a) + FA_RB + 2 * FA_EVP(a)) +
                                             FA_ROWS_SCALARS + FA_GATHER(a));
    if (!FA_NAME(int8_dots)(a)) return rest;
    return rest + (size_t)FA_ROWS_MAX * (size_t)(FA_Q8_LD(a) + 8 * FA_Q8_GROUPS(a)) +
           (a->kv_store == FA_STORE_I8 ? (size_t)FA_IGROUP * (size_t)a->Ev : 0);
}

/* The row kernel's scratch, carved from work (64-byte aligned). */
typedef struct {
    T *qs;     /* FA_ROWS_MAX x E: the query rows */
    T *s;      /* FA_ROWS_MAX x FA_RB: logits, then weights */
    T *o;      /* FA_ROWS_MAX x Ev: unnormalised output */
    T *ob;     /* FA_ROWS_MAX x Ev: a block's part of it (rows_accumulate) */
    T *m, *l;  /* running maximum and sum */
    T *shift;  /* each row's term of the key mean (k_mean) */
    T *gather; /* a key row or a value tile copied contiguous */
    int8_t *q8;     /* FA_ROWS_MAX x FA_Q8_LD: the int8 query (int8_dots) */
    float *qd;      /* FA_ROWS_MAX x FA_Q8_GROUPS: its scales */
    int32_t *qb;    /* FA_ROWS_MAX x FA_Q8_GROUPS: its offsets against Q4 */
    int8_t *codes;  /* FA_IGROUP x Ev: int8 value rows whose features are strided, copied */
    int dot;        /* the integer products' instance (fa_idot_cpu) */
} FA_NAME(rows_scratch);

static FA_NAME(rows_scratch) FA_NAME(rows_carve)(const fa_attn_args *a, T *work)
{
    FA_NAME(rows_scratch) w;
    w.qs = work;
    w.s = w.qs + FA_ROWS_MAX * FA_EP(a);
    w.o = w.s + FA_ROWS_MAX * FA_RB;
    w.ob = w.o + FA_ROWS_MAX * FA_EVP(a);
    w.m = w.ob + FA_ROWS_MAX * FA_EVP(a);
    w.l = w.m + FA_ROWS_MAX;
    w.shift = w.l + FA_ROWS_MAX;
    w.gather = w.m + FA_ROWS_SCALARS;
    w.qd = (float *)(w.gather + FA_GATHER(a));
    w.qb = (int32_t *)(w.qd + FA_ROWS_MAX * FA_Q8_GROUPS(a));
    w.q8 = (int8_t *)(w.qb + FA_ROWS_MAX * FA_Q8_GROUPS(a));
    w.codes = w.q8 + FA_ROWS_MAX * FA_Q8_LD(a);
    w.dot = FA_NAME(int8_dots)(a) && !a->int8_base && fa_idot_cpu();
    return w;
}

/* Rows of a call over n positions: n of each of the query heads that
 * share the keys (fa_attn_args' heads), row t being head t / n at position
 * i0 + t % n. */
static FA_ALWAYS_INLINE fa_idx FA_NAME(heads)(const fa_attn_args *a)
{
    return a->heads > 1 ? a->heads : 1;
}

/* The arguments of query head g of a call: its ALiBi slope and sink, one
 * head (no per-head arrays left, so that the second pass of attn_rows,
 * which takes the arguments of head 0 of this one, keeps head g's). */
static fa_attn_args FA_NAME(head_args)(const fa_attn_args *a, fa_idx g)
{
    fa_attn_args h = *a;
    h.heads = 1;
    if (a->head_slopes != NULL) h.alibi_slope = a->head_slopes[g];
    if (a->head_sinks != NULL) h.sink = a->head_sinks[g];
    h.head_slopes = h.head_sinks = NULL;
    return h;
}

/* Where the row kernel loads keys and values (through fa_kern_load.h).
 * Rows whose features are strided are first copied contiguous, so that
 * every layout of the same numbers goes through the same vector arithmetic:
 * results are bitwise the same whatever the strides. */

#if FA_IS_F32
/* ot += the weights w (the rows' scales folded in) of a group of n keys
 * times their int8 value rows, n4 of them (n rounded up to 4, rows past n
 * repeating row 0): the weights rounded to 0..127 against the group's
 * largest / 127, summed with the codes as integers (fa_igemv_i8), added as
 * scale * sum.  Exactly as rows_values does (each row times its weight, in
 * order) when a weight is not finite or below 0, or the scale is below
 * FLT_MIN, whose rounding would let a code pass 127. */
static void FA_NAME(values_i8_group)(const fa_attn_args *a, int dot, fa_idx n, fa_idx n4,
                                     const T *w, const int8_t *const *rows, T *ot)
{
    const float wmax = FA_NAME(max)(n, w), all = FA_NAME(sum)(n, w), u = wmax / 127.0f;
    int neg = 0;
    for (fa_idx r = 0; r < n; ++r) neg |= w[r] < 0;
    if (all - all != 0 || neg || (wmax > 0 && u < FLT_MIN)) { /* subnormal: codes past 127 */
        for (fa_idx r = 0; r < n; ++r)
            for (fa_idx c = 0; w[r] != 0 && c < a->Ev; ++c) ot[c] += w[r] * (float)rows[r][c];
        return;
    }
    if (wmax == 0) return;
    uint8_t w8[FA_IGROUP];
    for (fa_idx r = 0; r < n; ++r) w8[r] = (uint8_t)rintf(w[r] / u);
    for (fa_idx r = n; r < n4; ++r) w8[r] = 0;
    fa_igemv_i8(dot, n4, w8, rows, a->Ev, u, ot);
}

/* The end of the group of value rows from g (the next multiple of
 * FA_IGROUP), cut at end. */
static FA_ALWAYS_INLINE fa_idx FA_NAME(group_end)(fa_idx g, fa_idx end)
{
    const fa_idx g1 = (g / FA_IGROUP + 1) * FA_IGROUP;
    return g1 < end ? g1 : end;
}

/* rows[0..n) = the value rows of positions g.., a run of rows in one block
 * at a time */
static void FA_NAME(value_rows)(const fa_attn_args *a, const void *v, fa_idx g, fa_idx n,
                                const char **rows)
{
    for (fa_idx r = 0, m; r < n; r += m) {
        m = fa_kv_run(a, g + r, n - r);
        const char *first = (const char *)v + fa_value_at(a, g + r);
        for (fa_idx i = 0; i < m; ++i) rows[r + i] = first + i * a->v_ss;
    }
}

/* rows_values in the int8 mode against int8 values, their rows' scales
 * folded into s by rows_values: the keys s0..s0+nk-1 in groups of
 * FA_IGROUP positions fixed by position (j / FA_IGROUP, cut at the block's
 * ends), whatever the block placement, each group's weights rounded to one
 * scale and summed in integers (values_i8_group), the groups added in
 * order.  Q4 values keep the exact sum: integers measured no faster there
 * (threads-and-speed.md, "The int8 mode"). */
static void FA_NAME(rows_values_int8)(const fa_attn_args *a, const FA_NAME(rows_scratch) *w,
                                      const void *v, fa_idx nq, fa_idx s0, fa_idx nk, T *s, T *o)
{
    /* no prefetch: the rows are read in order (fa_igemv_i8), which the
     * hardware prefetcher follows; asking for the next group's 64 lines at
     * once stalled the loads behind them (threads-and-speed.md) */
    const char *rows[FA_IGROUP];
    const fa_idx end = s0 + nk;
    for (fa_idx g0 = s0, g1; g0 < end; g0 = g1) {
        g1 = FA_NAME(group_end)(g0, end);
        const fa_idx n = g1 - g0, n4 = (n + 3) / 4 * 4;
        FA_NAME(value_rows)(a, v, g0, n, rows);
        for (fa_idx r = 0; a->v_es != 1 && r < n; ++r) { /* copied contiguous */
            int8_t *row = w->codes + r * a->Ev;
            for (fa_idx c = 0; c < a->Ev; ++c) row[c] = (int8_t)rows[r][c * a->v_es];
            rows[r] = (const char *)row;
        }
        for (fa_idx r = n; r < n4; ++r) rows[r] = rows[0];
        for (fa_idx t = 0; t < nq; ++t) {
            const T *p = s + t * FA_RB + (g0 - s0);
            T *ot = o + t * FA_EVP(a);
            FA_NAME(values_i8_group)(a, w->dot, n, n4, p, (const int8_t *const *)rows, ot);
        }
    }
}
#endif

/* o[t] += p[t] V[s0 .. s0+nk-1] for the nq rows (p[t] = s + t * FA_RB),
 * a run of rows in one block at a time (fa_kv_run): each output element
 * sums its keys in order whatever the placement; a scaled row's scale
 * (fa_store_scaled) is folded into its weights (s is changed then). */
static void FA_NAME(rows_values)(const fa_attn_args *a, const FA_NAME(rows_scratch) *w,
                                 const void *v, fa_idx nq, fa_idx s0, fa_idx nk, T *s, T *o)
{
    T *buf = w->gather;
    const fa_idx Ev = a->Ev;
    const fa_store st = a->kv_store;
    if (fa_store_scaled(st))
        for (fa_idx r0 = 0, n; r0 < nk; r0 += n) {
            n = fa_kv_run(a, s0 + r0, nk - r0);
            const float *sc = a->v_scale + fa_kv_row(a, s0 + r0, a->vsc_s, a->vsc_bs);
            for (fa_idx t = 0; t < nq; ++t)
                for (fa_idx r = 0; r < n; ++r) { /* a weight of 0 stays 0, whatever the scale */
                    T *x = s + t * FA_RB + r0 + r;
                    *x = *x == 0 ? 0 : *x * (T)sc[r * a->vsc_s];
                }
        }
#if FA_IS_F32
    if (FA_NAME(int8_dots)(a) && st == FA_STORE_I8) {
        FA_NAME(rows_values_int8)(a, w, v, nq, s0, nk, s, o);
        return;
    }
#endif
    if (a->v_es == 1) {
        const fa_idx vrb = FA_NAME(st_row_bytes)(st, Ev), eb = FA_NAME(st_bytes)(st);
        const fa_ahead_rows none = {NULL, 0, 0, 0};
        for (fa_idx r0 = 0, n; r0 < nk; r0 += n) {
            n = fa_kv_run(a, s0 + r0, nk - r0);
            const fa_idx j = s0 + r0 + n; /* the next run */
            if (a->block_table != NULL && !(a->prefetch & FA_PREFETCH_NONE) && vrb > 0 &&
                j < a->S && j % a->block_size == 0) {
                const fa_idx m = fa_kv_run(a, j, a->S - j);
                const fa_ahead_rows next[2] = {
                    {(const char *)v + fa_value_at(a, j) * eb, a->v_ss * eb, vrb,
                     m < FA_VALUE_AHEAD_ROWS ? m : FA_VALUE_AHEAD_ROWS},
                    none};
                for (fa_idx r = 0; r < next[0].count; ++r) FA_NAME(fetch_rows)(r, &none, next);
            }
            FA_NAME(gemv_t_st)(st, nq, n, Ev, s + r0, FA_RB,
                               FA_NAME(st_at)(st, v, fa_value_at(a, s0 + r0)), a->v_ss, o,
                               FA_EVP(a), (a->prefetch & FA_PREFETCH_NONE) != 0);
        }
        return;
    }
    /* the same products, a tile at a time: each output element still sums
     * its keys in order, with the same vector or scalar operation */
    for (fa_idx c0 = 0; c0 < Ev; c0 += FA_VT_COLS) {
        const fa_idx nc = Ev - c0 < FA_VT_COLS ? Ev - c0 : FA_VT_COLS;
        for (fa_idx r0 = 0; r0 < nk; r0 += FA_VT_ROWS) {
            const fa_idx nr = nk - r0 < FA_VT_ROWS ? nk - r0 : FA_VT_ROWS;
            for (fa_idx r = 0; r < nr; ++r)
                FA_NAME(load_row)(st, nc,
                                  FA_NAME(st_at)(st, v, fa_value_at(a, s0 + r0 + r) + c0 * a->v_es),
                                  a->v_es, buf + r * FA_VT_COLS);
            for (fa_idx t = 0; t < nq; ++t)
                FA_NAME(gemv_t)(nr, nc, s + t * FA_RB + r0, buf, FA_VT_COLS, o + t * FA_EVP(a) + c0);
        }
    }
}

/* scale * q_t . k_key (w.qs holds q_t) for a score that came out inf or
 * NaN: each product scaled before they are summed, in order (a product
 * itself beyond T's range with the query's element scaled first).  The
 * block kernel scales each half of a score before adding the two, so a
 * product beyond T's range that the scale brings back stays finite there;
 * here it then does for any E and any path's vector width.  When the scaled
 * products overflow both ways (inf - inf: a scale near T's largest), the
 * score is the scale times the dot product summed in order, as the score
 * would be without this repair: beyond T's range, it is +-inf.  The key's
 * elements are dequantised before the products and the sum runs in double,
 * so that neither a code times a huge query nor a partial sum overflows
 * where the score does not; the int8 mode takes its rounded query (the
 * mode's score). */
static T FA_NAME(rows_dot_scaled)(const fa_attn_args *a, const FA_NAME(rows_scratch) *w,
                                  const void *k, fa_idx t, fa_idx key)
{
    const T scale = (T)a->scale, *x = w->qs + t * FA_EP(a);
    const char *row = (const char *)FA_NAME(st_at)(a->kv_store, k, fa_key_at(a, key));
    const T ks = fa_store_scaled(a->kv_store) ? (T)fa_key_scale(a, key) : 1;
    double s = 0; /* a float's partial sums may pass its range where the score does not */
    T d = 0;
    for (fa_idx c = 0; c < a->E; ++c) {
        T xc = x[c];
#if FA_IS_F32
        if (FA_NAME(int8_dots)(a)) { /* the int8 mode's query: its codes times their scale */
            const fa_idx ng = FA_Q8_GROUPS(a), g = FA_Q8_LD(a) / ng;
            xc = (T)w->q8[t * FA_Q8_LD(a) + c] * w->qd[t * ng + c / g];
        }
#endif
        const T y = FA_NAME(st_get)(a->kv_store, row, c * a->k_es) * ks, p = xc * y;
        s += (double)(p - p == 0 ? scale * p : (scale * xc) * y);
        d += p;
    }
    return s == s ? (T)s : scale * d;
}

#if FA_IS_F32
/* dots (fa_kern_load.h) from integer products, for the int8 mode
 * (int8_dots): s[t * FA_RB + r] = the int8 query row t against key row r
 * of the nr rows from y, rb bytes apart (fa_idot.h), sixteen rows at a
 * time asked for ahead as dots asks, a run of rows at once (fetch_run); 64
 * at a time when none is asked for (in L1 for the next query row). */
static void FA_NAME(idots)(const fa_attn_args *a, const FA_NAME(rows_scratch) *w, fa_idx nq,
                           fa_idx nr, const void *y, fa_idx rb, T *s, const fa_ahead_rows *l1,
                           const fa_ahead_rows *l2)
{
    const fa_idx ng = FA_Q8_GROUPS(a), ld = FA_Q8_LD(a);
    const fa_idx step = l1->count > 0 || l2[0].count > 0 || l2[1].count > 0 ? 16 : 64;
    for (fa_idx r0 = 0; r0 < nr; r0 += step) {
        const fa_idx m = nr - r0 < step ? nr - r0 : step;
        const char *rows = (const char *)y + r0 * rb;
        FA_NAME(fetch_run)(r0, m, l1, l2);
        for (fa_idx t = 0; t < nq; ++t) {
            if (a->kv_store == FA_STORE_Q4)
                fa_idot_q4(w->dot, m, ng, w->q8 + t * ld, w->qd + t * ng, w->qb + t * ng,
                           (const uint8_t *)rows, rb, s + t * FA_RB + r0);
            else
                fa_idot_i8(w->dot, m, a->E, w->q8 + t * ld, w->qd[t], (const int8_t *)rows, rb,
                           s + t * FA_RB + r0);
        }
    }
}
#endif

/* s[t, r] = logit of row t (of n positions from i0, of every head) and key
 * s0 + r, for nk keys; w.qs holds the query rows.  What is asked for ahead
 * depends on a->prefetch, as fastattn/_tuning.py measured it pays:
 * - FA_PREFETCH_KEYS: the key rows FA_PREFETCH_BYTES on, into L1;
 * - FA_PREFETCH_VALUES, when v is not NULL: the value rows of these keys,
 *   into L2, as their sum follows.
 * Which pays depends on the CPU (see threads-and-speed.md, "What the
 * decoding kernel prefetches, measured per machine").  Paged keys are
 * asked into L2 across blocks whatever a->prefetch says. */
static void FA_NAME(rows_logits)(const fa_attn_args *a, const FA_NAME(rows_scratch) *w,
                                 const void *k, const void *v, const void *mask, fa_idx i0,
                                 fa_idx n, fa_idx s0, fa_idx nk)
{
    const fa_idx nq = FA_NAME(heads)(a) * n;
    T *s = w->s;
    const T scale = (T)a->scale;
    const fa_store st = a->kv_store;
    const fa_idx row_bytes = FA_NAME(st_row_bytes)(st, a->E); /* 0 when E = 0: nothing to fetch */
    const fa_idx far = (a->prefetch & FA_PREFETCH_FAR) ? FA_PREFETCH_FAR_BYTES : FA_PREFETCH_BYTES;
    const fa_idx ahead = row_bytes == 0 || !(a->prefetch & FA_PREFETCH_KEYS) ? 0
                         : row_bytes < far ? far / row_bytes
                                           : 1;
    const fa_idx eb = FA_NAME(st_bytes)(st);
    const fa_ahead_rows none = {NULL, 0, 0, 0}, nones[2] = {none, none};
    const fa_idx block_ahead = a->block_table == NULL || row_bytes == 0 ||
                               (a->prefetch & FA_PREFETCH_NONE) ? 0
                               : (FA_BLOCK_AHEAD_BYTES + row_bytes - 1) / row_bytes;
    const int long_blocks = block_ahead > 0 && a->block_size * row_bytes > 4 * FA_BLOCK_AHEAD_BYTES;
    if (a->k_es == 1) {
        /* in place, a run of rows in one block at a time, split again where
         * the rows `ahead` further on, asked for while these are read,
         * cross into another block */
        for (fa_idx r0 = 0, n; r0 < nk; r0 += n) {
            const fa_idx j = s0 + r0, ja = j + ahead, jb = j + block_ahead;
            n = fa_kv_run(a, j, nk - r0);
            fa_ahead_rows krows = none, l2[2] = {none, none};
            if (ahead > 0 && ja < a->S) {
                const fa_idx na = fa_kv_run(a, ja, a->S - ja);
                n = n < na ? n : na;
                krows = (fa_ahead_rows){(const char *)k + fa_key_at(a, ja) * eb, a->k_ss * eb,
                                        row_bytes, n};
            }
            /* in long blocks, only rows of a later block than j's: the
             * hardware prefetcher streams within them (see
             * threads-and-speed.md, "Paged decoding's look-ahead") */
            const fa_idx edge = long_blocks ? (j / a->block_size + 1) * a->block_size : 0;
            if (jb < edge) {
                n = n < edge - jb ? n : edge - jb; /* up to the rows whose jb crosses */
            } else if (block_ahead > 0 && jb < a->S) {
                const fa_idx nb = fa_kv_run(a, jb, a->S - jb);
                n = n < nb ? n : nb;
                l2[1] = (fa_ahead_rows){(const char *)k + fa_key_at(a, jb) * eb, a->k_ss * eb,
                                        row_bytes, n};
            }
            if (v != NULL && a->v_es == 1 && (a->prefetch & FA_PREFETCH_VALUES))
                l2[0] = (fa_ahead_rows){(const char *)v + fa_value_at(a, j) * eb, a->v_ss * eb,
                                        FA_NAME(st_row_bytes)(st, a->Ev), n};
            const void *rows = FA_NAME(st_at)(st, k, fa_key_at(a, j));
#if FA_IS_F32
            if (FA_NAME(int8_dots)(a)) {
                FA_NAME(idots)(a, w, nq, n, rows, a->k_ss * eb, s + r0, &krows, l2);
                continue;
            }
#endif
            FA_NAME(dots)(st, nq, n, a->E, w->qs, FA_EP(a), rows, a->k_ss, s + r0, FA_RB, &krows, l2,
                          (a->prefetch & FA_PREFETCH_NONE) != 0);
        }
    } else { /* each key row copied contiguous first (int8 codes as they are) */
        for (fa_idx r = 0; r < nk; ++r) {
            const char *row = (const char *)FA_NAME(st_at)(st, k, fa_key_at(a, s0 + r));
#if FA_IS_F32
            if (FA_NAME(int8_dots)(a)) { /* int8: Q4 rows are contiguous */
                int8_t *codes = (int8_t *)w->gather;
                for (fa_idx e = 0; e < a->E; ++e) codes[e] = (int8_t)row[e * a->k_es];
                FA_NAME(idots)(a, w, nq, 1, codes, 0, s + r, &none, nones);
                continue;
            }
#endif
            FA_NAME(load_row)(st, a->E, row, a->k_es, w->gather);
            FA_NAME(dots)(FA_STORE_NATIVE, nq, 1, a->E, w->qs, FA_EP(a), w->gather, 0, s + r,
                          FA_RB, &none, nones, 0);
        }
    }
    if (!fa_store_scaled(st)) /* along each row of s: a loop the compiler vectorises */
        for (fa_idx t = 0; t < nq; ++t)
            for (fa_idx r = 0; r < nk; ++r) s[t * FA_RB + r] = scale * s[t * FA_RB + r];
    for (fa_idx r0 = 0, n; fa_store_scaled(st) && r0 < nk; r0 += n) { /* times the row's scale */
        n = fa_kv_run(a, s0 + r0, nk - r0);
        const float *sc = a->k_scale + fa_kv_row(a, s0 + r0, a->ksc_s, a->ksc_bs);
        for (fa_idx t = 0; t < nq; ++t) /* along each row of s, as the values' scales */
            for (fa_idx r = 0; r < n; ++r)
                s[t * FA_RB + r0 + r] = scale * ((T)sc[r * a->ksc_s] * s[t * FA_RB + r0 + r]);
    }
    for (fa_idx t = 0; t < nq; ++t) { /* a score inf or NaN: perhaps a sum beyond T's range */
        T *z = s + t * FA_RB, sum = FA_NAME(sum)(nk, z);
        if (sum - sum == 0) continue;
        /* not where the stage hides the key whatever its score (a padded
         * cache's NaN there cost decoding two thirds more) */
        const fa_attn_args h = FA_NAME(head_args)(a, t / n);
        for (fa_idx r = 0; r < nk; ++r)
            if (z[r] - z[r] != 0 && FA_NAME(modify)(&h, mask, i0 + t % n, s0 + r, 0) != -(T)INFINITY)
                z[r] = FA_NAME(rows_dot_scaled)(a, w, k, t, s0 + r);
    }
    for (fa_idx t = 0; a->k_mean != NULL && t < nq; ++t)
        for (fa_idx r = 0; r < nk; ++r) s[t * FA_RB + r] += w->shift[t];
    /* the rest of the per-score stage; nothing to do past the soft-cap
     * without a mask or ALiBi in a block the bounds leave whole */
    const int whole = !FA_NAME(masked)(a, s0, nk) && a->alibi_slope == 0 &&
                      a->head_slopes == NULL && s0 >= FA_NAME(key_lo)(a, i0 + n - 1) &&
                      s0 + nk - 1 <= FA_NAME(key_hi)(a, i0);
    for (fa_idx t = 0; t < nq; ++t) {
        T *z = s + t * FA_RB;
        if (a->softcap > 0) FA_NAME(softcap)(a, nk, z);
        if (whole) continue;
        const fa_attn_args h = FA_NAME(head_args)(a, t / n);
        for (fa_idx r = 0; r < nk; ++r) z[r] = FA_NAME(modify)(&h, mask, i0 + t % n, s0 + r, z[r]);
    }
}

/* A block of nk logits of the nq rows (w.s) into their running state:
 * the maximum m rises, the sum l and the output so far are rescaled, and
 * the logits become weights, exp(z - m), divided by l in the second pass
 * of a normalized sum (rows_accumulate). */
static void FA_NAME(rows_softmax)(const fa_attn_args *a, const FA_NAME(rows_scratch) *w,
                                  fa_idx nq, fa_idx nk, int values, int normalized)
{
    const T ninf = -(T)INFINITY;
    T *m = w->m, *l = w->l;
    for (fa_idx t = 0; t < nq; ++t) {
        T *st = w->s + t * FA_RB;
        const T bm = FA_NAME(max)(nk, st);
        if (bm > m[t] && m[t] != ninf) { /* the sink's term and the keys' so far */
            T alpha = m[t] - bm;
            FA_NAME(vexp)(1, &alpha, &alpha);
            l[t] *= alpha;
            for (fa_idx c = 0; c < a->Ev; ++c) w->o[t * FA_EVP(a) + c] *= alpha;
        }
        m[t] = bm > m[t] ? bm : m[t];
        const T ms = m[t] == ninf ? 0 : m[t];
        for (fa_idx r = 0; r < nk; ++r) st[r] -= ms;
        FA_NAME(vexp)(nk, st, st);
        if (!(values && normalized))
            l[t] += FA_NAME(sum)(nk, st);
        else if (l[t] != 0)
            for (fa_idx r = 0; r < nk; ++r) st[r] /= l[t];
    }
}

/* A block's weighted value rows are summed apart (w.ob), then added: one
 * running sum over all the keys stops growing once it is 2^24 times each
 * term (float32: 2^29 keys of weight 1 and value 1 gave 0.5); a block's
 * part is at most FA_RB terms. */
static void FA_NAME(rows_values_start)(const fa_attn_args *a, const FA_NAME(rows_scratch) *w,
                                       fa_idx nq)
{
    for (fa_idx i = 0; i < nq * FA_EVP(a); ++i) w->ob[i] = 0;
}

static void FA_NAME(rows_values_end)(const fa_attn_args *a, const FA_NAME(rows_scratch) *w,
                                     fa_idx nq)
{
    for (fa_idx t = 0; t < nq; ++t)
        for (fa_idx c = 0; c < a->Ev; ++c) w->o[t * FA_EVP(a) + c] += w->ob[t * FA_EVP(a) + c];
}

/* Keys s_lo..s_hi-1 into the running state of the rows of n positions:
 * maximum m, sum l and unnormalised output o (a row of Ev each); w.qs holds
 * the query rows.
 * Online, two things can make a row non-finite that is not: a key whose
 * weight is 0 only against a later maximum has a nonzero weight when its
 * value row is added (a non-finite value there gives inf, or NaN once
 * rescaled by an underflowed factor, 0 x inf), and values near T's largest
 * overflow the unnormalised sum (two values of 3e38).  normalized: the
 * maximum and the sum over all the keys are found first (the logits
 * computed twice), so that m never rises while the values are added
 * and each weight is divided by l before its value row is: such a key's
 * weight is then 0 and its value row skipped, and o, a weighted mean, stays
 * within the values' range (attn_rows). */
static void FA_NAME(rows_accumulate)(const fa_attn_args *a, const FA_NAME(rows_scratch) *w,
                                     const void *k, const void *v, const void *mask, fa_idx i0,
                                     fa_idx n, fa_idx s_lo, fa_idx s_hi, int normalized)
{
    const fa_idx nq = FA_NAME(heads)(a) * n;
    /* normalized: a first pass finds m and l alone, the second adds the values */
    for (int values = !normalized; values < 2; ++values)
        for (fa_idx s0 = s_lo; s0 < s_hi; s0 += FA_RB) {
            const fa_idx nk = s_hi - s0 < FA_RB ? s_hi - s0 : FA_RB;
            FA_NAME(rows_logits)(a, w, k, values ? v : NULL, mask, i0, n, s0, nk);
            FA_NAME(rows_softmax)(a, w, nq, nk, values, normalized);
            if (!values) continue;
            FA_NAME(rows_values_start)(a, w, nq);
            FA_NAME(rows_values)(a, w, v, nq, s0, nk, w->s, w->ob);
            FA_NAME(rows_values_end)(a, w, nq);
        }
}

/* w.qs = the query rows of n positions from i0 (of every head); the state
 * starts empty, or with each head's sink alone. */
static void FA_NAME(rows_start)(const fa_attn_args *a, const void *q, fa_idx i0, fa_idx n,
                                const FA_NAME(rows_scratch) *w, int with_sink)
{
    for (fa_idx t = 0; t < FA_NAME(heads)(a) * n; ++t) {
        const fa_idx at = (i0 + t % n) * a->q_ls + t / n * a->q_hs;
        FA_NAME(load_row)(a->q_store, a->E, FA_NAME(st_at)(a->q_store, q, at), a->q_es,
                          w->qs + t * FA_EP(a));
#if FA_IS_F32
        if (FA_NAME(int8_dots)(a)) {
            const fa_idx ng = FA_Q8_GROUPS(a);
            fa_quantise_i8(a->E, w->qs + t * FA_EP(a), FA_Q8_LD(a) / ng, ng, w->q8 + t * FA_Q8_LD(a),
                           w->qd + t * ng, w->qb + t * ng);
        }
#endif
        if (a->k_mean != NULL) w->shift[t] = FA_NAME(mean_shift)(a, w->qs + t * FA_EP(a), 1, 1);
        for (fa_idx c = 0; c < a->Ev; ++c) w->o[t * FA_EVP(a) + c] = 0;
        w->m[t] = -(T)INFINITY;
        w->l[t] = 0;
        if (with_sink) FA_NAME(sink_start)(a, t / n, w->m + t, w->l + t);
    }
}

/* The weights of rows i0..i0+nq-1 (one head), exp(z - m) / l, from their
 * final maximum m and sum l (in ws): 0 where hidden or where no key was
 * visible, NaN all along a NaN row; ws.qs holds the query rows. */
static void FA_NAME(rows_weights)(const fa_attn_args *a, const FA_NAME(rows_scratch) *ws,
                                  const void *k, const void *mask, fa_idx i0, fa_idx nq, T *w)
{
    const T ninf = -(T)INFINITY;
    const T *m = ws->m, *l = ws->l;
    T *s = ws->s;
    fa_idx s_begin, s_end;
    FA_NAME(key_range)(a, i0, i0 + nq, &s_begin, &s_end);
    for (fa_idx s0 = 0; s0 < a->S; s0 += FA_RB) {
        const fa_idx nk = a->S - s0 < FA_RB ? a->S - s0 : FA_RB;
        const int seen = s0 < s_end && s0 + nk > s_begin;
        if (seen) {
            FA_NAME(rows_logits)(a, ws, k, NULL, mask, i0, nq, s0, nk);
            for (fa_idx t = 0; t < nq; ++t) {
                const T ms = m[t] == ninf ? 0 : m[t];
                for (fa_idx r = 0; r < nk; ++r) s[t * FA_RB + r] -= ms;
                FA_NAME(vexp)(nk, s + t * FA_RB, s + t * FA_RB);
            }
        }
        for (fa_idx t = 0; t < nq; ++t) {
            T *wrow = w + (i0 + t) * a->w_ls + s0 * a->w_ss;
            const int zero = !seen || l[t] == 0;
            const T fill = l[t] == l[t] ? 0 : l[t]; /* a NaN row is NaN in skipped blocks too */
            for (fa_idx r = 0; r < nk; ++r) wrow[r * a->w_ss] = zero ? fill : s[t * FA_RB + r] / l[t];
        }
    }
}

/* Where row t of a call over n positions from i0 (fa_NAME(heads)) writes
 * its output, and its lse. */
static FA_ALWAYS_INLINE fa_idx FA_NAME(out_at)(const fa_attn_args *a, fa_idx i0, fa_idx n, fa_idx t)
{
    return (i0 + t % n) * a->o_ls + t / n * a->o_hs;
}

static FA_ALWAYS_INLINE fa_idx FA_NAME(lse_at)(const fa_attn_args *a, fa_idx i0, fa_idx n, fa_idx t)
{
    return (i0 + t % n) * a->lse_s + t / n * a->lse_hs;
}

/* Output rows i0..i1-1 of every head (at most FA_ROWS_MAX rows), their
 * log-sum-exp when lse is not NULL and their weights when w is not NULL
 * (one head); normalized as in rows_accumulate.  Returns the rows (bit t:
 * row t) that came out not finite though no visible logit was NaN. */
static unsigned FA_NAME(rows_out)(const fa_attn_args *a, const void *q, const void *k,
                                  const void *v, const void *mask, T *out, T *w, T *lse,
                                  fa_idx i0, fa_idx i1, T *work, int normalized)
{
    const fa_idx n = i1 - i0, nq = FA_NAME(heads)(a) * n, Ev = a->Ev;
    const FA_NAME(rows_scratch) ws = FA_NAME(rows_carve)(a, work);
    fa_idx s_begin, s_end;
    FA_NAME(key_range)(a, i0, i1, &s_begin, &s_end);

    FA_NAME(rows_start)(a, q, i0, n, &ws, 1);
    FA_NAME(rows_accumulate)(a, &ws, k, v, mask, i0, n, s_begin, s_end, normalized);
    /* l is 0 exactly when no key was visible (the maximum alone gives 1);
     * NaN when a visible logit was */
    unsigned again = 0;
    for (fa_idx t = 0; t < nq; ++t) {
        T *orow = out + FA_NAME(out_at)(a, i0, n, t), bad = 0;
        const T d = normalized ? 1 : ws.l[t];
        for (fa_idx c = 0; c < Ev; ++c) {
            const T y = ws.l[t] == 0 ? 0 : ws.o[t * FA_EVP(a) + c] / d;
            orow[c * a->o_es] = y;
            bad += y - y;
        }
        if (bad != 0 && ws.l[t] == ws.l[t]) again |= 1u << t;
        if (lse) lse[FA_NAME(lse_at)(a, i0, n, t)] = FA_NAME(lse)(ws.m[t], ws.l[t]);
    }

    if (w != NULL) FA_NAME(rows_weights)(a, &ws, k, mask, i0, nq, w);
    return again;
}

/* Head g of a call alone: its arguments, and its q, out and lse. */
typedef struct {
    fa_attn_args a;
    const void *q;
    T *out, *lse;
} FA_NAME(one_head);

static FA_NAME(one_head) FA_NAME(one_head_of)(const fa_attn_args *a, fa_idx g, const void *q,
                                              T *out, T *lse)
{
    FA_NAME(one_head) h;
    h.a = FA_NAME(head_args)(a, g);
    h.q = FA_NAME(st_at)(a->q_store, q, g * a->q_hs);
    h.out = out + g * a->o_hs;
    h.lse = lse != NULL ? lse + g * a->lse_hs : NULL;
    return h;
}

/* Rows i0..i1-1 of every head (at most FA_ROWS_MAX rows): online, then,
 * for a row that came out non-finite though no visible logit was NaN, that
 * row alone again, normalized (rows_accumulate): the same NaN or inf when
 * they are genuine (an inf logit, a non-finite value at a key of nonzero
 * weight), else the finite row. */
static void FA_NAME(attn_rows)(const fa_attn_args *a, const void *q, const void *k, const void *v,
                               const void *mask, T *out, T *w, T *lse, fa_idx i0, fa_idx i1,
                               T *work)
{
    const fa_idx n = i1 - i0;
    const unsigned again = FA_NAME(rows_out)(a, q, k, v, mask, out, w, lse, i0, i1, work, 0);
    for (fa_idx t = 0; again && t < FA_NAME(heads)(a) * n; ++t)
        if (again >> t & 1u) {
            const FA_NAME(one_head) h = FA_NAME(one_head_of)(a, t / n, q, out, lse);
            const fa_idx i = i0 + t % n;
            FA_NAME(rows_out)(&h.a, h.q, k, v, mask, h.out, NULL, h.lse, i, i + 1, work, 1);
        }
}

/* The state of nsplit pieces of nq rows (attn_part): row t of piece p at
 * states + (p * nq + t) * (FA_STATE_HEAD + Ev), its maximum and sum, then
 * its unnormalised output. */
#define FA_STATE_ROW(states, p, nq, t, Ev) ((states) + ((p) * (nq) + (t)) * (FA_STATE_HEAD + (Ev)))

/* The state of the nq rows in w (attn_part's) written to state. */
static void FA_NAME(rows_state)(const fa_attn_args *a, const FA_NAME(rows_scratch) *w, fa_idx nq,
                                T *state)
{
    for (fa_idx t = 0; t < nq; ++t) {
        T *st = FA_STATE_ROW(state, 0, nq, t, a->Ev);
        st[0] = w->m[t];
        st[1] = w->l[t];
        for (fa_idx c = 0; c < a->Ev; ++c) st[FA_STATE_HEAD + c] = w->o[t * FA_EVP(a) + c];
    }
}

/* The state (m, l of rows_accumulate, o[0..Ev)) of rows i0..i1-1 of every
 * head over keys s_lo..s_hi-1 only; fa_attn_merge combines such pieces. */
void FA_NAME(attn_part)(const fa_attn_args *a, const void *q, const void *k, const void *v,
                        const void *mask, fa_idx i0, fa_idx i1, fa_idx s_lo, fa_idx s_hi,
                        T *state, void *work)
{
    const fa_idx n = i1 - i0, nq = FA_NAME(heads)(a) * n;
    const FA_NAME(rows_scratch) ws = FA_NAME(rows_carve)(a, (T *)FA_ALIGNED(work));
    fa_idx begin, end;
    FA_NAME(key_range)(a, i0, i1, &begin, &end);
    FA_NAME(rows_start)(a, q, i0, n, &ws, s_lo == 0);
    FA_NAME(rows_accumulate)(a, &ws, k, v, mask, i0, n, s_lo > begin ? s_lo : begin,
                             s_hi < end ? s_hi : end, 0);
    FA_NAME(rows_state)(a, &ws, nq, state);
}

/* Whether calls a and b read the same key and value rows for keys lo..hi-1:
 * the same arrays, strides and blocks. */
static int FA_NAME(same_rows)(const fa_attn_args *a, const void *ka, const void *va,
                              const fa_attn_args *b, const void *kb, const void *vb, fa_idx lo,
                              fa_idx hi)
{
    if (ka != kb || va != vb || a->k_ss != b->k_ss || a->v_ss != b->v_ss ||
        a->k_es != b->k_es || a->v_es != b->v_es || (a->block_table == NULL) != (b->block_table == NULL))
        return 0;
    if (a->block_table == NULL || hi <= lo) return 1;
    if (a->block_size != b->block_size || a->k_bs != b->k_bs || a->v_bs != b->v_bs) return 0;
    for (fa_idx j = lo / a->block_size; j <= (hi - 1) / a->block_size; ++j)
        if (a->block_table[j] != b->block_table[j]) return 0;
    return 1;
}

/* Keys per run of attn_parts: its calls read a run's key rows, then the
 * next run's, so that each stays in L1 while all of them read it; a
 * multiple of FA_IGROUP, as the int8 mode's groups of value rows are cut
 * at a run's ends. */
#define FA_PARTS_RUN 32

/* The end of the run from key r0: the next multiple of FA_PARTS_RUN, or end. */
static FA_ALWAYS_INLINE fa_idx FA_NAME(run_end)(fa_idx r0, fa_idx end)
{
    const fa_idx r1 = (r0 / FA_PARTS_RUN + 1) * FA_PARTS_RUN;
    return r1 < end ? r1 : end;
}

/* attn_part of n calls, each of rows 0..L-1 over the same keys s_lo..s_hi-1,
 * run by run of FA_PARTS_RUN keys (at multiples of it) for all of them:
 * where their key and value rows are the same memory (a paged cache's
 * shared blocks), each run is read from memory once.  Each call's state is
 * the bits of its attn_part alone: its logits, softmax steps and value sums
 * are those of the same key blocks, only interleaved with the others'.  A
 * call whose bounds leave it other keys than call 0 runs alone.  Call c's
 * scratch at work + c * stride (bytes, 64-byte aligned there). */
void FA_NAME(attn_parts)(fa_idx n, const fa_attn_args *a, const void *const *q,
                         const void *const *k, const void *const *v, const void *const *mask,
                         fa_idx s_lo, fa_idx s_hi, T *const *state, void *work, size_t stride)
{
    FA_NAME(rows_scratch) ws[FA_ATTN_PARTS_MAX];
    fa_attn_args own[FA_ATTN_PARTS_MAX];
    fa_idx nq[FA_ATTN_PARTS_MAX], with[FA_ATTN_PARTS_MAX], nw = 0, lo = 0, hi = 0;
    for (fa_idx c = 0; c < n; ++c) {
        void *wc = (char *)work + (size_t)c * stride;
        fa_idx b, e;
        FA_NAME(key_range)(&a[c], 0, a[c].L, &b, &e);
        b = s_lo > b ? s_lo : b;
        e = s_hi < e ? s_hi : e;
        if (c == 0) lo = b, hi = e;
        if (b != lo || e != hi) {
            FA_NAME(attn_part)(&a[c], q[c], k[c], v[c], mask[c], 0, a[c].L, s_lo, s_hi, state[c], wc);
            continue;
        }
        own[nw] = a[c];
        if (nw > 0 && FA_NAME(same_rows)(&a[c], k[c], v[c], &a[with[0]], k[with[0]], v[with[0]], lo, hi))
            own[nw].prefetch = FA_PREFETCH_NONE; /* the first call asks for them */
        ws[nw] = FA_NAME(rows_carve)(&a[c], (T *)FA_ALIGNED(wc));
        nq[nw] = FA_NAME(heads)(&a[c]) * a[c].L;
        FA_NAME(rows_start)(&a[c], q[c], 0, a[c].L, &ws[nw], s_lo == 0);
        with[nw++] = c;
    }
    for (fa_idx s0 = lo; s0 < hi; s0 += FA_RB) {
        const fa_idx nk = hi - s0 < FA_RB ? hi - s0 : FA_RB;
        for (fa_idx r0 = s0, r1; r0 < s0 + nk; r0 = r1) {
            r1 = FA_NAME(run_end)(r0, s0 + nk);
            for (fa_idx u = 0; u < nw; ++u) {
                const fa_idx c = with[u];
                FA_NAME(rows_scratch) run = ws[u];
                run.s += r0 - s0;
                FA_NAME(rows_logits)(&own[u], &run, k[c], v[c], mask[c], 0, a[c].L, r0, r1 - r0);
            }
        }
        for (fa_idx u = 0; u < nw; ++u) {
            FA_NAME(rows_softmax)(&own[u], &ws[u], nq[u], nk, 1, 0);
            FA_NAME(rows_values_start)(&own[u], &ws[u], nq[u]);
        }
        for (fa_idx r0 = s0, r1; r0 < s0 + nk; r0 = r1) {
            r1 = FA_NAME(run_end)(r0, s0 + nk);
            for (fa_idx u = 0; u < nw; ++u)
                FA_NAME(rows_values)(&own[u], &ws[u], v[with[u]], nq[u], r0, r1 - r0,
                                     ws[u].s + (r0 - s0), ws[u].ob);
        }
        for (fa_idx u = 0; u < nw; ++u) FA_NAME(rows_values_end)(&own[u], &ws[u], nq[u]);
    }
    for (fa_idx u = 0; u < nw; ++u) FA_NAME(rows_state)(&own[u], &ws[u], nq[u], state[with[u]]);
}

/* out rows i0..i1-1 from nsplit pieces of state: every piece is rescaled to
 * the largest maximum M by exp(m - M), as in the log-sum-exp of a softmax
 * split in parts.  A piece whose factor is 0 holds only zero weights and is
 * skipped, like any key of weight 0.  When ml is not NULL, ml[2t] and
 * ml[2t + 1] receive the whole row's maximum and sum. */
void FA_NAME(attn_merge)(const fa_attn_args *a, fa_idx nsplit, const T *states, T *out, T *ml,
                         fa_idx i0, fa_idx i1)
{
    const fa_idx n = i1 - i0, nq = FA_NAME(heads)(a) * n, Ev = a->Ev;
    const T ninf = -(T)INFINITY;
    for (fa_idx t = 0; t < nq; ++t) {
        T mx = ninf, l = 0, nan = 0;
        for (fa_idx p = 0; p < nsplit; ++p) {
            const T *st = FA_STATE_ROW(states, p, nq, t, Ev);
            mx = st[0] > mx ? st[0] : mx;
            nan += st[1] - st[1]; /* a NaN logit (the maximum ignores NaN) left l NaN */
        }
        T *orow = out + FA_NAME(out_at)(a, i0, n, t);
        for (fa_idx c = 0; c < Ev; ++c) orow[c * a->o_es] = nan;
        for (fa_idx p = 0; nan == 0 && mx != ninf && p < nsplit; ++p) {
            const T *st = FA_STATE_ROW(states, p, nq, t, Ev);
            T f = st[0] == mx ? 0 : st[0] - mx; /* 0, not inf - inf, at a sink of +inf */
            FA_NAME(vexp)(1, &f, &f);
            if (f == 0) continue;
            l += f * st[1];
            for (fa_idx c = 0; c < Ev; ++c) orow[c * a->o_es] += f * st[FA_STATE_HEAD + c];
        }
        for (fa_idx c = 0; nan == 0 && c < Ev; ++c) orow[c * a->o_es] = l == 0 ? 0 : orow[c * a->o_es] / l;
        if (ml) {
            ml[2 * t] = mx;
            ml[2 * t + 1] = nan == 0 ? l : nan;
        }
    }
}

/* Rows i0..i1-1 of out (of every head), merged from nsplit pieces of
 * state, that are not finite though no visible logit was NaN
 * (rows_accumulate says how): computed again by attn_rows, consecutive ones
 * of a head together (lse too when not NULL). */
void FA_NAME(attn_repair)(const fa_attn_args *a, const void *q, const void *k, const void *v,
                          const void *mask, fa_idx nsplit, const T *states, T *out, T *lse,
                          fa_idx i0, fa_idx i1, void *work)
{
    const fa_idx n = i1 - i0, nq = FA_NAME(heads)(a) * n;
    for (fa_idx g = 0; g < FA_NAME(heads)(a); ++g) {
        const FA_NAME(one_head) h = FA_NAME(one_head_of)(a, g, q, out, lse);
        fa_idx run = 0; /* rows i - run .. i - 1 wait for attn_rows */
        for (fa_idx i = i0; i <= i1; ++i) {
            int again = 0;
            if (i < i1) {
                const T *orow = h.out + i * a->o_ls;
                T bad = 0, nan = 0;
                for (fa_idx c = 0; c < a->Ev; ++c) bad += orow[c * a->o_es] - orow[c * a->o_es];
                for (fa_idx p = 0; bad != 0 && p < nsplit; ++p) /* NaN where l is */
                    nan += FA_STATE_ROW(states, p, nq, g * n + i - i0, a->Ev)[1] * 0;
                again = bad != 0 && nan == 0;
            }
            if (again && run < FA_ROWS_MAX) {
                ++run;
                continue;
            }
            if (run > 0)
                FA_NAME(attn_rows)(&h.a, h.q, k, v, mask, h.out, NULL, h.lse, i - run, i,
                                   (T *)FA_ALIGNED(work));
            run = again;
        }
    }
}

/* The weights of rows i0..i1-1 from their maximum and sum in ml (as left by
 * attn_merge): the weights of a call whose keys were split. */
void FA_NAME(attn_weights)(const fa_attn_args *a, const void *q, const void *k, const void *mask,
                           const T *ml, T *w, fa_idx i0, fa_idx i1, void *work)
{
    const fa_idx nq = i1 - i0;
    const FA_NAME(rows_scratch) ws = FA_NAME(rows_carve)(a, (T *)FA_ALIGNED(work));
    FA_NAME(rows_start)(a, q, i0, nq, &ws, 0);
    for (fa_idx t = 0; t < nq; ++t) {
        ws.m[t] = ml[2 * t];
        ws.l[t] = ml[2 * t + 1];
    }
    FA_NAME(rows_weights)(a, &ws, k, mask, i0, nq, w);
}
