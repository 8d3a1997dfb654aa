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
 *   S^T[key, q]  = sum_e K[key, e] * Qp[e, q]     (Qp: the packed query block)
 *   O^T[c, q]   += sum_key V[key, c] * P^T[key, q]
 *
 * Needs T, FA_NR, FA_NAME and the primitives ukr, vexp, exp_sub_sum. */

#define FA_QB (4 * FA_NR)   /* query rows per block: 64 floats, 32 doubles */
#define FA_KB 128           /* keys per block */

size_t FA_NAME(attn_work)(const fa_attn_args *a)
{
    /* Qp E x QB, S^T and the mask tile KB x QB each, O^T Ev x QB, six vectors of QB */
    return sizeof(T) * (size_t)FA_QB * (size_t)(a->E + 2 * FA_KB + a->Ev + 6);
}

/* One past the last key any of the rows before i1 may see. */
static fa_idx FA_NAME(key_end)(const fa_attn_args *a, fa_idx i1)
{
    if (!a->causal) return a->S;
    const fa_idx end = i1 + a->causal_offset;
    return end < 0 ? 0 : end > a->S ? a->S : end;
}

/* st[r, j] = logit of query i0 + j and key s0 + r: the scaled score plus the
 * mask, -inf where hidden.  Columns nq..ld-1 are padding.  Returns 0, with
 * st untouched, when the mask hides every key of the block from every
 * query row (the block is then skipped without reading K). */
static int FA_NAME(block_logits)(const fa_attn_args *a, const T *qp, const T *k,
                                 const void *mask, fa_idx i0, fa_idx nq, fa_idx ld,
                                 fa_idx s0, fa_idx nk, T *st, T *bias)
{
    const T ninf = -(T)INFINITY, scale = (T)a->scale;
    const int per_key = a->mask_kind != FA_MASK_NONE && a->m_ls == 0;
    const int tile = a->mask_kind != FA_MASK_NONE && a->m_ls != 0;

    if (a->mask_kind != FA_MASK_NONE) {
        int any = 0;
        for (fa_idx j = 0; j < (per_key ? 1 : nq); ++j) {
            for (fa_idx r = 0; r < nk; ++r) {
                const fa_idx off = (i0 + j) * a->m_ls + (s0 + r) * a->m_ss;
                T b;
                if (a->mask_kind == FA_MASK_BOOL)
                    b = ((const unsigned char *)mask)[off] ? 0 : ninf;
                else
                    b = ((const T *)mask)[off];
                bias[per_key ? r : r * ld + j] = b;
                any |= b != ninf;
            }
        }
        if (!any) return 0;
        if (tile)
            for (fa_idx r = 0; r < nk; ++r)
                for (fa_idx j = nq; j < ld; ++j) bias[r * ld + j] = 0;
    }

    for (fa_idx r = 0; r < nk; r += FA_MR) {
        const int mr = (int)(nk - r < FA_MR ? nk - r : FA_MR);
        for (fa_idx p = 0; p < ld; p += FA_NR)
            FA_NAME(ukr)(mr, a->E, k + (s0 + r) * a->k_ss, a->k_ss, a->k_es, qp + p, ld,
                         st + r * ld + p, ld, 0);
    }

    for (fa_idx r = 0; r < nk; ++r) {
        T *z = st + r * ld;
        if (per_key && bias[r] == ninf) {
            for (fa_idx j = 0; j < ld; ++j) z[j] = ninf;
        } else if (per_key) {
            const T b = bias[r];
            for (fa_idx j = 0; j < ld; ++j) z[j] = z[j] * scale + b;
        } else if (tile) {
            const T *b = bias + r * ld;
            /* -inf hides the key whatever the score, even a NaN one */
            for (fa_idx j = 0; j < ld; ++j) z[j] = b[j] == ninf ? ninf : z[j] * scale + b[j];
        } else {
            for (fa_idx j = 0; j < ld; ++j) z[j] *= scale;
        }
        if (a->causal) { /* key s0 + r is hidden from queries i < s0 + r - offset */
            fa_idx jlim = s0 + r - a->causal_offset - i0;
            jlim = jlim > ld ? ld : jlim;
            for (fa_idx j = 0; j < jlim; ++j) z[j] = ninf;
        }
    }
    return 1;
}

/* 1 when every entry of the nk x Ev value block is finite. */
static int FA_NAME(all_finite)(const T *v, fa_idx v_ss, fa_idx v_es, fa_idx nk, fa_idx Ev)
{
    int bad = 0;
    for (fa_idx r = 0; r < nk; ++r)
        for (fa_idx c = 0; c < Ev; ++c) {
            const T x = v[r * v_ss + c * v_es];
            bad |= x - x != 0; /* NaN for inf and NaN */
        }
    return !bad;
}

