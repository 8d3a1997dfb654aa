/* Fused attention for one (batch, head) and one block of query rows, for
 * element type T.
 *
 * The online softmax of FlashAttention (Milakov & Gimelshein 2018, "Online
 * normalizer calculation for softmax"; Dao et al. 2022): key blocks stream
 * past a block of queries, a running maximum m and sum l are kept per query,
 * and the output accumulator is rescaled only when m grows.  Scores are
 * kept transposed (keys x queries) so that every softmax reduction runs
 * down columns, one vector of queries at a time, with no horizontal
 * operation.  Both products use the register micro-kernel reading K and V
 * in place through their strides:
 *   S^T[key, q]  = scale * sum_e K[key, e] * Qp[e, q]   (Qp: the query block)
 *   O^T[c, q]   += sum_key V[key, c] * P^T[key, q]
 * Blocks of at most FA_ROWS_MAX rows go to the row kernel (fa_kern_rows.h),
 * which also recomputes, with its zero-weight guard, any row whose output
 * came out non-finite.
 *
 * Needs T, FA_NR, FA_NAME and the primitives ukr, vexp, exp_block, pack_t,
 * normalize, and the row kernel's. */

#include "fa_kern_rows.h"

#define FA_QB (FA_QB_BYTES / (fa_idx)sizeof(T)) /* query rows per block: 64 floats, 32 doubles */
#define FA_KB FA_KEY_BLOCK /* keys per block */
/* A score of E >= 2 * FA_EC features is summed in two halves: float32
 * scores then carry less rounding error for one more load, add and store
 * per tile (threads-and-speed.md gives both, by "summed in two halves").
 * Each half is scaled before the two are added: a product q.k beyond
 * float's range then still gives a finite score when the scale brings it
 * back. */
#define FA_EC 32
#include "fa_kern_iblock.h"
/* m is raised only when a block's maximum passes it by more than ln 256:
 * the weights exp(z - m) of a block are then at most 256 (the same after
 * the division by l, whose terms share the m), and O^T is rescaled only in
 * the rare blocks that raise m, not in most blocks of a sweep.
 * FlashAttention-4's conditional rescaling, as described in Modal's "We
 * reverse-engineered Flash Attention 4" (2025). */
#define FA_SLACK ((T)5.545177444479562) /* ln 256 */

/* Rows of the register tile at row r of n: FA_MR, but a remainder of
 * fewer than FA_MR / 2 rows is shared with the tile before it (128 keys on
 * AVX2: 20 tiles of 6, then 4 and 4 instead of 6 and 2).  A tile of 2 rows
 * has 4 accumulators, too few to hide the FMA's latency. */
static fa_idx FA_NAME(tile_rows)(fa_idx n, fa_idx r)
{
    const fa_idx left = n - r;
    return left <= FA_MR ? left : left < FA_MR + FA_MR / 2 ? (left + 1) / 2 : FA_MR;
}

/* Lines asked into L2 (L1 keeps this call's keys) during the products, a
 * few per register tile (fetch_some; a burst waits for fill buffers), so
 * that neither this call's end nor the next call's start waits for memory:
 * this call's output rows, the next call's queries, and its first key
 * block when it starts a new head (fa_attn_next; the hardware prefetcher
 * cannot guess where a new head starts).  The caller gives no hint when the
 * operands fit in L2: the lines asked for are there already.  A cursor per
 * stream walks its lines, the four streams at the same pace (one after
 * the other, the key block came too late), without a division per tile
 * (threads-and-speed.md, "The block kernel's smaller choices"). */
typedef struct {
    const char *base[4];           /* the output's rows, the next q, k and v */
    const fa_attn_args *paged[4];  /* a paged call's keys or values: its placement */
    fa_idx first[4], rows[4];      /* the stream's rows: first..first+rows-1 */
    fa_idx ls[4], bs[4], len[4];   /* bytes between rows, between blocks, per row */
    const char *row[4];            /* the cursors: row r's address, byte in the row */
    fa_idx r[4], off[4];
    fa_idx quota[4];               /* lines per product */
} FA_NAME(ahead);

/* Where row r of stream s starts: ls bytes after the row before, or, for
 * paged keys and values, where their block table puts it (fa_kv_row). */
static const char *FA_NAME(ahead_row)(const FA_NAME(ahead) *h, int s, fa_idx r)
{
    const fa_idx j = h->first[s] + r;
    return h->base[s] +
           (h->paged[s] != NULL ? fa_kv_row(h->paged[s], j, h->ls[s], h->bs[s]) : j * h->ls[s]);
}

static void FA_NAME(ahead_stream)(FA_NAME(ahead) *h, int s, const void *base, fa_idx rows,
                                  fa_idx ls, fa_idx es, fa_idx n)
{
    const fa_idx size = (fa_idx)sizeof(T);
    h->base[s] = (const char *)base;
    h->rows[s] = es == 1 && n > 0 ? rows : 0; /* rows of contiguous elements only */
    h->ls[s] = ls * size;
    h->len[s] = n * size;
    h->row[s] = h->base[s];
}

