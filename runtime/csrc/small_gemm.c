/* Products of a few rows with a large weight, for decoding on a CPU with AVX2 and FMA.
 *
 * A decoding step multiplies every weight of the model by 1 to ~65 rows (the pending token and
 * the draft tree's nodes). At those row counts a product should cost what reading its weight
 * from memory costs, and each row after the first almost nothing: the weight is read once and
 * every row multiplies it while it is in registers. BLAS and oneDNN kernels are built for many
 * rows; at 1-17 rows they ran at 30-60% of this CPU's memory bandwidth (runtime/gemm.py's doc).
 *
 * Layout: the weight W [n, k] (torch's nn.Linear layout) is packed once (runtime/gemm.py) into
 * panels of 16 outputs: panel b holds W[16b .. 16b+15][0 .. k-1] as k rows of 16 values
 * (zero-padded past n), so a product streams each panel once, in order.
 *
 * Arithmetic: every output accumulates in float32, one fused multiply-add per k, in increasing
 * k, from zero; the bias is added last. That order is the same whatever the number of rows, the
 * row's position among them and the number of threads, so a row's result is bitwise the same in
 * a 1-row product as in a 65-row one (plain decoding and a tree verification agree bit for bit
 * in the linear layers). bf16 weights and inputs are widened to float32 exactly (bf16 is the top
 * half of a float32); the float32 result is rounded to bf16 to nearest, ties to even.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 16 /* outputs per panel: two 8-float registers */
#define MR 6  /* rows per register block: 12 accumulators, 2 weight registers, 1 broadcast */
#define GROUP 72 /* rows whose blocks take turns over a panel (gemm.MAX_ROWS: a whole tree) */
/* KC: panel rows per turn (2 KiB of float32 weights, which stay in L1 for the next block).
 * Short turns keep the first block, the one that reads memory, coming back often: with 128-row
 * turns (8 KiB) a product of 7-17 rows (two or three blocks) ran 10-20% slower on a 2-core Zen 3,
 * the later blocks computing from L1 for long stretches while memory idled (BENCHMARKS.md). */
#ifndef KC
#define KC 32
#endif
#ifndef PREFETCH
#define PREFETCH 1536 /* bytes ahead of the panel read, into L1 (48-96 k steps) */
#endif

int specstore_gemm_abi(void) { return 1; }

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) /* NaN stays NaN (quiet) */
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

/* 16 weights of panel row kk as two float32 registers */
static inline __attribute__((always_inline)) void load_f32(const void *panel, int64_t kk, __m256 *w0, __m256 *w1) {
    const float *p = (const float *)panel + kk * NB;
    _mm_prefetch((const char *)p + PREFETCH, _MM_HINT_T0);
    *w0 = _mm256_loadu_ps(p);
    *w1 = _mm256_loadu_ps(p + 8);
}

static inline __attribute__((always_inline)) void load_bf16(const void *panel, int64_t kk, __m256 *w0, __m256 *w1) {
    const uint16_t *p = (const uint16_t *)panel + kk * NB;
    _mm_prefetch((const char *)p + PREFETCH, _MM_HINT_T0);
    __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8)));
    *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
    *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
}

/* rows x[0 .. M-1] (float32, row stride ldx) times panel rows k0 .. k1-1, continuing the sums in
 * acc [M][NB] (from zero where k0 == 0); storing and reloading a float32 sum is exact */
static inline __attribute__((always_inline)) void block(const int M, const int bf16, const float *x, int64_t ldx,
                                                        const void *panel, int64_t k0, int64_t k1, float *acc) {
    __m256 a0[MR], a1[MR];
#pragma GCC unroll 6
    for (int r = 0; r < M; r++) {
        a0[r] = k0 ? _mm256_loadu_ps(acc + r * NB) : _mm256_setzero_ps();
        a1[r] = k0 ? _mm256_loadu_ps(acc + r * NB + 8) : _mm256_setzero_ps();
    }
    for (int64_t kk = k0; kk < k1; kk++) {
        __m256 w0, w1;
        if (bf16)
            load_bf16(panel, kk, &w0, &w1);
        else
            load_f32(panel, kk, &w0, &w1);
#pragma GCC unroll 6
        for (int r = 0; r < M; r++) {
            __m256 v = _mm256_broadcast_ss(x + r * ldx + kk);
            a0[r] = _mm256_fmadd_ps(v, w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(v, w1, a1[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < M; r++) {
        _mm256_storeu_ps(acc + r * NB, a0[r]);
        _mm256_storeu_ps(acc + r * NB + 8, a1[r]);
    }
}

#define BLOCKS(T, BF)                                                                                          \
    static void block_##T##_1(const float *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) { \
        block(1, BF, x, ldx, p, k0, k1, acc); }                                                                \
    static void block_##T##_2(const float *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) { \
        block(2, BF, x, ldx, p, k0, k1, acc); }                                                                \
    static void block_##T##_3(const float *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) { \
        block(3, BF, x, ldx, p, k0, k1, acc); }                                                                \
    static void block_##T##_4(const float *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) { \
        block(4, BF, x, ldx, p, k0, k1, acc); }                                                                \
    static void block_##T##_5(const float *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) { \
        block(5, BF, x, ldx, p, k0, k1, acc); }                                                                \
    static void block_##T##_6(const float *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) { \
        block(6, BF, x, ldx, p, k0, k1, acc); }
