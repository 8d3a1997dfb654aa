/* The gradients of the attention for element type T: FlashAttention-2's
 * backward (Dao 2023, "FlashAttention-2", Algorithm 2), in two sweeps that
 * each write their gradients once, with no atomics and no sum whose order
 * depends on the threads: attn_grad sweeps the query blocks past each key
 * block of a chunk of keys (the query heads of a group one after the
 * other), writing the chunk's dK and dV and its part of dQ, which the
 * caller sums over the chunks in their order.  It recomputes the logits of
 * a key block x query block tile through the forward's per-score stage
 * (block_logits), then
 *   P  = exp(logit - lse)               the forward's weights
 *   dP = V dO^T,  dS = P (dP - D)       D = rowsum(dO o O), the caller's
 *   dS = dS (1 - (capped / softcap)^2)  through the softcap's tanh
 *   dV = P^T dO,  dK = scale dS^T Q,  dQ = scale dS K
 * with tiles transposed as in the forward (keys x queries).  A key of
 * weight 0 adds nothing, not even a non-finite key or value row.
 *
 * Needs T, FA_NR, FA_NAME and the block kernel's. */

/* Columns of the B operands of the products (rows of Q, dO, and the dK
 * and dV accumulators): whole micro-kernel panels. */
#define FA_GP(n) (((n) + FA_NR - 1) / FA_NR * FA_NR)
/* FA_GP for the widest path's panels: the scratch's size is the same on
 * every path (fa_attn_grad_work_bytes gives the portable path's) */
#define FA_NR_WIDEST (FA_NR_BYTES_MAX / (fa_idx)sizeof(T))
#define FA_GP_MAX(n) (((n) + FA_NR_WIDEST - 1) / FA_NR_WIDEST * FA_NR_WIDEST)

typedef struct {
    T *qp, *dop;             /* E x QB and Ev x QB: a query block and its dO, transposed */
    T *qr, *dor;             /* QB x GP(E) and QB x GP(Ev): the same as rows */
    T *ot;                   /* Ev x QB: the block's output, transposed */
    T *st, *bias, *cap, *dp; /* KB x QB: logits then P, the mask, capped scores, dP then dS */
    T *ms, *dl, *bm, *bl;    /* QB each: lse (0 for -inf), D, block maxima, P's column sums */
    T *rn;                   /* QB: the rows' factors of P (rnorm), or NULL */
    T *panel, *kpanel;       /* converted tiles (block_logits'), key rows zeroed */
    T *acc;                  /* dK and dV of a key block */
} FA_NAME(grad_scratch);

size_t FA_NAME(grad_work)(const fa_attn_args *a)
{
    const size_t qb = FA_QB, kb = FA_KB, E = (size_t)a->E, Ev = (size_t)a->Ev;
    return sizeof(T) * ((E + 2 * Ev) * qb +
                        (qb + kb) * (size_t)(FA_GP_MAX(a->E) + FA_GP_MAX(a->Ev)) +
                        4 * kb * qb + 5 * qb + kb * (size_t)(2 * FA_EP(a) + FA_EVP(a))) +
           FA_ALIGN;
}

static FA_NAME(grad_scratch) FA_NAME(grad_scratch_of)(const fa_attn_args *a, void *work)
{
    const fa_idx qb = FA_QB, kb = FA_KB;
    FA_NAME(grad_scratch) w;
    w.qp = (T *)FA_ALIGNED(work);
    w.dop = w.qp + a->E * qb;
    w.qr = w.dop + a->Ev * qb;
    w.dor = w.qr + qb * FA_GP(a->E);
    w.ot = w.dor + qb * FA_GP(a->Ev);
    w.st = w.ot + a->Ev * qb;
    w.bias = w.st + kb * qb;
    w.cap = w.bias + kb * qb;
    w.dp = w.cap + kb * qb;
    w.ms = w.dp + kb * qb;
    w.dl = w.ms + qb;
    w.bm = w.dl + qb;
    w.bl = w.bm + qb;
    w.rn = w.bl + qb;
    w.panel = w.rn + qb;
    w.kpanel = w.panel + kb * (FA_EP(a) + FA_EVP(a));
    w.acc = w.kpanel + kb * FA_EP(a);
    return w;
}

