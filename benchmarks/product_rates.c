/* The rates of the product instructions an 8-bit or 16-bit attention mode
 * could build on, against the float32 FMA of the exact one: multiply-adds
 * per cycle of each, 12 independent accumulators (more than any of these
 * instructions' latency times its throughput), operands in registers, in
 * assembly so that the compiler neither hoists nor spills anything: only
 * the execution units count.  The operands' values do not change an
 * instruction's speed on the CPUs of interest (no data-dependent timing).
 *
 *   gcc -O2 -mavx512f benchmarks/product_rates.c -o /tmp/rates && /tmp/rates
 *
 * (x86 with AVX-512 VNNI and BF16, as a Zen 4 or a Sapphire Rapids: a loop
 * whose instructions the CPU lacks would fault.)  The clock is measured as
 * bench_clock.h measures it, with a chain of dependent integer adds.
 * Multiply-adds per instruction: FMA 8 (ymm) or 16 (zmm) float32;
 * vpmaddubsw + vpmaddwd + vpaddd 32 int8 (ymm, the three); vpdpbusd 32 or
 * 64 int8; vdpbf16ps 16 or 32 bfloat16. */
#include "bench_clock.h"

#define ITERS 20000000L
#define CHAINS 12

static void fma512(long iters)
{
    __asm__ volatile(
        "vpxord %%zmm29, %%zmm29, %%zmm29\n\t"
        "vpternlogd $0xff, %%zmm30, %%zmm30, %%zmm30\n\t"
        "vpabsb %%zmm30, %%zmm31\n\t"
        "1:\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm0\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm1\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm2\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm3\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm4\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm5\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm6\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm7\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm8\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm9\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm10\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm11\n\t"
        "dec %0\n\t"
        "jnz 1b"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "cc");
}

static void fma256(long iters)
{
    __asm__ volatile(
        "vpxord %%zmm29, %%zmm29, %%zmm29\n\t"
        "vpternlogd $0xff, %%zmm30, %%zmm30, %%zmm30\n\t"
        "vpabsb %%zmm30, %%zmm31\n\t"
        "1:\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm0\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm1\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm2\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm3\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm4\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm5\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm6\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm7\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm8\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm9\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm10\n\t"
        "vfmadd231ps %%ymm30, %%ymm31, %%ymm11\n\t"
        "dec %0\n\t"
        "jnz 1b"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "cc");
}

static void dpbusd512(long iters)
{
    __asm__ volatile(
        "vpxord %%zmm29, %%zmm29, %%zmm29\n\t"
        "vpternlogd $0xff, %%zmm30, %%zmm30, %%zmm30\n\t"
        "vpabsb %%zmm30, %%zmm31\n\t"
        "1:\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm0\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm1\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm2\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm3\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm4\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm5\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm6\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm7\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm8\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm9\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm10\n\t"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm11\n\t"
        "dec %0\n\t"
        "jnz 1b"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "cc");
}

static void dpbusd256(long iters)
{
    __asm__ volatile(
        "vpxord %%zmm29, %%zmm29, %%zmm29\n\t"
        "vpternlogd $0xff, %%zmm30, %%zmm30, %%zmm30\n\t"
        "vpabsb %%zmm30, %%zmm31\n\t"
        "1:\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm0\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm1\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm2\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm3\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm4\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm5\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm6\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm7\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm8\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm9\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm10\n\t"
        "vpdpbusd %%ymm30, %%ymm31, %%ymm11\n\t"
        "dec %0\n\t"
        "jnz 1b"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "cc");
}

