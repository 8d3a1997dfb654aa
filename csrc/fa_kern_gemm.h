/* Blocked matrix product for element type T, in the loop order of Goto and
 * van de Geijn ("Anatomy of high-performance matrix multiplication", 2008):
 * a KC x NC panel of B and an MC x KC block of A are packed into contiguous
 * micro-panels, then the register micro-kernel sweeps them.
 *
 * Included once per type and instruction set; needs T, FA_NR, FA_NAME and
 * the primitives (FA_NAME(ukr)). */

void FA_NAME(gemm)(const fa_gemm_args *g, const T *a, const T *b, T *c,
                          fa_idx i0, fa_idx i1, fa_idx j0, fa_idx j1, void *work)
{
    const fa_idx mb = i1 - i0, nb = j1 - j0;
    T *ap = (T *)FA_ALIGNED(work);           /* FA_GEMM_MC x FA_GEMM_KC */
    T *bp = ap + FA_GEMM_MC * FA_GEMM_KC;    /* FA_GEMM_KC x FA_GEMM_NC */
    T *tile = bp + FA_GEMM_KC * FA_GEMM_NC;  /* FA_MR x FA_NR */

    if (g->K == 0) {
        for (fa_idx i = 0; i < mb; ++i)
            for (fa_idx j = 0; j < nb; ++j) c[(i0 + i) * g->rs_c + (j0 + j) * g->cs_c] = 0;
        return;
    }
    for (fa_idx pc = 0; pc < g->K; pc += FA_GEMM_KC) {
        const fa_idx kc = g->K - pc < FA_GEMM_KC ? g->K - pc : FA_GEMM_KC;
        const int accumulate = pc > 0;

        /* B panels: FA_NR columns each, k-major, zero-padded on the right. */
        for (fa_idx jp = 0; jp < nb; jp += FA_NR) {
            T *dst = bp + (jp / FA_NR) * kc * FA_NR;
            const fa_idx ncols = nb - jp < FA_NR ? nb - jp : FA_NR;
            for (fa_idx k = 0; k < kc; ++k) {
                const T *src = b + (pc + k) * g->rs_b + (j0 + jp) * g->cs_b;
                fa_idx j = 0;
                for (; j < ncols; ++j) dst[k * FA_NR + j] = src[j * g->cs_b];
                for (; j < FA_NR; ++j) dst[k * FA_NR + j] = 0;
            }
        }
        /* A micro-panels: FA_MR rows each, k-major. */
        for (fa_idx ip = 0; ip < mb; ip += FA_MR) {
            T *dst = ap + (ip / FA_MR) * kc * FA_MR;
            const fa_idx mr = mb - ip < FA_MR ? mb - ip : FA_MR;
            for (fa_idx k = 0; k < kc; ++k)
                for (fa_idx r = 0; r < mr; ++r)
                    dst[k * FA_MR + r] = a[(i0 + ip + r) * g->rs_a + (pc + k) * g->cs_a];
        }
        for (fa_idx jp = 0; jp < nb; jp += FA_NR) {
            const T *bpanel = bp + (jp / FA_NR) * kc * FA_NR;
            const fa_idx ncols = nb - jp < FA_NR ? nb - jp : FA_NR;
            for (fa_idx ip = 0; ip < mb; ip += FA_MR) {
                const T *apanel = ap + (ip / FA_MR) * kc * FA_MR;
                const int mr = (int)(mb - ip < FA_MR ? mb - ip : FA_MR);
                T *cp = c + (i0 + ip) * g->rs_c + (j0 + jp) * g->cs_c;
                if (ncols == FA_NR && g->cs_c == 1) {
                    FA_NAME(ukr)(mr, kc, apanel, 1, FA_MR, bpanel, FA_NR, cp, g->rs_c, 1, accumulate, NULL);
                    continue;
                }
                /* Partial or strided tile of C: go through a local tile. */
                FA_NAME(ukr)(mr, kc, apanel, 1, FA_MR, bpanel, FA_NR, tile, FA_NR, 1, 0, NULL);
                for (int r = 0; r < mr; ++r)
                    for (fa_idx j = 0; j < ncols; ++j) {
                        T *cij = cp + r * g->rs_c + j * g->cs_c;
                        *cij = accumulate ? *cij + tile[r * FA_NR + j] : tile[r * FA_NR + j];
                    }
            }
        }
    }
}
