/* Two builds of specstore's product kernel (runtime/csrc/small_gemm.c) side by side: A and B,
 * e.g. the KC or PREFETCH of each, alternating 41 rounds in one process so that the machine's
 * drift hits both alike. Each round streams the default model's seven projection shapes x 40
 * layers (~560 MB of float32 weights: cold caches, as a forward) at a row count.
 *
 *     S=runtime/csrc/small_gemm.c; F="-O3 -mavx2 -mfma -fopenmp -std=gnu11 -c"
 *     cc $F -DKC=128 -DPREFETCH=1024 -Dspecstore_linear_f32=a_linear_f32 -Dspecstore_linear_bf16=a_linear_bf16 \
 *         -Dspecstore_gemm_abi=a_abi $S -o /tmp/a.o
 *     cc $F -Dspecstore_linear_f32=b_linear_f32 -Dspecstore_linear_bf16=b_linear_bf16 -Dspecstore_gemm_abi=b_abi $S -o /tmp/b.o
 *     cc -O2 -fopenmp benchmarks/small_gemm_ab.c /tmp/a.o /tmp/b.o -o /tmp/ab && /tmp/ab
 *
 * Prints per row count the median milliseconds of A and B and the median [quartiles] of B / A
 * over the rounds. */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
void a_linear_f32(const float *x, int64_t m, const float *panel, const float *bias, float *out, int64_t n, int64_t k, int threads);
void b_linear_f32(const float *x, int64_t m, const float *panel, const float *bias, float *out, int64_t n, int64_t k, int threads);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
    int threads = 2, W = 40, R = 41;
    /* the model's shapes in turn: q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536 */
    int64_t shapes[7][2] = {{576, 576}, {192, 576}, {192, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}};
    float **panel = malloc(W * 7 * sizeof *panel);
    for (int w = 0; w < W * 7; w++) {
        int64_t sz = shapes[w % 7][0] * shapes[w % 7][1];
        panel[w] = aligned_alloc(64, ((sz * 4 + 63) / 64) * 64 + 64 * 1024);
        for (int64_t j = 0; j < sz; j++) panel[w][j] = (float)((j * 7 + w) % 13) * 0.01f;
    }
    float *x = aligned_alloc(64, 72 * 1536 * 4), *oa = aligned_alloc(64, 72 * 1536 * 4), *ob = aligned_alloc(64, 72 * 1536 * 4);
    for (int j = 0; j < 72 * 1536; j++) x[j] = (float)(j % 17) * 0.1f;
    int rows[] = {1, 5, 7, 9, 10, 12, 13, 17, 24};
    for (size_t r = 0; r < sizeof rows / sizeof *rows; r++) {
        double ta[64], tb[64], ratio[64];
        for (int i = 0; i < R; i++) {
            for (int v = 0; v < 2; v++) {
                int which = (v + i) % 2;
                double s = now();
                for (int w = 0; w < W * 7; w++)
                    (which ? b_linear_f32 : a_linear_f32)(x, rows[r], panel[w], 0, which ? ob : oa, shapes[w % 7][0], shapes[w % 7][1], threads);
                (which ? tb : ta)[i] = now() - s;
            }
            ratio[i] = tb[i] / ta[i];
        }
        qsort(ta, R, sizeof(double), cmp); qsort(tb, R, sizeof(double), cmp); qsort(ratio, R, sizeof(double), cmp);
        printf("rows %2d: A %.2f ms  B %.2f ms (per 7*%d products)  B/A median %.3f [%.3f, %.3f]\n", rows[r], ta[R/2]*1e3, tb[R/2]*1e3, W, ratio[R/2], ratio[R/4], ratio[3*R/4]);
        fflush(stdout);
    }
    return 0;
}
