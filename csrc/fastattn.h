/* fastattn C API: plain C99 kernels over pointers and element strides.
 *
 * Every entry point computes one independent piece of work (one block of a
 * matrix product, one softmax row, one block of queries of one attention
 * head) so that the caller can spread pieces over threads; each piece is
 * computed the same way whatever thread runs it, which makes results
 * bitwise identical for any thread count.  No function keeps state: the
 * instruction-set path and the scratch memory come from the caller.  The
 * element size (4: float, 8: double) picks the type of the computation and
 * of the arrays it writes; any other size returns -1. */
#ifndef FASTATTN_H
#define FASTATTN_H

#include <stdint.h>
#include "fa_common.h"

/* ---- CPU ---------------------------------------------------------------- */

/* 1 when the CPU and the OS support AVX2, FMA and F16C, else 0. */
int fa_cpu_has_avx2_fma(void);
/* 1 when they also support AVX-512 (foundation), else 0. */
int fa_cpu_has_avx512(void);
/* 1 when they also support AVX-512 VNNI on 256-bit vectors (VNNI, VL and
 * BW), which the int8 mode's integer products use on the AVX-512 path, else 0. */
int fa_cpu_has_avx512_vnni(void);
/* 1 when they support AVX-VNNI (vpdpbusd on 256-bit vectors, VEX-encoded,
 * on CPUs without AVX-512 too), which the int8 mode's integer products use
 * on the AVX2 path, and the
 * build has that instance (a compiler and assembler that know it), else 0. */
int fa_cpu_has_avx_vnni(void);
/* 1 on an aarch64 CPU with Advanced SIMD (NEON) and a build with the NEON
 * path, else 0. */
int fa_cpu_has_neon(void);
/* 1 when that CPU also has half-precision arithmetic (ARMv8.2 FP16:
 * FADD/FMLA on 8 halves), and when it has the BF16 dot products (BFDOT,
 * BFMMLA); else 0.  No kernel uses them yet: they are what a reduced
 * precision path on aarch64 would check. */
int fa_cpu_has_neon_fp16(void);
int fa_cpu_has_neon_bf16(void);
/* 1 when that CPU has the dot products of ARMv8.2 (SDOT, UDOT), which the
 * int8 mode's integer products use on the NEON path, else 0 (Linux only:
 * elsewhere unreported). */
int fa_cpu_has_neon_dotprod(void);

/* ---- Blocked matrix product C = A B ------------------------------------ */

typedef struct {
    fa_idx M, N, K;
    fa_idx rs_a, cs_a;   /* A is M x K */
    fa_idx rs_b, cs_b;   /* B is K x N */
    fa_idx rs_c, cs_c;   /* C is M x N */
} fa_gemm_args;

/* Rows and columns of C per piece of work (cache blocks). */
fa_idx fa_gemm_mc(int elsize);
fa_idx fa_gemm_nc(int elsize);
/* Bytes of scratch one call of fa_gemm needs. */
size_t fa_gemm_work_bytes(int elsize);
/* C[i0:i1, j0:j1] = A[i0:i1, :] B[:, j0:j1] with i1 - i0 <= mc, j1 - j0 <= nc.
 * Returns 0, or -1 (nothing done) when the block is out of range. */
int fa_gemm(fa_isa isa, int elsize, const fa_gemm_args *g, const void *a, const void *b,
            void *c, fa_idx i0, fa_idx i1, fa_idx j0, fa_idx j1, void *work);

/* ---- Softmax of one row ------------------------------------------------- */

/* out = softmax(x) over n entries with the row maximum subtracted first.
 * Hidden entries (x == -inf, a false BOOL mask entry, or a -inf ADD mask
 * entry) get weight 0; a row with no visible entry gives zeros; a NaN in a
 * visible entry gives a NaN row.  Returns 0, or -1 when n < 0. */
size_t fa_softmax_work_bytes(fa_idx n, int elsize);
int fa_softmax_row(fa_isa isa, int elsize, fa_idx n, const void *x, fa_idx xs,
                   fa_mask_kind mk, const void *mask, fa_idx ms, void *out, fa_idx os,
                   void *work);