void FA_NAME(attn)(const fa_attn_args *a, const T *q, const T *k, const T *v,
                          const void *mask, T *out, T *w, fa_idx i0, fa_idx i1, void *work)
{
    const fa_idx nq = i1 - i0, ld = (nq + FA_NR - 1) / FA_NR * FA_NR;
    const fa_idx E = a->E, Ev = a->Ev;
    const T ninf = -(T)INFINITY;
    T *qp = (T *)work;          /* E x ld: query block, transposed, zero padded */
    T *st = qp + E * ld;        /* FA_KB x ld: logits, then weights, of a key block */
    T *bias = st + FA_KB * ld;  /* FA_KB x ld: the mask of a key block */
    T *ot = bias + FA_KB * ld;  /* Ev x ld: unnormalised output, transposed */
    T *m = ot + Ev * ld;        /* running maximum */
    T *l = m + ld;              /* running sum */
    T *ms = l + ld;             /* m, with -inf replaced by 0 for exp(z - ms) */
    T *alpha = ms + ld;         /* rescale factor of a block */
    T *bl = alpha + ld;         /* block sum */
    T *bm = bl + ld;            /* block maximum */
    const fa_idx s_end = FA_NAME(key_end)(a, i1);

    if (nq <= 0) return;
    for (fa_idx j = 0; j < ld; ++j) {
        if (j < nq) {
            const T *qrow = q + (i0 + j) * a->q_ls;
            for (fa_idx e = 0; e < E; ++e) qp[e * ld + j] = qrow[e * a->q_es];
        } else {
            for (fa_idx e = 0; e < E; ++e) qp[e * ld + j] = 0;
        }
        m[j] = ninf;
        ms[j] = 0;
        l[j] = 0;
    }
    for (fa_idx t = 0; t < Ev * ld; ++t) ot[t] = 0;

    for (fa_idx s0 = 0; s0 < s_end; s0 += FA_KB) {
        const fa_idx nk = s_end - s0 < FA_KB ? s_end - s0 : FA_KB;
        if (!FA_NAME(block_logits)(a, qp, k, mask, i0, nq, ld, s0, nk, st, bias)) continue;

        for (fa_idx j = 0; j < ld; ++j) bm[j] = ninf;
        for (fa_idx r = 0; r < nk; ++r) {
            const T *z = st + r * ld;
            for (fa_idx j = 0; j < ld; ++j) bm[j] = z[j] > bm[j] || z[j] != z[j] ? z[j] : bm[j];
        }
        int rescale = 0;
        for (fa_idx j = 0; j < ld; ++j) {
            const T mn = bm[j] > m[j] || bm[j] != bm[j] ? bm[j] : m[j]; /* NaN sticks */
            alpha[j] = mn == m[j] ? 0 : m[j] - mn; /* log of the factor; -inf when m was -inf */
            rescale |= alpha[j] != 0;
            m[j] = mn;
            ms[j] = mn == ninf ? 0 : mn;
        }
        if (rescale) {
            FA_NAME(vexp)(ld, alpha, alpha);
            for (fa_idx j = 0; j < ld; ++j) l[j] *= alpha[j];
            for (fa_idx c = 0; c < Ev; ++c)
                for (fa_idx j = 0; j < ld; ++j) ot[c * ld + j] *= alpha[j];
        }
        for (fa_idx j = 0; j < ld; ++j) bl[j] = 0;
        for (fa_idx r = 0; r < nk; ++r) FA_NAME(exp_sub_sum)(ld, st + r * ld, ms, bl);
        for (fa_idx j = 0; j < ld; ++j) l[j] += bl[j];

        const T *vb = v + s0 * a->v_ss;
        if (FA_NAME(all_finite)(vb, a->v_ss, a->v_es, nk, Ev)) {
            for (fa_idx c = 0; c < Ev; c += FA_MR) {
                const int mr = (int)(Ev - c < FA_MR ? Ev - c : FA_MR);
                for (fa_idx p = 0; p < ld; p += FA_NR)
                    FA_NAME(ukr)(mr, nk, vb + c * a->v_es, a->v_es, a->v_ss, st + p, ld,
                                 ot + c * ld + p, ld, 1);
            }
        } else { /* a key of weight zero must not turn the output into NaN */
            for (fa_idx r = 0; r < nk; ++r) {
                const T *pr = st + r * ld;
                for (fa_idx c = 0; c < Ev; ++c) {
                    const T x = vb[r * a->v_ss + c * a->v_es];
                    for (fa_idx j = 0; j < ld; ++j)
                        if (pr[j] != 0) ot[c * ld + j] += pr[j] * x;
                }
            }
        }
    }

    for (fa_idx j = 0; j < nq; ++j) {
        T *orow = out + (i0 + j) * a->o_ls;
        for (fa_idx c = 0; c < Ev; ++c)
            orow[c * a->o_es] = m[j] == ninf ? 0 : ot[c * ld + j] / l[j];
    }

    if (w == NULL) return;
    /* The weights, from the final m and l: exp(z - m) / l. */
    for (fa_idx s0 = 0; s0 < a->S; s0 += FA_KB) {
        const fa_idx nk = a->S - s0 < FA_KB ? a->S - s0 : FA_KB;
        const int visible = s0 < s_end && FA_NAME(block_logits)(a, qp, k, mask, i0, nq, ld, s0, nk, st, bias);
        if (visible)
            for (fa_idx r = 0; r < nk; ++r) {
                T *z = st + r * ld;
                for (fa_idx j = 0; j < ld; ++j) z[j] -= ms[j];
                FA_NAME(vexp)(ld, z, z);
            }
        for (fa_idx j = 0; j < nq; ++j) {
            T *wrow = w + (i0 + j) * a->w_ls + s0 * a->w_ss;
            const int zero = !visible || m[j] == ninf;
            for (fa_idx r = 0; r < nk; ++r) wrow[r * a->w_ss] = zero ? 0 : st[r * ld + j] / l[j];
        }
    }
}