/* Keys or values s0..s0+n-1 of this call (x with row, feature and block
 * strides ss, es and bs, `features` per row), in their storage and
 * placement. */
static void FA_NAME(ahead_kv)(FA_NAME(ahead) *h, int s, const fa_attn_args *a, const void *x,
                              fa_idx s0, fa_idx n, fa_idx ss, fa_idx es, fa_idx bs,
                              fa_idx features)
{
    const fa_idx eb = FA_NAME(st_bytes)(a->kv_store);
    h->base[s] = (const char *)x;
    h->paged[s] = a->block_table != NULL ? a : NULL;
    h->first[s] = s0;
    h->rows[s] = es == 1 && features > 0 ? n : 0; /* rows of contiguous elements only */
    h->ls[s] = ss * eb;
    h->bs[s] = bs * eb;
    h->len[s] = FA_NAME(st_row_bytes)(a->kv_store, features);
    h->row[s] = h->rows[s] > 0 ? FA_NAME(ahead_row)(h, s, 0) : NULL;
}

/* Each stream's lines spread over `parts` products: its quota per product. */
static void FA_NAME(ahead_spread)(FA_NAME(ahead) *h, fa_idx parts)
{
    for (int s = 0; s < 4; ++s) {
        const fa_idx lines = h->rows[s] * ((h->len[s] + 63) / 64);
        h->quota[s] = parts > 0 ? (lines + parts - 1) / parts : 0;
    }
}

/* The lines of this call's output rows i0..i1-1 and of the next call,
 * spread over `parts` products; none without a next call. */
static FA_NAME(ahead) FA_NAME(ahead_of)(const fa_attn_args *a, const fa_attn_next *next,
                                        const void *k, T *out, fa_idx i0, fa_idx i1, fa_idx parts)
{
    FA_NAME(ahead) h;
    memset(&h, 0, sizeof h);
    if (next == NULL) return h;
    FA_NAME(ahead_stream)(&h, 0, out + i0 * a->o_ls, i1 - i0, a->o_ls, a->o_es, a->Ev);
    if (next->i1 > next->i0 && a->q_store == FA_STORE_NATIVE)
        FA_NAME(ahead_stream)(&h, 1, (const T *)next->q + next->i0 * a->q_ls, next->i1 - next->i0,
                              a->q_ls, a->q_es, a->E);
    if (next->i1 > next->i0 && a->kv_store == FA_STORE_NATIVE && a->block_table == NULL &&
        next->k != NULL && next->v != NULL && next->k != k) {
        fa_idx b, e;
        FA_NAME(key_range)(a, next->i0, next->i1, &b, &e);
        if (e > b) {
            const fa_idx n = e - b < FA_KB ? e - b : FA_KB;
            FA_NAME(ahead_stream)(&h, 2, (const T *)next->k + b * a->k_ss, n, a->k_ss, a->k_es, a->E);
            FA_NAME(ahead_stream)(&h, 3, (const T *)next->v + b * a->v_ss, n, a->v_ss, a->v_es, a->Ev);
        }
    }
    FA_NAME(ahead_spread)(&h, parts);
    return h;
}

/* The lines of the key block the sweep reads next, keys s0..s0+n-1, into
 * L2 during this block's products (fa_attn_args.prefetch's
 * FA_PREFETCH_BLOCKS, which the caller sets when one item's keys and values
 * exceed L2): the hardware prefetcher alone lets keys and values that miss
 * L2 cost a quarter of the time, and cannot foresee a paged cache's blocks.
 * Not for dense keys stored otherwise than as T: the loader converts each
 * block in one sequential sweep, which the hardware prefetcher follows
 * (threads-and-speed.md, "The block kernel's smaller choices"). */
static FA_NAME(ahead) FA_NAME(ahead_of_block)(const fa_attn_args *a, const void *k, const void *v,
                                              fa_idx s0, fa_idx n, fa_idx parts)
{
    FA_NAME(ahead) h;
    memset(&h, 0, sizeof h);
    if (!(a->prefetch & FA_PREFETCH_BLOCKS) || n <= 0 ||
        (a->kv_store != FA_STORE_NATIVE && a->block_table == NULL))
        return h;
    FA_NAME(ahead_kv)(&h, 2, a, k, s0, n, a->k_ss, a->k_es, a->k_bs, a->E);
    FA_NAME(ahead_kv)(&h, 3, a, v, s0, n, a->v_ss, a->v_es, a->v_bs, a->Ev);
    FA_NAME(ahead_spread)(&h, parts);
    return h;
}

