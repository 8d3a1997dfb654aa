# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Cython layer of fastattn: the parallel loops around the C kernels.

Every function here takes arrays that the Python layer has already checked:
dtypes float32/float64 (bool for masks), element strides, shapes that agree.
The loops release the GIL and split the work into independent pieces (see
csrc/fastattn.h), spread over OpenMP threads when the build has OpenMP.
"""
import threading
from os import cpu_count

from cython.parallel cimport parallel, prange, threadid
from libc.math cimport INFINITY, log
from libc.stdint cimport int8_t, int32_t
from libc.stdlib cimport free, malloc, qsort
from libc.string cimport memcpy, memset

cimport numpy as cnp
from cpython.exc cimport PyErr_Fetch, PyErr_Restore
from cpython.ref cimport PyObject

cnp.import_array()

# OpenMP ends the whole process when it cannot create a thread it was asked
# for, so a request is bounded: well past any useful count on this machine.
MAX_THREADS = max(1024, cpu_count() or 1)

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static int fa_have_openmp(void) { return 1; }
    static int fa_omp_max_threads(void) { return omp_get_max_threads(); }
    static double fa_clock(void) { return omp_get_wtime(); }
    #else
    #include <time.h>
    static int fa_have_openmp(void) { return 0; }
    static int fa_omp_max_threads(void) { return 1; }
    /* serial build: the one thread's processor time is its wall time */
    static double fa_clock(void) { return (double)clock() / CLOCKS_PER_SEC; }
    #endif
    /* flag is read by every thread while the calling thread may set it */
    typedef struct { double next_check; volatile int flag; } fa_stop;
    """
    int fa_have_openmp() nogil
    int fa_omp_max_threads() nogil
    double fa_clock() nogil
    ctypedef struct fa_stop:
        double next_check
        int flag

cdef extern from "fastattn.h" nogil:
    ctypedef Py_ssize_t fa_idx
    ctypedef enum fa_isa:
        FA_ISA_PORTABLE
        FA_ISA_AVX2
        FA_ISA_AVX512
        FA_ISA_NEON
    ctypedef enum fa_mask_kind:
        FA_MASK_NONE
        FA_MASK_BOOL
        FA_MASK_ADD
    ctypedef enum fa_store:
        FA_STORE_NATIVE
        FA_STORE_F16
        FA_STORE_BF16
        FA_STORE_I8
        FA_STORE_F8E4M3
        FA_STORE_F8E5M2
        FA_STORE_Q4
    ctypedef enum fa_precision:
        FA_PRECISION_EXACT
        FA_PRECISION_INT8
    ctypedef struct fa_gemm_args:
        fa_idx M, N, K
        fa_idx rs_a, cs_a, rs_b, cs_b, rs_c, cs_c
    ctypedef struct fa_attn_args:
        fa_idx L, S, E, Ev
        fa_idx q_ls, q_es, k_ss, k_es, v_ss, v_es, o_ls, o_es, w_ls, w_ss, lse_s
        fa_mask_kind mask_kind
        fa_idx m_ls, m_ss, m_s0
        double scale, softcap, alibi_slope
        int causal
        fa_idx window_left, window_right, causal_offset
        double sink
        fa_store q_store, kv_store
        const float *k_scale
        const float *v_scale
        fa_idx ksc_s, vsc_s
        const int32_t *block_table
        fa_idx block_size
        fa_idx k_bs, v_bs, ksc_bs, vsc_bs
        fa_idx heads
        fa_idx q_hs, o_hs, lse_hs
        const double *head_slopes
        const double *head_sinks
        int prefetch
        fa_precision precision
        int int8_base
        const void *k_mean
    enum:
        FA_PREFETCH_KEYS
        FA_PREFETCH_VALUES
        FA_PREFETCH_FAR
        FA_PREFETCH_BLOCKS

    int fa_cpu_has_avx2_fma()
    int fa_cpu_has_avx512()
    int fa_cpu_has_avx512_vnni()
    int fa_cpu_has_avx_vnni()
    int fa_cpu_has_neon()
    int fa_cpu_has_neon_fp16()
    int fa_cpu_has_neon_bf16()
    int fa_cpu_has_neon_dotprod()
    fa_idx fa_gemm_mc(int elsize)
    fa_idx fa_gemm_nc(int elsize)
    size_t fa_gemm_work_bytes(int elsize)
    int fa_gemm(fa_isa isa, int elsize, const fa_gemm_args *g, const void *a, const void *b,
                void *c, fa_idx i0, fa_idx i1, fa_idx j0, fa_idx j1, void *work)
    size_t fa_softmax_work_bytes(fa_idx n, int elsize)
    int fa_softmax_row(fa_isa isa, int elsize, fa_idx n, const void *x, fa_idx xs,
                       fa_mask_kind mk, const void *mask, fa_idx ms, void *out, fa_idx os,
                       void *work)
    enum: FA_ATTN_MAX_FEATURES
    fa_idx fa_attn_query_block(int elsize)
    size_t fa_attn_work_bytes(const fa_attn_args *a, int elsize)
    ctypedef struct fa_attn_next:
        const void *q
        const void *k
        const void *v
        fa_idx i0, i1
    int fa_attn(fa_isa isa, int elsize, const fa_attn_args *a, const void *q, const void *k,
                const void *v, const void *mask, void *out, void *w, void *lse, fa_idx i0,
                fa_idx i1, const fa_attn_next *next, void *work)
    fa_idx fa_attn_splits(const fa_attn_args *a)
    fa_idx fa_attn_split_keys(const fa_attn_args *a)
    enum: FA_ATTN_SPLITS_MAX
    enum: FA_ATTN_PARTS_MAX
    int fa_attn_parts(fa_isa isa, int elsize, fa_idx n, const fa_attn_args *a,
                      const void *const *q, const void *const *k, const void *const *v,
                      const void *const *mask, fa_idx s_lo, fa_idx s_hi, void *const *state,
                      void *work)
    fa_idx fa_attn_group(fa_isa isa, int elsize, const fa_attn_args *a, fa_idx group)
    fa_idx fa_attn_state_len(const fa_attn_args *a, fa_idx i0, fa_idx i1)
    int fa_attn_part(fa_isa isa, int elsize, const fa_attn_args *a, const void *q,
                     const void *k, const void *v, const void *mask, fa_idx i0, fa_idx i1,
                     fa_idx s_lo, fa_idx s_hi, void *state, void *work)
    int fa_attn_merge(fa_isa isa, int elsize, const fa_attn_args *a, fa_idx nsplit,
                      const void *states, void *out, void *ml, fa_idx i0, fa_idx i1)
    int fa_attn_weights(fa_isa isa, int elsize, const fa_attn_args *a, const void *q,
                        const void *k, const void *mask, const void *ml, void *w, fa_idx i0,
                        fa_idx i1, void *work)
    int fa_attn_repair(fa_isa isa, int elsize, const fa_attn_args *a, const void *q,
                       const void *k, const void *v, const void *mask, fa_idx nsplit,
                       const void *states, void *out, void *lse, fa_idx i0, fa_idx i1,
                       void *work)
    ctypedef struct fa_grad_args:
        fa_idx do_ls, do_es, dk_ss, dk_es, dv_ss, dv_es, do_hs, m_hs
    fa_idx fa_attn_grad_chunk_keys(const fa_attn_args *a, fa_idx kv_heads)
    size_t fa_attn_grad_work_bytes(const fa_attn_args *a, int elsize)
    int fa_attn_grad(fa_isa isa, int elsize, const fa_attn_args *a, const fa_grad_args *g,
                     const void *q, const void *k, const void *v, const void *mask,
                     const void *dout, const void *out, const void *lse, const void *rnorm,
                     void *dk, void *dv, void *dqt, void *psum, fa_idx s0, fa_idx s1,
                     void *work)
    int fa_attn_grad_merge(fa_isa isa, int elsize, fa_idx nchunks, fa_idx E, fa_idx nq,
                           double scale, const void *parts, fa_idx part_s, const void *sums,
                           fa_idx sum_s, void *dq, fa_idx dq_ls, fa_idx dq_es, void *psum,
                           fa_idx psum_s)
    int fa_narrow_f32(fa_isa isa, fa_store st, fa_idx n, const float *x, void *y)
    fa_idx fa_int8_rows(fa_isa isa, fa_idx rows, fa_idx n, const float *x, const float *mean,
                          int8_t *codes, float *scales)
    int fa_col_sums(fa_isa isa, fa_idx rows, fa_idx n, const float *x, double *sums)
    int fa_rotary(int elsize, fa_idx n, fa_idx half, int interleaved, const void *x,
                  fa_idx xs, const void *c, const void *s, void *y, fa_idx ys)
    int fa_exp(fa_isa isa, int elsize, fa_idx n, const void *x, void *y, int mode)

DEF MAXDIM = 64

ISA_PORTABLE = <int>FA_ISA_PORTABLE
ISA_AVX2 = <int>FA_ISA_AVX2
ISA_AVX512 = <int>FA_ISA_AVX512
ISA_NEON = <int>FA_ISA_NEON
MASK_NONE = <int>FA_MASK_NONE
MASK_BOOL = <int>FA_MASK_BOOL
MASK_ADD = <int>FA_MASK_ADD
STORE_NATIVE = <int>FA_STORE_NATIVE
STORE_F16 = <int>FA_STORE_F16
STORE_BF16 = <int>FA_STORE_BF16
STORE_I8 = <int>FA_STORE_I8
STORE_F8E4M3 = <int>FA_STORE_F8E4M3
STORE_F8E5M2 = <int>FA_STORE_F8E5M2
STORE_Q4 = <int>FA_STORE_Q4
PRECISION_EXACT = <int>FA_PRECISION_EXACT
PRECISION_INT8 = <int>FA_PRECISION_INT8
PREFETCH_KEYS = <int>FA_PREFETCH_KEYS
PREFETCH_VALUES = <int>FA_PREFETCH_VALUES
PREFETCH_FAR = <int>FA_PREFETCH_FAR
ATTN_MAX_FEATURES = FA_ATTN_MAX_FEATURES


cdef extern from *:
    """
    #if defined(__unix__) || defined(__APPLE__)
    #include <unistd.h>
    #endif
    /* One core's L2 cache in bytes where the C library tells (glibc), else 1 MiB. */
    static long fa_l2_bytes(void)
    {
    #ifdef _SC_LEVEL2_CACHE_SIZE
        const long n = sysconf(_SC_LEVEL2_CACHE_SIZE);
        if (n > 0) return n;
    #endif
        return 1L << 20;
    }
    """
    long fa_l2_bytes()


# Operands beyond the L2 of the threads used get prefetch hints (Ragged.ahead).
cdef Py_ssize_t L2_BYTES = fa_l2_bytes()


def cpu_has_avx2_fma():
    return bool(fa_cpu_has_avx2_fma())


def cpu_has_avx512():
    return bool(fa_cpu_has_avx512())


def cpu_has_avx512_vnni():
    return bool(fa_cpu_has_avx512_vnni())


def cpu_has_avx_vnni():
    return bool(fa_cpu_has_avx_vnni())


def cpu_has_neon():
    return bool(fa_cpu_has_neon())


def cpu_has_neon_fp16():
    return bool(fa_cpu_has_neon_fp16())


def cpu_has_neon_bf16():
    return bool(fa_cpu_has_neon_bf16())


def cpu_has_neon_dotprod():
    return bool(fa_cpu_has_neon_dotprod())


def have_openmp():
    return bool(fa_have_openmp())


def omp_max_threads():
    return fa_omp_max_threads()


def attn_query_block(int elsize):
    return fa_attn_query_block(elsize)


cdef struct Batch:
    # Leading ("batch") dimensions shared by the operands of one call, and
    # each operand's element strides over them.
    int nd
    fa_idx shape[MAXDIM]
    fa_idx count


