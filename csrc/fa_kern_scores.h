/* The per-score stage of the attention kernels, for element type T: what
 * happens to a score between Q K^T and the online softmax.  Each modifier
 * is defined here once; the block kernel (fa_kern_attn.h: a keys x queries
 * tile) and the row kernel (fa_kern_rows.h: a few query rows) apply them in
 * this order to the score z of query i and key j, with i' = i + offset
 * (the causal alignment: 0 upper-left, S - L lower-right):
 *
 *   1. scale    z = scale * q_i . k_j          (Vaswani et al. 2017)
 *               + scale * q_i . m              (k_mean: keys stored less m)
 *   2. softcap  z = c * tanh(z / c)            (Gemma 2: before masks and biases)
 *   3. mask     z = z + M[i, j - m_s0] for keys j >= m_s0; -inf where a
 *               boolean mask is false (m_s0 > 0: a mask over the newest keys
 *               only, as a tree of draft tokens is)
 *   4. ALiBi    z = z - slope * |i' - j|       (Press et al. 2022, FlashAttention's form)
 *   5. bounds   z = -inf unless i' - left <= j <= i' + right
 *               (sliding window, Beltagy et al. 2020; causal: right = 0)
 *   6. sink     a logit of the head joins every row's softmax denominator
 *               as a key with no value (gpt-oss): the running maximum starts
 *               at it and the running sum at 1 (sink_start).
 *
 * A -inf from the mask or the bounds hides the key whatever the score, a
 * NaN one included.  Key blocks outside the bounds of a whole block of
 * queries are never read (key_range), so a window costs O(L x window).
 *
 * Needs T, FA_NAME and the primitive vtanh. */

/* The first and last key query i may see by the bounds alone (inclusive;
 * possibly outside 0..S-1, which callers clamp). */
static fa_idx FA_NAME(key_lo)(const fa_attn_args *a, fa_idx i)
{
    return a->window_left < 0 ? 0 : i + a->causal_offset - a->window_left;
}

static fa_idx FA_NAME(key_hi)(const fa_attn_args *a, fa_idx i)
{
    const fa_idx right = a->causal ? 0 : a->window_right;
    return right < 0 ? a->S - 1 : i + a->causal_offset + right;
}

/* Rows i0 + lo .. i0 + hi - 1 of the n rows from i0: those the bounds let
 * see key (key_lo and key_hi inverted: both grow with i, one for one). */
static void FA_NAME(key_rows)(const fa_attn_args *a, fa_idx key, fa_idx i0, fa_idx n, fa_idx *lo,
                              fa_idx *hi)
{
    const fa_idx right = a->causal ? 0 : a->window_right, d = key - a->causal_offset - i0;
    const fa_idx first = right < 0 ? 0 : d - right;            /* key <= key_hi(i) */
    const fa_idx end = a->window_left < 0 ? n : d + a->window_left + 1; /* key >= key_lo(i) */
    *lo = first < 0 ? 0 : first > n ? n : first;
    *hi = end < *lo ? *lo : end > n ? n : end;
}

/* Keys begin..end-1: every key that one of the queries i0..i1-1 (i1 > i0)
 * may see; empty (begin == end) when none. */
static void FA_NAME(key_range)(const fa_attn_args *a, fa_idx i0, fa_idx i1, fa_idx *begin,
                               fa_idx *end)
{
    const fa_idx lo = FA_NAME(key_lo)(a, i0), hi = FA_NAME(key_hi)(a, i1 - 1) + 1;
    *begin = lo < 0 ? 0 : lo > a->S ? a->S : lo;
    *end = hi < *begin ? *begin : hi > a->S ? a->S : hi;
}

/* Step 1's term of the key mean for nr <= 8 query rows q + r ldq (their
 * elements qs apart, times unscale, a power of two), into out[r]: each
 * summed in double, whose products of floats are exact, in four
 * interleaved parts added in a fixed order, so that both kernels and every
 * path get its bits.  Inlined with nr = 8 (mean_shifts), eight rows'
 * chains of additions run side by side (one row's are E / 4 long). */