/* ---- Fused attention for one (batch, head) ------------------------------ */

typedef struct {
    fa_idx L, S, E, Ev;          /* query rows, keys, key size, value size */
    fa_idx q_ls, q_es;           /* strides of query (L, E) */
    fa_idx k_ss, k_es;           /* key (S, E) */
    fa_idx v_ss, v_es;           /* value (S, Ev) */
    fa_idx o_ls, o_es;           /* output (L, Ev) */
    fa_idx w_ls, w_ss;           /* weights (L, S), used when w != NULL */
    fa_idx lse_s;                /* stride of lse (L), used when lse != NULL */
    fa_mask_kind mask_kind;
    fa_idx m_ls, m_ss;           /* mask (L, S - m_s0) */
    fa_idx m_s0;                 /* >= 0: the first key the mask covers (its column 0);
                                  * keys before it are not masked (a tree mask over a
                                  * sequence's newest keys); 0: all */
    /* The per-score stage, in this order (fa_kern_scores.h), for query i
     * and key j, with i' = i + causal_offset: */
    double scale;                /* multiplies Q K^T */
    double softcap;              /* > 0: z = softcap * tanh(z / softcap); 0: none */
    double alibi_slope;          /* adds -alibi_slope * |i' - j| (0: none) */
    int causal;                  /* key j is hidden from query i when j > i' */
    fa_idx window_left;          /* >= 0: hidden when j < i' - window_left; -1: unbounded */
    fa_idx window_right;         /* >= 0: hidden when j > i' + window_right; -1: unbounded */
    fa_idx causal_offset;        /* 0: upper-left alignment, S - L: lower-right */
    double sink;                 /* a logit joining every row's softmax with no value; -inf: none */
    /* Storage (fa_common.h), for the float kernels; the double kernels take
     * NATIVE only.  Strides stay in elements of the storage type (bytes
     * for Q4, whose rows are whole blocks, fa_common.h). */
    fa_store q_store;            /* NATIVE, F16 or BF16 */
    fa_store kv_store;           /* key and value: any */
    const float *k_scale;        /* I8, F8E4M3: key row j is k_scale[j * ksc_s] * its codes */
    const float *v_scale;        /* I8, F8E4M3: value row j is v_scale[j * vsc_s] * its codes */
    fa_idx ksc_s, vsc_s;
    /* Placement of the keys and values (and of their row scales): dense when
     * block_table is NULL, row j at k + j * k_ss as above.  Paged otherwise
     * (vLLM's PagedAttention, Kwon et al. 2023): the rows lie in blocks of
     * block_size rows, row j in block b = block_table[j / block_size] at
     * k + b * k_bs + (j % block_size) * k_ss; v, k_scale and v_scale alike
     * with v_bs, ksc_bs and vsc_bs.  The caller checks that the first
     * ceil(S / block_size) entries are blocks of its arrays; the kernels
     * read no other entry.  A result never depends on the placement. */
    const int32_t *block_table;
    fa_idx block_size;
    fa_idx k_bs, v_bs, ksc_bs, vsc_bs;
    /* Query heads that share these keys and values, computed in one call so
     * that the keys and values are read once for all of them (grouped-query
     * attention; Multi-head Latent Attention's absorbed form).  heads <= 1:
     * one head.  With heads = G > 1, a call for rows i0..i1-1 (G (i1 - i0)
     * at most a query block, no weights; a mask is every head's) computes those rows of G
     * heads: head g's queries at q + g * q_hs, its output at out + g * o_hs
     * and its lse at lse + g * lse_hs, with ALiBi slope head_slopes[g] and
     * sink head_sinks[g] where those are not NULL (else alibi_slope and
     * sink).  Up to FA_ROWS_MAX rows in all, the row kernel computes each
     * row alone over the same key blocks, so each head gets the bits of a
     * call of its own; beyond, the block kernel folds the G heads of each
     * row into its columns (a matrix product over each key block), each
     * column the bits of the same row in a block-kernel call of its head
     * over the same rows i0..i1-1. */
    fa_idx heads;
    fa_idx q_hs, o_hs, lse_hs;
    const double *head_slopes;
    const double *head_sinks;
    /* What the kernels ask the cache for ahead of their reads, beyond the
     * hardware prefetcher: a bitwise or of FA_PREFETCH_KEYS (with
     * FA_PREFETCH_FAR or without) and FA_PREFETCH_VALUES (the row kernel:
     * which is faster depends on the CPU, fastattn/_tuning.py measures
     * it) and FA_PREFETCH_BLOCKS (the
     * block kernel, for keys and values beyond L2).  No result depends on
     * it. */
    int prefetch;
    /* The products' arithmetic (fa_common.h): EXACT, or INT8, whose
     * results differ from the exact ones by the rounding of the query and
     * of the weights to 8 bits. */
    fa_precision precision;
    /* 1: the int8 mode's integer products without the CPU's dot-product
     * instruction (vpdpbusd, sdot), as on a CPU that lacks it; the same
     * sums, so the same results (for testing the instance every CPU runs). */
    int int8_base;
    /* Key smoothing (SageAttention's smooth_k, Zhang et al. 2025): the keys
     * were stored less a mean m, E values of the kernels' type (NULL:
     * none); step 1 adds scale * q_i . m back to every score of row i, so
     * the logits are those of the keys before. */
    const void *k_mean;
} fa_attn_args;

