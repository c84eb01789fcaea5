/* specstore's product kernel (runtime/csrc/small_gemm.c) alone, per row count: one weight of the
 * default model's MLP shape (576 inputs, 1536 outputs, float32), in cache ("hot": the same weight
 * every call) or streamed from memory ("cold": 40 weights, 141 MB, in turn), on 1 or 2 threads.
 *
 *     cc -O3 -mavx2 -mfma -fopenmp -std=gnu11 -I runtime/csrc benchmarks/small_gemm_rows.c -o /tmp/rows
 *     /tmp/rows 2 40     # threads, weights (1: hot, 40: cold)
 *
 * Prints per row count the best of 5 rounds: microseconds a product, GFLOPS, and the weight's
 * bytes over that time. Whole verification steps: benchmarks/small_gemm.py. */
#include "small_gemm.c"

#include <stdio.h>
#include <time.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s THREADS WEIGHTS  (WEIGHTS 1: in cache; 40: streamed from memory)\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[1]), weights = atoi(argv[2]);
    const int64_t n = 1536, k = 576, max_rows = 72;
    if (threads < 1 || weights < 1) {
        fprintf(stderr, "THREADS and WEIGHTS must be >= 1\n");
        return 2;
    }
    float **panel = malloc(weights * sizeof *panel); /* the kernel's layout: any values serve */
    for (int w = 0; w < weights; w++) {
        panel[w] = aligned_alloc(64, n * k * sizeof(float));
        for (int64_t j = 0; j < n * k; j++) panel[w][j] = (float)((j * 7 + w) % 13) * 0.01f;
    }
    float *x = aligned_alloc(64, max_rows * k * sizeof(float));
    float *out = aligned_alloc(64, max_rows * n * sizeof(float));
    for (int64_t j = 0; j < max_rows * k; j++) x[j] = (float)(j % 17) * 0.1f;
    const int rows[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 17, 18, 24, 33, 65};
    const int calls = weights == 1 ? 200 : weights * 5;
    printf("%d thread(s), %s\n", threads, weights == 1 ? "one weight in cache" : "weights streamed from memory");
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        double best = 1e30;
        for (int round = 0; round < 5; round++) {
            double start = seconds();
            for (int c = 0; c < calls; c++) specstore_linear_f32(x, rows[r], panel[c % weights], 0, out, n, k, threads);
            double each = (seconds() - start) / calls;
            best = each < best ? each : best;
        }
        printf("rows %2d: %7.1f us  %6.1f GFLOPS  %5.1f GB/s\n", rows[r], best * 1e6, 2.0 * rows[r] * n * k / best / 1e9,
               (double)n * k * sizeof(float) / best / 1e9);
    }
    return 0;
}
