/* What one core's bf16 dot-product instruction delivers: the compute side of where a verification
 * stops being free per tree row. The kernel (runtime/csrc/small_gemm.c) reads each weight once and
 * multiplies every row by it, so a product costs its weight's memory time until the rows' dot
 * products take longer than that; this prints the instruction's throughput in core cycles.
 *
 *     cc -O2 -mavx512f -mavx512bf16 -mavx512vl benchmarks/dp_throughput.c -o /tmp/dp && /tmp/dp
 *
 * Core cycles come from a chain of dependent float adds (latency: ADD_LATENCY cycles, 3 on Zen 4
 * and recent Intel cores): the time-stamp counter of a virtual machine need not tick at the
 * core's clock. Prints cycles per instruction for 12 independent accumulators (the kernel's
 * register block, MRD) in 512- and 256-bit forms, and the multiply-adds per cycle that gives. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <x86intrin.h>

#define ADD_LATENCY 3.0
#define N 100000000LL

/* cycles per dot product, 12 independent accumulators ``acc`` updated N / 10 times each */
#define TIMED_DP(out, acc, dp, wreg)                                                    \
    do {                                                                                \
        uint64_t start = __rdtsc();                                                     \
        for (long long i = 0; i < N / 10; i++) {                                        \
            _Pragma("GCC unroll 12") for (int r = 0; r < 12; r++) {                     \
                acc[r] = dp(acc[r], wreg, wreg);                                        \
                __asm__ volatile("" : "+v"(acc[r]));                                    \
            }                                                                           \
        }                                                                               \
        out = (double)(__rdtsc() - start) / (N / 10 * 12) / tsc_per_cycle;              \
    } while (0)

int main(void) {
    __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-9f);
    uint64_t t0 = __rdtsc();
    for (long long i = 0; i < N; i++) {
        x = _mm512_add_ps(x, y);
        __asm__ volatile("" : "+v"(x));
    }
    double tsc_per_cycle = (double)(__rdtsc() - t0) / N / ADD_LATENCY;

    __m512 a[12];
    __m256 c[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(0.001f * i), c[i] = _mm256_set1_ps(0.001f * i);
    __m512bh w = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    __m256bh w2 = (__m256bh)_mm256_set1_epi32(0x3f803f80);
    double zmm, ymm;
    TIMED_DP(zmm, a, _mm512_dpbf16_ps, w);
    TIMED_DP(ymm, c, _mm256_dpbf16_ps, w2);
    float sink = _mm512_reduce_add_ps(x);
    for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(a[i]) + c[i][0];
    printf("time-stamp ticks per core cycle: %.3f\n", tsc_per_cycle);
    printf("vdpbf16ps zmm: %.2f cycles each, %.1f multiply-adds a cycle\n", zmm, 32.0 / zmm);
    printf("vdpbf16ps ymm: %.2f cycles each, %.1f multiply-adds a cycle\n", ymm, 16.0 / ymm);
    return sink == 12345.0f; /* keeps the results live */
}