/* fa_attn_args.prefetch: the row kernel's key rows FA_PREFETCH_BYTES ahead
 * into L1 as the keys are read, and a block's value rows into L2 while its
 * keys are read (fa_kern_rows.h); the block kernel's next key block, keys
 * and values, into L2 while it computes the current one (fa_kern_attn.h).
 * FA_PREFETCH_NONE: nothing, not even a paged cache's next blocks: the rows
 * are in cache already (fa_attn_parts gives it to the calls after the first
 * that read the same rows). */
enum {
    FA_PREFETCH_KEYS = 1,
    FA_PREFETCH_VALUES = 2,
    FA_PREFETCH_BLOCKS = 4,
    FA_PREFETCH_NONE = 8,
    FA_PREFETCH_FAR = 16 /* with KEYS: FA_PREFETCH_FAR_BYTES ahead, not FA_PREFETCH_BYTES */
};

/* Where the caller's next call of fa_attn_* on this thread will read its
 * queries (rows i0..i1-1), keys and values: the kernel asks the cache for
 * its own output rows, the next queries, and the first key block when the
 * keys are another head's, during its products, so that neither its end
 * nor the next call's start waits for memory.  Only a hint: it never
 * changes a result; NULL (nothing asked for) suits operands that fit in
 * L2, where asking only costs time. */
typedef struct {
    const void *q;               /* as the q of that call */
    const void *k, *v;           /* as its k and v */
    fa_idx i0, i1;
} fa_attn_next;

/* Largest E and Ev the attention kernels accept, far above any head size:
 * their scratch memory grows with E + Ev, and this bound keeps its size far
 * from overflowing a size_t (a wrapped size would be a heap overflow).
 * Beyond it fa_attn return -1 and fa_attn_work_bytes 0. */
#define FA_ATTN_MAX_FEATURES ((fa_idx)1 << 20)

/* Query rows per piece of work. */
fa_idx fa_attn_query_block(int elsize);
/* Bytes of scratch one call of fa_attn needs for these arguments. */
size_t fa_attn_work_bytes(const fa_attn_args *a, int elsize);
/* Output rows i0..i1-1 (i1 - i0 <= query block) of
 *   softmax(modified scores) V
 * (the scores scale * Q K^T through the per-score stage of fa_attn_args)
 * computed block by block with an online softmax, never forming the L x S
 * matrix.  When w is not NULL the normalised weights of these rows are
 * written there too, and when lse is not NULL each row's log-sum-exp of
 * its logits (the sink included; -inf for a row with nothing visible).  A
 * key with zero weight never contributes its value row, so a non-finite
 * value at a hidden key cannot leak into the output.  The float kernels
 * read q as a->q_store and k and v as a->kv_store, a tile at a time. */
