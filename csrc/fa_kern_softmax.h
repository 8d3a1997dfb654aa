/* Softmax of one strided row for element type T, with the row maximum
 * subtracted first and the all-hidden guard.  Needs T, FA_NAME and the
 * primitive FA_NAME(vexp). */

void FA_NAME(softmax_row)(fa_idx n, const T *x, fa_idx xs, fa_mask_kind mk,
                                 const void *mask, fa_idx ms, T *out, fa_idx os, void *work)
{
    T *z = (T *)FA_ALIGNED(work);
    const T ninf = -(T)INFINITY;
    T m = ninf;

    /* z = the logits with hidden entries at -inf; m = their NaN-propagating max */
    for (fa_idx j = 0; j < n; ++j) {
        T v = x[j * xs];
        if (mk == FA_MASK_BOOL) {
            if (!((const unsigned char *)mask)[j * ms]) v = ninf;
        } else if (mk == FA_MASK_ADD) {
            const T mv = ((const T *)mask)[j * ms];
            v = mv == ninf ? ninf : v + mv;
        }
        z[j] = v;
        if (v > m || v != v) m = v; /* once NaN, m stays NaN */
    }
    if (m == ninf) { /* no visible entry: a zero row, not 0/0 */
        for (fa_idx j = 0; j < n; ++j) out[j * os] = 0;
        return;
    }
    for (fa_idx j = 0; j < n; ++j) z[j] -= m;
    FA_NAME(vexp)(n, z, z);

    const T sum = FA_NAME(sum)(n, z);
    for (fa_idx k = 0; k < n; ++k) out[k * os] = z[k] / sum;
}