static void madd256(long iters)
{
    __asm__ volatile(
        "vpxord %%zmm29, %%zmm29, %%zmm29\n\t"
        "vpternlogd $0xff, %%zmm30, %%zmm30, %%zmm30\n\t"
        "vpabsb %%zmm30, %%zmm31\n\t"
        "1:\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm16\n\tvpmaddwd %%ymm29, %%ymm16, %%ymm16\n\tvpaddd %%ymm16, %%ymm0, %%ymm0\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm17\n\tvpmaddwd %%ymm29, %%ymm17, %%ymm17\n\tvpaddd %%ymm17, %%ymm1, %%ymm1\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm18\n\tvpmaddwd %%ymm29, %%ymm18, %%ymm18\n\tvpaddd %%ymm18, %%ymm2, %%ymm2\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm19\n\tvpmaddwd %%ymm29, %%ymm19, %%ymm19\n\tvpaddd %%ymm19, %%ymm3, %%ymm3\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm20\n\tvpmaddwd %%ymm29, %%ymm20, %%ymm20\n\tvpaddd %%ymm20, %%ymm4, %%ymm4\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm21\n\tvpmaddwd %%ymm29, %%ymm21, %%ymm21\n\tvpaddd %%ymm21, %%ymm5, %%ymm5\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm22\n\tvpmaddwd %%ymm29, %%ymm22, %%ymm22\n\tvpaddd %%ymm22, %%ymm6, %%ymm6\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm23\n\tvpmaddwd %%ymm29, %%ymm23, %%ymm23\n\tvpaddd %%ymm23, %%ymm7, %%ymm7\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm24\n\tvpmaddwd %%ymm29, %%ymm24, %%ymm24\n\tvpaddd %%ymm24, %%ymm8, %%ymm8\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm25\n\tvpmaddwd %%ymm29, %%ymm25, %%ymm25\n\tvpaddd %%ymm25, %%ymm9, %%ymm9\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm26\n\tvpmaddwd %%ymm29, %%ymm26, %%ymm26\n\tvpaddd %%ymm26, %%ymm10, %%ymm10\n\t"
        "vpmaddubsw %%ymm30, %%ymm31, %%ymm27\n\tvpmaddwd %%ymm29, %%ymm27, %%ymm27\n\tvpaddd %%ymm27, %%ymm11, %%ymm11\n\t"
        "dec %0\n\t"
        "jnz 1b"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "cc");
}

static void dpbf512(long iters)
{
    __asm__ volatile(
        "vpxord %%zmm29, %%zmm29, %%zmm29\n\t"
        "vpternlogd $0xff, %%zmm30, %%zmm30, %%zmm30\n\t"
        "vpabsb %%zmm30, %%zmm31\n\t"
        "1:\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm0\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm1\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm2\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm3\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm4\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm5\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm6\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm7\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm8\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm9\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm10\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm11\n\t"
        "dec %0\n\t"
        "jnz 1b"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "cc");
}

static void dpbf256(long iters)
{
    __asm__ volatile(
        "vpxord %%zmm29, %%zmm29, %%zmm29\n\t"
        "vpternlogd $0xff, %%zmm30, %%zmm30, %%zmm30\n\t"
        "vpabsb %%zmm30, %%zmm31\n\t"
        "1:\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm0\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm1\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm2\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm3\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm4\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm5\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm6\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm7\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm8\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm9\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm10\n\t"
        "vdpbf16ps %%ymm30, %%ymm31, %%ymm11\n\t"
        "dec %0\n\t"
        "jnz 1b"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "cc");
}

int main(void)
{
    const double ghz = clock_ghz();
    const struct {
        const char *name;
        void (*f)(long);
        int macs; /* multiply-adds per chain and step */
    } loops[] = {
        {"float32 FMA, zmm", fma512, 16},
        {"float32 FMA, ymm", fma256, 8},
        {"int8 vpdpbusd, zmm", dpbusd512, 64},
        {"int8 vpdpbusd, ymm", dpbusd256, 32},
        {"int8 vpmaddubsw + vpmaddwd + vpaddd, ymm", madd256, 32},
        {"bfloat16 vdpbf16ps, zmm", dpbf512, 32},
        {"bfloat16 vdpbf16ps, ymm", dpbf256, 16},
    };
    double fma = 0;
    for (unsigned i = 0; i < sizeof loops / sizeof loops[0]; ++i) {
        const double best = best_seconds(loops[i].f, ITERS);
        const double cycles = best * ghz * 1e9 / ((double)ITERS * CHAINS); /* a chain's step */
        const double macs = loops[i].macs / cycles;
        if (i == 0) fma = macs;
        printf("%-42s %5.2f steps a cycle, %6.1f multiply-adds a cycle (%.2fx FMA zmm)\n",
               loops[i].name, 1 / cycles, macs, macs / fma);
    }
    return 0;
}