int fa_attn(fa_isa isa, int elsize, const fa_attn_args *a, const void *q, const void *k,
            const void *v, const void *mask, void *out, void *w, void *lse, fa_idx i0,
            fa_idx i1, const fa_attn_next *next, void *work);

/* ---- Decoding split along the keys ------------------------------------- */

/* How many pieces to split the keys of each (batch, head) into, and their
 * keys: piece p holds keys p * fa_attn_split_keys(a) on, the last one what
 * is left.  More than 1 piece only for decoding-like calls (at most 4 query
 * rows, at least 2048 keys), of 1024 keys (2048, 4096... beyond
 * FA_ATTN_SPLITS_MAX pieces).  Both depend on the shape of one (batch, head) alone, never on
 * the batch, the thread count, the strides nor on whether weights are
 * wanted; the pieces' bounds on its number of keys only through that
 * doubling, so that sequences sharing their first keys split them alike. */
#define FA_ATTN_SPLITS_MAX 64
fa_idx fa_attn_splits(const fa_attn_args *a);
fa_idx fa_attn_split_keys(const fa_attn_args *a);
/* Query heads of one key/value head to compute together (heads) for a
 * sequence of a->L query rows whose key/value heads serve `group` query
 * heads each, by its shape and the path alone: up to FA_ROWS_MAX rows of
 * heads, the row kernel's; beyond, when at least 8 rows of heads fit a
 * query block, as many as fit, folded by the block kernel (not the int8
 * mode's integer rows, nor, on the portable path, rows of 4 or fewer
 * queries, which its row kernel computes faster); else 1 (or the row
 * kernel's 4 rows).  The caller leaves heads at 1 where a mask that
 * differs between heads, weights or per-head slopes and sinks not one
 * element apart forbid sharing. */
fa_idx fa_attn_group(fa_isa isa, int elsize, const fa_attn_args *a, fa_idx group);
/* Values of state one piece holds: heads * (i1 - i0) * (Ev + 2). */
fa_idx fa_attn_state_len(const fa_attn_args *a, fa_idx i0, fa_idx i1);
/* The running maximum, sum, lowest logit of nonzero weight and unnormalised output of rows i0..i1-1 over
 * keys s_lo..s_hi-1 (i1 - i0 <= 4; work as for fa_attn); the piece with
 * s_lo = 0 holds the sink. */
int fa_attn_part(fa_isa isa, int elsize, const fa_attn_args *a, const void *q, const void *k,
                 const void *v, const void *mask, fa_idx i0, fa_idx i1, fa_idx s_lo,
                 fa_idx s_hi, void *state, void *work);

/* fa_attn_part of n calls (n <= FA_ATTN_PARTS_MAX) over the same keys
 * s_lo..s_hi-1: call c's rows 0..a[c].L-1 (at most 4 rows of its heads)
 * with q[c], k[c], v[c] and mask[c] into state[c], the bits of its
 * fa_attn_part alone.  The calls read the keys a run of a few rows at a
 * time, every call each run, so that the rows several of them share (a
 * paged cache's blocks that forked sequences or a common prompt hold) are
 * read from memory once for all.  work: n times fa_attn_work_bytes(a[0]);
 * the calls share E, Ev, storage and precision.  Returns 0, or -1 (nothing
 * done) when any call would make fa_attn_part refuse. */
#define FA_ATTN_PARTS_MAX 16
int fa_attn_parts(fa_isa isa, int elsize, fa_idx n, const fa_attn_args *a, const void *const *q,
                  const void *const *k, const void *const *v, const void *const *mask,
                  fa_idx s_lo, fa_idx s_hi, void *const *state, void *work);

/* Output rows i0..i1-1 from nsplit consecutive pieces of state; when ml is
 * not NULL it receives each row's maximum and sum (2 values a row). */
int fa_attn_merge(fa_isa isa, int elsize, const fa_attn_args *a, fa_idx nsplit,
                  const void *states, void *out, void *ml, fa_idx i0, fa_idx i1);

