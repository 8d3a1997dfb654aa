/* Machine peaks for the benchmarks (fastattn/_peak.pyx): loops that do a
 * known amount of work, for the caller to time.  Kept out of fastattn.h: the
 * kernels' module does not link them. */
#ifndef FA_PEAK_H
#define FA_PEAK_H

#include "fastattn.h"

/* Each loop runs with the instruction set of a kernel path; as for the
 * kernels, the caller checks that the CPU has it. */

/* Floating-point operations per iteration of fa_peak_fma_f32 (an FMA is 2). */
fa_idx fa_peak_fma_flops(fa_isa isa);
/* iters iterations of independent float32 multiply-add chains, on the
 * calling thread, with enough chains to keep every FMA unit busy; returns a
 * value that depends on all of them so that no work can be optimised away.
 * Time it to get the thread's FMA throughput.  iters < 0 counts as 0. */
float fa_peak_fma_f32(fa_isa isa, fa_idx iters);
/* Sum of x[0..n-1] (contiguous), each element read once with several
 * independent vector accumulators: time it over a buffer much larger than
 * the last-level cache to get the thread's memory read bandwidth.
 * Returns 0 when n <= 0 or x is NULL. */
float fa_peak_read_f32(fa_isa isa, fa_idx n, const float *x);

#endif
