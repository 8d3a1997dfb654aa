/* The arithmetic ceiling of decoding over a cache stored in fewer bits:
 * cycles per 128 elements (one key or value row of a head of 128) of the
 * loop the row kernel runs on them, each element converted exactly to
 * float32 and multiplied into an accumulator, with the row in L1 so that
 * memory plays no part.  Decoding makes two such passes a key and head
 * (its key row, its value row), so twice the figure is the least a key and
 * head can take, whatever the memory delivers.
 *
 *   gcc -O2 -mavx512f -mavx512bw -mavx2 -mfma -mf16c \
 *       benchmarks/conversion_ceiling.c -o /tmp/ceiling && /tmp/ceiling
 *
 * (x86 with AVX-512 only: a loop whose instructions the CPU lacks would
 * fault.  The accumulators stay in registers only with the loops over them
 * unrolled, hence the pragmas.)  The clock is measured with a chain of
 * dependent integer adds, one a cycle (bench_clock.h).  Also timed: two
 * exact conversions that avoid
 * vcvtdq2ps (the float bits of 1.5 * 2^23 + k, less 1.5 * 2^23), in case
 * a CPU runs them on ports the FMAs leave free. */
#include "bench_clock.h"
#include <immintrin.h>
#include <stdint.h>

#define ROWS 32 /* 4 KB of int8, 8 KB of float16, 16 KB of float32: L1 */
#define N 128
#define ITERS 200000L

static int8_t i8[ROWS * N] __attribute__((aligned(64)));
static uint16_t f16[ROWS * N] __attribute__((aligned(64)));
static float f32[ROWS * N] __attribute__((aligned(64)));
static float w[ROWS];
static volatile float sink;

/* acc[u] += w[r] * x_r[16 u ..], 8 accumulators over ROWS rows of N: the
 * value pass (gemv_t_body); the key pass has the same conversions and
 * FMAs. */
#define LOOP512(name, CONVERT)                                                  \
    static void name(long iters)                                                \
    {                                                                           \
        __m512 acc[8];                                                          \
        for (int u = 0; u < 8; ++u) acc[u] = _mm512_setzero_ps();              \
        for (long k = 0; k < iters; ++k)                                        \
            for (int r = 0; r < ROWS; ++r) {                                    \
                const __m512 p = _mm512_set1_ps(w[r]);                          \
                _Pragma("GCC unroll 8") for (int u = 0; u < 8; ++u) {           \
                    const int e = r * N + 16 * u;                               \
                    acc[u] = _mm512_fmadd_ps(p, CONVERT, acc[u]);               \
                }                                                               \
            }                                                                   \
        for (int u = 1; u < 8; ++u) acc[0] = _mm512_add_ps(acc[0], acc[u]);    \
        sink = _mm512_reduce_add_ps(acc[0]);                                    \
    }

#define I8_CVT _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(i8 + e))))
#define I8_MAGIC                                                                \
    _mm512_sub_ps(_mm512_castsi512_ps(_mm512_add_epi32(                         \
                      _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(i8 + e))), \
                      _mm512_set1_epi32(0x4b400000))),                          \
                  _mm512_set1_ps(12582912.0f))
#define I8_HALF ((u & 1) ? I8_MAGIC : I8_CVT)

LOOP512(f32_512, _mm512_loadu_ps(f32 + e))
LOOP512(f16_512, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(f16 + e))))
LOOP512(i8_512, I8_CVT)
LOOP512(i8_magic_512, I8_MAGIC)
LOOP512(i8_mixed_512, I8_HALF)

/* AVX2: 16 accumulators of 8 */
#define LOOP256(name, CONVERT)                                                  \
    static void name(long iters)                                                \
    {                                                                           \
        __m256 acc[16];                                                         \
        for (int u = 0; u < 16; ++u) acc[u] = _mm256_setzero_ps();             \
        for (long k = 0; k < iters; ++k)                                        \
            for (int r = 0; r < ROWS; ++r) {                                    \
                const __m256 p = _mm256_set1_ps(w[r]);                          \
                _Pragma("GCC unroll 16") for (int u = 0; u < 16; ++u) {         \
                    const int e = r * N + 8 * u;                                \
                    acc[u] = _mm256_fmadd_ps(p, CONVERT, acc[u]);               \
                }                                                               \
            }                                                                   \
        for (int u = 1; u < 16; ++u) acc[0] = _mm256_add_ps(acc[0], acc[u]);   \
        float t[8];                                                             \
        _mm256_storeu_ps(t, acc[0]);                                            \
        sink = t[0];                                                            \
    }

LOOP256(f32_256, _mm256_loadu_ps(f32 + e))
LOOP256(f16_256, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(f16 + e))))
LOOP256(i8_256, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(i8 + e)))))

int main(void)
{
    for (int i = 0; i < ROWS * N; ++i) {
        i8[i] = (int8_t)(i * 37);
        f16[i] = (uint16_t)(0x3c00 ^ (i & 0x3ff)); /* finite, normal */
        f32[i] = 1.0f + (float)(i & 7);
    }
    for (int r = 0; r < ROWS; ++r) w[r] = 0.001f * (float)r;
    const double ghz = clock_ghz();
    const struct {
        const char *name;
        void (*f)(long);
    } loops[] = {
        {"float32, AVX-512 (FMA alone)", f32_512},
        {"float16, AVX-512 (vcvtph2ps)", f16_512},
        {"int8, AVX-512 (vpmovsxbd, vcvtdq2ps)", i8_512},
        {"int8, AVX-512, 1.5*2^23 + k", i8_magic_512},
        {"int8, AVX-512, half of each", i8_mixed_512},
        {"float32, AVX2 (FMA alone)", f32_256},
        {"float16, AVX2 (vcvtph2ps)", f16_256},
        {"int8, AVX2 (vpmovsxbd, vcvtdq2ps)", i8_256},
    };
    for (unsigned i = 0; i < sizeof loops / sizeof loops[0]; ++i) {
        const double best = best_seconds(loops[i].f, ITERS);
        printf("%-40s %6.2f cycles per %d elements\n", loops[i].name,
               best * ghz * 1e9 / ((double)ITERS * ROWS), N);
    }
    return 0;
}