/* The next quota of lines of each stream. */
static void FA_NAME(fetch_some)(FA_NAME(ahead) *h)
{
    for (int s = 0; s < 4; ++s)
        for (fa_idx n = h->quota[s]; n > 0 && h->r[s] < h->rows[s]; --n) {
            FA_PREFETCH_L2(h->row[s] + h->off[s]);
            h->off[s] += 64;
            if (h->off[s] >= h->len[s]) {
                h->off[s] = 0;
                if (++h->r[s] < h->rows[s]) h->row[s] = FA_NAME(ahead_row)(h, s, h->r[s]);
            }
        }
}

/* Key and value tiles converted from their storage or gathered from
 * their blocks (fa_kern_load.h): KB rows of E and of Ev, also where a
 * block of queries is converted or a mask may hide values that are not
 * finite (hidden_values); none when everything is stored as T, densely,
 * without a mask. */
static size_t FA_NAME(panels_work)(const fa_attn_args *a)
{
    if (a->kv_store == FA_STORE_NATIVE && a->q_store == FA_STORE_NATIVE &&
        a->block_table == NULL && a->mask_kind == FA_MASK_NONE)
        return 0;
    return sizeof(T) * (size_t)FA_KB * (size_t)(FA_EP(a) + FA_EVP(a));
}

size_t FA_NAME(attn_work)(const fa_attn_args *a)
{
    /* Qp E x QB, S^T and the mask tile KB x QB each, O^T Ev x QB, seven vectors
     * of QB, the converted tiles, and the row kernel's scratch for repairs;
     * QB columns and panel rows are whole multiples of 64 bytes, so every
     * row of these starts aligned */
    return sizeof(T) * (size_t)FA_QB * (size_t)(a->E + 2 * FA_KB + a->Ev + 7) +
           FA_NAME(panels_work)(a) + FA_NAME(rows_work)(a) + FA_NAME(iblock_work)(a) + FA_ALIGN;
}

/* Keys lo..hi-1 of the block s0..s0+nk-1: those the bounds let one of the
 * FA_NR columns p..p+FA_NR-1 see, column j being the query at position
 * i0 + j / G (G query heads folded, fa_attn_args' heads). */
static void FA_NAME(tile_keys)(const fa_attn_args *a, fa_idx i0, fa_idx G, fa_idx p, fa_idx s0,
                               fa_idx nk, fa_idx *lo, fa_idx *hi)
{
    const fa_idx first = FA_NAME(key_lo)(a, i0 + p / G) - s0;
    const fa_idx last = FA_NAME(key_hi)(a, i0 + (p + FA_NR - 1) / G) - s0 + 1;
    *lo = first < 0 ? 0 : first > nk ? nk : first;
    *hi = last < *lo ? *lo : last > nk ? nk : last;
}

/* Whether the bounds hide some key of the block s0..s0+nk-1 from some of
 * the rows i0..i0+nq-1: its first key from the last row, or its last key
 * from the first (blocks wholly outside are never visited). */
static int FA_NAME(block_edge)(const fa_attn_args *a, fa_idx i0, fa_idx nq, fa_idx s0, fa_idx nk)
{
    return s0 < FA_NAME(key_lo)(a, i0 + nq - 1) || s0 + nk - 1 > FA_NAME(key_hi)(a, i0);
}

/* st[r, j] = logit of column j and key s0 + r: the score through the
 * per-score stage (fa_kern_scores.h), a tile at a time; bm[j] = the maximum
 * of column j (NaN ignored).  Column j is query head j % G at position
 * i0 + j / G (G = 1 but for folded heads, which take no mask); columns
 * G nq..ld-1 are padding.  Returns 0, with
 * st untouched, when the mask hides every key of the block from every query
 * row (the block is then skipped without reading K).  The scale is qp's
 * (the packed queries) times alpha; shift[j]: query j's term of the key
 * mean (k_mean); capped (not NULL, with a softcap): the scores after step 2
 * too, whose tanh the backward pass differentiates (fa_kern_grad.h); i8
 * (not NULL in the int8 mode, int8_block): the products as integers from
 * its query codes (int8_logits) instead. */