/* Rows i0..i0+nq-1 of one head: its queries and dO, both transposed and as
 * rows (zero padded), its lse, and D = rowsum(dO o O) of its output out. */
static void FA_NAME(grad_rows)(const fa_attn_args *a, const fa_grad_args *g, const T *q,
                               const T *dout, const T *out, const T *lse, const T *rnorm,
                               fa_idx i0, fa_idx nq, const FA_NAME(grad_scratch) *w)
{
    const fa_idx qb = FA_QB, eg = FA_GP(a->E), evg = FA_GP(a->Ev);
    FA_NAME(pack_t)(nq, a->E, q + i0 * a->q_ls, a->q_ls, a->q_es, 1, w->qp, qb, 1);
    FA_NAME(pack_t)(nq, a->Ev, dout + i0 * g->do_ls, g->do_ls, g->do_es, 1, w->dop, qb, 1);
    for (fa_idx e = 0; e < a->E; ++e)
        for (fa_idx j = nq; j < qb; ++j) w->qp[e * qb + j] = 0;
    for (fa_idx c = 0; c < a->Ev; ++c)
        for (fa_idx j = nq; j < qb; ++j) w->dop[c * qb + j] = 0;
    for (fa_idx j = 0; j < nq; ++j) { /* rows read in place: unit strides copy as vectors */
        const T *qj = q + (i0 + j) * a->q_ls, *dj = dout + (i0 + j) * g->do_ls;
        T *qrj = w->qr + j * eg, *drj = w->dor + j * evg;
        for (fa_idx e = 0; e < a->E; ++e) qrj[e] = qj[e * a->q_es];
        for (fa_idx e = a->E; e < eg; ++e) qrj[e] = 0;
        for (fa_idx c = 0; c < a->Ev; ++c) drj[c] = dj[c * g->do_es];
        for (fa_idx c = a->Ev; c < evg; ++c) drj[c] = 0;
    }
    /* D over the features in order, the rows side by side (in vectors) */
    FA_NAME(pack_t)(nq, a->Ev, out + i0 * a->o_ls, a->o_ls, a->o_es, 1, w->ot, qb, 1);
    for (fa_idx j = 0; j < qb; ++j) w->dl[j] = 0;
    for (fa_idx c = 0; c < a->Ev; ++c)
        for (fa_idx j = 0; j < nq; ++j) w->dl[j] += w->dop[c * qb + j] * w->ot[c * qb + j];
    for (fa_idx j = 0; j < qb; ++j) {
        const T l = j < nq ? lse[(i0 + j) * a->lse_s] : 0;
        w->ms[j] = l == -(T)INFINITY ? 0 : l; /* a row with nothing visible: P = exp(-inf) */
        w->rn[j] = rnorm != NULL && j < nq ? rnorm[(i0 + j) * a->lse_s] : 1;
    }
}

/* P (in st; times the rows' factors with rnorm) and dS (in dp) of the key
 * block s0..s0+nk-1 and the query block grad_rows loaded; 0 when the mask
 * hides the whole block. */
static int FA_NAME(grad_block)(const fa_attn_args *a, const void *k, const void *v,
                               const void *mask, fa_idx i0, fa_idx nq, fa_idx s0, fa_idx nk,
                               int rnorm, const FA_NAME(grad_scratch) *w)
{
    const fa_idx qb = FA_QB;
    const T c = (T)a->softcap;
    if (!FA_NAME(block_logits)(a, w->qp, (T)a->scale, NULL, k, mask, i0, nq, 1, qb, s0, nk,
                               w->st, w->bias, w->bm, w->panel, NULL, NULL,
                               c > 0 ? w->cap : NULL, NULL))
        return 0;
    FA_NAME(exp_block)(0, nk, qb, qb, w->st, w->ms, w->bl, 1);
    for (fa_idx r = 0; rnorm && r < nk; ++r)
        for (fa_idx j = 0; j < qb; ++j) w->st[r * qb + j] *= w->rn[j];
    const FA_NAME(tile) vt = FA_NAME(value_tile)(a, v, s0, nk, w->panel + FA_KB * FA_EP(a));
    /* panels of B outer: one stays in L1 while the tiles of A stream past
     * (their broadcasts read a third of its bytes) */
    for (fa_idx p = 0; p < qb; p += FA_NR)
        for (fa_idx r = 0, mr; r < nk; r += mr) {
            mr = FA_NAME(tile_rows)(nk, r);
            FA_NAME(ukr)((int)mr, a->Ev, vt.p + r * vt.ss, vt.ss, vt.es, w->dop + p, qb,
                         w->dp + r * qb + p, qb, 1, 0, NULL);
        }
    /* weight 0: no gradient, whatever dP (a non-finite value row) or the
     * capped score (hidden tiles hold NaN there); selects, not branches,
     * so that the loops run in vectors */
    for (fa_idx r = 0; r < nk; ++r) {
        const T *p = w->st + r * qb, *h = w->cap + r * qb;
        T *ds = w->dp + r * qb;
        for (fa_idx j = 0; j < qb; ++j) {
            const T d = p[j] * (ds[j] - w->dl[j]);
            ds[j] = p[j] == 0 ? 0 : d;
        }
        for (fa_idx j = 0; c > 0 && j < qb; ++j) {
            const T t = h[j] / c, d = ds[j] * (1 - t * t);
            ds[j] = p[j] == 0 ? 0 : d;
        }
    }
    return 1;
}