cdef int fill_batch(Batch *b, cnp.ndarray a, int nd) except -1:
    """The first nd axes of a are the batch axes."""
    cdef int d
    if nd > MAXDIM:
        raise ValueError(f"at most {MAXDIM} batch dimensions are supported, got {nd}")
    b.nd = nd
    b.count = 1
    for d in range(nd):
        b.shape[d] = cnp.PyArray_DIM(a, d)
        b.count *= b.shape[d]
    return 0


cdef inline fa_idx estride(cnp.ndarray a, int axis):
    """The element stride of one axis; 0 for an empty array, whose strides
    may be anything (2**62 included) and only ever feed pointer arithmetic."""
    if cnp.PyArray_SIZE(a) == 0:
        return 0
    return cnp.PyArray_STRIDE(a, axis) // cnp.PyArray_ITEMSIZE(a)


cdef int fill_strides(fa_idx *dst, cnp.ndarray a, int nd) except -1:
    """Element strides of the first nd axes of a (see estride)."""
    cdef int d
    for d in range(nd):
        dst[d] = estride(a, d)
    return 0


cdef inline fa_idx nd_offset(const Batch *b, const fa_idx *strides, fa_idx flat) noexcept nogil:
    """Element offset of batch item `flat`."""
    cdef fa_idx off = 0
    cdef int d
    if b.nd == 1:  # (a ragged call's sequences: no division per operand and task)
        return flat * strides[0]
    for d in range(b.nd - 1, -1, -1):
        off += (flat % b.shape[d]) * strides[d]
        flat = flat // b.shape[d]
    return off


# Ctrl-C during a long call.  Python runs its signal handlers only with the
# GIL, which the loops release; so the calling thread (thread 0 of each
# parallel loop), between two of its tasks, takes the GIL every
# SIGNAL_CHECK seconds to run them.  When one raises (KeyboardInterrupt),
# every thread skips the tasks left, the loop ends, and the exception
# propagates.  Calls shorter than SIGNAL_CHECK never take the GIL.
DEF SIGNAL_CHECK = 0.02

cdef extern from "Python.h":
    # declared here without cpython.exc's `except -1`: its exception is kept
    # set across the rest of the loop, then raised by stop_raise
    int run_signal_handlers "PyErr_CheckSignals"()


cdef inline void stop_init(fa_stop *s) noexcept nogil:
    s.next_check = fa_clock() + SIGNAL_CHECK
    s.flag = 0


cdef int signal_raised() noexcept with gil:
    """Python's signal handlers, run now: -1 when one raised, with its
    exception left set for stop_raise."""
    return run_signal_handlers()


cdef inline bint stopped(fa_stop *s) noexcept nogil:
    """Whether the remaining tasks of this call are to be skipped."""
    if threadid() == 0 and s.flag == 0 and fa_clock() >= s.next_check:
        if signal_raised() != 0:
            s.flag = 1
        s.next_check = fa_clock() + SIGNAL_CHECK
    return s.flag != 0


cdef int stop_raise(const fa_stop *s) except -1:
    """Raises the exception of the signal handler that stopped a loop."""
    return -1 if s.flag else 0


cdef int raise_on(int err, str what) except -1:
    """The error a parallel loop flagged: 1 = a thread's scratch allocation
    failed, 2 = a kernel rejected its arguments (a bug of this module)."""
    if err == 1:
        raise MemoryError(f"fastattn: cannot allocate the {what} scratch memory")
    if err == 2:
        raise RuntimeError(f"fastattn internal error: the {what} kernel rejected its arguments")
    return 0


cdef inline void *at(char *base, int size, const Batch *b, const fa_idx *strides,
                     fa_idx item) noexcept nogil:
    """Start of batch item `item` of an operand; NULL stays NULL."""
    if base == NULL:
        return NULL
    return base + size * nd_offset(b, strides, item)


cdef struct Operand:
    # One array of an attention call: its start (NULL: absent), element
    # size, and element strides over the sequences' axes and the heads.
    char *base
    int size
    fa_idx head
    fa_idx seq[MAXDIM]


cdef int operand(Operand *x, cnp.ndarray a, int nseq, int head_axis) except -1:
    """x (zeroed: absent) from a, unless a is None: its first nseq axes are
    the sequences' axes, head_axis (-1: none) its heads'."""
    if a is None:
        return 0
    x.base = <char *>cnp.PyArray_DATA(a)
    x.size = cnp.PyArray_ITEMSIZE(a)
    fill_strides(x.seq, a, nseq)
    x.head = estride(a, head_axis) if head_axis >= 0 else 0
    return 0


cdef struct Ragged:
    # The operands of one attention call, dense or ragged: the arguments its
    # sequences and heads share and where each starts.  Sequence b's
    # operands start at its offsets over `seqs` (a dense call's batch axes
    # before the heads; a ragged call's B sequences), plus in a ragged call
    # its first query row cu_q[b] and its keys' first row kv_start[b] or
    # block table row; query head h at h head strides from there, and
    # key/value head h // group.
    fa_attn_args a
    Batch seqs
    Operand q, k, v, m, o, w, lse, ksc, vsc, slope, sink, kmean
    const int32_t *table          # (B, table_s) block ids, or NULL: keys contiguous
    const cnp.int64_t *kv_start   # or NULL: every sequence's keys from row 0
    const cnp.int64_t *cu_q       # or NULL: a.L rows from row 0
    const cnp.int64_t *seq_lens   # or NULL: a.S keys
    const cnp.int64_t *tree_at    # or NULL: where each sequence's tree mask starts in m
    fa_idx table_s, Hq, group
    fa_idx kv_row_bytes   # a key row's and a value row's bytes
    fa_idx align_offset   # query i of a sequence is at key position i + this
    bint lower_right      # ... plus S - L of the sequence
    bint ahead_blocks     # FA_PREFETCH_BLOCKS for sequences beyond L2
    bint ahead            # fa_attn_next hints: the operands exceed the threads' L2
    bint can_group        # query heads may share their key/value head's reads
    int es                # of out, weights and lse: the kernels' type
    int isa               # the path the call's kernels take


cdef struct RaggedTask:
    # Rows i0..i1-1 of query heads head..head+heads-1 of a sequence (heads
    # that share a key/value head, computed together so that its keys and
    # values are read once); when the item's keys are split (nsplit > 1),
    # its keys s_lo..s_hi-1 into the state at `state` (elements from the
    # start of the call's states).  cost: of its whole item; order: when made.
    # share: the tasks from this one on that read the same keys together
    # (fa_attn_parts: pieces over a paged cache's shared blocks), 1 alone;
    # key: a paged piece's hash of the rows it reads, else 0.
    fa_idx seq, head, heads, i0, i1, s_lo, s_hi, nsplit, state, order, share
    cnp.uint64_t key
    double cost


cdef int costlier_first(const void *x, const void *y) noexcept nogil:
    """qsort's order of tasks: costlier items first, then as made (qsort is
    not stable), so that an item's tasks, and the heads of one key/value
    head, stay together and in order."""
    cdef const RaggedTask *s = <const RaggedTask *>x
    cdef const RaggedTask *t = <const RaggedTask *>y
    if s.cost != t.cost:
        return -1 if s.cost > t.cost else 1
    return -1 if s.order < t.order else (1 if s.order > t.order else 0)


cdef inline char *start(const Operand *x, const Ragged *p, fa_idx b, fa_idx h, fa_idx row,
                        fa_idx row_stride) noexcept nogil:
    """Where operand x of sequence b, head h, row `row` starts; NULL when absent."""
    if x.base == NULL:
        return NULL
    return x.base + x.size * (nd_offset(&p.seqs, x.seq, b) + h * x.head + row * row_stride)


cdef inline fa_idx q_row(const Ragged *p, fa_idx b) noexcept nogil:
    return p.cu_q[b] if p.cu_q != NULL else 0


cdef inline fa_idx kv_row(const Ragged *p, fa_idx b) noexcept nogil:
    return p.kv_start[b] if p.kv_start != NULL else 0