static int FA_NAME(block_logits)(const fa_attn_args *a, const T *qp, T alpha, const T *shift,
                                 const void *k, const void *mask, fa_idx i0, fa_idx nq, fa_idx G,
                                 fa_idx ld, fa_idx s0, fa_idx nk, T *st, T *bias, T *bm, T *panel,
                                 FA_NAME(ahead) *ahead, FA_NAME(ahead) *block, T *capped,
                                 const FA_NAME(iscratch) *i8)
{
    const T ninf = -(T)INFINITY;
    const int masked = FA_NAME(masked)(a, s0, nk);
    const int per_key = masked && a->m_ls == 0;
    const int tile = masked && a->m_ls != 0;
    const int edge = FA_NAME(block_edge)(a, i0, nq, s0, nk);
    /* keys r0..nk-1 of the block are the mask's columns c0..: those before
     * m_s0 are not masked (bias 0) */
    const fa_idx r0 = a->m_s0 > s0 ? a->m_s0 - s0 : 0, c0 = s0 + r0 - a->m_s0;

    if (tile) { /* the mask of the block, transposed like the query block (each row's
                 * for the G heads of its columns: one mask for every head) */
        if (a->mask_kind == FA_MASK_BOOL) { /* as 0 / -inf rows in st, free until the scores */
            for (fa_idx j = 0; j < nq; ++j) {
                const unsigned char *row = (const unsigned char *)mask + (i0 + j) * a->m_ls + c0 * a->m_ss;
                for (fa_idx r = r0; r < nk; ++r) st[j * nk + r] = row[(r - r0) * a->m_ss] ? 0 : ninf;
            }
            for (fa_idx g = 0; g < G; ++g)
                FA_NAME(pack_t)(nq, nk - r0, st + r0, nk, 1, 1, bias + r0 * ld + g, ld, G);
        } else {
            for (fa_idx g = 0; g < G; ++g)
                FA_NAME(pack_t)(nq, nk - r0, (const T *)mask + i0 * a->m_ls + c0 * a->m_ss,
                                a->m_ls, a->m_ss, 1, bias + r0 * ld + g, ld, G);
        }
        int any = 0;
        for (fa_idx r = 0; r < nk; ++r) {
            for (fa_idx j = 0; j < nq * G; ++j) {
                if (r < r0) bias[r * ld + j] = 0;
                any |= bias[r * ld + j] != ninf;
            }
            for (fa_idx j = nq * G; j < ld; ++j) bias[r * ld + j] = 0;
        }
        if (!any) return 0;
    } else if (per_key) {
        int any = 0;
        for (fa_idx r = 0; r < nk; ++r) {
            const fa_idx off = (r - r0 + c0) * a->m_ss;
            bias[r] = r < r0 ? 0
                      : a->mask_kind == FA_MASK_BOOL ? (((const unsigned char *)mask)[off] ? 0 : ninf)
                                                     : ((const T *)mask)[off];
            any |= bias[r] != ninf;
        }
        if (!any) return 0;
    }

    for (fa_idx j = 0; j < ld; ++j) bm[j] = ninf;
    const int alibi = a->alibi_slope != 0 || a->head_slopes != NULL;
    /* plain: the products are the logits, their maximum taken as they are
     * written (the int8 mode's with the key mean's term added there) */
    const int plain = !per_key && !tile && !edge && a->softcap == 0 && !alibi &&
                      (a->k_mean == NULL || i8 != NULL);
    const fa_idx h = a->E >= 2 * FA_EC ? a->E / 2 : 0; /* features of the first half */
#if FA_IS_F32
    if (i8 != NULL) FA_NAME(int8_logits)(a, i8, k, s0, nk, ld, shift, st, plain ? bm : NULL);
#endif
    const FA_NAME(tile) kt = i8 != NULL ? (FA_NAME(tile)){NULL, 0, 0}
                                        : FA_NAME(key_tile)(a, k, s0, nk, panel);
    for (fa_idx r = 0, mr; i8 == NULL && r < nk; r += mr) {
        mr = FA_NAME(tile_rows)(nk, r);
        const T *kr = kt.p + r * kt.ss;
        for (fa_idx p = 0; p < ld; p += FA_NR) {
            T *c = st + r * ld + p;
            fa_idx lo, hi; /* the keys of the block these NR queries may see */
            if (edge && (FA_NAME(tile_keys)(a, i0, G, p, s0, nk, &lo, &hi), r >= hi || r + mr <= lo)) {
                for (fa_idx t = 0; t < mr; ++t) /* hidden: left to the stage's -inf */
                    for (fa_idx j = 0; j < FA_NR; ++j) c[t * ld + j] = ninf;
                continue;
            }
            if (ahead) { /* with block; both NULL when the weights are computed again */
                FA_NAME(fetch_some)(ahead);
                FA_NAME(fetch_some)(block);
            }
            if (h > 0)
                FA_NAME(ukr)((int)mr, h, kr, kt.ss, kt.es, qp + p, ld, c, ld, alpha, 0, NULL);
            FA_NAME(ukr)((int)mr, a->E - h, kr + h * kt.es, kt.ss, kt.es, qp + h * ld + p, ld, c,
                         ld, alpha, h > 0, plain ? bm + p : NULL);
        }
    }
    if (plain) return 1;

    for (fa_idx r = 0; a->k_mean != NULL && i8 == NULL && r < nk; ++r)
        for (fa_idx j = 0; j < ld; ++j) st[r * ld + j] += shift[j];
    if (a->softcap > 0) {
        /* the cap would turn a score beyond T's range finite and wrong:
         * NaN sends its row to the row kernel, which computes it again
         * (rows_dot_scaled) */
        for (fa_idx t = 0; t < nk * ld; ++t) st[t] = st[t] - st[t] == 0 ? st[t] : (T)NAN;
        FA_NAME(softcap)(a, nk * ld, st);
        if (capped != NULL) memcpy(capped, st, sizeof(T) * (size_t)(nk * ld));
    }
    for (fa_idx r = 0; r < nk; ++r) {
        T *z = st + r * ld;
        const fa_idx key = s0 + r;
        if (per_key) {
            const T b = bias[r];
            for (fa_idx j = 0; j < ld; ++j) z[j] = b == ninf ? ninf : z[j] + b;
        } else if (tile) {
            const T *b = bias + r * ld;
            /* -inf hides the key whatever the score, even a NaN one */
            for (fa_idx j = 0; j < ld; ++j) z[j] = b[j] == ninf ? ninf : z[j] + b[j];
        }
        if (alibi)
            for (fa_idx j = 0; j < ld; ++j) {
                const T slope = a->head_slopes != NULL ? (T)a->head_slopes[j % G] : (T)a->alibi_slope;
                z[j] = z[j] + FA_NAME(alibi)(slope, a->causal_offset, i0 + j / G, key);
            }
        if (edge) { /* only the positions lo..hi-1, columns G lo..G hi-1, see this key */
            fa_idx lo, hi;
            FA_NAME(key_rows)(a, key, i0, (ld + G - 1) / G, &lo, &hi);
            for (fa_idx j = 0; j < lo * G && j < ld; ++j) z[j] = ninf;
            for (fa_idx j = hi * G; j < ld; ++j) z[j] = ninf;
        }
    }
    /* the maximum down each column, eight rows at a time held in registers
     * (a row at a time, every store to bm waits for the one before) */
    fa_idx r = 0;
    for (; r + 8 <= nk; r += 8)
        for (fa_idx j = 0; j < ld; ++j) {
            T mx = bm[j];
            for (int u = 0; u < 8; ++u) {
                const T z = st[(r + u) * ld + j];
                mx = z > mx ? z : mx;
            }
            bm[j] = mx;
        }
    for (; r < nk; ++r)
        for (fa_idx j = 0; j < ld; ++j) bm[j] = st[r * ld + j] > bm[j] ? st[r * ld + j] : bm[j];
    return 1;
}