/* The key tile kt with the rows that no query of the block uses (dS 0
 * throughout) read as zeros where they are not finite: 0 x inf in dS K
 * would be NaN.  In place unless a row is zeroed, then copied into panel. */
static FA_NAME(tile) FA_NAME(unused_keys)(const fa_attn_args *a, FA_NAME(tile) kt, const T *ds,
                                          fa_idx nq, fa_idx nk, T *panel)
{
    const fa_idx lp = FA_EP(a);
    for (fa_idx r = 0; r < nk; ++r) {
        int used = 0;
        for (fa_idx j = 0; j < nq; ++j) used |= ds[r * FA_QB + j] != 0;
        T zero = 0;
        for (fa_idx e = 0; !used && e < a->E; ++e) zero += kt.p[r * kt.ss + e * kt.es] * 0;
        if (used || zero == 0) continue;
        kt = FA_NAME(tile_in)(kt, nk, a->E, panel, lp);
        for (fa_idx e = 0; e < a->E; ++e) panel[r * lp + e] = 0;
    }
    return kt;
}

void FA_NAME(attn_grad)(const fa_attn_args *a, const fa_grad_args *g, const void *q,
                        const void *k, const void *v, const void *mask, const T *dout,
                        const T *out, const T *lse, const T *rnorm, T *dk, T *dv, T *dqt,
                        T *psum, fa_idx s0, fa_idx s1, void *work)
{
    const FA_NAME(grad_scratch) w = FA_NAME(grad_scratch_of)(a, work);
    const fa_idx qb = FA_QB, E = a->E, eg = FA_GP(a->E), evg = FA_GP(a->Ev);
    const fa_idx heads = FA_NAME(heads)(a), nqb = (a->L + qb - 1) / qb;
    const fa_idx msize = a->mask_kind == FA_MASK_BOOL ? 1 : (fa_idx)sizeof(T);
    T *ak = w.acc, *av = w.acc + FA_KB * eg;
    for (fa_idx t = 0; t < heads * nqb * E * qb; ++t) dqt[t] = 0;
    for (fa_idx t = 0; t < heads * a->L; ++t) psum[t] = 0;
    for (fa_idx b0 = s0; b0 < s1; b0 += FA_KB) {
        const fa_idx nk = s1 - b0 < FA_KB ? s1 - b0 : FA_KB;
        for (fa_idx t = 0; t < nk * eg; ++t) ak[t] = 0;
        for (fa_idx t = 0; t < nk * evg; ++t) av[t] = 0;
        for (fa_idx h = 0; h < heads; ++h) { /* in order: the same sums on any thread */
            const fa_attn_args ah = FA_NAME(head_args)(a, h);
            const T *qh = (const T *)q + h * a->q_hs;
            const void *mh = mask == NULL ? NULL : (const char *)mask + h * g->m_hs * msize;
            fa_idx lo, hi, lo_last, hi_last; /* the rows that may see the first and the last key */
            FA_NAME(key_rows)(&ah, b0, 0, ah.L, &lo, &hi);
            FA_NAME(key_rows)(&ah, b0 + nk - 1, 0, ah.L, &lo_last, &hi_last);
            for (fa_idx i0 = lo / qb * qb; i0 < hi_last; i0 += qb) {
                const fa_idx nq = ah.L - i0 < qb ? ah.L - i0 : qb;
                FA_NAME(grad_rows)(&ah, g, qh, dout + h * g->do_hs, out + h * a->o_hs,
                                   lse + h * a->lse_hs,
                                   rnorm == NULL ? NULL : rnorm + h * a->lse_hs, i0, nq, &w);
                if (!FA_NAME(grad_block)(&ah, k, v, mh, i0, nq, b0, nk, rnorm != NULL, &w))
                    continue;
                for (fa_idx j = 0; j < nq; ++j) psum[h * a->L + i0 + j] += w.bl[j];
                for (fa_idx c = 0; c < evg; c += FA_NR) /* dV += P^T dO */
                    for (fa_idx r = 0, mr; r < nk; r += mr) {
                        mr = FA_NAME(tile_rows)(nk, r);
                        FA_NAME(ukr)((int)mr, nq, w.st + r * qb, qb, 1, w.dor + c, evg,
                                     av + r * evg + c, evg, 1, 1, NULL);
                    }
                for (fa_idx e = 0; e < eg; e += FA_NR) /* dK += dS^T Q */
                    for (fa_idx r = 0, mr; r < nk; r += mr) {
                        mr = FA_NAME(tile_rows)(nk, r);
                        FA_NAME(ukr)((int)mr, nq, w.dp + r * qb, qb, 1, w.qr + e, eg,
                                     ak + r * eg + e, eg, 1, 1, NULL);
                    }
                /* dQ^T[e, j] += sum_r K[r, e] dS[r, j] */
                FA_NAME(tile) kt = FA_NAME(key_tile)(&ah, k, b0, nk, w.kpanel);
                kt = FA_NAME(unused_keys)(&ah, kt, w.dp, nq, nk, w.kpanel);
                T *dqb = dqt + (h * nqb + i0 / qb) * E * qb;
                for (fa_idx p = 0; p < qb; p += FA_NR)
                    for (fa_idx e = 0, mr; e < E; e += mr) {
                        mr = FA_NAME(tile_rows)(E, e);
                        FA_NAME(ukr)((int)mr, nk, kt.p + e * kt.es, kt.es, kt.ss, w.dp + p, qb,
                                     dqb + e * qb + p, qb, 1, 1, NULL);
                    }
            }
        }
        for (fa_idx r = 0; r < nk; ++r) {
            for (fa_idx e = 0; e < E; ++e)
                dk[(b0 + r) * g->dk_ss + e * g->dk_es] = (T)a->scale * ak[r * eg + e];
            for (fa_idx c = 0; c < a->Ev; ++c)
                dv[(b0 + r) * g->dv_ss + c * g->dv_es] = av[r * evg + c];
        }
    }
}