static FA_ALWAYS_INLINE void FA_NAME(mean_shifts_n)(const fa_attn_args *a, const fa_idx nr,
                                                    const T *q, fa_idx ldq, fa_idx qs, T unscale,
                                                    T *out)
{
    const T *m = (const T *)a->k_mean;
    double part[8][4];
    for (fa_idx r = 0; r < nr; ++r)
        for (int t = 0; t < 4; ++t) part[r][t] = 0;
    fa_idx e = 0;
    for (; e + 4 <= a->E; e += 4)
        for (fa_idx r = 0; r < nr; ++r)
            for (int t = 0; t < 4; ++t)
                part[r][t] += (double)q[r * ldq + (e + t) * qs] * (double)m[e + t];
    for (fa_idx r = 0; r < nr; ++r) {
        for (fa_idx x = e; x < a->E; ++x) part[r][0] += (double)q[r * ldq + x * qs] * (double)m[x];
        const double d = (part[r][0] + part[r][1]) + (part[r][2] + part[r][3]);
        const T x = (T)(d / (double)unscale);
        /* the product in double where the sum alone is past T's range (a
         * query of 1e37 against keys of mean 1: the term 1e38, its sum 1e39) */
        out[r] = x - x == 0 ? (T)a->scale * x : (T)((double)(T)a->scale * (d / (double)unscale));
    }
}

/* mean_shifts_n, its accumulators in registers for a whole eight rows */
static void FA_NAME(mean_shifts)(const fa_attn_args *a, fa_idx nr, const T *q, fa_idx ldq,
                                 fa_idx qs, T unscale, T *out)
{
    if (nr == 8)
        FA_NAME(mean_shifts_n)(a, 8, q, ldq, qs, unscale, out);
    else
        FA_NAME(mean_shifts_n)(a, nr, q, ldq, qs, unscale, out);
}

/* mean_shifts of one row */
static T FA_NAME(mean_shift)(const fa_attn_args *a, const T *q, fa_idx qs, T unscale)
{
    T out;
    FA_NAME(mean_shifts_n)(a, 1, q, 0, qs, unscale, &out);
    return out;
}

/* Step 2 on n contiguous scores. */
static void FA_NAME(softcap)(const fa_attn_args *a, fa_idx n, T *z)
{
    const T c = (T)a->softcap;
    for (fa_idx j = 0; j < n; ++j) z[j] /= c;
    FA_NAME(vtanh)(n, z, z);
    for (fa_idx j = 0; j < n; ++j) z[j] *= c;
}

/* Step 4's bias of query i and key j, for a head of this slope. */
static T FA_NAME(alibi)(T slope, fa_idx causal_offset, fa_idx i, fa_idx j)
{
    const fa_idx d = i + causal_offset - j;
    return -slope * (T)(d < 0 ? -d : d);
}

/* Whether the mask covers some of the keys s0..s0+nk-1. */
static int FA_NAME(masked)(const fa_attn_args *a, fa_idx s0, fa_idx nk)
{
    return a->mask_kind != FA_MASK_NONE && s0 + nk > a->m_s0;
}

/* Steps 3 to 5 for one score z (after steps 1 and 2) of query i and key j:
 * the row kernel's form; the block kernel does the same a tile at a time. */
static T FA_NAME(modify)(const fa_attn_args *a, const void *mask, fa_idx i, fa_idx j, T z)
{
    const T ninf = -(T)INFINITY;
    const fa_idx off = i * a->m_ls + (j - a->m_s0) * a->m_ss;
    const fa_mask_kind mk = j >= a->m_s0 ? a->mask_kind : FA_MASK_NONE;
    if (mk == FA_MASK_BOOL && !((const unsigned char *)mask)[off]) return ninf;
    if (mk == FA_MASK_ADD) {
        const T b = ((const T *)mask)[off];
        if (b == ninf) return ninf;
        z = z + b;
    }
    if (a->alibi_slope != 0) z = z + FA_NAME(alibi)((T)a->alibi_slope, a->causal_offset, i, j);
    return j < FA_NAME(key_lo)(a, i) || j > FA_NAME(key_hi)(a, i) ? ninf : z;
}

/* Step 6: the running maximum m and sum l of a row of query head g (of
 * fa_attn_args' heads) before any key. */
static void FA_NAME(sink_start)(const fa_attn_args *a, fa_idx g, T *m, T *l)
{
    *m = (T)(a->head_sinks != NULL ? a->head_sinks[g] : a->sink);
    *l = *m == -(T)INFINITY ? 0 : 1;
}

/* A row's log-sum-exp from its maximum m and sum l: -inf when nothing was
 * visible (l = 0), NaN when a visible logit was. */
static T FA_NAME(lse)(T m, T l)
{
    return l == 0 ? -(T)INFINITY : m + (T)log((double)l);
}
