/* The timing shared by the benchmarks' C loops (conversion_ceiling.c,
 * product_rates.c): include first, before any system header, for
 * clock_gettime's feature macro. */
#ifndef BENCH_CLOCK_H
#define BENCH_CLOCK_H
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <stdio.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The core's clock in GHz, from a chain of dependent integer adds (one a
 * cycle), printed: cycles are what the loops are compared in. */
static double clock_ghz(void)
{
    const long n = 50000000L;
    long x = 0;
    const double t = now();
    for (long k = 0; k < n; ++k)
        __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    const double ghz = 4.0 * (double)n / (now() - t) / 1e9;
    printf("clock %.2f GHz (dependent adds)\n", ghz);
    return ghz;
}

/* The least of 5 timings of f(iters), each after a short warm-up call. */
static double best_seconds(void (*f)(long), long iters)
{
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
        f(1000);
        const double t = now();
        f(iters);
        const double dt = now() - t;
        if (dt < best) best = dt;
    }
    return best;
}
#endif