/* dQ of nq rows (a query block) of one head: scale times the sum of the
 * chunks' parts in their order (chunk c's E x qb, transposed, at parts +
 * c * part_s), and the rows' sums likewise (at sums + c * sum_s). */
void FA_NAME(attn_grad_merge)(fa_idx nchunks, fa_idx E, fa_idx nq, T scale, const T *parts,
                              fa_idx part_s, const T *sums, fa_idx sum_s, T *dq, fa_idx dq_ls,
                              fa_idx dq_es, T *psum, fa_idx psum_s)
{
    const fa_idx qb = FA_QB;
    T row[FA_QB];
    for (fa_idx e = 0; e < E; ++e) {
        for (fa_idx j = 0; j < nq; ++j) row[j] = parts[e * qb + j];
        for (fa_idx c = 1; c < nchunks; ++c)
            for (fa_idx j = 0; j < nq; ++j) row[j] += parts[c * part_s + e * qb + j];
        for (fa_idx j = 0; j < nq; ++j) dq[j * dq_ls + e * dq_es] = scale * row[j];
    }
    for (fa_idx j = 0; j < nq; ++j) {
        T t = sums[j];
        for (fa_idx c = 1; c < nchunks; ++c) t += sums[c * sum_s + j];
        psum[j * psum_s] = t;
    }
}

#undef FA_GP
#undef FA_GP_MAX
#undef FA_NR_WIDEST
