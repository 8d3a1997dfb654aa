# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Cython layer of fastattn: the parallel loops around the C kernels.

Every function here takes arrays that the Python layer has already checked:
dtypes float32/float64 (bool for masks), element strides, shapes that agree.
The loops release the GIL and split the work into independent pieces (see
csrc/fastattn.h), spread over OpenMP threads when the build has OpenMP.
"""
from cython.parallel cimport parallel, prange, threadid
from libc.math cimport INFINITY, log
from libc.stdint cimport int32_t
from libc.stdlib cimport free, malloc, qsort
from libc.string cimport memset

cimport numpy as cnp

cnp.import_array()

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
    ctypedef struct fa_gemm_args:
        fa_idx M, N, K
        fa_idx rs_a, cs_a, rs_b, cs_b, rs_c, cs_c
    ctypedef struct fa_attn_args:
        fa_idx L, S, E, Ev
        fa_idx q_ls, q_es, k_ss, k_es, v_ss, v_es, o_ls, o_es, w_ls, w_ss, lse_s
        fa_mask_kind mask_kind
        fa_idx m_ls, m_ss
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
    enum:
        FA_PREFETCH_KEYS
        FA_PREFETCH_VALUES
        FA_PREFETCH_BLOCKS

    int fa_cpu_has_avx2_fma()
    int fa_cpu_has_avx512()
    int fa_cpu_has_neon()
    int fa_cpu_has_neon_fp16()
    int fa_cpu_has_neon_bf16()
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
    int fa_narrow_f32(fa_isa isa, fa_store st, fa_idx n, const float *x, void *y)
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
PREFETCH_KEYS = <int>FA_PREFETCH_KEYS
PREFETCH_VALUES = <int>FA_PREFETCH_VALUES
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


# Operands beyond the L2 of the threads used get prefetch hints (Operands.ahead).
cdef Py_ssize_t L2_BYTES = fa_l2_bytes()


def cpu_has_avx2_fma():
    return bool(fa_cpu_has_avx2_fma())


def cpu_has_avx512():
    return bool(fa_cpu_has_avx512())


def cpu_has_neon():
    return bool(fa_cpu_has_neon())


def cpu_has_neon_fp16():
    return bool(fa_cpu_has_neon_fp16())


def cpu_has_neon_bf16():
    return bool(fa_cpu_has_neon_bf16())


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


cdef inline fa_idx nd_offset(const Batch *b, const fa_idx *strides, fa_idx flat,
                             int last_div) noexcept nogil:
    """Element offset of batch item `flat`; the index of the last batch axis
    is divided by last_div (grouped-query attention maps query head h to
    key/value head h // group)."""
    cdef fa_idx off = 0, i
    cdef int d
    for d in range(b.nd - 1, -1, -1):
        i = flat % b.shape[d]
        flat = flat // b.shape[d]
        if d == b.nd - 1:
            i = i // last_div
        off += i * strides[d]
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


cdef struct Operands:
    # Where the operands of one attention call start (mask and weights NULL
    # when absent) and their element strides over the batch axes.
    char *q
    char *k
    char *v
    char *m
    char *o
    char *w
    char *lse      # (..., L): each row's log-sum-exp
    char *slope    # float64 per item: ALiBi slopes
    char *sink     # float64 per item: sink logits
    char *ksc      # float32 per key/value item and position: int8 key scales
    char *vsc      # and value scales
    bint ahead     # operands beyond the threads' L2: hints for the next task
    fa_idx qs[MAXDIM]
    fa_idx ks[MAXDIM]
    fa_idx vs[MAXDIM]
    fa_idx ms[MAXDIM]
    fa_idx os[MAXDIM]
    fa_idx ws[MAXDIM]
    fa_idx lses[MAXDIM]
    fa_idx slopes[MAXDIM]
    fa_idx sinks[MAXDIM]
    fa_idx kscs[MAXDIM]
    fa_idx vscs[MAXDIM]
    int elsize   # of out, weights and lse: the kernel's type
    int qsize    # of q, and of k and v: their storage
    int kvsize
    int msize    # of the mask
    fa_idx group  # query heads per key/value head


cdef inline void *at(char *base, int size, const Batch *b, const fa_idx *strides, fa_idx item,
                     int div) noexcept nogil:
    """Start of batch item `item` of an operand; NULL stays NULL."""
    if base == NULL:
        return NULL
    return base + size * nd_offset(b, strides, item, div)


cdef inline void *q_at(const Operands *o, const Batch *b, fa_idx item) noexcept nogil:
    return at(o.q, o.qsize, b, o.qs, item, 1)


cdef inline void *k_at(const Operands *o, const Batch *b, fa_idx item) noexcept nogil:
    return at(o.k, o.kvsize, b, o.ks, item, o.group)


cdef inline void *v_at(const Operands *o, const Batch *b, fa_idx item) noexcept nogil:
    return at(o.v, o.kvsize, b, o.vs, item, o.group)


cdef inline void *m_at(const Operands *o, const Batch *b, fa_idx item) noexcept nogil:
    return at(o.m, o.msize, b, o.ms, item, 1)


cdef inline void *o_at(const Operands *o, const Batch *b, fa_idx item) noexcept nogil:
    return at(o.o, o.elsize, b, o.os, item, 1)


cdef inline void *w_at(const Operands *o, const Batch *b, fa_idx item) noexcept nogil:
    return at(o.w, o.elsize, b, o.ws, item, 1)


cdef inline void *lse_at(const Operands *o, const Batch *b, fa_idx item) noexcept nogil:
    return at(o.lse, o.elsize, b, o.lses, item, 1)


cdef inline fa_attn_args item_args(const fa_attn_args *a, const Operands *o, const Batch *b,
                                   fa_idx item) noexcept nogil:
    """The arguments of one (batch, head) item: a's, with its ALiBi slope,
    sink and int8 scales."""
    cdef fa_attn_args r = a[0]
    if o.ksc != NULL:
        r.k_scale = <const float *>at(o.ksc, 4, b, o.kscs, item, o.group)
        r.v_scale = <const float *>at(o.vsc, 4, b, o.vscs, item, o.group)
    if o.slope != NULL:
        r.alibi_slope = (<double *>at(o.slope, 8, b, o.slopes, item, 1))[0]
        r.head_slopes = <double *>at(o.slope, 8, b, o.slopes, item, 1) if r.heads > 1 else NULL
    if o.sink != NULL:
        r.sink = (<double *>at(o.sink, 8, b, o.sinks, item, 1))[0]
        r.head_sinks = <double *>at(o.sink, 8, b, o.sinks, item, 1) if r.heads > 1 else NULL
    return r


cdef fa_idx group_heads(fa_attn_args *a, Batch *b, Operands *o, int nd) noexcept nogil:
    """Decoding with grouped-query attention: the query heads of a key/value
    head computed together, `together` of them per item (a divisor of the
    group, as many as the row kernel's 4 rows hold), so that its keys and
    values are read once for them all (fa_attn_args' heads): the last batch
    axis counts chunks of heads from here on.  Only without a mask or
    weights, with per-head slopes and sinks one element apart.  Returns the
    heads per item (1: unchanged).  Each head keeps the bits of a call of
    its own."""
    cdef fa_idx together = min(o.group, 4 // a.L) if 0 < a.L <= 2 else 1
    while together > 1 and o.group % together:
        together -= 1
    if (together < 2 or nd < 1 or a.mask_kind != FA_MASK_NONE or o.w != NULL
            or (o.slope != NULL and o.slopes[nd - 1] != 1)
            or (o.sink != NULL and o.sinks[nd - 1] != 1)):
        return 1
    a.heads = together
    a.q_hs, a.o_hs, a.lse_hs = o.qs[nd - 1], o.os[nd - 1], o.lses[nd - 1]
    b.shape[nd - 1] //= together
    b.count //= together
    o.group //= together
    o.qs[nd - 1] *= together
    o.os[nd - 1] *= together
    o.lses[nd - 1] *= together
    o.slopes[nd - 1] *= together
    o.sinks[nd - 1] *= together
    return together


# Task t of the attention loop: head by head, so that the threads share one
# head's keys and values in cache; within a head the largest causal blocks
# come first, except under a window's left bound (ascending), where blocks
# cost about the same and the keys new to each block then continue the
# ascending stream of the one before, which the hardware prefetcher follows.
cdef inline fa_attn_next task_rows(const Operands *o, const Batch *b, fa_idx t, fa_idx nqb,
                                   fa_idx qb, fa_idx L, bint ascending) noexcept nogil:
    cdef fa_attn_next r
    cdef fa_idx item = t // nqb
    r.q = q_at(o, b, item)
    r.k = k_at(o, b, item)
    r.v = v_at(o, b, item)
    r.i0 = (t % nqb if ascending else nqb - 1 - t % nqb) * qb
    r.i1 = r.i0 + qb if r.i0 + qb < L else L
    return r


cdef int attn_task(int isa, const fa_attn_args *a, const Operands *o, const Batch *b, fa_idx t,
                   fa_idx nqb, fa_idx qb, fa_idx ntasks, int nthreads,
                   void *work) noexcept nogil:
    """Task t of the attention loop (task_rows); the kernel's return code."""
    cdef fa_idx item = t // nqb
    cdef bint ascending = a.window_left >= 0
    cdef fa_attn_next cur = task_rows(o, b, t, nqb, qb, a.L, ascending)
    cdef fa_attn_next nxt
    cdef const fa_attn_next *hint = NULL
    cdef fa_attn_args ai = item_args(a, o, b, item)
    # the task this thread most likely takes next: prefetched as this one
    # ends (only a hint; no result depends on it)
    if o.ahead and t + nthreads < ntasks:
        nxt = task_rows(o, b, t + nthreads, nqb, qb, a.L, ascending)
        hint = &nxt
    return fa_attn(<fa_isa>isa, o.elsize, &ai, cur.q, cur.k, cur.v, m_at(o, b, item),
                   o_at(o, b, item), w_at(o, b, item), lse_at(o, b, item), cur.i0, cur.i1,
                   hint, work)


def attention(int isa, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask, int mask_kind,
              cnp.ndarray out, object weights, fa_idx group, bint causal, fa_idx causal_offset,
              double scale, int nthreads, int prefetch=FA_PREFETCH_KEYS | FA_PREFETCH_VALUES,
              fa_idx window_left=-1, fa_idx window_right=-1, double softcap=0,
              object slopes=None, object sinks=None, object lse=None,
              int q_store=STORE_NATIVE, int kv_store=STORE_NATIVE, object k_scale=None,
              object v_scale=None, bint ahead_blocks=True):
    """out[..., L, Ev] = attention of q (..., L, E), k/v (..., S, E|Ev).

    All arrays have the same number of dimensions; the axes before the last
    two are batch axes, equal to out's except that k and v have out's last
    batch axis divided by group.  slopes and sinks (float64) have out's
    batch shape, lse (out's dtype) its batch shape and L.  q, and k and v,
    are stored as q_store and kv_store (out float32 unless both are native);
    with int8 and float8_e4m3fn, k_scale and v_scale (float32) have k's
    batch shape and S; Q4 rows are blocks of bytes (fa_common.h), so Ev is
    out's last axis, not v's.  prefetch: fa_attn_args' (fastattn/_tuning.py
    chooses it); ahead_blocks: FA_PREFETCH_BLOCKS joins it where one item's
    keys and values exceed L2.  No result depends on either."""
    cdef int nd = q.ndim - 2
    cdef Batch b
    cdef Operands o
    cdef fa_attn_args a
    cdef cnp.ndarray m_arr, w_arr, x_arr
    memset(&o, 0, sizeof(o))
    memset(&a, 0, sizeof(a))
    a.prefetch = prefetch
    # one item's keys and values beyond L2: the block kernel asks for each
    # next key block while it computes one (FA_PREFETCH_BLOCKS)
    if ahead_blocks and (k.shape[nd] * (k.shape[nd + 1] + v.shape[nd + 1]) *
                         cnp.PyArray_ITEMSIZE(k) > L2_BYTES):
        a.prefetch |= FA_PREFETCH_BLOCKS
    fill_batch(&b, out, nd)
    o.q, o.k, o.v, o.o = (<char *>cnp.PyArray_DATA(q), <char *>cnp.PyArray_DATA(k),
                          <char *>cnp.PyArray_DATA(v), <char *>cnp.PyArray_DATA(out))
    o.elsize, o.msize, o.group = cnp.PyArray_ITEMSIZE(out), 1, group
    o.qsize, o.kvsize = cnp.PyArray_ITEMSIZE(q), cnp.PyArray_ITEMSIZE(k)
    a.q_store, a.kv_store = <fa_store>q_store, <fa_store>kv_store
    fill_strides(o.qs, q, nd)
    fill_strides(o.ks, k, nd)
    fill_strides(o.vs, v, nd)
    fill_strides(o.os, out, nd)
    a.L = q.shape[nd]
    a.E = q.shape[nd + 1]
    a.S = k.shape[nd]
    a.Ev = out.shape[nd + 1]  # v's last axis counts bytes for Q4
    a.q_ls, a.q_es = estride(q, nd), estride(q, nd + 1)
    a.k_ss, a.k_es = estride(k, nd), estride(k, nd + 1)
    a.v_ss, a.v_es = estride(v, nd), estride(v, nd + 1)
    a.o_ls, a.o_es = estride(out, nd), estride(out, nd + 1)
    a.mask_kind = <fa_mask_kind>mask_kind
    if mask_kind != MASK_NONE:
        m_arr = mask
        o.m = <char *>cnp.PyArray_DATA(m_arr)
        o.msize = cnp.PyArray_ITEMSIZE(m_arr)
        fill_strides(o.ms, m_arr, nd)
        a.m_ls, a.m_ss = estride(m_arr, nd), estride(m_arr, nd + 1)
    if weights is not None:
        w_arr = weights
        o.w = <char *>cnp.PyArray_DATA(w_arr)
        fill_strides(o.ws, w_arr, nd)
        a.w_ls, a.w_ss = estride(w_arr, nd), estride(w_arr, nd + 1)
    a.causal = causal
    a.causal_offset = causal_offset
    a.scale = scale
    a.window_left, a.window_right, a.softcap, a.sink = window_left, window_right, softcap, -INFINITY
    if slopes is not None:
        x_arr = slopes
        o.slope = <char *>cnp.PyArray_DATA(x_arr)
        fill_strides(o.slopes, x_arr, nd)
    if sinks is not None:
        x_arr = sinks
        o.sink = <char *>cnp.PyArray_DATA(x_arr)
        fill_strides(o.sinks, x_arr, nd)
    if lse is not None:
        x_arr = lse
        o.lse = <char *>cnp.PyArray_DATA(x_arr)
        fill_strides(o.lses, x_arr, nd)
        a.lse_s = estride(x_arr, nd)
    if k_scale is not None:
        x_arr = k_scale
        o.ksc = <char *>cnp.PyArray_DATA(x_arr)
        fill_strides(o.kscs, x_arr, nd)
        a.ksc_s = estride(x_arr, nd)
        x_arr = v_scale
        o.vsc = <char *>cnp.PyArray_DATA(x_arr)
        fill_strides(o.vscs, x_arr, nd)
        a.vsc_s = estride(x_arr, nd)

    group_heads(&a, &b, &o, nd)
    cdef fa_idx qb = fa_attn_query_block(o.elsize)
    cdef fa_idx nqb = (a.L + qb - 1) // qb
    cdef fa_idx ntasks = nqb * b.count
    cdef size_t work_bytes = fa_attn_work_bytes(&a, o.elsize)
    cdef fa_idx t
    cdef void *work
    cdef int err = 0
    cdef int *errp = &err
    cdef fa_stop stop
    if ntasks == 0:
        return
    cdef fa_idx nsplit = fa_attn_splits(&a)
    if nsplit > 1:
        split_attention(isa, &a, &b, &o, nsplit, work_bytes, nthreads)
        return
    nthreads = min(nthreads, ntasks)  # do not wake threads that would get no work
    o.ahead = q.nbytes + k.nbytes + v.nbytes + out.nbytes > L2_BYTES * nthreads
    stop_init(&stop)
    if nthreads == 1:  # the same tasks in order, without a parallel region: entering one
        with nogil:    # costs a tenth of a small call (threads-and-speed.md, "Small calls")
            work = malloc(work_bytes)
            err = 1 if work == NULL else 0
            t = 0
            while err == 0 and t < ntasks and not stopped(&stop):
                err = 2 if attn_task(isa, &a, &o, &b, t, nqb, qb, ntasks, 1, work) != 0 else 0
                t += 1
            free(work)
    else:
        with nogil, parallel(num_threads=nthreads):
            work = malloc(work_bytes)
            if work == NULL:
                errp[0] = 1
            for t in prange(ntasks, schedule="dynamic"):
                if work == NULL or stopped(&stop):
                    continue
                if attn_task(isa, &a, &o, &b, t, nqb, qb, ntasks, nthreads, work) != 0:
                    errp[0] = 2
            free(work)
    stop_raise(&stop)
    raise_on(err, "attention")


cdef inline void row_lse(int es, void *ml, fa_idx i, void *lse, fa_idx at) noexcept nogil:
    """lse[at] from row i's merged maximum and sum in ml (fa_kern_scores.h's lse)."""
    cdef double m, l
    if es == 4:
        m, l = (<float *>ml)[2 * i], (<float *>ml)[2 * i + 1]
        (<float *>lse)[at] = -INFINITY if l == 0 else <float>m + <float>log(l)
    else:
        m, l = (<double *>ml)[2 * i], (<double *>ml)[2 * i + 1]
        (<double *>lse)[at] = -INFINITY if l == 0 else m + log(l)


cdef int split_attention(int isa, const fa_attn_args *a, const Batch *b, const Operands *o,
                         fa_idx nsplit, size_t work_bytes, int nthreads) except -1:
    """Decoding (a few query rows, many keys): every item's keys in nsplit
    pieces computed in parallel, then merged (csrc/fastattn.h); the weights,
    when wanted, from each row's merged maximum and sum, so that asking for
    them does not change the output."""
    cdef int es = o.elsize
    cdef fa_idx chunk = (a.S + nsplit - 1) // nsplit
    cdef fa_idx slen = fa_attn_state_len(a, 0, a.L)
    cdef fa_idx ntasks = b.count * nsplit
    cdef fa_idx t, item, piece, s_lo, s_hi
    cdef char *states = <char *>malloc(ntasks * slen * es)
    cdef bint want_ml = o.w != NULL or o.lse != NULL
    cdef fa_idx rows = a.L * (a.heads if a.heads > 1 else 1)  # of an item (group_heads)
    cdef char *ml = <char *>malloc(b.count * rows * 2 * es) if want_ml else NULL
    cdef void *work
    cdef void *mlrow
    cdef int err = 0
    cdef int *errp = &err
    cdef int rc
    cdef fa_stop stop
    cdef fa_attn_args ai
    cdef fa_idx i
    if states == NULL or (want_ml and ml == NULL):
        free(states)
        free(ml)
        raise MemoryError("fastattn: cannot allocate the split-attention state")
    stop_init(&stop)
    with nogil, parallel(num_threads=min(nthreads, ntasks)):
        work = malloc(work_bytes)
        if work == NULL:
            errp[0] = 1
        for t in prange(ntasks, schedule="dynamic"):
            if work == NULL or stopped(&stop):
                continue
            item = t // nsplit
            piece = t % nsplit
            s_lo = piece * chunk
            s_hi = s_lo + chunk if s_lo + chunk < a.S else a.S
            ai = item_args(a, o, b, item)
            rc = fa_attn_part(<fa_isa>isa, es, &ai, q_at(o, b, item), k_at(o, b, item),
                              v_at(o, b, item), m_at(o, b, item), 0, a.L, s_lo, s_hi,
                              states + es * t * slen, work)
            if rc != 0:
                errp[0] = 2
        free(work)
    # merged, then the rows that came out non-finite where a key's weight may
    # be 0 against the row's maximum but not against its piece's computed
    # again without the split (fa_attn_repair), then the weights from the
    # merged maximum and sum
    if err == 0 and stop.flag == 0:
        with nogil, parallel(num_threads=min(nthreads, b.count)):
            work = malloc(work_bytes)
            if work == NULL:
                errp[0] = 1
            for item in prange(b.count, schedule="static"):
                if work == NULL:
                    continue
                mlrow = <void *>(ml + es * item * rows * 2) if ml != NULL else NULL
                ai = item_args(a, o, b, item)
                rc = fa_attn_merge(<fa_isa>isa, es, a, nsplit,
                                   states + es * item * nsplit * slen, o_at(o, b, item), mlrow,
                                   0, a.L)
                if rc == 0:
                    rc = fa_attn_repair(<fa_isa>isa, es, &ai, q_at(o, b, item), k_at(o, b, item),
                                        v_at(o, b, item), m_at(o, b, item), nsplit,
                                        states + es * item * nsplit * slen, o_at(o, b, item),
                                        NULL, 0, a.L, work)
                if rc == 0 and o.w != NULL:
                    rc = fa_attn_weights(<fa_isa>isa, es, &ai, q_at(o, b, item), k_at(o, b, item),
                                         m_at(o, b, item), mlrow, w_at(o, b, item), 0, a.L, work)
                if rc != 0:
                    errp[0] = 2
                if o.lse != NULL:  # row i: head i // L, query i % L
                    for i in range(rows):
                        row_lse(es, mlrow, i, lse_at(o, b, item),
                                i // a.L * a.lse_hs + i % a.L * a.lse_s)
            free(work)
    free(states)
    free(ml)
    stop_raise(&stop)
    return raise_on(err, "split attention")


cdef struct Ragged:
    # The operands of one ragged() call: the arguments shared by its
    # sequences and heads, and where each sequence's and head's start.
    fa_attn_args a
    char *q
    char *k
    char *v
    char *o
    char *lse
    const float *ksc
    const float *vsc
    const int32_t *table          # (B, table_s) block ids, or NULL: keys contiguous
    const cnp.int64_t *kv_start   # without a table, each sequence's first key row
    const cnp.int64_t *cu_q
    const cnp.int64_t *seq_lens
    const double *slope   # (B, Hq) or NULL
    const double *sink    # (Hq,) or NULL
    fa_idx table_s, Hq, group, qh, kh, vh, oh, lh, ksch, vsch
    fa_idx kv_row_bytes   # a key row's and a value row's bytes
    fa_idx align_offset   # query i of a sequence is at key position i + this
    bint lower_right      # ... plus S - L of the sequence
    bint ahead_blocks     # FA_PREFETCH_BLOCKS for sequences beyond L2
    int qsize, kvsize, es


cdef struct RaggedTask:
    # Rows i0..i1-1 of query heads head..head+heads-1 of a sequence (heads
    # that share a key/value head, computed together so that its keys and
    # values are read once); when the item's keys are split (nsplit > 1),
    # its keys s_lo..s_hi-1 into the state at `state` (elements from the
    # start of the call's states).  order: when made.
    fa_idx seq, head, heads, i0, i1, s_lo, s_hi, nsplit, state, order
    double cost


cdef int costlier_first(const void *x, const void *y) noexcept nogil:
    """qsort's order of tasks: costlier first, then as made (qsort is not
    stable), so that the heads of one key/value head stay together."""
    cdef const RaggedTask *s = <const RaggedTask *>x
    cdef const RaggedTask *t = <const RaggedTask *>y
    if s.cost != t.cost:
        return -1 if s.cost > t.cost else 1
    return -1 if s.order < t.order else (1 if s.order > t.order else 0)


cdef inline fa_attn_args ragged_args(const Ragged *p, fa_idx b, fa_idx h,
                                    fa_idx heads) noexcept nogil:
    """The arguments of sequence b, query heads h..h+heads-1 (of one
    key/value head): its L and S (the queries its last L positions), block
    table row, scales, slopes and sinks."""
    cdef fa_attn_args r = p.a
    r.L = p.cu_q[b + 1] - p.cu_q[b]
    r.S = p.seq_lens[b]
    r.causal_offset = (r.S - r.L if p.lower_right else 0) + p.align_offset
    r.block_table = p.table + b * p.table_s if p.table != NULL else NULL
    r.heads = heads
    if p.ahead_blocks and r.S * p.kv_row_bytes > L2_BYTES:  # as attention() decides
        r.prefetch |= FA_PREFETCH_BLOCKS
    if p.ksc != NULL:
        r.k_scale = p.ksc + (h // p.group) * p.ksch
        r.v_scale = p.vsc + (h // p.group) * p.vsch
    if p.slope != NULL:
        r.alibi_slope = p.slope[b * p.Hq + h]
        r.head_slopes = p.slope + b * p.Hq + h
    if p.sink != NULL:
        r.sink = p.sink[h]
        r.head_sinks = p.sink + h
    return r


cdef int ragged_run(int isa, const Ragged *p, const RaggedTask *t, char *states, bint merge,
                   void *work) noexcept nogil:
    """Task t of ragged(), or (merge) the merge of its item's split pieces,
    their repair and lse; the kernels' return code."""
    cdef fa_idx b = t.seq, h = t.head, i
    cdef fa_attn_args ai = ragged_args(p, b, h, t.heads)
    cdef char *q = p.q + p.qsize * (p.cu_q[b] * ai.q_ls + h * p.qh)
    cdef fa_idx row0 = p.kv_start[b] if p.kv_start != NULL else 0
    cdef char *k = p.k + p.kvsize * ((h // p.group) * p.kh + row0 * ai.k_ss)
    cdef char *v = p.v + p.kvsize * ((h // p.group) * p.vh + row0 * ai.v_ss)
    cdef char *o = p.o + p.es * (p.cu_q[b] * ai.o_ls + h * p.oh)
    cdef char *lse = p.lse + p.es * (h * p.lh + p.cu_q[b] * ai.lse_s) if p.lse != NULL else NULL
    cdef char *st = states + p.es * t.state if t.nsplit > 1 else NULL
    cdef float mlf[2 * 4]   # the merged maximum and sum of at most FA_ROWS_MAX rows
    cdef double mld[2 * 4]
    cdef void *ml = <void *>mlf if p.es == 4 else <void *>mld
    cdef int rc
    if not merge and st == NULL:
        return fa_attn(<fa_isa>isa, p.es, &ai, q, k, v, NULL, o, NULL, lse, t.i0, t.i1, NULL,
                       work)
    if not merge:
        return fa_attn_part(<fa_isa>isa, p.es, &ai, q, k, v, NULL, 0, ai.L, t.s_lo, t.s_hi, st,
                            work)
    # as split_attention does: merged, the rows that came out non-finite
    # computed again, then each row's lse from the merged maximum and sum
    rc = fa_attn_merge(<fa_isa>isa, p.es, &ai, t.nsplit, st, o, ml, 0, ai.L)
    if rc == 0:
        rc = fa_attn_repair(<fa_isa>isa, p.es, &ai, q, k, v, NULL, t.nsplit, st, o, NULL, 0, ai.L,
                            work)
    if lse != NULL:  # row i of head g of the task: ml's row g L + i
        for i in range(ai.L * t.heads):
            row_lse(p.es, ml, i, lse, i // ai.L * p.lh + i % ai.L * ai.lse_s)
    return rc


cdef inline fa_idx grouped(const fa_attn_args *a, fa_idx group) noexcept nogil:
    """Query heads of one key/value head computed together for a sequence
    of a->L queries: as many as the row kernel's 4 rows hold (1 when its
    L > 4 rows go to the block kernel)."""
    return max(1, min(group, 4 // a.L)) if a.L <= 4 else 1


cdef double ragged_cost(const fa_attn_args *a, fa_idx i0, fa_idx i1, fa_idx s_lo, fa_idx s_hi) noexcept nogil:
    """About the time of rows i0..i1-1 over keys s_lo..s_hi-1 (those the
    bounds leave), in key-rows: a block of rows reads each key once for all
    of them, and a key read costs some 8 rows' products (decoding is bound
    by memory, blocks of rows by arithmetic)."""
    cdef fa_idx lo = s_lo, hi = s_hi
    if a.causal or a.window_right >= 0:
        hi = min(hi, max(a.causal_offset + i1 + (0 if a.causal else a.window_right), 0))
    if a.window_left >= 0:
        lo = max(lo, a.causal_offset + i0 - a.window_left)
    return <double>max(hi - lo, 0) * <double>(i1 - i0 + 8)


def ragged(int isa, cnp.ndarray q, cnp.ndarray key_cache, cnp.ndarray value_cache,
           object k_scale, object v_scale, object block_table, object kv_start,
           const cnp.int64_t[::1] seq_lens, const cnp.int64_t[::1] cu_q, cnp.ndarray out,
           object lse, fa_idx group, bint causal, bint lower_right, fa_idx align_offset,
           double scale, int nthreads, fa_idx window_left, fa_idx window_right,
           double softcap, object slopes, object sinks, int q_store, int kv_store,
           int prefetch=FA_PREFETCH_KEYS | FA_PREFETCH_VALUES, bint ahead_blocks=True):
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
    lower_right.  slopes (B, Hq) and sinks (Hq,) float64 or None.

    One task list for the whole ragged batch: a task per block of query
    rows of each (sequence, head), of the sequence's own length, or, where
    scaled_dot_product_attention splits a sequence's keys (decoding), a
    task per piece, merged after; costlier tasks first.  prefetch and
    ahead_blocks as in attention(), per sequence."""
    cdef Ragged p
    cdef const int32_t[:, ::1] table
    cdef const cnp.int64_t[::1] starts
    cdef fa_idx nseq = cu_q.shape[0] - 1, Hq = out.shape[1]
    cdef fa_idx b, h, i0, nqb, piece, chunk, nsplit, ntasks = 0, nitems = 0, nstate = 0
    cdef fa_idx t, slen
    cdef cnp.ndarray x_arr
    memset(&p, 0, sizeof(p))
    p.es = cnp.PyArray_ITEMSIZE(out)
    p.qsize, p.kvsize = cnp.PyArray_ITEMSIZE(q), cnp.PyArray_ITEMSIZE(key_cache)
    p.a.E, p.a.Ev = q.shape[2], out.shape[2]  # the caches' last axes count bytes for Q4
    p.a.q_ls, p.a.q_es = estride(q, 0), estride(q, 2)
    p.a.k_bs, p.a.k_ss, p.a.k_es = estride(key_cache, 0), estride(key_cache, 2), estride(key_cache, 3)
    p.a.v_bs, p.a.v_ss, p.a.v_es = (estride(value_cache, 0), estride(value_cache, 2),
                                    estride(value_cache, 3))
    p.a.o_ls, p.a.o_es = estride(out, 0), estride(out, 2)
    p.a.q_hs, p.a.o_hs = estride(q, 1), estride(out, 1)
    p.a.mask_kind = FA_MASK_NONE
    p.a.prefetch = prefetch
    p.a.scale, p.a.softcap, p.a.causal = scale, softcap, causal
    p.a.window_left, p.a.window_right, p.a.sink = window_left, window_right, -INFINITY
    p.a.q_store, p.a.kv_store = <fa_store>q_store, <fa_store>kv_store
    p.a.block_size = key_cache.shape[2]
    p.kv_row_bytes = (key_cache.shape[3] + value_cache.shape[3]) * p.kvsize
    p.ahead_blocks = ahead_blocks
    p.lower_right, p.align_offset = lower_right, align_offset
    if block_table is not None:
        table = block_table
        if table.shape[0] > 0 and table.shape[1] > 0:
            p.table, p.table_s = &table[0, 0], table.shape[1]
    elif nseq > 0:
        starts = kv_start
        p.kv_start = &starts[0]
    p.a.block_table = p.table  # (fa_attn_work_bytes: paged reads need tile buffers)
    p.q, p.k = <char *>cnp.PyArray_DATA(q), <char *>cnp.PyArray_DATA(key_cache)
    p.v, p.o = <char *>cnp.PyArray_DATA(value_cache), <char *>cnp.PyArray_DATA(out)
    p.qh, p.kh, p.vh, p.oh = estride(q, 1), estride(key_cache, 1), estride(value_cache, 1), estride(out, 1)
    p.cu_q, p.seq_lens = &cu_q[0], (&seq_lens[0] if nseq > 0 else NULL)
    p.Hq, p.group = Hq, group
    if k_scale is not None:
        x_arr = k_scale
        p.ksc = <const float *>cnp.PyArray_DATA(x_arr)
        p.a.ksc_bs, p.ksch, p.a.ksc_s = estride(x_arr, 0), estride(x_arr, 1), estride(x_arr, 2)
        p.a.k_scale = p.ksc
        x_arr = v_scale
        p.vsc = <const float *>cnp.PyArray_DATA(x_arr)
        p.a.vsc_bs, p.vsch, p.a.vsc_s = estride(x_arr, 0), estride(x_arr, 1), estride(x_arr, 2)
        p.a.v_scale = p.vsc
    if lse is not None:
        x_arr = lse
        p.lse = <char *>cnp.PyArray_DATA(x_arr)
        p.lh, p.a.lse_s = estride(x_arr, 0), estride(x_arr, 1)
        p.a.lse_hs = p.lh
    if slopes is not None:
        x_arr = slopes  # C-contiguous (B, Hq)
        p.slope = <const double *>cnp.PyArray_DATA(x_arr)
    if sinks is not None:
        x_arr = sinks   # C-contiguous (Hq,)
        p.sink = <const double *>cnp.PyArray_DATA(x_arr)
    if (p.table == NULL and p.kv_start == NULL) or Hq == 0:
        return

    # the tasks: every (sequence, head) as scaled_dot_product_attention on
    # that sequence alone splits it (fa_attn_splits), so its bits are that
    # call's; a few rows (decoding) of the query heads of one key/value head
    # together (fa_attn_args' heads: the keys read once for all); then
    # sorted costlier first
    cdef fa_idx qb = fa_attn_query_block(p.es)
    cdef fa_idx together, nchunks, h0
    cdef fa_attn_args ai
    for b in range(nseq):
        ai = ragged_args(&p, b, 0, 1)
        if ai.L == 0:
            continue
        nsplit = fa_attn_splits(&ai)
        together = grouped(&ai, group)
        nchunks = (Hq // group) * ((group + together - 1) // together)
        ntasks += nchunks * (nsplit if nsplit > 1 else (ai.L + qb - 1) // qb)
        nitems += nchunks if nsplit > 1 else 0
    if ntasks == 0:
        return
    cdef RaggedTask *tasks = <RaggedTask *>malloc((ntasks + nitems) * sizeof(RaggedTask))
    if tasks == NULL:
        raise MemoryError("fastattn: cannot allocate the task list")
    cdef RaggedTask *items = tasks + ntasks  # the split items, to merge
    cdef RaggedTask *x
    t = 0
    nitems = 0
    for b in range(nseq):
        ai = ragged_args(&p, b, 0, 1)
        if ai.L == 0:
            continue
        nsplit = fa_attn_splits(&ai)
        together = grouped(&ai, group)
        nqb = (ai.L + qb - 1) // qb
        chunk = (ai.S + nsplit - 1) // nsplit
        for h0 in range(Hq):  # chunks of `together` heads of one key/value head
            if h0 % group % together:
                continue
            h = min(together, group - h0 % group)
            ai.heads = h
            slen = fa_attn_state_len(&ai, 0, ai.L)
            if nsplit > 1:
                items[nitems] = RaggedTask(b, h0, h, 0, ai.L, 0, ai.S, nsplit, nstate, nitems, 0)
                nitems += 1
            for piece in range(nsplit if nsplit > 1 else nqb):
                x = &tasks[t]
                x.seq, x.head, x.heads, x.nsplit, x.order = b, h0, h, nsplit, t
                if nsplit > 1:
                    x.i0, x.i1, x.s_lo = 0, ai.L, piece * chunk
                    x.s_hi = min(x.s_lo + chunk, ai.S)
                    x.state = nstate
                    nstate += slen
                else:
                    x.i0 = piece * qb
                    x.i1 = min(x.i0 + qb, ai.L)
                    x.s_lo, x.s_hi, x.state = 0, ai.S, 0
                x.cost = ragged_cost(&ai, x.i0, x.i1, x.s_lo, x.s_hi) * h
                t += 1
    qsort(tasks, ntasks, sizeof(RaggedTask), costlier_first)

    cdef char *states = <char *>malloc(max(nstate, 1) * p.es)
    if states == NULL:
        free(tasks)
        raise MemoryError("fastattn: cannot allocate the split-attention state")
    cdef size_t work_bytes = fa_attn_work_bytes(&p.a, p.es)
    cdef void *work
    cdef int err = 0
    cdef int *errp = &err
    cdef fa_stop stop
    stop_init(&stop)
    with nogil, parallel(num_threads=min(nthreads, ntasks)):
        work = malloc(work_bytes)
        if work == NULL:
            errp[0] = 1
        for t in prange(ntasks, schedule="dynamic"):
            if work == NULL or stopped(&stop):
                continue
            if ragged_run(isa, &p, &tasks[t], states, False, work) != 0:
                errp[0] = 2
        free(work)
    if err == 0 and stop.flag == 0 and nitems > 0:
        with nogil, parallel(num_threads=min(nthreads, nitems)):
            work = malloc(work_bytes)
            if work == NULL:
                errp[0] = 1
            for t in prange(nitems, schedule="dynamic"):
                if work == NULL:
                    continue
                if ragged_run(isa, &p, &items[t], states, True, work) != 0:
                    errp[0] = 2
            free(work)
    free(states)
    free(tasks)
    stop_raise(&stop)
    raise_on(err, "ragged attention")


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
    stop_init(&stop)
    with nogil, parallel(num_threads=nthreads):
        work = malloc(work_bytes)
        if work == NULL:
            errp[0] = 1
        for r in prange(b.count, schedule="static"):
            if work == NULL or stopped(&stop):
                continue
            mrow = at(mp, msize, &b, ms, r, 1)
            if fa_softmax_row(<fa_isa>isa, elsize, n, at(xp, elsize, &b, xs, r, 1), x_s,
                              <fa_mask_kind>mask_kind, mrow, m_s, at(op, elsize, &b, os, r, 1),
                              o_s, work) != 0:
                errp[0] = 2
        free(work)
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
    stop_init(&stop)
    with nogil, parallel(num_threads=nthreads):
        work = malloc(work_bytes)
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
            if fa_gemm(<fa_isa>isa, elsize, &g, at(ap, elsize, &b, as_, item, 1),
                       at(bp, elsize, &b, bs, item, 1), at(op, elsize, &b, os, item, 1),
                       i0, i1, j0, j1, work) != 0:
                errp[0] = 2
        free(work)
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