/* The tile t of nk rows of n elements in panel (rows lp apart), copied
 * there unless it is there already: before rows of it are zeroed. */
static FA_NAME(tile) FA_NAME(tile_in)(FA_NAME(tile) t, fa_idx nk, fa_idx n, T *panel, fa_idx lp)
{
    if (t.p == panel) return t;
    for (fa_idx r = 0; r < nk; ++r)
        for (fa_idx c = 0; c < n; ++c) panel[r * lp + c] = t.p[r * t.ss + c * t.es];
    t.p = panel;
    t.ss = lp;
    t.es = 1;
    return t;
}

/* The value tile vt of keys s0..s0+nk-1 with the rows of the keys that the
 * mask hides from every query of the block (bias as block_logits leaves
 * it) read as zeros where they are not finite: their weights are 0, but 0 x
 * inf or NaN in the products gives NaN (attn_block's second run).  In place
 * when no row is zeroed, else copied into panel.  A zeroed row adds +0 where
 * its finite values would have added +-0: the same bits but for the sign of
 * an output that is exactly zero.  A row is tested by its sum, not finite
 * also when finite values overflow it: such a row is zeroed too. */
static FA_NAME(tile) FA_NAME(hidden_values)(const fa_attn_args *a, FA_NAME(tile) vt,
                                            const T *bias, fa_idx nq, fa_idx ld, fa_idx nk,
                                            T *panel)
{
    const T ninf = -(T)INFINITY;
    const fa_idx lp = FA_EVP(a);
    for (fa_idx r = 0; r < nk; ++r) {
        const T *b = a->m_ls == 0 ? bias + r : bias + r * ld; /* a mask per key, or a tile */
        if (b[0] != ninf) continue;
        int hidden = 1;
        for (fa_idx j = 1; a->m_ls != 0 && j < nq; ++j) hidden &= b[j] == ninf;
        if (!hidden) continue;
        const T *x = vt.p + r * vt.ss;
        T sum = 0;
        if (vt.es == 1)
            sum = FA_NAME(sum)(a->Ev, x);
        else
            for (fa_idx c = 0; c < a->Ev; ++c) sum += x[c * vt.es] * 0;
        if (sum - sum == 0) continue;
        vt = FA_NAME(tile_in)(vt, nk, a->Ev, panel, lp);
        for (fa_idx c = 0; c < a->Ev; ++c) panel[r * lp + c] = 0;
    }
    return vt;
}

/* attn; zero_hidden: the value rows of keys the mask hides from the whole
 * block read as zeros where they are not finite (hidden_values). */