/* The weights of rows i0..i1-1 (at most 4) from their maximum and sum. */
int fa_attn_weights(fa_isa isa, int elsize, const fa_attn_args *a, const void *q,
                    const void *k, const void *mask, const void *ml, void *w, fa_idx i0,
                    fa_idx i1, void *work);

/* Rows i0..i1-1 (at most 4) of out, merged from nsplit pieces of state,
 * that came out non-finite where a key's weight may be 0 against the row's
 * maximum but was not against its piece's: again by the row kernel over all
 * the keys, which skips keys of weight 0, a non-finite value there included.
 * Genuine NaN and inf stay.  lse and work as for fa_attn. */
int fa_attn_repair(fa_isa isa, int elsize, const fa_attn_args *a, const void *q,
                   const void *k, const void *v, const void *mask, fa_idx nsplit,
                   const void *states, void *out, void *lse, fa_idx i0, fa_idx i1, void *work);

/* ---- Gradients (the backward pass) -------------------------------------- */

/* What the backward pass reads and writes besides the forward's
 * fa_attn_args (FlashAttention-2's backward, Dao 2023, Algorithm 2), in
 * element strides: dO (grad_out) is (L, Ev), dK (S, E), dV (S, Ev); the
 * forward's output is read through fa_attn_args' o_ls, o_es (and o_hs);
 * between the query heads of a grouped call (fa_attn_args' heads, whose
 * q_hs, o_hs and lse_hs serve here too), do_hs and m_hs (the mask's). */
typedef struct {
    fa_idx do_ls, do_es;
    fa_idx dk_ss, dk_es;
    fa_idx dv_ss, dv_es;
    fa_idx do_hs, m_hs;
} fa_grad_args;

/* Keys per chunk of fa_attn_grad for a sequence of a->S keys and kv_heads
 * key/value heads: whole key blocks of the block kernel, as many chunks as
 * give the sequence FA_ATTN_GRAD_TASKS tasks (a task per chunk and
 * key/value head), at most FA_ATTN_GRAD_CHUNKS; by the sequence's own shape
 * alone, never the batch or the threads.  Each chunk holds a part of dQ
 * until they are summed: fewer chunks, less memory. */
#define FA_ATTN_GRAD_CHUNKS 8
#define FA_ATTN_GRAD_TASKS 32
fa_idx fa_attn_grad_chunk_keys(const fa_attn_args *a, fa_idx kv_heads);
/* Bytes of scratch one call of fa_attn_grad needs (0 when E or Ev is out
 * of range). */
size_t fa_attn_grad_work_bytes(const fa_attn_args *a, int elsize);
/* The gradients of the keys s0..s1-1 (a chunk: s0 a multiple of
 * fa_attn_grad_chunk_keys, s1 the next one or S) from the queries, keys,
 * values and mask of the forward call a describes, its output out and
 * lse, and dO, for the query heads of the call (heads; head h's queries,
 * output, lse, dO and mask at h times their head strides, its ALiBi slope
 * head_slopes[h]): dK and dV of those keys, summed over the heads in their
 * order, then over the query blocks (multiples of the query block from row
 * 0); and what those keys add to dQ / scale, transposed per query block,
 * into dqt (heads x ceil(L / qb) x E x qb, qb the query block), and to each
 * row's sum of exp(logit - lse), into psum (heads x L).  The logits are
 * computed again through the per-score stage (sinks aside: they are in
 * lse), D = rowsum(dO o O) once per query block.  rnorm (NULL: none),
 * laid out as lse: a factor per row of the weights exp(logit - lse), for
 * an lse too large for its dtype to carry the row's sum, whose rounding
 * left the row's weights summing to other than 1.  Dense keys and values
 * stored as T, exact precision, no k_mean; returns 0, or -1 (nothing done)
 * otherwise. */
int fa_attn_grad(fa_isa isa, int elsize, const fa_attn_args *a, const fa_grad_args *g,
                 const void *q, const void *k, const void *v, const void *mask,
                 const void *dout, const void *out, const void *lse, const void *rnorm,
                 void *dk, void *dv, void *dqt, void *psum, fa_idx s0, fa_idx s1, void *work);