cdef inline void ragged_args(const Ragged *p, fa_idx b, fa_idx h, fa_idx heads,
                             fa_attn_args *r) noexcept nogil:
    """r = the arguments of sequence b, query heads h..h+heads-1 (of one
    key/value head): its L and S (the queries its last L positions), block
    table row, scales, key mean, slopes and sinks."""
    cdef const double *x
    r[0] = p.a
    if p.cu_q != NULL:
        r.L = p.cu_q[b + 1] - p.cu_q[b]
    if p.seq_lens != NULL:
        r.S = p.seq_lens[b]
    r.causal_offset = (r.S - r.L if p.lower_right else 0) + p.align_offset
    if p.tree_at != NULL:  # an (L, L) bool mask over its last L keys (L <= S), or none
        r.mask_kind = FA_MASK_NONE
        if p.tree_at[b] >= 0:
            r.mask_kind = FA_MASK_BOOL
            r.m_ls, r.m_ss, r.m_s0 = r.L, 1, r.S - r.L
    r.block_table = p.table + b * p.table_s if p.table != NULL else NULL
    r.heads = heads
    if p.ahead_blocks and r.S * p.kv_row_bytes > L2_BYTES:
        r.prefetch |= FA_PREFETCH_BLOCKS
    if p.ksc.base != NULL:
        r.k_scale = <const float *>start(&p.ksc, p, b, h // p.group, kv_row(p, b), r.ksc_s)
        r.v_scale = <const float *>start(&p.vsc, p, b, h // p.group, kv_row(p, b), r.vsc_s)
    r.k_mean = start(&p.kmean, p, b, h // p.group, 0, 0)
    if p.slope.base != NULL:
        x = <const double *>start(&p.slope, p, b, h, 0, 0)
        r.alibi_slope = x[0]
        r.head_slopes = x if heads > 1 else NULL
    if p.sink.base != NULL:
        x = <const double *>start(&p.sink, p, b, h, 0, 0)
        r.sink = x[0]
        r.head_sinks = x if heads > 1 else NULL


cdef inline fa_attn_next task_rows(const Ragged *p, const RaggedTask *t,
                                   const fa_attn_args *a) noexcept nogil:
    """Where task t reads its queries, keys and values."""
    cdef fa_attn_next r
    cdef fa_idx b = t.seq, kvh = t.head // p.group
    r.q = start(&p.q, p, b, t.head, q_row(p, b), a.q_ls)
    r.k = start(&p.k, p, b, kvh, kv_row(p, b), a.k_ss)
    r.v = start(&p.v, p, b, kvh, kv_row(p, b), a.v_ss)
    r.i0, r.i1 = t.i0, t.i1
    return r


cdef inline void row_lse(int es, void *ml, fa_idx i, void *lse, fa_idx at) noexcept nogil:
    """lse[at] from row i's merged maximum and sum in ml (fa_kern_scores.h's lse)."""
    cdef double m, l
    if es == 4:
        m, l = (<float *>ml)[2 * i], (<float *>ml)[2 * i + 1]
        (<float *>lse)[at] = -INFINITY if l == 0 else <float>m + <float>log(l)
    else:
        m, l = (<double *>ml)[2 * i], (<double *>ml)[2 * i + 1]
        (<double *>lse)[at] = -INFINITY if l == 0 else m + log(l)


cdef struct Plan:
    # A call's task list: ntasks tasks, then nitems merges of split items.
    # Explicit (tasks: ragged calls, whose sequences differ and are sorted
    # costlier first), or, when tasks is NULL, implicit: a dense call's
    # items are alike, so task t is computed from t in the order made,
    # in constant memory whatever the batch.
    RaggedTask *tasks
    fa_idx ntasks, nitems, nstate
    # tasks run in order (NULL: every task); a run of `share` tasks counts
    # once, by its first, and nrun is how many there are; most: the largest
    fa_idx *run
    fa_idx nrun, most
    # the implicit list: per item per_item tasks (nsplit pieces of chunk
    # keys, or nqb blocks of rows); per sequence `chunks` items of at most
    # `together` heads, cpk of them per key/value head; slen: the state of
    # a piece of `together` heads
    fa_idx per_item, nsplit, chunk, nqb, chunks, cpk, together, slen, L, S
    bint ascending


cdef inline void implicit_item(const Ragged *p, const Plan *pl, fa_idx item,
                               RaggedTask *x) noexcept nogil:
    """The sequence and heads of item `item` of an implicit plan."""
    cdef fa_idx c = item % pl.chunks, j
    j = c % pl.cpk
    x.seq = item // pl.chunks
    x.head = (c // pl.cpk) * p.group + j * pl.together
    x.heads = min(pl.together, p.group - j * pl.together)
    x.nsplit = pl.nsplit
    x.share = 1
    x.i0, x.i1, x.s_lo, x.s_hi = 0, pl.L, 0, pl.S


cdef inline void plan_task(const Ragged *p, const Plan *pl, fa_idx t, bint merge,
                           RaggedTask *x) noexcept nogil:
    """Task t of the plan, or (merge) its merge t."""
    cdef fa_idx piece
    if pl.tasks != NULL:
        x[0] = pl.tasks[pl.ntasks + t if merge else (pl.run[t] if pl.run != NULL else t)]
        return
    if merge:
        implicit_item(p, pl, t, x)
        x.state = t * pl.per_item * pl.slen
        return
    implicit_item(p, pl, t // pl.per_item, x)
    piece = t % pl.per_item
    if pl.nsplit > 1:  # an item's pieces one after another, each of its heads' length
        x.s_lo = piece * pl.chunk
        x.s_hi = min(x.s_lo + pl.chunk, pl.S)
        x.state = (t - piece) * pl.slen + piece * (pl.slen // pl.together) * x.heads
    else:
        x.i0 = (piece if pl.ascending else pl.nqb - 1 - piece) * fa_attn_query_block(p.es)
        x.i1 = min(x.i0 + fa_attn_query_block(p.es), pl.L)
        x.state = 0


cdef inline const void *mask_of(const Ragged *p, fa_idx b, fa_idx h) noexcept nogil:
    """Sequence b's mask for query head h: its tree's, or the mask operand's."""
    if p.tree_at == NULL:
        return start(&p.m, p, b, h, 0, 0)
    return p.m.base + p.tree_at[b] if p.tree_at[b] >= 0 else NULL


cdef int parts_run(int isa, const Ragged *p, const RaggedTask *x, fa_idx n, char *states,
                   void *work) noexcept nogil:
    """Pieces x[0..n-1] of different items over the same keys, computed
    together (fa_attn_parts); the kernel's return code."""
    cdef fa_attn_args a[FA_ATTN_PARTS_MAX]
    cdef const void *q[FA_ATTN_PARTS_MAX]
    cdef const void *k[FA_ATTN_PARTS_MAX]
    cdef const void *v[FA_ATTN_PARTS_MAX]
    cdef const void *m[FA_ATTN_PARTS_MAX]
    cdef void *st[FA_ATTN_PARTS_MAX]
    cdef fa_attn_next r
    cdef fa_idx u
    for u in range(n):
        ragged_args(p, x[u].seq, x[u].head, x[u].heads, &a[u])
        r = task_rows(p, &x[u], &a[u])
        q[u], k[u], v[u] = r.q, r.k, r.v
        m[u] = mask_of(p, x[u].seq, x[u].head)
        st[u] = states + p.es * x[u].state
    return fa_attn_parts(<fa_isa>isa, p.es, n, a, q, k, v, m, x[0].s_lo, x[0].s_hi, st, work)


cdef int ragged_run(int isa, const Ragged *p, const Plan *pl, fa_idx t, fa_idx n,
                    int nthreads, char *states, bint merge, void *work) noexcept nogil:
    """Task t of the plan, or (merge) the merge of split item t's pieces,
    their repair, weights and lse; the kernels' return code."""
    cdef RaggedTask x, nx
    plan_task(p, pl, t, merge, &x)
    cdef fa_idx b = x.seq, h = x.head, i
    cdef fa_attn_args ai
    ragged_args(p, b, h, x.heads, &ai)
    cdef fa_attn_next cur = task_rows(p, &x, &ai)
    cdef fa_attn_next nxt
    cdef const fa_attn_next *hint = NULL
    cdef void *m = <void *>mask_of(p, b, h)
    cdef void *o = start(&p.o, p, b, h, q_row(p, b), ai.o_ls)
    cdef void *w = start(&p.w, p, b, h, 0, 0)
    cdef void *lse = start(&p.lse, p, b, h, q_row(p, b), ai.lse_s)
    cdef void *st = states + p.es * x.state if x.nsplit > 1 else NULL
    cdef float mlf[2 * 4]   # the merged maximum and sum of at most FA_ROWS_MAX rows
    cdef double mld[2 * 4]
    cdef void *ml = <void *>mlf if p.es == 4 else <void *>mld
    cdef int rc
    if not merge and st == NULL:
        # the task this thread most likely takes next, when its rows suit
        # this call: prefetched as this one ends (only a hint)
        if p.ahead and t + nthreads < n:
            plan_task(p, pl, t + nthreads, False, &nx)
            if nx.nsplit == 1 and nx.i1 <= ai.L and ai.heads * (nx.i1 - nx.i0) <= fa_attn_query_block(p.es):
                nxt = task_rows(p, &nx, &ai)
                hint = &nxt
        return fa_attn(<fa_isa>isa, p.es, &ai, cur.q, cur.k, cur.v, m, o, w, lse, x.i0, x.i1,
                       hint, work)
    if not merge and x.share > 1:
        return parts_run(isa, p, &pl.tasks[pl.run[t]], x.share, states, work)
    if not merge:
        return fa_attn_part(<fa_isa>isa, p.es, &ai, cur.q, cur.k, cur.v, m, 0, ai.L, x.s_lo,
                            x.s_hi, st, work)
    # merged, then the rows that came out non-finite where a key's weight
    # may be 0 against the row's maximum but not against its piece's
    # computed again without the split (fa_attn_repair), then the weights
    # and each row's lse from the merged maximum and sum, so that asking for
    # them does not change the output
    rc = fa_attn_merge(<fa_isa>isa, p.es, &ai, x.nsplit, st, o, ml, 0, ai.L)
    if rc == 0:
        rc = fa_attn_repair(<fa_isa>isa, p.es, &ai, cur.q, cur.k, cur.v, m, x.nsplit, st, o,
                            NULL, 0, ai.L, work)
    if rc == 0 and w != NULL:
        rc = fa_attn_weights(<fa_isa>isa, p.es, &ai, cur.q, cur.k, m, ml, w, 0, ai.L, work)
    if lse != NULL:  # row i of head g of the task: ml's row g L + i
        for i in range(ai.L * x.heads):
            row_lse(p.es, ml, i, lse, i // ai.L * p.lse.head + i % ai.L * ai.lse_s)
    return rc


cdef inline fa_idx grouped(const Ragged *p, const fa_attn_args *a) noexcept nogil:
    """Query heads of one key/value head computed together for a sequence
    of a->L queries: fa_attn_group's, never with weights or a mask that
    differs between heads."""
    if not p.can_group:
        return 1
    return fa_attn_group(<fa_isa>p.isa, p.es, a, p.group)


cdef inline fa_idx item_splits(const fa_attn_args *a, fa_idx together) noexcept nogil:
    """Pieces an item's keys are split into: fa_attn_splits's, but none for
    heads folded into the block kernel (more than 4 rows in all)."""
    return fa_attn_splits(a) if together * a.L <= 4 else 1


cdef inline void bounded_keys(const fa_attn_args *a, fa_idx i0, fa_idx i1, fa_idx *lo,
                              fa_idx *hi) noexcept nogil:
    """lo..hi-1 (s_lo..s_hi-1 on entry): those of the keys that the causal
    and window bounds leave rows i0..i1-1 (fa_kern_scores.h's key_range)."""
    if a.causal or a.window_right >= 0:
        hi[0] = min(hi[0], max(a.causal_offset + i1 + (0 if a.causal else a.window_right), 0))
    if a.window_left >= 0:
        lo[0] = max(lo[0], a.causal_offset + i0 - a.window_left)


cdef double ragged_cost(const fa_attn_args *a, fa_idx i0, fa_idx i1, fa_idx s_lo, fa_idx s_hi) noexcept nogil:
    """About the time of rows i0..i1-1 over keys s_lo..s_hi-1 (those the
    bounds leave), in key-rows: a block of rows reads each key once for all
    of them, and a key read costs some 8 rows' products (decoding is bound
    by memory, blocks of rows by arithmetic)."""
    cdef fa_idx lo = s_lo, hi = s_hi
    bounded_keys(a, i0, i1, &lo, &hi)
    return <double>max(hi - lo, 0) * <double>(i1 - i0 + 8)


ctypedef int (*task_fn)(const void *ctx, fa_idx t, void *work) noexcept nogil


# The kernels' scratch, kept between calls per Python thread up to this
# size: malloc'd and freed per call, glibc could give it back to the OS and
# the next call fault it in again (threads-and-speed.md, "Scratch kept
# between calls").
SCRATCH_KEEP = 8 << 20
_kept = threading.local()


cdef class Scratch:
    """nbytes of malloc'd scratch, freed with the object (take_scratch)."""
    cdef char *data
    cdef readonly size_t nbytes

    def __cinit__(self, size_t nbytes):
        self.data = <char *>malloc(max(nbytes, 1))
        if self.data == NULL:
            raise MemoryError(f"cannot allocate {nbytes} bytes of scratch")
        self.nbytes = nbytes

    def __dealloc__(self):
        free(self.data)

    def fill(self, unsigned char byte):
        """Every byte set to byte (the tests' garbage between calls)."""
        memset(self.data, byte, self.nbytes)


cdef inline size_t scratch_stride(size_t work_bytes) noexcept nogil:
    """Bytes between two threads' parts of a kept scratch: their own lines."""
    return (work_bytes + 63) // 64 * 64


cdef Scratch take_scratch(size_t work_bytes, int nthreads):
    """This Python thread's kept scratch, taken out of its keeping for the
    call (a call made meanwhile on this thread, by a signal handler or a
    finaliser run at a signal check, makes its own), or a new one when it
    is smaller than nthreads parts of work_bytes; None past SCRATCH_KEEP.
    Given back by keep_scratch."""
    cdef size_t nbytes = scratch_stride(work_bytes) * max(nthreads, 1)
    if nbytes > SCRATCH_KEEP:
        return None
    s = getattr(_kept, "buf", None)
    _kept.buf = None
    if type(s) is not Scratch or (<Scratch>s).nbytes < nbytes:
        s = Scratch(nbytes)
    return <Scratch>s


cdef void keep_scratch(Scratch s):
    """s kept for this Python thread's next calls, unless it keeps a larger
    one (made by a call nested in the one that took s); an exception a
    signal handler left set for stop_raise stays set."""
    cdef PyObject *etype
    cdef PyObject *evalue
    cdef PyObject *etb
    if s is None:
        return
    PyErr_Fetch(&etype, &evalue, &etb)
    held = getattr(_kept, "buf", None)
    if type(held) is not Scratch or (<Scratch>held).nbytes < s.nbytes:
        _kept.buf = s
    PyErr_Restore(etype, evalue, etb)


cdef inline char *scratch_data(Scratch s) noexcept:
    """s's bytes, NULL for None (each thread mallocs its own then)."""
    return s.data if s is not None else NULL


cdef inline void *thread_scratch(char *kept, size_t work_bytes) noexcept nogil:
    """The calling thread's work_bytes (thread 0 outside a parallel region):
    its part of kept (take_scratch's, sized for every thread of the
    region), or malloc'd (NULL if that fails) when kept is NULL; released
    by release_scratch."""
    if kept != NULL:
        return kept + threadid() * scratch_stride(work_bytes)
    return malloc(work_bytes)


cdef inline void release_scratch(char *kept, void *work) noexcept nogil:
    if kept == NULL:
        free(work)


cdef int run_parallel(task_fn task, const void *ctx, fa_idx n, size_t work_bytes, int nthreads,
                      fa_stop *stop) except -1:
    """task(ctx, t, work) for t in 0..n-1 over nthreads threads, each with
    work_bytes of scratch (parts of take_scratch's, else malloc'd); a single
    thread without a parallel region: entering one costs a tenth of a small
    call (threads-and-speed.md, "Small calls").  1 when a thread's scratch
    could not be allocated, 2 when a task returned non-zero, else 0."""
    cdef fa_idx t
    cdef void *work
    cdef int err = 0
    cdef int *errp = &err
    nthreads = min(nthreads, n)
    cdef Scratch scratch = take_scratch(work_bytes, nthreads) if n > 0 else None
    cdef char *kept = scratch_data(scratch)
    if nthreads <= 1:
        with nogil:
            work = thread_scratch(kept, work_bytes)
            err = 1 if work == NULL else 0
            t = 0
            while err == 0 and t < n and not stopped(stop):
                err = 2 if task(ctx, t, work) != 0 else 0
                t += 1
            release_scratch(kept, work)
    else:
        with nogil, parallel(num_threads=nthreads):
            work = thread_scratch(kept, work_bytes)
            if work == NULL:
                errp[0] = 1
            for t in prange(n, schedule="dynamic"):
                if work == NULL or stopped(stop):
                    continue
                if task(ctx, t, work) != 0:
                    errp[0] = 2
            release_scratch(kept, work)
    keep_scratch(scratch)
    return err


cdef struct PlanRun:
    # run_tasks' arguments, for run_parallel
    int isa
    const Ragged *p
    const Plan *pl
    fa_idx n
    char *states
    bint merge
    int nthreads


cdef int plan_task_run(const void *ctx, fa_idx t, void *work) noexcept nogil:
    cdef const PlanRun *r = <const PlanRun *>ctx
    return ragged_run(r.isa, r.p, r.pl, t, r.n, r.nthreads, r.states, r.merge, work)


cdef int run_tasks(int isa, const Ragged *p, const Plan *pl, fa_idx n, char *states,
                   bint merge, int nthreads, fa_stop *stop) except -1:
    """Tasks 0..n-1 of the plan (or its merges) over nthreads threads."""
    cdef PlanRun r
    r.isa, r.p, r.pl, r.n, r.states, r.merge = isa, p, pl, n, states, merge
    r.nthreads = min(nthreads, n)
    return run_parallel(plan_task_run, &r, n,
                        fa_attn_work_bytes(&p.a, p.es) * (1 if merge else pl.most), nthreads, stop)


cdef void implicit_plan(const Ragged *p, Plan *pl) noexcept nogil:
    """A dense call's plan: its sequences all of a.L rows over a.S keys."""
    cdef fa_attn_args ai
    cdef fa_idx qb = fa_attn_query_block(p.es)
    if p.seqs.count == 0 or p.Hq == 0:
        return
    ragged_args(p, 0, 0, 1, &ai)
    if ai.L == 0:
        return
    pl.L, pl.S = ai.L, ai.S
    pl.together = grouped(p, &ai)
    pl.nsplit = item_splits(&ai, pl.together)
    pl.cpk = (p.group + pl.together - 1) // pl.together
    pl.chunks = (p.Hq // p.group) * pl.cpk
    pl.nqb = (ai.L + qb - 1) // qb
    pl.chunk = fa_attn_split_keys(&ai)
    pl.per_item = pl.nsplit if pl.nsplit > 1 else pl.nqb
    pl.ntasks = p.seqs.count * pl.chunks * pl.per_item
    ai.heads = pl.together
    pl.slen = fa_attn_state_len(&ai, 0, ai.L)
    if pl.nsplit > 1:
        pl.nitems = p.seqs.count * pl.chunks
        pl.nstate = pl.ntasks * pl.slen


cdef inline cnp.uint64_t mixed(cnp.uint64_t h, cnp.uint64_t x) noexcept nogil:
    return (h ^ x) * <cnp.uint64_t>1099511628211  # FNV-1a's step, a word at a time


cdef cnp.uint64_t block_ids_key(const Ragged *p, fa_idx b, fa_idx s_lo, fa_idx s_hi) noexcept nogil:
    """A hash of sequence b's keys s_lo..s_hi-1 and the blocks they lie in."""
    cdef cnp.uint64_t h = mixed(mixed(<cnp.uint64_t>14695981039346656037, <cnp.uint64_t>s_lo),
                                <cnp.uint64_t>s_hi)
    cdef fa_idx j
    for j in range(s_lo // p.a.block_size, (s_hi - 1) // p.a.block_size + 1):
        h = mixed(h, <cnp.uint64_t><cnp.uint32_t>p.table[b * p.table_s + j])
    return h


cdef int explicit_plan(const Ragged *p, Plan *pl, fa_stop *stop) noexcept nogil:
    """A ragged call's plan, sorted; 1 when the list cannot be allocated."""
    cdef fa_idx qb = fa_attn_query_block(p.es)
    cdef fa_idx nseq = p.seqs.count, b, h, h0, piece, nqb, chunk, nsplit, together, first
    cdef fa_idx ntasks = 0, nitems = 0, nstate = 0, t, slen, k
    cdef double cost
    cdef fa_attn_args ai
    cdef RaggedTask *x
    cdef cnp.uint64_t blocks[FA_ATTN_SPLITS_MAX]  # each piece's hash of its block ids
    for b in range(nseq):
        ragged_args(p, b, 0, 1, &ai)
        if ai.L == 0:
            continue
        together = grouped(p, &ai)
        nsplit = item_splits(&ai, together)
        k = (p.Hq // p.group) * ((p.group + together - 1) // together)
        ntasks += k * (nsplit if nsplit > 1 else (ai.L + qb - 1) // qb)
        nitems += k if nsplit > 1 else 0
    if ntasks == 0:
        return 0
    pl.tasks = <RaggedTask *>malloc((ntasks + nitems) * sizeof(RaggedTask))
    if pl.tasks == NULL:
        return 1
    pl.ntasks = ntasks
    t = 0
    nitems = 0
    for b in range(nseq):
        if b % 4096 == 0 and stopped(stop):  # millions of sequences: let Ctrl-C in
            return 0
        ragged_args(p, b, 0, 1, &ai)
        if ai.L == 0:
            continue
        together = grouped(p, &ai)
        nsplit = item_splits(&ai, together)
        nqb = (ai.L + qb - 1) // qb
        chunk = fa_attn_split_keys(&ai)
        for piece in range(nsplit if nsplit > 1 and p.table != NULL else 0):
            blocks[piece] = block_ids_key(p, b, piece * chunk, min((piece + 1) * chunk, ai.S))
        for h0 in range(p.Hq):  # chunks of `together` heads of one key/value head
            if h0 % p.group % together:
                continue
            h = min(together, p.group - h0 % p.group)
            ai.heads = h
            slen = fa_attn_state_len(&ai, 0, ai.L)
            if nsplit > 1:
                pl.tasks[ntasks + nitems] = RaggedTask(b, h0, h, 0, ai.L, 0, ai.S, nsplit,
                                                       nstate, nitems, 1, 0, 0)
                nitems += 1
            first, cost = t, 0
            for piece in range(nsplit if nsplit > 1 else nqb):
                x = &pl.tasks[t]
                x.seq, x.head, x.heads, x.nsplit, x.order, x.share = b, h0, h, nsplit, t, 1
                x.key = 0
                if nsplit > 1:
                    x.i0, x.i1, x.s_lo = 0, ai.L, piece * chunk
                    x.s_hi = min(x.s_lo + chunk, ai.S)
                    x.state = nstate
                    nstate += slen
                    if p.table != NULL:  # those blocks of its key/value head's rows
                        x.key = mixed(blocks[piece], <size_t>start(
                            &p.k, p, b, h0 // p.group, kv_row(p, b), p.a.k_ss))
                else:
                    x.i0 = (piece if pl.ascending else nqb - 1 - piece) * qb
                    x.i1 = min(x.i0 + qb, ai.L)
                    x.s_lo, x.s_hi, x.state = 0, ai.S, 0
                cost += ragged_cost(&ai, x.i0, x.i1, x.s_lo, x.s_hi) * h
                t += 1
            for k in range(first, t):
                pl.tasks[k].cost = cost
    pl.nitems, pl.nstate = nitems, nstate
    qsort(pl.tasks, ntasks, sizeof(RaggedTask), costlier_first)
    if p.table != NULL and nitems > 1:
        return share_pieces(pl)
    return 0


cdef struct Keyed:
    cnp.uint64_t key
    fa_idx task


cdef int by_key(const void *x, const void *y) noexcept nogil:
    """qsort's order of keyed tasks: by key, then as listed."""
    cdef const Keyed *s = <const Keyed *>x
    cdef const Keyed *t = <const Keyed *>y
    if s.key != t.key:
        return -1 if s.key < t.key else 1
    return -1 if s.task < t.task else (1 if s.task > t.task else 0)


cdef int share_pieces(Plan *pl) noexcept nogil:
    """Pieces of different items that read the same keys in the same blocks
    (forked sequences, a prompt several requests share) made runs of up to
    FA_ATTN_PARTS_MAX tasks, each where its first (costliest) one was, so that
    fa_attn_parts reads those rows once for all; each piece's bits are its
    own still.  Found by their keys (hashes of the rows they read) and
    their key ranges, which a run shares (fa_attn_parts takes one): a
    collision, which a crafted block table can make, only runs pieces of
    the same keys over different blocks together, each still computed
    alone, and fa_attn_parts checks the rows before it lets one ask
    nothing ahead.  1 when memory fails."""
    cdef fa_idx n = pl.ntasks, nk = 0, i, j, u, w, t, c, g
    cdef Keyed *keyed = <Keyed *>malloc(n * sizeof(Keyed))
    cdef fa_idx *lead = <fa_idx *>malloc(4 * n * sizeof(fa_idx))
    cdef fa_idx *count = lead + n
    cdef fa_idx *nxt = lead + 2 * n      # the next member of a run, or -1
    cdef fa_idx *tail = lead + 3 * n     # a run's last member so far
    cdef RaggedTask *out = NULL
    if keyed == NULL or lead == NULL:
        free(keyed)
        free(lead)
        return 1
    for t in range(n):
        lead[t], count[t], nxt[t], tail[t] = t, 1, -1, t
        if pl.tasks[t].key != 0:
            keyed[nk].key, keyed[nk].task = pl.tasks[t].key, t
            nk += 1
    qsort(keyed, nk, sizeof(Keyed), by_key)
    g = 0
    i = 0
    while i < nk:
        j = i
        while j < nk and keyed[j].key == keyed[i].key:
            j += 1
        for u in range(i, j):  # a new run from each piece not taken yet
            t = keyed[u].task
            if lead[t] != t:
                continue
            w = u + 1
            while w < j and count[t] < FA_ATTN_PARTS_MAX:
                c = keyed[w].task
                # the same keys: the run is computed over its first's range
                if lead[c] == c and count[c] == 1 and pl.tasks[c].s_lo == pl.tasks[t].s_lo \
                        and pl.tasks[c].s_hi == pl.tasks[t].s_hi:
                    lead[c] = t
                    nxt[tail[t]] = c
                    tail[t] = c
                    count[t] += 1
                    g = max(g, count[t])
                w += 1
        i = j
    free(keyed)
    if g > 1:
        out = <RaggedTask *>malloc((n + pl.nitems) * sizeof(RaggedTask))
        pl.run = <fa_idx *>malloc(n * sizeof(fa_idx))
        if out == NULL or pl.run == NULL:
            free(out)
            free(lead)
            return 1
        c, pl.nrun, pl.most = 0, 0, g
        for t in range(n):
            if lead[t] != t:
                continue
            pl.run[pl.nrun] = c
            pl.nrun += 1
            u = t
            while u >= 0:
                out[c] = pl.tasks[u]
                out[c].share = count[t] if u == t else 0
                c += 1
                u = nxt[u]
        memcpy(out + n, pl.tasks + n, pl.nitems * sizeof(RaggedTask))
        free(pl.tasks)
        pl.tasks = out
    free(lead)
    return 0


cdef inline void task_keys(const Ragged *p, const RaggedTask *x, fa_idx *lo,
                           fa_idx *hi) noexcept nogil:
    """The keys task x reads: its s_lo..s_hi-1 that the bounds leave its
    rows (fa_attn_part's range)."""
    cdef fa_attn_args ai
    ragged_args(p, x.seq, x.head, x.heads, &ai)
    lo[0], hi[0] = x.s_lo, x.s_hi
    bounded_keys(&ai, x.i0, x.i1, lo, hi)


cdef cnp.int64_t plan_reads(const Ragged *p, const Plan *pl, fa_idx n) noexcept nogil:
    """Bytes of keys and values the plan's n tasks stream: each task's keys
    times a key row's and a value row's bytes; in a run of pieces over
    shared blocks, the keys of its first once, and those of each piece that
    the bounds leave other keys (which fa_attn_parts computes alone)."""
    cdef RaggedTask x
    cdef fa_idx t, u, lo, hi, lo1, hi1
    cdef cnp.int64_t total = 0
    for t in range(n):
        plan_task(p, pl, t, False, &x)
        task_keys(p, &x, &lo, &hi)
        total += max(hi - lo, 0) * p.kv_row_bytes
        for u in range(1, x.share):
            task_keys(p, &pl.tasks[pl.run[t] + u], &lo1, &hi1)
            if lo1 != lo or hi1 != hi:
                total += max(hi1 - lo1, 0) * p.kv_row_bytes
    return total


cdef int schedule(int isa, Ragged *p, size_t operand_bytes, int nthreads,
                  cnp.int64_t *read=NULL) except -1:
    """The call's tasks: every (sequence, head) split as
    scaled_dot_product_attention on that sequence alone splits it
    (fa_attn_splits), so that its bits are that call's: a task per block of
    query rows, of the sequence's own length, or per piece of its keys,
    merged after; a few rows (decoding) of the query heads of one key/value
    head together (fa_attn_args' heads: the keys read once for all).
    Costlier items first (a dense call's are alike: as made); within an
    item the largest causal blocks first, except under a window's left
    bound (ascending), where blocks cost about the same and the keys new to
    each block continue the ascending stream of the one before, which the
    hardware prefetcher follows."""
    cdef Plan pl
    cdef fa_stop stop
    cdef int err = 0
    cdef char *states = NULL
    memset(&pl, 0, sizeof(pl))
    p.isa = isa
    pl.ascending = p.a.window_left >= 0
    stop_init(&stop)
    if p.cu_q == NULL:  # a few operations: not worth releasing the GIL
        implicit_plan(p, &pl)
    else:
        with nogil:
            err = explicit_plan(p, &pl, &stop)
    if err == 0 and stop.flag == 0 and pl.ntasks > 0:
        states = <char *>malloc(max(pl.nstate, 1) * p.es)
        err = 3 if states == NULL else 0
    if err != 0 or stop.flag != 0 or pl.ntasks == 0:
        free(pl.tasks)
        free(pl.run)
        stop_raise(&stop)
        if err == 1:
            raise MemoryError("fastattn: cannot allocate the task list")
        if err == 3:
            raise MemoryError("fastattn: cannot allocate the split-attention state")
        return 0
    p.ahead = p.table == NULL and operand_bytes > <size_t>L2_BYTES * min(nthreads, pl.ntasks)
    if pl.run == NULL:
        pl.nrun, pl.most = pl.ntasks, 1
    if read != NULL:
        read[0] = plan_reads(p, &pl, pl.nrun)
    err = run_tasks(isa, p, &pl, pl.nrun, states, False, nthreads, &stop)
    if err == 0 and stop.flag == 0 and pl.nitems > 0:
        err = run_tasks(isa, p, &pl, pl.nitems, states, True, nthreads, &stop)
    free(states)
    free(pl.tasks)
    free(pl.run)
    stop_raise(&stop)
    return raise_on(err, "attention")


cdef int dense_operands(Ragged *p, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v,
                        cnp.ndarray out, object mask, int mask_kind, object lse, object slopes,
                        fa_idx group, bint causal, fa_idx causal_offset, double scale,
                        fa_idx window_left, fa_idx window_right, double softcap) except -1:
    """p (zeroed) from a dense call's operands, all of one number of
    dimensions: the axes before the last two are batch axes, out's (..., Hq,
    L, Ev) but that k and v have its heads divided by group; lse (..., Hq,
    L), slopes (..., Hq).  The other operands are left to the caller."""
    cdef int nd = q.ndim - 2
    cdef int ns = nd - 1 if nd > 0 else 0   # the sequences' axes: the batch axes but the heads
    cdef int ha = nd - 1                    # the heads' axis, or -1
    fill_batch(&p.seqs, out, ns)
    p.Hq = out.shape[ha] if nd > 0 else 1
    p.group = group if nd > 0 else 1
    p.es = cnp.PyArray_ITEMSIZE(out)
    operand(&p.q, q, ns, ha)
    operand(&p.k, k, ns, ha)
    operand(&p.v, v, ns, ha)
    operand(&p.o, out, ns, ha)
    operand(&p.m, mask if mask_kind != MASK_NONE else None, ns, ha)
    operand(&p.lse, lse, ns, ha)
    operand(&p.slope, slopes, ns, ha)
    p.a.L, p.a.E, p.a.S = q.shape[nd], q.shape[nd + 1], k.shape[nd]
    p.a.Ev = out.shape[nd + 1]  # v's last axis counts bytes for Q4
    p.a.q_ls, p.a.q_es = estride(q, nd), estride(q, nd + 1)
    p.a.k_ss, p.a.k_es = estride(k, nd), estride(k, nd + 1)
    p.a.v_ss, p.a.v_es = estride(v, nd), estride(v, nd + 1)
    p.a.o_ls, p.a.o_es = estride(out, nd), estride(out, nd + 1)
    p.a.q_hs, p.a.o_hs, p.a.lse_hs = p.q.head, p.o.head, p.lse.head
    p.a.mask_kind = <fa_mask_kind>mask_kind
    if p.m.base != NULL:
        p.a.m_ls, p.a.m_ss = estride(mask, nd), estride(mask, nd + 1)
    if p.lse.base != NULL:
        p.a.lse_s = estride(lse, nd)
    p.a.causal, p.align_offset = causal, causal_offset
    p.a.scale, p.a.softcap = scale, softcap
    p.a.window_left, p.a.window_right, p.a.sink = window_left, window_right, -INFINITY
    return 0


def attention(int isa, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask, int mask_kind,
              cnp.ndarray out, object weights, fa_idx group, bint causal, fa_idx causal_offset,
              double scale, int nthreads, int prefetch=FA_PREFETCH_KEYS | FA_PREFETCH_VALUES,
              fa_idx window_left=-1, fa_idx window_right=-1, double softcap=0,
              object slopes=None, object sinks=None, object lse=None,
              int q_store=STORE_NATIVE, int kv_store=STORE_NATIVE, object k_scale=None,
              object v_scale=None, bint ahead_blocks=True, int precision=PRECISION_EXACT,
              object key_mean=None, bint int8_dot=True):
    """out[..., L, Ev] = attention of q (..., L, E), k/v (..., S, E|Ev).

    All arrays have the same number of dimensions; the axes before the last
    two are batch axes, equal to out's except that k and v have out's last
    batch axis (the heads) divided by group.  slopes and sinks (float64)
    have out's batch shape, lse (out's dtype) its batch shape and L.  q,
    and k and v, are stored as q_store and kv_store (out float32 unless both
    are native); with int8 and float8_e4m3fn, k_scale and v_scale (float32)
    have k's batch shape and S; Q4 rows are blocks of bytes (fa_common.h),
    so Ev is out's last axis, not v's.  prefetch: fa_attn_args'
    (fastattn/_tuning.py chooses it); ahead_blocks: FA_PREFETCH_BLOCKS joins
    it for items whose keys and values exceed L2.  No result depends on
    either.  precision: fa_attn_args' (PRECISION_EXACT or PRECISION_INT8);
    int8_dot: False sets its int8_base (the same results).  key_mean: None, or the mean the keys were stored less (fa_attn_args'
    k_mean), out's dtype, k's batch shape and E, its last axis contiguous.
    The tasks: schedule()'s, every item of the batch a sequence."""
    cdef int nd = q.ndim - 2
    cdef int ns = nd - 1 if nd > 0 else 0
    cdef int ha = nd - 1
    cdef Ragged p
    memset(&p, 0, sizeof(p))
    dense_operands(&p, q, k, v, out, mask, mask_kind, lse, slopes, group, causal, causal_offset,
                   scale, window_left, window_right, softcap)
    operand(&p.w, weights, ns, ha)
    operand(&p.sink, sinks, ns, ha)
    operand(&p.ksc, k_scale, ns, ha)
    operand(&p.vsc, v_scale, ns, ha)
    operand(&p.kmean, key_mean, ns, ha)
    if p.w.base != NULL:
        p.a.w_ls, p.a.w_ss = estride(weights, nd), estride(weights, nd + 1)
    if p.ksc.base != NULL:
        p.a.ksc_s, p.a.vsc_s = estride(k_scale, nd), estride(v_scale, nd)
    p.a.q_store, p.a.kv_store = <fa_store>q_store, <fa_store>kv_store
    p.a.prefetch, p.a.precision = prefetch, <fa_precision>precision
    p.a.int8_base = not int8_dot
    p.kv_row_bytes = (k.shape[nd + 1] + v.shape[nd + 1]) * cnp.PyArray_ITEMSIZE(k)
    p.ahead_blocks = ahead_blocks
    # heads share their key/value head's reads only without weights, with
    # one mask for all of them, per-head slopes and sinks one element apart
    p.can_group = ((p.m.base == NULL or p.m.head == 0) and p.w.base == NULL and
                   (p.slope.base == NULL or p.slope.head == 1) and
                   (p.sink.base == NULL or p.sink.head == 1))
    schedule(isa, &p, q.nbytes + k.nbytes + v.nbytes + out.nbytes, nthreads)


cdef struct Grad:
    # A backward call: the forward's operands (p: q, k, v, its mask m, its
    # output o, lse, slopes) and the backward's own, with its tasks: rows
    # of five int64 (sequence, key/value head, chunk of keys, and where in
    # parts and in sums the task writes its part of dQ / scale and of the
    # rows' sums: fa_attn_grad's dqt and psum), then the merges' rows of
    # eight (sequence, query head, first row of a query block, where its
    # chunk 0 starts in parts and the chunks' stride there, the same in
    # sums, and the chunks: fa_attn_grad_merge's).
    Ragged p
    fa_grad_args g
    Operand dout, dq, dk, dv, psum, rnorm
    fa_idx dq_ls, dq_es, psum_s
    char *parts
    char *sums
    const cnp.int64_t *tasks
    const cnp.int64_t *merges
    int isa


cdef int grad_run(const void *ctx, fa_idx t, void *work) noexcept nogil:
    """Task t of a backward call (a Grad); the kernel's return code."""
    cdef const Grad *x = <const Grad *>ctx
    cdef const Ragged *p = &x.p
    cdef const cnp.int64_t *task = x.tasks + 5 * t
    cdef fa_idx b = task[0], h = task[1], c = task[2], hq = task[1] * p.group
    cdef fa_idx qr = q_row(p, b), kr = kv_row(p, b), n
    cdef fa_attn_args ai
    ragged_args(p, b, hq, p.group, &ai)
    n = fa_attn_grad_chunk_keys(&ai, p.Hq // p.group)
    return fa_attn_grad(<fa_isa>x.isa, p.es, &ai, &x.g, start(&p.q, p, b, hq, qr, ai.q_ls),
                        start(&p.k, p, b, h, kr, ai.k_ss), start(&p.v, p, b, h, kr, ai.v_ss),
                        mask_of(p, b, hq), start(&x.dout, p, b, hq, qr, x.g.do_ls),
                        start(&p.o, p, b, hq, qr, ai.o_ls), start(&p.lse, p, b, hq, qr, ai.lse_s),
                        start(&x.rnorm, p, b, hq, qr, ai.lse_s), start(&x.dk, p, b, h, kr, x.g.dk_ss), start(&x.dv, p, b, h, kr, x.g.dv_ss),
                        x.parts + p.es * task[3], x.sums + p.es * task[4], c * n,
                        min((c + 1) * n, ai.S), work)


cdef int merge_run(const void *ctx, fa_idx t, void *work) noexcept nogil:
    """Merge t of a backward call (a Grad): dQ and the rows' sums of a query block."""
    cdef const Grad *x = <const Grad *>ctx
    cdef const Ragged *p = &x.p
    cdef const cnp.int64_t *m = x.merges + 8 * t
    cdef fa_idx b = m[0], h = m[1], i0 = m[2], qr = q_row(p, b)
    cdef fa_idx L = p.cu_q[b + 1] - p.cu_q[b] if p.cu_q != NULL else p.a.L
    return fa_attn_grad_merge(<fa_isa>x.isa, p.es, m[7], p.a.E,
                              min(fa_attn_query_block(p.es), L - i0), p.a.scale,
                              x.parts + p.es * m[3], m[4], x.sums + p.es * m[5], m[6],
                              start(&x.dq, p, b, h, qr + i0, x.dq_ls), x.dq_ls, x.dq_es,
                              start(&x.psum, p, b, h, qr + i0, x.psum_s), x.psum_s)


def grad_chunk_keys(fa_idx S, fa_idx kv_heads):
    """Keys per chunk of the backward's tasks for S keys and kv_heads
    key/value heads (fa_attn_grad_chunk_keys)."""
    cdef fa_attn_args a
    memset(&a, 0, sizeof(a))
    a.S = S
    return fa_attn_grad_chunk_keys(&a, kv_heads)


cdef int grad_call(Grad *x, cnp.ndarray dout, cnp.ndarray dq, cnp.ndarray dk, cnp.ndarray dv,
                   cnp.ndarray psum, cnp.ndarray parts, cnp.ndarray sums,
                   const cnp.int64_t[:, ::1] tasks, const cnp.int64_t[:, ::1] merges,
                   object rnorm, int ns, int ha, int rows, int lse_ha, int lse_rows,
                   int nthreads) except -1:
    """The backward's own operands into x, whose p holds the forward's, then
    its tasks, then its merges: the axes before ns are the sequences', ha
    the heads', rows the positions' (of psum, as of lse: lse_ha and
    lse_rows; rnorm too, with lse's strides), the features' last."""
    cdef fa_stop stop
    cdef int err
    operand(&x.rnorm, rnorm, ns, lse_ha)
    operand(&x.dout, dout, ns, ha)
    operand(&x.dq, dq, ns, ha)
    operand(&x.dk, dk, ns, ha)
    operand(&x.dv, dv, ns, ha)
    operand(&x.psum, psum, ns, lse_ha)
    x.g.do_ls, x.g.do_es, x.g.do_hs = estride(dout, rows), estride(dout, dout.ndim - 1), x.dout.head
    x.g.m_hs = x.p.m.head
    x.g.dk_ss, x.g.dk_es = estride(dk, rows), estride(dk, dk.ndim - 1)
    x.g.dv_ss, x.g.dv_es = estride(dv, rows), estride(dv, dv.ndim - 1)
    x.dq_ls, x.dq_es, x.psum_s = estride(dq, rows), estride(dq, dq.ndim - 1), estride(psum, lse_rows)
    if (tasks.shape[1] != 5 or merges.shape[1] != 8 or not parts.flags.c_contiguous or
            not sums.flags.c_contiguous):
        raise ValueError("tasks must be (n, 5), merges (m, 8), parts and sums C-contiguous")
    x.parts, x.sums = <char *>cnp.PyArray_DATA(parts), <char *>cnp.PyArray_DATA(sums)
    x.tasks = &tasks[0, 0] if tasks.shape[0] > 0 else NULL
    x.merges = &merges[0, 0] if merges.shape[0] > 0 else NULL
    stop_init(&stop)
    err = run_parallel(grad_run, x, tasks.shape[0], fa_attn_grad_work_bytes(&x.p.a, x.p.es),
                       nthreads, &stop)
    if err == 0 and stop.flag == 0:
        err = run_parallel(merge_run, x, merges.shape[0], 1, nthreads, &stop)
    stop_raise(&stop)
    return raise_on(err, "attention backward")


def attention_backward(int isa, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask,
                       int mask_kind, cnp.ndarray out, cnp.ndarray lse, cnp.ndarray dout,
                       cnp.ndarray dq, cnp.ndarray dk, cnp.ndarray dv, cnp.ndarray psum,
                       cnp.ndarray parts, cnp.ndarray sums, const cnp.int64_t[:, ::1] tasks,
                       const cnp.int64_t[:, ::1] merges, fa_idx group, bint causal,
                       fa_idx causal_offset, double scale, int nthreads,
                       fa_idx window_left=-1, fa_idx window_right=-1, double softcap=0,
                       object slopes=None, object rnorm=None):
    """dq, dk and dv of the attention that attention() computes with the
    same arguments and gave out and lse (FlashAttention-2's backward,
    fa_attn_grad), from dout, and psum, each row's sum of exp(logit - lse)
    over its keys.  The tasks (n, 5: sequence, key/value head, chunk of
    grad_chunk_keys(S, Hkv) keys, offsets in parts and sums) write their parts of
    dq / scale and of psum in parts and sums (C-contiguous scratch); the
    merges (m, 8: sequence, query head, first row of a query block, its
    chunk 0's offset and the chunks' stride in parts, the same in sums, the
    chunks) sum them into dq and psum.  rnorm: None, or a factor per row of
    the weights exp(logit - lse), as lse (fa_attn_grad's).  The sequences: the batch axes
    before the heads, flattened.  q, dout, dq: (..., Hq, L, E | Ev); k, v,
    dk, dv: (..., Hkv, S, E | Ev), Hkv = Hq / group; lse and psum: (..., Hq,
    L); mask a view of (..., Hq, L, S); slopes (..., Hq) float64, its last
    axis contiguous.  All of one dtype, float32 or float64.  Every gradient
    and part is written once, its sums in an order fixed by positions: the
    same bits for any thread count."""
    cdef int nd = q.ndim - 2
    cdef Grad x
    memset(&x, 0, sizeof(x))
    x.isa = isa
    dense_operands(&x.p, q, k, v, out, mask, mask_kind, lse, slopes, group, causal,
                   causal_offset, scale, window_left, window_right, softcap)
    grad_call(&x, dout, dq, dk, dv, psum, parts, sums, tasks, merges, rnorm,
              nd - 1 if nd > 0 else 0, nd - 1, nd, nd - 1, nd, nthreads)


def varlen_backward(int isa, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out,
                    cnp.ndarray lse, cnp.ndarray dout, cnp.ndarray dq, cnp.ndarray dk,
                    cnp.ndarray dv, cnp.ndarray psum, cnp.ndarray parts, cnp.ndarray sums,
                    const cnp.int64_t[:, ::1] tasks, const cnp.int64_t[:, ::1] merges,
                    const cnp.int64_t[::1] cu_q, const cnp.int64_t[::1] cu_k,
                    const cnp.int64_t[::1] seq_lens, fa_idx group,
                    bint causal, bint lower_right, fa_idx align_offset, double scale,
                    int nthreads, fa_idx window_left, fa_idx window_right, double softcap,
                    object slopes, object rnorm=None):
    """attention_backward of packed sequences (varlen_attention's): q, out,
    dout, dq (total_q, Hq, E | Ev), k and v as the one block of caches (1,
    Hkv, total_k, E | Ev), dk, dv (total_k, Hkv, E | Ev), lse and psum (Hq,
    total_q), sequence b's rows cu_q[b]..cu_q[b + 1] - 1 and keys
    cu_k[b]..cu_k[b + 1] - 1 (seq_lens[b] keys); slopes (B, Hq) float64 or
    None."""
    cdef Grad x
    cdef Ragged *p = &x.p
    cdef fa_idx nseq = cu_q.shape[0] - 1
    memset(&x, 0, sizeof(x))
    x.isa = isa
    packed_operands(p, q, k, v, out, lse, slopes, nseq, group, causal, lower_right,
                    align_offset, scale, window_left, window_right, softcap)
    if nseq > 0:
        p.cu_q, p.kv_start, p.seq_lens = &cu_q[0], &cu_k[0], &seq_lens[0]
    grad_call(&x, dout, dq, dk, dv, psum, parts, sums, tasks, merges, rnorm, 0, 1, 0, 0, 1,
              nthreads)


cdef int packed_operands(Ragged *p, cnp.ndarray q, cnp.ndarray key_cache,
                         cnp.ndarray value_cache, cnp.ndarray out, object lse, object slopes,
                         fa_idx nseq, fa_idx group, bint causal, bint lower_right,
                         fa_idx align_offset, double scale, fa_idx window_left,
                         fa_idx window_right, double softcap) except -1:
    """p (zeroed) from a ragged call's operands: q and out (total_q, Hq, E |
    Ev), the caches (blocks, Hkv, rows, E | Ev), lse (Hq, total_q), slopes
    (nseq, Hq); each sequence's rows, keys and lengths are the caller's."""
    p.seqs.nd, p.seqs.shape[0], p.seqs.count = 1, nseq, nseq
    p.Hq, p.group = out.shape[1], group
    p.es = cnp.PyArray_ITEMSIZE(out)
    operand(&p.q, q, 0, 1)
    operand(&p.k, key_cache, 0, 1)
    operand(&p.v, value_cache, 0, 1)
    operand(&p.o, out, 0, 1)
    operand(&p.lse, lse, 0, 0)
    operand(&p.slope, slopes, 1, 1)
    p.a.E, p.a.Ev = q.shape[2], out.shape[2]  # the caches' last axes count bytes for Q4
    p.a.q_ls, p.a.q_es = estride(q, 0), estride(q, 2)
    p.a.k_bs, p.a.k_ss, p.a.k_es = estride(key_cache, 0), estride(key_cache, 2), estride(key_cache, 3)
    p.a.v_bs, p.a.v_ss, p.a.v_es = (estride(value_cache, 0), estride(value_cache, 2),
                                    estride(value_cache, 3))
    p.a.o_ls, p.a.o_es = estride(out, 0), estride(out, 2)
    p.a.q_hs, p.a.o_hs, p.a.lse_hs = p.q.head, p.o.head, p.lse.head
    if p.lse.base != NULL:
        p.a.lse_s = estride(lse, 1)
    p.a.mask_kind = FA_MASK_NONE
    p.a.scale, p.a.softcap, p.a.causal = scale, softcap, causal
    p.a.window_left, p.a.window_right, p.a.sink = window_left, window_right, -INFINITY
    p.lower_right, p.align_offset = lower_right, align_offset
    return 0


def ragged(int isa, cnp.ndarray q, cnp.ndarray key_cache, cnp.ndarray value_cache,
           object k_scale, object v_scale, object block_table, object kv_start,
           const cnp.int64_t[::1] seq_lens, const cnp.int64_t[::1] cu_q, cnp.ndarray out,
           object lse, fa_idx group, bint causal, bint lower_right, fa_idx align_offset,
           double scale, int nthreads, fa_idx window_left, fa_idx window_right,
           double softcap, object slopes, object sinks, int q_store, int kv_store,
           int prefetch=FA_PREFETCH_KEYS | FA_PREFETCH_VALUES, bint ahead_blocks=True,
           int precision=PRECISION_EXACT, object key_mean=None, object tree_mask=None,
           object tree_at=None, object read=None, bint int8_dot=True):
    """Attention of a ragged batch of sequences (checked by the caller): q
    (total_q, Hq, E) stored as q_store, key_cache (num_blocks, Hkv,
    block_size, E) and value_cache (..., Ev) as kv_store, with int8 and
    float8_e4m3fn scales k_scale, v_scale (num_blocks, Hkv, block_size)
    float32 or None; out (total_q, Hq, Ev) and lse None or (Hq, total_q) in
    the kernels' dtype.  Sequence b holds query rows cu_q[b]..cu_q[b+1]-1
    and seq_lens[b] keys: paged, in the blocks block_table[b, :] (int32
    (B, max_blocks), C-contiguous, every entry it reads valid), or, with
    block_table None, rows kv_start[b].. (int64 (B,)) of the one block of
    key_cache and value_cache (packed sequences: varlen).  Query i of a
    sequence sits at key position i + align_offset, plus S - L with
    lower_right.  slopes (B, Hq) and sinks (Hq,) float64 or None; key_mean
    None or (B, Hkv, E) in out's dtype, as in attention().  tree_mask: None,
    or a C-contiguous bool array holding, for each sequence b with
    tree_at[b] >= 0 (int64 (B,)), an (L, L) mask from element tree_at[b]
    over its L queries and its last L keys (fa_attn_args' m_s0). The tasks:
    schedule()'s; prefetch, ahead_blocks, precision and int8_dot as in
    attention().
    read: None, or an int64 (1,) array that receives the bytes of keys and
    values the tasks stream (plan_reads)."""
    cdef Ragged p
    cdef const int32_t[:, ::1] table
    cdef const cnp.int64_t[::1] starts
    cdef const cnp.int64_t[::1] trees
    cdef cnp.int64_t[::1] reads
    cdef cnp.int64_t *read_at = NULL
    cdef fa_idx nseq = cu_q.shape[0] - 1
    memset(&p, 0, sizeof(p))
    packed_operands(&p, q, key_cache, value_cache, out, lse, slopes, nseq, group, causal,
                    lower_right, align_offset, scale, window_left, window_right, softcap)
    operand(&p.sink, sinks, 0, 0)
    operand(&p.ksc, k_scale, 0, 1)
    operand(&p.vsc, v_scale, 0, 1)
    operand(&p.kmean, key_mean, 1, 1)
    if p.ksc.base != NULL:
        p.a.ksc_bs, p.a.ksc_s = estride(k_scale, 0), estride(k_scale, 2)
        p.a.vsc_bs, p.a.vsc_s = estride(v_scale, 0), estride(v_scale, 2)
    p.a.prefetch, p.a.precision = prefetch, <fa_precision>precision
    p.a.int8_base = not int8_dot
    p.a.q_store, p.a.kv_store = <fa_store>q_store, <fa_store>kv_store
    p.a.block_size = key_cache.shape[2]
    p.kv_row_bytes = (key_cache.shape[3] + value_cache.shape[3]) * cnp.PyArray_ITEMSIZE(key_cache)
    p.ahead_blocks = ahead_blocks
    p.can_group = True
    if block_table is not None:
        table = block_table
        if table.shape[0] > 0 and table.shape[1] > 0:
            p.table, p.table_s = &table[0, 0], table.shape[1]
    elif nseq > 0:
        starts = kv_start
        p.kv_start = &starts[0]
    p.a.block_table = p.table  # (fa_attn_work_bytes: paged reads need tile buffers)
    p.cu_q, p.seq_lens = &cu_q[0], (&seq_lens[0] if nseq > 0 else NULL)
    if tree_mask is not None and nseq > 0:  # (mask_kind: what fa_attn_work_bytes sizes)
        p.a.mask_kind = FA_MASK_BOOL
        operand(&p.m, tree_mask, 0, -1)
        trees = tree_at
        p.tree_at = &trees[0]
    if (p.table == NULL and p.kv_start == NULL) or p.Hq == 0:
        return
    if read is not None:
        reads = read
        read_at = &reads[0]
    schedule(isa, &p, q.nbytes + key_cache.nbytes + value_cache.nbytes + out.nbytes, nthreads,
             read_at)


def rotary(cnp.ndarray x, const cnp.int64_t[::1] positions, cnp.ndarray cos, cnp.ndarray sin,
           bint interleaved, cnp.ndarray out, int nthreads):
    """out (n, H, D) = x (n, H, D) with each token's heads rotated at its
    position (fa_rotary_*); cos and sin C-contiguous (max_pos, half) in x's
    dtype, every position below max_pos (checked by the caller).  out may be
    x or another array of its shape and dtype."""
    cdef fa_idx n = x.shape[0], H = x.shape[1], D = x.shape[2], half = cos.shape[1]
    cdef fa_idx x_ts = estride(x, 0), x_hs = estride(x, 1), x_es = estride(x, 2)
    cdef fa_idx o_ts = estride(out, 0), o_hs = estride(out, 1), o_es = estride(out, 2)
    cdef char *xp = <char *>cnp.PyArray_DATA(x)
    cdef char *op = <char *>cnp.PyArray_DATA(out)
    cdef char *cp = <char *>cnp.PyArray_DATA(cos)
    cdef char *sp = <char *>cnp.PyArray_DATA(sin)
    cdef int es = cnp.PyArray_ITEMSIZE(x)
    cdef fa_idx t, h, p
    cdef int err = 0
    cdef int *errp = &err
    if n == 0 or H == 0:
        return
    with nogil:
        for t in prange(n, schedule="static", num_threads=min(nthreads, n)):
            p = positions[t] * half
            for h in range(H):
                if fa_rotary(es, D, half, interleaved, xp + es * (t * x_ts + h * x_hs), x_es,
                             cp + es * p, sp + es * p, op + es * (t * o_ts + h * o_hs),
                             o_es) != 0:
                    errp[0] = 2
    raise_on(err, "rotary")


def softmax_rows(int isa, cnp.ndarray x, object mask, int mask_kind, cnp.ndarray out,
                 int nthreads):
    """Softmax along the last axis of x into out (same shape); mask, when
    given, has x's shape too (stride 0 where broadcast)."""
    cdef int nd = x.ndim - 1
    cdef Batch b
    cdef fa_idx xs[MAXDIM]
    cdef fa_idx ms[MAXDIM]
    cdef fa_idx os[MAXDIM]
    cdef fa_idx n = x.shape[nd]
    cdef fa_idx x_s = estride(x, nd), o_s = estride(out, nd), m_s = 0
    cdef char *xp = <char *>cnp.PyArray_DATA(x)
    cdef char *op = <char *>cnp.PyArray_DATA(out)
    cdef char *mp = NULL
    cdef cnp.ndarray m_arr
    cdef int elsize = cnp.PyArray_ITEMSIZE(x)
    cdef int msize = 1
    fill_batch(&b, x, nd)
    fill_strides(xs, x, nd)
    fill_strides(os, out, nd)
    if mask_kind != MASK_NONE:
        m_arr = mask
        mp = <char *>cnp.PyArray_DATA(m_arr)
        msize = cnp.PyArray_ITEMSIZE(m_arr)
        fill_strides(ms, m_arr, nd)
        m_s = estride(m_arr, nd)
    cdef size_t work_bytes = fa_softmax_work_bytes(n, elsize)
    cdef fa_idx r
    cdef void *work
    cdef void *mrow
    cdef int err = 0
    cdef int *errp = &err
    cdef fa_stop stop
    if b.count == 0 or n == 0:
        return
    cdef Scratch scratch = take_scratch(work_bytes, nthreads)
    cdef char *kept = scratch_data(scratch)
    stop_init(&stop)
    with nogil, parallel(num_threads=nthreads):
        work = thread_scratch(kept, work_bytes)
        if work == NULL:
            errp[0] = 1
        for r in prange(b.count, schedule="static"):
            if work == NULL or stopped(&stop):
                continue
            mrow = at(mp, msize, &b, ms, r)
            if fa_softmax_row(<fa_isa>isa, elsize, n, at(xp, elsize, &b, xs, r), x_s,
                              <fa_mask_kind>mask_kind, mrow, m_s, at(op, elsize, &b, os, r),
                              o_s, work) != 0:
                errp[0] = 2
        release_scratch(kept, work)
    keep_scratch(scratch)
    stop_raise(&stop)
    raise_on(err, "softmax")


def matmul(int isa, cnp.ndarray a, cnp.ndarray bm, cnp.ndarray out, int nthreads):
    """out[..., M, N] = a[..., M, K] @ bm[..., K, N]; all three have out's
    batch shape (stride 0 where broadcast)."""
    cdef int nd = out.ndim - 2
    cdef Batch b
    cdef fa_idx as_[MAXDIM]
    cdef fa_idx bs[MAXDIM]
    cdef fa_idx os[MAXDIM]
    cdef fa_gemm_args g
    cdef char *ap = <char *>cnp.PyArray_DATA(a)
    cdef char *bp = <char *>cnp.PyArray_DATA(bm)
    cdef char *op = <char *>cnp.PyArray_DATA(out)
    cdef int elsize = cnp.PyArray_ITEMSIZE(out)
    fill_batch(&b, out, nd)
    fill_strides(as_, a, nd)
    fill_strides(bs, bm, nd)
    fill_strides(os, out, nd)
    g.M, g.K, g.N = a.shape[nd], a.shape[nd + 1], bm.shape[nd + 1]
    g.rs_a, g.cs_a = estride(a, nd), estride(a, nd + 1)
    g.rs_b, g.cs_b = estride(bm, nd), estride(bm, nd + 1)
    g.rs_c, g.cs_c = estride(out, nd), estride(out, nd + 1)
    cdef fa_idx mc = fa_gemm_mc(elsize), nc = fa_gemm_nc(elsize)
    cdef fa_idx nmb = (g.M + mc - 1) // mc, nnb = (g.N + nc - 1) // nc
    cdef fa_idx ntasks = b.count * nmb * nnb
    cdef size_t work_bytes = fa_gemm_work_bytes(elsize)
    cdef fa_idx t, item, i0, j0, i1, j1, rest
    cdef void *work
    cdef int err = 0
    cdef int *errp = &err
    cdef fa_stop stop
    if ntasks == 0:
        return
    nthreads = min(nthreads, ntasks)
    cdef Scratch scratch = take_scratch(work_bytes, nthreads)
    cdef char *kept = scratch_data(scratch)
    stop_init(&stop)
    with nogil, parallel(num_threads=nthreads):
        work = thread_scratch(kept, work_bytes)
        if work == NULL:
            errp[0] = 1
        for t in prange(ntasks, schedule="dynamic"):
            if work == NULL or stopped(&stop):
                continue
            item = t // (nmb * nnb)
            rest = t % (nmb * nnb)
            i0 = (rest // nnb) * mc
            j0 = (rest % nnb) * nc
            i1 = i0 + mc if i0 + mc < g.M else g.M
            j1 = j0 + nc if j0 + nc < g.N else g.N
            if fa_gemm(<fa_isa>isa, elsize, &g, at(ap, elsize, &b, as_, item),
                       at(bp, elsize, &b, bs, item), at(op, elsize, &b, os, item),
                       i0, i1, j0, j1, work) != 0:
                errp[0] = 2
        release_scratch(kept, work)
    keep_scratch(scratch)
    stop_raise(&stop)
    raise_on(err, "matmul")


ctypedef fused real:
    float
    double


cdef void merge_heads_loop(const real[:, :, :, :] x, real[:, :, ::1] out,
                           int nthreads) noexcept nogil:
    cdef Py_ssize_t B = x.shape[0], H = x.shape[1], L = x.shape[2], D = x.shape[3]
    cdef Py_ssize_t r, bi, li, h, d
    for r in prange(B * L, schedule="static", num_threads=nthreads):
        bi = r // L
        li = r % L
        for h in range(H):
            for d in range(D):
                out[bi, li, h * D + d] = x[bi, h, li, d]


def merge_heads(cnp.ndarray x, cnp.ndarray out, int nthreads):
    """out (B, L, H*D) = x (B, H, L, D) with heads side by side."""
    if x.dtype.itemsize == 4:
        merge_heads_loop[float](x, out, nthreads)
    else:
        merge_heads_loop[double](x, out, nthreads)


def narrow(int isa, int store, cnp.ndarray x, cnp.ndarray out, int nthreads):
    """out (16-bit, stored as store) = x (float32) rounded to nearest-even;
    both C-contiguous, of one size."""
    DEF CHUNK = 65536
    cdef fa_idx n = x.size, nchunks = (n + CHUNK - 1) // CHUNK, c, lo
    cdef const float *src = <const float *>cnp.PyArray_DATA(x)
    cdef char *dst = <char *>cnp.PyArray_DATA(out)
    cdef int err = 0
    cdef int *errp = &err
    if nchunks == 0:
        return
    with nogil:
        for c in prange(nchunks, schedule="static", num_threads=min(nthreads, nchunks)):
            lo = c * CHUNK
            if fa_narrow_f32(<fa_isa>isa, <fa_store>store, min(CHUNK, n - lo), src + lo,
                             dst + 2 * lo) != 0:
                errp[0] = 2
    raise_on(err, "narrow")


cdef inline fa_idx round_rows_chunk(int isa, fa_idx lo, fa_idx hi, fa_idx S, fa_idx n,
                                   const float *x, const float *mean, const cnp.int64_t *skip,
                                   int8_t *codes, float *scales) noexcept nogil:
    """fa_int8_rows over rows lo..hi-1 of the rows of n floats at x, in runs
    of one head's S rows (head h less mean + h n, mean NULL: none), the
    heads with skip[h] != 0 left out (skip NULL: none); the rows the mean
    made not finite."""
    cdef fa_idx row = lo, r, h, spoilt = 0
    while row < hi:
        h = row // S
        r = min(hi, (h + 1) * S)
        if skip == NULL or skip[h] == 0:
            spoilt += fa_int8_rows(<fa_isa>isa, r - row, n, x + row * n,
                                   mean + h * n if mean != NULL else NULL, codes + row * n,
                                   scales + row)
        row = r
    return spoilt


cdef inline fa_idx round_chunk_rows(fa_idx n) noexcept nogil:
    """Rows a thread rounds at a time: about 16384 floats."""
    return max(1, 16384 // max(n, 1))


def int8_rows(int isa, cnp.ndarray x not None, mean, cnp.ndarray codes not None,
                cnp.ndarray scales not None, int nthreads):
    """codes, scales = x (float32, C-contiguous (R, S, n)) less mean (None,
    or float32 C-contiguous (R, n): row r's mean for its S rows) rounded to
    int8 per row (fa_int8_rows), into codes (int8, x's shape) and scales
    (float32, (R, S)), both C-contiguous.  Returns how many rows the mean
    pushed past float32's range."""
    cdef fa_idx R, S, n, c, spoilt = 0, chunk, nchunks
    cdef const float *src = <const float *>cnp.PyArray_DATA(x)
    cdef const float *mp = NULL
    cdef int8_t *dst = <int8_t *>cnp.PyArray_DATA(codes)
    cdef float *sp = <float *>cnp.PyArray_DATA(scales)
    if x.ndim != 3:
        raise ValueError(f"int8_rows: x of 3 dimensions (R, S, n), got {x.ndim}")
    R, S, n = x.shape[0], x.shape[1], x.shape[2]
    chunk = round_chunk_rows(n)
    nchunks = (R * S + chunk - 1) // chunk
    if not (native(x, "f") and native(codes, "b") and native(scales, "f")):
        raise ValueError("int8_rows: x float32, codes int8, scales float32, native and aligned")
    if not (x.flags.c_contiguous and codes.flags.c_contiguous and scales.flags.c_contiguous and
            codes.flags.writeable and scales.flags.writeable and codes.size == x.size and
            scales.size == R * S):
        raise ValueError("int8_rows: contiguous arrays of matching sizes, outputs writeable")
    if mean is not None:
        if (not isinstance(mean, cnp.ndarray) or not native(mean, "f") or
                not mean.flags.c_contiguous or (<object>mean).shape != (R, n)):
            raise ValueError("int8_rows: mean float32, native, aligned, C-contiguous, (R, n)")
        mp = <const float *>cnp.PyArray_DATA(mean)
    cdef int nt = loop_threads(nthreads, nchunks)
    if nchunks == 0:
        return 0
    with nogil:
        for c in prange(nchunks, schedule="static", num_threads=nt):
            spoilt += round_rows_chunk(isa, c * chunk, min((c + 1) * chunk, R * S), S, n, src,
                                       mp, NULL, dst, sp)
    return spoilt


cdef bint native(cnp.ndarray a, str char):
    """a's dtype is `char` in native byte order, and a is aligned (C reads
    it in place)."""
    return a.dtype.char == char and a.dtype.isnative and a.flags.aligned


cdef int loop_threads(int nthreads, fa_idx work) except -1:
    """The threads of a parallel loop over `work` items: nthreads, checked
    against MAX_THREADS, at most one an item."""
    if nthreads < 1 or nthreads > MAX_THREADS:
        raise ValueError(f"nthreads must be 1..{MAX_THREADS}, got {nthreads}")
    return max(1, min(nthreads, work))


cdef cnp.ndarray new_array(int nd, fa_idx a, fa_idx b, fa_idx c, int typenum, bint zeros=False):
    """A new C-ordered array of shape (a, b, c)[:nd], of zeros or not
    initialised."""
    cdef cnp.npy_intp dims[3]
    dims[0], dims[1], dims[2] = a, b, c
    return cnp.PyArray_ZEROS(nd, dims, typenum, 0) if zeros else cnp.PyArray_EMPTY(nd, dims, typenum, 0)


def int8_operands(int isa, cnp.ndarray k not None, cnp.ndarray v not None, int nthreads):
    """The int8 mode's operands of keys k (R, S, E) and values v (Rv, Sv,
    Ev), float32 and C-contiguous, in one parallel region: each head's key
    mean, float32(the column sums (col_sums' bits) / S), then the keys less
    it and the values rounded to int8 per row (int8_rows').  Returns
    (key codes, key scales, value codes, value scales, mean), or None when
    a column sum is not finite or the mean pushed a key past float32's
    range: _storage.int8_mode_operands takes its general path then."""
    if k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"int8_operands: k and v of 3 dimensions, got {k.ndim} and {v.ndim}")
    if not (native(k, "f") and native(v, "f") and k.flags.c_contiguous and v.flags.c_contiguous):
        raise ValueError("int8_operands: k and v float32, native, aligned and C-contiguous")
    cdef fa_idx R = k.shape[0], S = k.shape[1], E = k.shape[2]
    cdef fa_idx Rv = v.shape[0], Sv = v.shape[1], Ev = v.shape[2]
    cdef fa_idx kchunk = round_chunk_rows(E), vchunk = round_chunk_rows(Ev)
    cdef fa_idx nk = (R * S + kchunk - 1) // kchunk, nv = (Rv * Sv + vchunk - 1) // vchunk
    sums = new_array(2, R, E, 0, cnp.NPY_FLOAT64)
    mean = new_array(2, R, E, 0, cnp.NPY_FLOAT32)
    kc, ks = new_array(3, R, S, E, cnp.NPY_INT8), new_array(2, R, S, 0, cnp.NPY_FLOAT32)
    vc, vs = new_array(3, Rv, Sv, Ev, cnp.NPY_INT8), new_array(2, Rv, Sv, 0, cnp.NPY_FLOAT32)
    bad = new_array(1, R + nk, 0, 0, cnp.NPY_INT64, True)  # per head: a sum not finite; per key chunk: rows spoilt
    cdef const float *kp = <const float *>cnp.PyArray_DATA(k)
    cdef const float *vp = <const float *>cnp.PyArray_DATA(v)
    cdef double *sp = <double *>cnp.PyArray_DATA(sums)
    cdef float *mp = <float *>cnp.PyArray_DATA(mean)
    cdef int8_t *kcp = <int8_t *>cnp.PyArray_DATA(kc)
    cdef int8_t *vcp = <int8_t *>cnp.PyArray_DATA(vc)
    cdef float *ksp = <float *>cnp.PyArray_DATA(ks)
    cdef float *vsp = <float *>cnp.PyArray_DATA(vs)
    cdef cnp.int64_t *bp = <cnp.int64_t *>cnp.PyArray_DATA(bad)
    cdef fa_idx i, c, lo
    cdef double x
    cdef int nt = loop_threads(nthreads, max(R + nv, nk))
    if R + nv + nk > 0:
        with nogil, parallel(num_threads=nt):
            # the key mean's sums beside the values' rounding; then the keys'
            for i in prange(R + nv, schedule="static"):
                if i < R:
                    fa_col_sums(<fa_isa>isa, S, E, kp + i * S * E, sp + i * E)
                    for c in range(E):
                        x = sp[i * E + c]
                        bp[i] += x - x != 0
                        mp[i * E + c] = <float>(x / <double>max(S, 1))
                else:
                    lo = (i - R) * vchunk
                    round_rows_chunk(isa, lo, min(lo + vchunk, Rv * Sv), Sv, Ev, vp, NULL, NULL,
                                     vcp, vsp)
            for i in prange(nk, schedule="static"):  # the heads whose sums were finite
                bp[R + i] = round_rows_chunk(isa, i * kchunk, min((i + 1) * kchunk, R * S), S, E,
                                             kp, mp, bp, kcp, ksp)
    if bad.any():
        return None
    return kc, ks, vc, vs, mean


def col_sums(int isa, cnp.ndarray x not None, cnp.ndarray out not None, int nthreads):
    """out[r, c] = the sum over s of x[r, s, c] (x float32, C-contiguous
    (R, S, n); out float64, C-contiguous (R, n)), each in float64 with s in
    order: numpy's order for x.sum(axis=1, dtype=np.float64) (fa_col_sums),
    on the kernels' threads, an (r) each (the int8 mode's key mean)."""
    cdef fa_idx R, S, n, r
    cdef const float *src = <const float *>cnp.PyArray_DATA(x)
    cdef double *dst = <double *>cnp.PyArray_DATA(out)
    if x.ndim != 3:
        raise ValueError(f"col_sums: x of 3 dimensions (R, S, n), got {x.ndim}")
    R, S, n = x.shape[0], x.shape[1], x.shape[2]
    if not (native(x, "f") and native(out, "d")):
        raise ValueError("col_sums: x float32, out float64, native and aligned")
    if not (x.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable and
            out.size == R * n):
        raise ValueError("col_sums: contiguous arrays, out (R, n) and writeable")
    cdef int nt = loop_threads(nthreads, R)
    if R == 0:
        return
    with nogil:
        for r in prange(R, schedule="static", num_threads=nt):
            fa_col_sums(<fa_isa>isa, S, n, src + r * S * n, dst + r * n)


def exp(int isa, cnp.ndarray x not None, cnp.ndarray out not None, int mode=0):
    """out = exp(x) with the kernels' exp; x and out contiguous, same dtype.
    mode 0: the general exp; 1: the softmax's, for x <= ln 256; 2: the same
    with -inf lanes skipped (fastattn.h).  ValueError for any other mode,
    dtype, a shape or layout of out other than x's, or a read-only out."""
    cdef fa_idx n = x.size
    if mode not in (0, 1, 2):
        raise ValueError(f"mode must be 0, 1 or 2, got {mode}")
    if x.dtype.char not in "fd" or not x.dtype.isnative or out.dtype != x.dtype:
        raise ValueError(f"x and out must both be float32 or both float64 in native byte order, "
                         f"got {x.dtype.str} and {out.dtype.str}")
    if (<object>out).shape != (<object>x).shape:
        raise ValueError(f"out must have x's shape {(<object>x).shape}, got {(<object>out).shape}")
    if not (x.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("x and out must be C-contiguous and out writeable")
    fa_exp(<fa_isa>isa, x.dtype.itemsize, n, cnp.PyArray_DATA(x), cnp.PyArray_DATA(out), mode)
