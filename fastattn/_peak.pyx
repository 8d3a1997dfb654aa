# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Cython layer of the machine-peak loops (csrc/fa_peak*.c) used by
fastattn.bench: each function runs one loop per thread on N OpenMP threads,
with the GIL released, and returns the work done and the wall time.  isa is
a SIMD path name of fastattn.available_simd_paths()."""
from cython.parallel cimport prange
from libc.stdlib cimport free, malloc
from time import perf_counter

cimport numpy as cnp

cnp.import_array()

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static int fa_thread_num(void) { return omp_get_thread_num(); }
    #else
    static int fa_thread_num(void) { return 0; }
    #endif
    """
    int fa_thread_num() nogil

cdef extern from "fa_peak.h" nogil:
    ctypedef Py_ssize_t fa_idx
    ctypedef enum fa_isa:
        pass
    fa_idx fa_peak_fma_flops(fa_isa isa)
    float fa_peak_fma_f32(fa_isa isa, fa_idx iters)
    float fa_peak_read_f32(fa_isa isa, fa_idx n, const float *x)


cdef int isa_code(str isa) except -1:
    """The fa_isa of a SIMD path name, checked against what this CPU runs."""
    from fastattn import _runtime
    if isa not in _runtime.available_simd_paths():
        raise ValueError(f"isa must be one of {_runtime.available_simd_paths()} on this CPU, "
                         f"got {isa!r}")
    return _runtime._PATHS[isa]


cdef int check_threads(int nthreads) except -1:
    if nthreads < 1:
        raise ValueError(f"nthreads must be >= 1, got {nthreads}")
    return 0


def fma_run(str isa, fa_idx iters, int nthreads):
    """Run the FMA loop for iters iterations on each of nthreads threads.

    Returns (flops, seconds, threads_seen): the floating-point operations done
    in all, the wall time from the start of the parallel region to its end,
    and how many distinct OpenMP threads ran a loop (1 in a serial build)."""
    cdef int code = isa_code(isa)
    check_threads(nthreads)
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    cdef float *sink = <float *>malloc(nthreads * sizeof(float))
    cdef int *who = <int *>malloc(nthreads * sizeof(int))
    cdef int t
    if sink == NULL or who == NULL:
        free(sink)
        free(who)
        raise MemoryError()
    try:
        start = perf_counter()
        with nogil:
            for t in prange(nthreads, schedule="static", chunksize=1, num_threads=nthreads):
                sink[t] = fa_peak_fma_f32(<fa_isa>code, iters)
                who[t] = fa_thread_num()
        seconds = perf_counter() - start
        seen = len({who[t] for t in range(nthreads)})
    finally:
        free(sink)
        free(who)
    return float(fa_peak_fma_flops(<fa_isa>code)) * iters * nthreads, seconds, seen


def read_run(str isa, list arrays, int nthreads):
    """Read every element of the arrays once, split into nthreads equal
    slices per array, one slice of each per thread.

    arrays: C-contiguous float32 ndarrays.  Returns (bytes, seconds, total):
    the bytes read, the wall time of the parallel region, and the sum of all
    elements as the loops computed it (what proves they read everything)."""
    cdef int code = isa_code(isa)
    check_threads(nthreads)
    cdef Py_ssize_t na = len(arrays), i
    cdef cnp.ndarray a
    for i in range(na):
        a = arrays[i]
        if a.dtype.num != cnp.NPY_FLOAT32 or not a.flags.c_contiguous:
            raise TypeError(f"arrays[{i}] must be a C-contiguous float32 ndarray, got "
                            f"dtype {a.dtype}, C-contiguous {a.flags.c_contiguous}")
    cdef const float **ptrs = <const float **>malloc((na + 1) * sizeof(float *))
    cdef fa_idx *sizes = <fa_idx *>malloc((na + 1) * sizeof(fa_idx))
    cdef double *sink = <double *>malloc(nthreads * sizeof(double))
    cdef fa_idx total = 0, lo, hi
    cdef int t
    if ptrs == NULL or sizes == NULL or sink == NULL:
        free(ptrs)
        free(sizes)
        free(sink)
        raise MemoryError()
    try:
        for i in range(na):
            a = arrays[i]
            ptrs[i] = <const float *>cnp.PyArray_DATA(a)
            sizes[i] = cnp.PyArray_SIZE(a)
            total += sizes[i]
        start = perf_counter()
        with nogil:
            for t in prange(nthreads, schedule="static", chunksize=1, num_threads=nthreads):
                sink[t] = 0
                for i in range(na):
                    lo = sizes[i] * t // nthreads
                    hi = sizes[i] * (t + 1) // nthreads
                    sink[t] += fa_peak_read_f32(<fa_isa>code, hi - lo, ptrs[i] + lo)
        seconds = perf_counter() - start
        checksum = sum(sink[t] for t in range(nthreads))
    finally:
        free(ptrs)
        free(sizes)
        free(sink)
    return float(total) * 4, seconds, checksum