/* dQ of nq rows (at most a query block) of one head, scale times the sum of
 * nchunks chunks' dqt parts of those rows in the chunks' order (chunk c's E
 * x qb at parts + c * part_s elements), into dq (rows dq_ls apart,
 * features dq_es); and the rows' psum likewise, from sums + c * sum_s into
 * psum (psum_s apart): summed over the chunks, 1 less the sink's weight
 * when lse is the forward's, which lets the caller check it.  No result
 * depends on the threads.  Returns 0, or -1 when nq is out of range. */
int fa_attn_grad_merge(fa_isa isa, int elsize, fa_idx nchunks, fa_idx E, fa_idx nq,
                       double scale, const void *parts, fa_idx part_s, const void *sums,
                       fa_idx sum_s, void *dq, fa_idx dq_ls, fa_idx dq_es, void *psum,
                       fa_idx psum_s);

/* ---- Rotary position embedding (fa_rotary.c) --------------------------- */

/* y = x with its first 2 * half features rotated in pairs by the angles
 * whose cosines and sines are c[0..half) and s[0..half), the other n - 2 *
 * half copied: y_a = x_a c_i - x_b s_i, y_b = x_b c_i + x_a s_i for the pairs
 * (a, b) = (i, i + half) (GPT-NeoX's layout, FlashAttention's default), or
 * (2i, 2i + 1) when interleaved (GPT-J's).  x and y hold n elements at
 * strides xs and ys; y may be x.  Returns 0, or -1 when 2 * half > n or
 * either is negative. */
int fa_rotary(int elsize, fa_idx n, fa_idx half, int interleaved, const void *x, fa_idx xs,
              const void *c, const void *s, void *y, fa_idx ys);

/* ---- Outputs in 16 bits ------------------------------------------------- */

/* y[0..n) = x[0..n) rounded to nearest-even F16 or BF16 (st), both
 * contiguous: a float32 result returned in its inputs' 16-bit dtype.
 * Returns 0, or -1 for another st or n < 0. */
int fa_narrow_f32(fa_isa isa, fa_store st, fa_idx n, const float *x, void *y);

/* ---- The int8 mode's operands (fastattn/_storage.py, int8_mode_operands) */

/* Each of `rows` contiguous rows of n floats at x, less mean (n floats;
 * NULL: none), rounded to int8: scales[r] = m / 127 with m = max |y| over
 * the row's y = x - mean, codes = y * (127 / m) rounded to nearest-even
 * (0 for a row of zeros; y and m times 2^64 first where 127 / m would
 * overflow); a row whose y holds a NaN or an
 * inf gets scale NaN and codes 0.  Returns how
 * many rows had a finite x but a non-finite y (the mean pushed them past
 * float's range), or -1 when rows or n is negative. */
fa_idx fa_int8_rows(fa_isa isa, fa_idx rows, fa_idx n, const float *x, const float *mean,
                      int8_t *codes, float *scales);

/* sums[c] = the sum over r of x[r * n + c] (`rows` contiguous rows of n
 * floats) in double, r in order, as numpy's x.sum(axis=0, dtype=float64)
 * sums them (n > 1): the int8 mode's key mean (of two NaNs, which one's
 * payload the sum keeps is the compiler's choice).  -1 when rows or n is
 * negative, else 0. */
int fa_col_sums(fa_isa isa, fa_idx rows, fa_idx n, const float *x, double *sums);

/* ---- The exp used by softmax (error bound: fa_prim_exp_consts.h) ------------ */

/* y = exp(x) for n elements.  mode 0: the general exp; 1: the softmax's,
 * for x <= ln 256 only (what the attention kernels use on their scores,
 * less their running maximum); 2: the same with -inf lanes skipped (masked
 * scores).  Returns 0, or -1 when n < 0. */
int fa_exp(fa_isa isa, int elsize, fa_idx n, const void *x, void *y, int mode);

#endif