static void FA_NAME(attn_block)(const fa_attn_args *a, const void *q, const void *k,
                                const void *v, const void *mask, T *out, T *w, T *lse,
                                fa_idx i0, fa_idx i1, const fa_attn_next *next, void *work,
                                int zero_hidden)
{
    /* columns: G query heads of each row, folded (fa_attn_args' heads) */
    const fa_idx G = a->heads > 1 ? a->heads : 1, nq = i1 - i0, nc = G * nq;
    /* the int8 mode's register tiles take whole 16 columns (fa_itile) */
    const fa_idx lq = FA_NAME(int8_block)(a) && FA_NR < 16 ? 16 : FA_NR;
    const fa_idx ld = (nc + lq - 1) / lq * lq;
    const fa_idx E = a->E, Ev = a->Ev;
    const T ninf = -(T)INFINITY;
    T *qp = (T *)FA_ALIGNED(work); /* E x ld: query block, transposed, zero padded */
    T *st = qp + E * ld;        /* FA_KB x ld: logits, then weights, of a key block */
    T *bias = st + FA_KB * ld;  /* FA_KB x ld: the mask of a key block */
    T *ot = bias + FA_KB * ld;  /* Ev x ld: unnormalised output, transposed */
    T *m = ot + Ev * ld;        /* running maximum (NaN ignored) */
    T *l = m + ld;              /* running sum */
    T *ms = l + ld;             /* m, with -inf replaced by 0 for exp(z - ms) */
    T *alpha = ms + ld;         /* log of the rescale factor of a block */
    T *bl = alpha + ld;         /* block sum */
    T *bm = bl + ld;            /* block maximum */
    T *shift = bm + ld;         /* each query's term of the key mean (k_mean) */
    T *panel = shift + ld;      /* FA_KB x EP, then FA_KB x EvP: converted tiles */
    T *vpanel = panel + FA_KB * FA_EP(a);
    T *rows_work = (T *)((char *)panel + FA_NAME(panels_work)(a)); /* the row kernel's scratch */
    /* the int8 mode's scratch (int8_block), else NULL */
    FA_NAME(iscratch) i8s;
    const FA_NAME(iscratch) *i8 = NULL;
    if (FA_NAME(int8_block)(a)) {
        i8s = FA_NAME(iblock_carve)(a, (char *)rows_work + FA_NAME(rows_work)(a));
        i8 = &i8s;
    }

    if (nq <= 0) return;
    if (nc <= FA_ROWS_MAX) {
        FA_NAME(attn_rows)(a, q, k, v, mask, out, w, lse, i0, i1, qp);
        return;
    }
    fa_idx s_begin, s_end;
    FA_NAME(key_range)(a, i0, i1, &s_begin, &s_end);
    if (i8 != NULL && s_end > s_begin) s_begin = FA_NAME(int8_begin)(s_begin);
    /* A scale that is a power of two from 2^-60 to 1 (E = 64: 1/8)
     * multiplies the queries as they are packed and spares every score
     * tile a multiply: exact, so the same scores, for queries above 2^-66
     * (a scale above 1 could overflow them).  Any other scale multiplies
     * the scores: one rounding fewer than on the queries. */
    int e2;
    const T qscale = frexp((double)(T)a->scale, &e2) == 0.5 && e2 > -60 && e2 <= 1 ? (T)a->scale : 1;
    const T sscale = (T)a->scale / qscale; /* the scores' part */
    if (i8 != NULL) { /* the query's codes instead (and the key mean's terms) */
#if FA_IS_F32
        FA_NAME(int8_queries)(a, i8, q, i0, G, nc, ld, shift);
#endif
    } else if (a->q_store == FA_STORE_NATIVE) {
        for (fa_idx g = 0; g < G; ++g)
            FA_NAME(pack_t)(nq, E, (const T *)q + g * a->q_hs + i0 * a->q_ls, a->q_ls, a->q_es,
                            qscale, qp + g, ld, G);
    } else { /* converted row by row (FA_QB <= FA_KB rows fit the panel), then packed */
        for (fa_idx j = 0; j < nc; ++j)
            FA_NAME(load_row)(a->q_store, E,
                              FA_NAME(st_at)(a->q_store, q, j % G * a->q_hs + (i0 + j / G) * a->q_ls),
                              a->q_es, panel + j * FA_EP(a));
        FA_NAME(pack_t)(nc, E, panel, FA_EP(a), 1, qscale, qp, ld, 1);
    }
    for (fa_idx e = 0; i8 == NULL && e < E; ++e) /* padding columns */
        for (fa_idx j = nc; j < ld; ++j) qp[e * ld + j] = 0;
    for (fa_idx j = 0, n; i8 == NULL && j < ld; j += n) { /* eight columns at a time */
        n = ld - j < 8 ? ld - j : 8;
        if (a->k_mean == NULL)
            for (fa_idx t = 0; t < n; ++t) shift[j + t] = 0;
        else
            FA_NAME(mean_shifts)(a, n, qp + j, 1, ld, qscale, shift + j);
    }
    for (fa_idx j = 0; j < ld; ++j) {
        FA_NAME(sink_start)(a, j % G, m + j, l + j);
        ms[j] = m[j] == ninf ? 0 : m[j];
    }
    /* O^T holds nothing until the first block visited writes it, tile by
     * tile (a tile none of whose keys its queries see is zeroed): no pass
     * that zeroes it first */
    int fresh = 1;
    if (i8 != NULL) { /* its sums add to O^T from the first block on */
        for (fa_idx t = 0; t < Ev * ld; ++t) ot[t] = 0;
        fresh = 0;
    }

    /* the lines ahead are spread over the products (register tiles of the
     * scores and of the output) of the key blocks before the last, or of
     * the only one; the last block's take what skipped blocks left */
    fa_idx tiles = 0;
    for (fa_idx c = 0; c < Ev; c += FA_NAME(tile_rows)(Ev, c)) ++tiles;
    for (fa_idx r = 0; r < FA_KB; r += FA_NAME(tile_rows)(FA_KB, r)) ++tiles;
    const fa_idx fetch_blocks = s_end - s_begin <= FA_KB ? 1 : (s_end - s_begin - 1) / FA_KB;
    FA_NAME(ahead) ahead = FA_NAME(ahead_of)(a, next, k, out, i0, i1, fetch_blocks * tiles * (ld / FA_NR));
    for (fa_idx s0 = s_begin; s0 < s_end; s0 += FA_KB) {
        const fa_idx nk = s_end - s0 < FA_KB ? s_end - s0 : FA_KB;
        const fa_idx nn = s_end - s0 - nk < FA_KB ? s_end - s0 - nk : FA_KB; /* the next block's */
        FA_NAME(ahead) block = FA_NAME(ahead_of_block)(a, k, v, s0 + nk, nn, tiles * (ld / FA_NR));
        if (!FA_NAME(block_logits)(a, qp, sscale, shift, k, mask, i0, nq, G, ld, s0, nk, st,
                                   bias, bm, panel, &ahead, &block, NULL, i8))
            continue;

        int rescale = 0;
        for (fa_idx j = 0; j < ld; ++j) {
            const T mn = bm[j] > m[j] + FA_SLACK ? bm[j] : m[j];
            /* nothing to rescale while m is -inf: l and O^T are still 0 */
            alpha[j] = m[j] == ninf || mn == m[j] ? 0 : m[j] - mn;
            rescale |= alpha[j] != 0;
            m[j] = mn;
            ms[j] = mn == ninf ? 0 : mn;
        }
        if (rescale) {
            FA_NAME(vexp)(ld, alpha, alpha);
            for (fa_idx j = 0; j < ld; ++j) l[j] *= alpha[j];
            if (!fresh)
                for (fa_idx c = 0; c < Ev; ++c)
                    for (fa_idx j = 0; j < ld; ++j) ot[c * ld + j] *= alpha[j];
        }
        const int edge = FA_NAME(block_edge)(a, i0, nq, s0, nk);
        if (edge) { /* only the keys each NR queries may see, as below */
            for (fa_idx p = 0; p < ld; p += FA_NR) {
                fa_idx lo, hi;
                FA_NAME(tile_keys)(a, i0, G, p, s0, nk, &lo, &hi);
                FA_NAME(exp_block)(lo, hi, FA_NR, ld, st + p, ms + p, bl + p, 1);
            }
        } else {
            FA_NAME(exp_block)(0, nk, ld, ld, st, ms, bl, FA_NAME(masked)(a, s0, nk));
        }
        for (fa_idx j = 0; j < ld; ++j) l[j] += bl[j];

#if FA_IS_F32
        if (i8 != NULL) {
            if (edge) /* the keys a column does not see weigh 0 (exp_block left their logits) */
                for (fa_idx p = 0; p < ld; p += FA_NR) {
                    fa_idx lo, hi;
                    FA_NAME(tile_keys)(a, i0, G, p, s0, nk, &lo, &hi);
                    for (fa_idx r = 0; r < nk; ++r)
                        for (fa_idx j = 0; (r < lo || r >= hi) && j < FA_NR; ++j) st[r * ld + p + j] = 0;
                }
            FA_NAME(int8_values)(a, i8, v, s0, nk, ld, st, ot);
            continue;
        }
#endif
        FA_NAME(tile) vt = FA_NAME(value_tile)(a, v, s0, nk, vpanel);
        if (zero_hidden && FA_NAME(masked)(a, s0, nk))
            vt = FA_NAME(hidden_values)(a, vt, bias, nc, ld, nk, vpanel);
        for (fa_idx c = 0, mr; c < Ev; c += mr) {
            mr = FA_NAME(tile_rows)(Ev, c);
            for (fa_idx p = 0; p < ld; p += FA_NR) {
                FA_NAME(fetch_some)(&ahead);
                FA_NAME(fetch_some)(&block);
                /* only the keys these NR queries may see: the others have
                 * weight 0, whose products add nothing */
                fa_idx lo = 0, hi = nk;
                if (edge) FA_NAME(tile_keys)(a, i0, G, p, s0, nk, &lo, &hi);
                T *o = ot + c * ld + p;
                if (hi > lo)
                    FA_NAME(ukr)((int)mr, hi - lo, vt.p + lo * vt.ss + c * vt.es, vt.es, vt.ss,
                                 st + lo * ld + p, ld, o, ld, 1, !fresh, NULL);
                else if (fresh)
                    for (fa_idx t = 0; t < mr; ++t)
                        for (fa_idx j = 0; j < FA_NR; ++j) o[t * ld + j] = 0;
            }
        }
        fresh = 0;
    }
    if (fresh) /* no block visited */
        for (fa_idx t = 0; t < Ev * ld; ++t) ot[t] = 0;

    /* l is 0 exactly when no key was visible (the maximum alone gives 1);
     * NaN when a visible logit was NaN */
    FA_NAME(normalize)(Ev, ld, ot, l, bl);
    for (fa_idx g = 0; g < G; ++g)
        FA_NAME(pack_t)(Ev, nq, ot + g, ld, G, 1, out + g * a->o_hs + i0 * a->o_ls, a->o_ls,
                        a->o_es);
    /* Zero weights times a non-finite value of a hidden key give NaN in the
     * products above.  Padding positions hold whatever was there: with a
     * mask, the block runs once more with the rows of the keys it hides from
     * every query zeroed where not finite (far cheaper than computing every
     * such row again, and the finite call's bits).  Then any row
     * still not finite is computed again by the row kernel, which skips keys
     * of weight 0 (it gives the same NaN or inf when they are genuine), its
     * weights too (a row whose score overflowed has no m and l here to give
     * them). */
    int bad = 0;
    for (fa_idx j = 0; j < nc; ++j) bad |= bl[j] != 0;
    if (bad && !zero_hidden && a->mask_kind != FA_MASK_NONE) {
        FA_NAME(attn_block)(a, q, k, v, mask, out, w, lse, i0, i1, next, work, 1);
        return;
    }
    for (fa_idx j = 0; j < nc; ++j) { /* head j % G at position i0 + j / G */
        const fa_idx i = i0 + j / G;
        if (bl[j] != 0) {
            const FA_NAME(one_head) h = FA_NAME(one_head_of)(a, j % G, q, out, lse);
            FA_NAME(attn_rows)(&h.a, h.q, k, v, mask, h.out, w, h.lse, i, i + 1, rows_work);
        } else if (lse) {
            lse[j % G * a->lse_hs + i * a->lse_s] = FA_NAME(lse)(m[j], l[j]);
        }
    }

    if (w == NULL) return;
    /* The weights, from the final m and l: exp(z - m) / l. */
    for (fa_idx s0 = 0; s0 < a->S; s0 += FA_KB) {
        const fa_idx nk = a->S - s0 < FA_KB ? a->S - s0 : FA_KB;
        const int visible = s0 < s_end && s0 + nk > s_begin &&
                            FA_NAME(block_logits)(a, qp, sscale, shift, k, mask, i0, nq, 1, ld,
                                                  s0, nk, st, bias, bm, panel, NULL, NULL, NULL,
                                                  i8);
        if (visible) /* exp(z - m); their sums, unused, in alpha (bl flags the rows recomputed) */
            FA_NAME(exp_block)(0, nk, ld, ld, st, ms, alpha,
                               FA_NAME(block_edge)(a, i0, nq, s0, nk) || FA_NAME(masked)(a, s0, nk));
        for (fa_idx j = 0; j < nq; ++j) {
            if (bl[j] != 0) continue; /* recomputed, weights and all, above */
            T *wrow = w + (i0 + j) * a->w_ls + s0 * a->w_ss;
            const int zero = !visible || l[j] == 0;
            const T fill = l[j] == l[j] ? 0 : l[j]; /* a NaN row is NaN in skipped blocks too */
            for (fa_idx r = 0; r < nk; ++r) wrow[r * a->w_ss] = zero ? fill : st[r * ld + j] / l[j];
        }
    }
}

void FA_NAME(attn)(const fa_attn_args *a, const void *q, const void *k, const void *v,
                   const void *mask, T *out, T *w, T *lse, fa_idx i0, fa_idx i1,
                   const fa_attn_next *next, void *work)
{
    FA_NAME(attn_block)(a, q, k, v, mask, out, w, lse, i0, i1, next, work, 0);
}