BLOCKS(f32, 0)
BLOCKS(bf16, 1)

typedef void (*block_fn)(const float *, int64_t, const void *, int64_t, int64_t, float *);
static const block_fn BLOCK_F32[MR + 1] = {0, block_f32_1, block_f32_2, block_f32_3, block_f32_4, block_f32_5, block_f32_6};
static const block_fn BLOCK_BF16[MR + 1] = {0, block_bf16_1, block_bf16_2, block_bf16_3, block_bf16_4, block_bf16_5,
                                            block_bf16_6};

/* out [m, n] = x [m, k] W^T (+ bias). Panels are split between threads. Within a panel, up to
 * GROUP rows at a time: register blocks of as equal sizes as MR allows (9 rows: 5 + 4, not
 * 6 + 3), which take turns over KC panel rows at a time, so that the panel is read from memory
 * once while every block computes (the first block alone would wait on memory, the others on
 * arithmetic); each block's sums wait in acc in between. */
static void product(const block_fn *blocks_of, int bf16, const float *x, int64_t m, const void *panel,
                    const float *bias, void *out, int64_t n, int64_t k, int threads) {
    const size_t wbytes = bf16 ? sizeof(uint16_t) : sizeof(float);
    int64_t panels = (n + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t b = 0; b < panels; b++) {
        float acc[GROUP * NB];
        const char *p = (const char *)panel + b * k * NB * wbytes;
        int cols = n - b * NB < NB ? (int)(n - b * NB) : NB;
        for (int64_t g0 = 0; g0 < m; g0 += GROUP) {
            int64_t g = m - g0 < GROUP ? m - g0 : GROUP;
            int64_t tiles = (g + MR - 1) / MR;
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                int64_t k1 = k - k0 < KC ? k : k0 + KC;
                int64_t row = 0;
                for (int64_t t = 0; t < tiles; t++) {
                    int rows = (int)((g - row) / (tiles - t) + ((g - row) % (tiles - t) != 0));
                    blocks_of[rows](x + (g0 + row) * k, k, p, k0, k1, acc + row * NB);
                    row += rows;
                }
            }
            for (int64_t r = 0; r < g; r++) {
                float *v = acc + r * NB;
                if (bias)
                    for (int j = 0; j < cols; j++) v[j] += bias[b * NB + j];
                if (bf16) {
                    uint16_t *o = (uint16_t *)out + (g0 + r) * n + b * NB;
                    for (int j = 0; j < cols; j++) o[j] = f32_to_bf16(v[j]);
                } else {
                    memcpy((float *)out + (g0 + r) * n + b * NB, v, cols * sizeof(float));
                }
            }
        }
    }
}

void specstore_linear_f32(const float *x, int64_t m, const float *panel, const float *bias, float *out,
                          int64_t n, int64_t k, int threads) {
    product(BLOCK_F32, 0, x, m, panel, bias, out, n, k, threads);
}

/* bf16 inputs, weights, bias and output; float32 arithmetic (module doc). Returns 0, or -1
 * where the float32 copy of the inputs could not be allocated. */
int specstore_linear_bf16(const uint16_t *x, int64_t m, const uint16_t *panel, const uint16_t *bias,
                          uint16_t *out, int64_t n, int64_t k, int threads) {
    float *xf = malloc((size_t)(m * k + (bias ? n : 0)) * sizeof(float));
    if (!xf) return -1;
    for (int64_t i = 0; i < m * k; i++) xf[i] = bf16_to_f32(x[i]);
    float *bf = bias ? xf + m * k : 0;
    for (int64_t i = 0; bias && i < n; i++) bf[i] = bf16_to_f32(bias[i]);
    product(BLOCK_BF16, 1, xf, m, panel, bf, out, n, k, threads);
    free(xf);
    return 0;
}
