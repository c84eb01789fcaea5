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
#include <math.h>
#include <omp.h>
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

int specstore_gemm_abi(void) { return 2; }

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
    static void block_##T##_1(const void *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) {  \
        block(1, BF, (const float *)x, ldx, p, k0, k1, acc); }                                                                \
    static void block_##T##_2(const void *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) {  \
        block(2, BF, (const float *)x, ldx, p, k0, k1, acc); }                                                                \
    static void block_##T##_3(const void *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) {  \
        block(3, BF, (const float *)x, ldx, p, k0, k1, acc); }                                                                \
    static void block_##T##_4(const void *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) {  \
        block(4, BF, (const float *)x, ldx, p, k0, k1, acc); }                                                                \
    static void block_##T##_5(const void *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) {  \
        block(5, BF, (const float *)x, ldx, p, k0, k1, acc); }                                                                \
    static void block_##T##_6(const void *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) {  \
        block(6, BF, (const float *)x, ldx, p, k0, k1, acc); }
BLOCKS(f32, 0)
BLOCKS(bf16, 1)

/* x: the first row (float32 here; bf16 for the dot-product blocks), ldx: elements between rows */
typedef void (*block_fn)(const void *, int64_t, const void *, int64_t, int64_t, float *);
static const block_fn BLOCK_F32[MR + 1] = {0, block_f32_1, block_f32_2, block_f32_3, block_f32_4, block_f32_5, block_f32_6};
static const block_fn BLOCK_BF16[MR + 1] = {0, block_bf16_1, block_bf16_2, block_bf16_3, block_bf16_4, block_bf16_5,
                                            block_bf16_6};

/* g rows in register blocks of at most mr rows, of as equal sizes as that allows (9 rows, mr 6:
 * 5 + 4, not 6 + 3): their sizes in order; returns how many blocks */
static inline int64_t split_rows(int64_t g, int mr, int *sizes) {
    const int64_t tiles = (g + mr - 1) / mr;
    for (int64_t t = 0, row = 0; t < tiles; row += sizes[t++])
        sizes[t] = (int)((g - row) / (tiles - t) + ((g - row) % (tiles - t) != 0));
    return tiles;
}

/* One panel's sums for a group of rows (x: its first row, row_bytes apart, k elements each) in its
 * register blocks (``tiles`` of ``sizes`` rows), the blocks taking turns over KC panel rows at a
 * time (``product``'s doc); each block's sums wait in acc [rows][NB] between turns. */
static inline void panel_sums(const block_fn *blocks_of, const char *x, size_t row_bytes, int64_t k, const void *p,
                              int64_t steps, const int *sizes, int64_t tiles, float *acc) {
    for (int64_t k0 = 0; k0 < steps; k0 += KC) {
        int64_t k1 = steps - k0 < KC ? steps : k0 + KC;
        for (int64_t t = 0, row = 0; t < tiles; row += sizes[t++])
            blocks_of[sizes[t]](x + row * row_bytes, k, p, k0, k1, acc + row * NB);
    }
}

/* out [m, n] = x [m, k] W^T (+ bias). Panels are split between threads. Within a panel, up to
 * GROUP rows at a time: register blocks of as equal sizes as ``mr`` allows (9 rows, mr 6: 5 + 4,
 * not 6 + 3), which take turns over KC panel rows at a time, so that the panel is read from
 * memory once while every block computes (the first block alone would wait on memory, the others
 * on arithmetic); each block's sums wait in acc in between. A panel has ``steps`` rows of
 * ``row_bytes`` (k rows of 16 weights; k / 2 rows of 16 pairs for the dot-product blocks); x's
 * elements are ``xbytes`` wide; the output is bf16 where ``bf16`` is set, float32 otherwise. */
static void product(const block_fn *blocks_of, int mr, int bf16, const void *x, size_t xbytes, int64_t m,
                    const void *panel, int64_t steps, size_t row_bytes, const float *bias, void *out, int64_t n,
                    int64_t k, int threads) {
    int64_t panels = (n + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t b = 0; b < panels; b++) {
        float acc[GROUP * NB];
        const char *p = (const char *)panel + b * steps * row_bytes;
        int cols = n - b * NB < NB ? (int)(n - b * NB) : NB;
        for (int64_t g0 = 0; g0 < m; g0 += GROUP) {
            int64_t g = m - g0 < GROUP ? m - g0 : GROUP;
            int sizes[GROUP];
            const int64_t tiles = split_rows(g, mr, sizes);
            panel_sums(blocks_of, (const char *)x + g0 * k * xbytes, k * xbytes, k, p, steps, sizes, tiles, acc);
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
    product(BLOCK_F32, MR, 0, x, sizeof(float), m, panel, k, NB * sizeof(float), bias, out, n, k, threads);
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
    product(BLOCK_BF16, MR, 1, xf, sizeof(float), m, panel, k, NB * sizeof(uint16_t), bf, out, n, k, threads);
    free(xf);
    return 0;
}

/* The longest suffix of a context found in a suffix array (runtime/suffix_array.py:
 * SuffixIndex.longest_suffix_match, which calls this where the library has it): binary search
 * over the lengths min_len .. max_len (occurrence is monotone in length), each length's interval
 * narrowed depth by depth by binary search over the ranks, the first depth from ``first`` (ranks
 * where each first token starts, first[t + 1] .. first[t + 2]; NULL: none). One call instead of
 * a few dozen numpy gathers, each on cold caches right after a forward. ``ctx``: the context's
 * last ``len`` tokens. A suffix-array entry outside the stream is stepped over (the nearest intact
 * one decides) and every read is clipped into the stream: a damaged array costs matches, never a
 * read outside. Returns the length found (0: none) and its ranks [out[0],
 * out[1]). */
static inline int64_t sa_entry(const void *sa, int sa64, int64_t r) {
    return sa64 ? ((const int64_t *)sa)[r] : (int64_t)((const int32_t *)sa)[r];
}

static int64_t sa_bound(const int32_t *stream, const void *sa, int sa64, int64_t n, int64_t lo, int64_t hi, int64_t d,
                        int32_t t, int strict) { /* first rank in [lo, hi) whose token at d is >= t (strict: > t) */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2, at = mid, start;
        /* a damaged entry (outside the stream) has no tokens: the nearest intact one decides */
        while (at < hi && (uint64_t)(start = sa_entry(sa, sa64, at)) >= (uint64_t)n) at++;
        if (at == hi) { /* none at or after mid: the last intact one before it, if any */
            for (at = mid - 1; at >= lo && (uint64_t)(start = sa_entry(sa, sa64, at)) >= (uint64_t)n; at--) {}
            if (at < lo) return lo;
            int32_t v = stream[start + d >= n ? n - 1 : start + d];
            if (strict ? v <= t : v < t) return hi; /* every rank after at is damaged */
            hi = at;
            continue;
        }
        int32_t v = stream[start + d >= n ? n - 1 : start + d];
        if (strict ? v <= t : v < t)
            lo = at + 1;
        else
            hi = mid;
    }
    return lo;
}

static void sa_find(const int32_t *stream, const void *sa, int sa64, int64_t n, const int64_t *first, int64_t nfirst,
                    const int64_t *pattern, int64_t len, int64_t *lo_out, int64_t *hi_out) {
    int64_t lo = 0, hi = n, depth = 0;
    if (first && len > 0) {
        int64_t at = pattern[0] + 1;
        if (at >= 0 && at < nfirst - 1) {
            lo = first[at] < 0 ? 0 : (first[at] > n ? n : first[at]);
            hi = first[at + 1] < lo ? lo : (first[at + 1] > n ? n : first[at + 1]);
        } else {
            lo = hi = 0;
        }
        depth = 1;
    }
    for (; depth < len && lo < hi; depth++) {
        int32_t t = (int32_t)pattern[depth];
        if (pattern[depth] != (int64_t)t) { /* no int32 token equals it */
            hi = lo;
            break;
        }
        int64_t l = sa_bound(stream, sa, sa64, n, lo, hi, depth, t, 0);
        hi = sa_bound(stream, sa, sa64, n, l, hi, depth, t, 1);
        lo = l;
    }
    *lo_out = lo;
    *hi_out = hi;
}

int64_t specstore_sa_longest(const int32_t *stream, const void *sa, int sa64, int64_t n, const int64_t *first,
                             int64_t nfirst, const int64_t *ctx, int64_t len, int64_t min_len, int64_t *out) {
    int64_t best = 0, lo_len = min_len < 1 ? 1 : min_len, hi_len = len;
    out[0] = out[1] = 0;
    if (n <= 0) return 0;
    while (lo_len <= hi_len) {
        int64_t mid = (lo_len + hi_len) / 2, lo, hi;
        sa_find(stream, sa, sa64, n, first, nfirst, ctx + len - mid, mid, &lo, &hi);
        if (hi > lo) {
            best = mid;
            out[0] = lo;
            out[1] = hi;
            lo_len = mid + 1;
        } else {
            hi_len = mid - 1;
        }
    }
    return best;
}

/* Prompt lookup's search (runtime/retrieval.py: context_matches, context_continuations): the
 * longest n in [min_ngram, max_ngram] (at most size - 1) whose last n tokens of ``tokens`` occur
 * earlier with a token after them; ``starts``: the offsets just after each such occurrence,
 * ascending (room for size - 1); ``back``: for each, how many tokens before it equal the
 * context's last ones, up to ``cap`` (n itself where cap <= n). Returns how many starts (0: no n;
 * then *n_out is 0). One pass over the context in one call, instead of numpy's few per n-gram
 * length and per candidate. */
int64_t specstore_context_matches(const int64_t *tokens, int64_t size, int64_t max_ngram, int64_t min_ngram,
                                  int64_t cap, int64_t *n_out, int64_t *starts, int64_t *back) {
    *n_out = 0;
    if (min_ngram < 1) min_ngram = 1;
    int64_t longest = max_ngram < size - 1 ? max_ngram : size - 1, best = 0, count = 0;
    if (longest < min_ngram) return 0;
    const int64_t last = tokens[size - 1];
    for (int64_t e = 0; e < size - 1; e++) {
        if (tokens[e] != last) continue;
        int64_t m = 1;
        while (m < longest && e - m >= 0 && tokens[e - m] == tokens[size - 1 - m]) m++;
        if (m > best) {
            best = m;
            count = 0;
        }
        if (m == best) starts[count++] = e + 1;
    }
    if (best < min_ngram) return 0;
    for (int64_t i = 0; i < count; i++) {
        if (cap <= best) {
            back[i] = best;
            continue;
        }
        int64_t start = starts[i], k = cap < start ? cap : start, j = 0;
        while (j < k && tokens[start - 1 - j] == tokens[size - 1 - j]) j++;
        back[i] = j;
    }
    *n_out = best;
    return count;
}

/* The verifier's cache compaction after a tree step (runtime/kv_cache.py: compact) in one call
 * instead of two torch ops per layer and tensor: in each of the ``nbufs`` buffers (a layer's keys or
 * values, ``heads`` blocks ``head_stride`` bytes apart, rows of ``row_bytes``), row start + from[i]
 * moves to row start + i for i = 0 .. kept - 1. from[] increases and from[i] >= i (an accepted path's
 * nodes, parents first), so copying in increasing i never overwrites a row before it is read. */
void specstore_move_rows(char *const *bufs, int64_t nbufs, int64_t heads, int64_t head_stride, int64_t row_bytes,
                         int64_t start, const int64_t *from, int64_t kept) {
    for (int64_t b = 0; b < nbufs; b++)
        for (int64_t h = 0; h < heads; h++) {
            char *base = bufs[b] + h * head_stride + start * row_bytes;
            for (int64_t i = 0; i < kept; i++)
                if (from[i] != i) memmove(base + i * row_bytes, base + from[i] * row_bytes, (size_t)row_bytes);
        }
}

/* ``score`` at offset ``at`` into the k best so far, idx / scores [count] (score descending, ties
 * to the lower offset; NaN dropped): the head's likeliest tokens and the dense search's rows */
static inline void top_insert(float score, int64_t at, int64_t k, int64_t *count, int64_t *idx, float *scores) {
    if (!(score == score)) return;
    int64_t c = *count;
    if (c == k && !(score > scores[k - 1])) return; /* ties keep the earlier (lower) offset */
    int64_t i = c < k ? c : k - 1;
    while (i > 0 && (scores[i - 1] < score || (scores[i - 1] == score && idx[i - 1] > at))) {
        scores[i] = scores[i - 1];
        idx[i] = idx[i - 1];
        i--;
    }
    scores[i] = score;
    idx[i] = at;
    if (c < k) *count = c + 1;
}

/* The draft head's guess beside other work (runtime/draft_head.py: DraftHead.guess_beside): ``job``
 * on the second thread of an OpenMP team of two while the calling thread runs ``beside`` (a
 * Python callback through ctypes: ReSpec's pool search), returning when both are done. The
 * second thread is the runtime's own worker, the one torch's products use: right after a forward
 * it is still spinning, waiting for work, and a thread of our own would share its core with it.
 * With one thread (torch.set_num_threads(1), nested teams) the job runs first, then ``beside``. */
#define HEAD_MAX_K 64
typedef void (*beside_fn)(void);

static void run_beside(beside_fn beside, void (*job)(void *), void *arg) {
#pragma omp parallel num_threads(2)
    {
        if (omp_get_num_threads() < 2) {
            job(arg);
            if (beside) beside();
        } else if (omp_get_thread_num() == 1) {
            job(arg);
        } else if (beside) {
            beside();
        }
    }
}

/* The float32 head (CPUs without AVX-512 BF16, where the head runs in float32): the torch path's
 * arithmetic, t = fc1h h + pending, u = silu(t), z = h + (fc2 u + b2), logits = out z,
 * probs = softmax(logits), each product a float32 sum in increasing k (block_f32_1, one row), so
 * probabilities agree with torch's to rounding, not bits. Weights as gemm.pack gives float32 ones
 * (panels of 16 outputs, k rows each); the k likeliest (probability descending, ties to the lower
 * index) go to top, -1 past the last. */
typedef struct {
    const float *h, *pending, *b2;
    const void *fc1, *fc2, *out;
    int64_t hidden, inner, vocab, k;
    float *probs, *u, *z;
    int64_t *top;
    int w16; /* the three weights' panels hold bf16 (widened exactly to float32 as read), not float32 */
} head_f32_job;

/* one row times two panels at once (four independent sums: one panel's two chains of dependent
 * FMAs leave the loads waiting), each output summed in increasing k as block() sums it */
static inline __attribute__((always_inline)) void matvec_pair(const int w16, const float *x, const void *p0,
                                                              const void *p1, int64_t k, float *acc) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 w0, w1, w2, w3;
        if (w16) {
            load_bf16(p0, kk, &w0, &w1);
            load_bf16(p1, kk, &w2, &w3);
        } else {
            load_f32(p0, kk, &w0, &w1);
            load_f32(p1, kk, &w2, &w3);
        }
        const __m256 v = _mm256_broadcast_ss(x + kk);
        a0 = _mm256_fmadd_ps(v, w0, a0);
        a1 = _mm256_fmadd_ps(v, w1, a1);
        a2 = _mm256_fmadd_ps(v, w2, a2);
        a3 = _mm256_fmadd_ps(v, w3, a3);
    }
    _mm256_storeu_ps(acc, a0);
    _mm256_storeu_ps(acc + 8, a1);
    _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3);
}

static void matvec_f32(const float *x, const void *panel, int w16, int64_t n, int64_t k, float *y) {
    float acc[2 * NB];
    const size_t bytes = (w16 ? sizeof(uint16_t) : sizeof(float)) * (size_t)k * NB; /* one panel */
    const char *base = panel;
    int64_t b = 0;
    for (; (b + 2) * NB <= n; b += 2) {
        if (w16)
            matvec_pair(1, x, base + b * bytes, base + (b + 1) * bytes, k, acc);
        else
            matvec_pair(0, x, base + b * bytes, base + (b + 1) * bytes, k, acc);
        memcpy(y + b * NB, acc, 2 * NB * sizeof(float));
    }
    for (; b * NB < n; b++) {
        if (w16)
            block(1, 1, x, k, base + b * bytes, 0, k, acc);
        else
            block(1, 0, x, k, base + b * bytes, 0, k, acc);
        const int64_t cols = n - b * NB < NB ? n - b * NB : NB;
        memcpy(y + b * NB, acc, (size_t)cols * sizeof(float));
    }
}

static void head_f32_run(void *arg) {
    head_f32_job *j = arg;
    const int64_t H = j->hidden, I = j->inner, V = j->vocab;
    matvec_f32(j->h, j->fc1, j->w16, I, H, j->u);
    for (int64_t i = 0; i < I; i++) {
        const float t = j->u[i] + j->pending[i];
        j->u[i] = t / (1.0f + expf(-t));
    }
    matvec_f32(j->u, j->fc2, j->w16, H, I, j->z);
    for (int64_t i = 0; i < H; i++) j->z[i] = j->h[i] + (j->z[i] + (j->b2 ? j->b2[i] : 0.0f));
    float *p = j->probs, best = -INFINITY, sum = 0.0f;
    matvec_f32(j->z, j->out, j->w16, V, H, p);
    for (int64_t i = 0; i < V; i++) best = p[i] > best ? p[i] : best;
    for (int64_t i = 0; i < V; i++) sum += (p[i] = expf(p[i] - best));
    const float inv = 1.0f / sum;
    int64_t count = 0;
    float scores[HEAD_MAX_K];
    for (int64_t i = 0; i < V; i++) {
        p[i] *= inv;
        top_insert(p[i], i, j->k, &count, j->top, scores);
    }
    for (int64_t i = count; i < j->k; i++) j->top[i] = -1;
}

/* Returns 0, or -1 for arguments it does not take (nothing run). ``w16``: the weights' panels are
 * bf16 ([ceil(n / 16), k, 16], not pairs): half the bytes to read right after a verification,
 * where the guess waits on memory; the arithmetic is the float32 one on the widened weights. */
int specstore_head_beside_f32(beside_fn beside, const float *h, const float *pending, const void *fc1,
                              const void *fc2, const float *b2, const void *out, int64_t hidden, int64_t inner,
                              int64_t vocab, int64_t k, float *probs, int64_t *top, int w16) {
    if (hidden <= 0 || inner <= 0 || vocab <= 0 || k < 0 || k > HEAD_MAX_K) return -1;
    float *work = malloc((size_t)(hidden + inner) * sizeof(float));
    if (!work) return -1;
    head_f32_job j = {h, pending, b2, fc1, fc2, out, hidden, inner, vocab, k, probs, work, work + inner, top, w16 != 0};
    run_beside(beside, head_f32_run, &j);
    free(work);
    return 0;
}

/* float32 attention for decoding's steps and trees (CPUs without AVX-512 BF16 decode in float32):
 * softmax(q k^T x scale + mask) v over each query row's allowed keys, the query heads grouped
 * over the key/value heads as transformers' repeat_kv groups them.
 *
 * A row's arithmetic depends only on its query and its allowed keys in order, so a tree node's
 * row gives the bits of plain decoding's step for that token: each score a float32 sum over the
 * head's dims, 8-float chunks in increasing order, the chunks' lanes added in a fixed order
 * (reduce8) for 8 list entries at a time from the list's start; the mask value added where it
 * is not +-0; e^(s - max) by the polynomial below; the weights summed in 8 lanes (entry t in
 * lane t mod 8) reduced in a fixed order; the output one FMA per allowed key, in list order,
 * times 1 / sum. Not torch's bits (its sums run in another order).
 *
 * Speed: every row of a call attends the keys before the tree (the cache) as its list's first
 * entries, so those keys and values are read from memory once for the rows of a key/value head
 * (taken F32_BLOCK_ROWS at a time): each 8-key block stays in L1 while every row scores it
 * (8 keys' sums side by side, one sum being a chain of dependent FMAs), and the values are summed
 * F32_VALUE_KEYS keys at a time, F32_TILE rows sharing each value's load. Each row's own entries
 * after them (its ancestors in the tree) are read for it alone. On a 2-core Zen 3 this ran one
 * layer of the default model's shape 14-32% faster than tiles of three rows sharing each key's
 * load (whose 24 partial sums did not fit the 16 registers), with the same bits (BENCHMARKS.md). */
#define F32_LANES 8
#define F32_MAX_DIM 256
#define F32_TILE 3        /* rows that share a value's load */
#define F32_CHUNKS 4      /* 8-float chunks of a value row a tile sums at once (dims: a multiple of 32, or one pass) */
#define F32_VALUE_KEYS 64 /* values a tile's pass sums before the next tile's (16 KiB at 64 dims: they stay in L1) */
#define F32_BLOCK_ROWS 12 /* rows of one key/value head an OpenMP item takes, at most */

static const float F32_ZEROS[F32_MAX_DIM]; /* the key of a list entry past the end: its sum is not read */

/* e^x = 2^n x 2^f, n = round(x log2 e), f in [-0.5, 0.5], 2^f by its Taylor series to f^7
 * (relative error < 1e-8), highest power first; x clamped to [-87, 88], so 2^n is a normal float
 * (exp8_ps here, exp_ps in the AVX-512 section) */
static const float EXP2_TAYLOR[8] = {1.525273380405984e-05f, 1.5403530393381608e-04f, 1.3333558146428443e-03f,
                                     9.618129107628477e-03f, 5.550410866482158e-02f,  2.402265069591007e-01f,
                                     6.931471805599453e-01f, 1.0f};

static inline __m256 exp8_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(EXP2_TAYLOR[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_TAYLOR[i]));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* 8 vectors -> one whose lane j holds the total of v[j]'s lanes, the same additions for every lane */
static inline __m256 reduce8(const __m256 *v) {
    __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    __m256 lo = _mm256_hadd_ps(a, b), hi = _mm256_hadd_ps(c, d); /* lane j (j < 4): v[j]'s low half; j + 4: its high half */
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

static inline __m256i live8(int64_t left) { /* lanes below ``left`` set */
    const int n = left >= F32_LANES ? F32_LANES : (int)left;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float lanes_sum8(__m256 v) { /* a fixed order */
    float l[8];
    _mm256_storeu_ps(l, v);
    return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
}

typedef struct {
    const float *q, *mask; /* mask: NULL where it adds nothing */
    const int32_t *idx;    /* allowed keys, idx[t] == t for t below the call's shared prefix */
    int64_t m;             /* how many */
    float *s, *o;          /* scratch [m + 8]: scores, then weights; the output [dim] */
} f32_row;

/* One row's scores of 8 list entries (their keys at kr[0 .. 7]): each key's sum over the head's
 * dims in 8-float chunks in increasing order, the lanes added by reduce8, times the scale */
static inline __attribute__((always_inline)) __m256 f32_scores8(const float *q, const float *const *kr,
                                                               const int64_t dim, __m256 vscale) {
    const int chunks = (int)(dim / F32_LANES);
    __m256 acc[F32_LANES];
    for (int j = 0; j < F32_LANES; j++) acc[j] = _mm256_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        const __m256 qv = _mm256_loadu_ps(q + F32_LANES * c);
        for (int j = 0; j < F32_LANES; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[j] + F32_LANES * c), acc[j]);
    }
    return _mm256_mul_ps(reduce8(acc), vscale);
}

/* Scores of list entries [0, p8) (p8 a multiple of 8, shared by every row: entry t is key t) for
 * all ``n`` rows, an 8-key block at a time for every row (the block stays in L1) */
static inline __attribute__((always_inline)) void f32_scores_shared(const f32_row *rows, int n, const float *kh,
                                                                    const int64_t dim, int64_t p8, __m256 vscale) {
    for (int64_t t0 = 0; t0 < p8; t0 += F32_LANES) {
        const float *kr[F32_LANES];
        for (int j = 0; j < F32_LANES; j++) kr[j] = kh + (t0 + j) * dim;
        for (int r = 0; r < n; r++) _mm256_storeu_ps(rows[r].s + t0, f32_scores8(rows[r].q, kr, dim, vscale));
    }
}

/* One row's scores of its list entries [from, m) (from a multiple of 8), its own keys */
static inline __attribute__((always_inline)) void f32_scores_row(const f32_row *row, const float *kh, const int64_t dim,
                                                                 int64_t from, __m256 vscale) {
    for (int64_t t0 = from; t0 < row->m; t0 += F32_LANES) {
        const int64_t left = row->m - t0;
        const float *kr[F32_LANES];
        for (int j = 0; j < F32_LANES; j++) kr[j] = j < left ? kh + (int64_t)row->idx[t0 + j] * dim : F32_ZEROS;
        _mm256_storeu_ps(row->s + t0, f32_scores8(row->q, kr, dim, vscale));
    }
}

/* A row's scores -> e^(s - max) in place; returns 1 / their sum. Whole 8-float loads and stores
 * (the scratch holds m + 8), the lanes past m left out by a blend and a mask: AMD's masked
 * loads and stores cost several times a plain one. */
static inline float f32_softmax_row(const f32_row *row) {
    float *s = row->s;
    const int64_t m = row->m, m8 = m - m % F32_LANES;
    if (row->mask)
        for (int64_t t = 0; t < m; t++) s[t] += row->mask[row->idx[t]];
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < m8; t += F32_LANES) top = _mm256_max_ps(_mm256_loadu_ps(s + t), top);
    const __m256 tail = _mm256_castsi256_ps(live8(m - m8));
    if (m8 < m) top = _mm256_max_ps(_mm256_blendv_ps(top, _mm256_loadu_ps(s + m8), tail), top);
    float l[8], best = -INFINITY;
    _mm256_storeu_ps(l, top);
    for (int j = 0; j < 8; j++) best = l[j] > best ? l[j] : best;
    __m256 sum = _mm256_setzero_ps();
    const __m256 vbest = _mm256_set1_ps(best);
    for (int64_t t = 0; t < m8; t += F32_LANES) {
        const __m256 e = exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), vbest));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (m8 < m) {
        const __m256 e = _mm256_and_ps(exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(s + m8), vbest)), tail);
        _mm256_storeu_ps(s + m8, e);
        sum = _mm256_add_ps(sum, e);
    }
    return 1.0f / lanes_sum8(sum);
}

/* Outputs' sums over list entries [0, p) (shared: entry t is value t) for all ``n`` rows, a tile
 * of rows and F32_CHUNKS chunks at a time (each value's chunk read once for the tile), over
 * F32_VALUE_KEYS values at a time (read from memory once for all tiles; a float32 sum stored and
 * reloaded in between is exact), written to the rows' outputs unscaled */
static inline __attribute__((always_inline)) void f32_values_shared(const f32_row *rows, int n, const float *vh,
                                                                    const int64_t dim, int64_t p) {
    const int chunks = (int)(dim / F32_LANES);
    const int step = chunks % F32_CHUNKS ? chunks : F32_CHUNKS;
    for (int64_t t0 = 0; t0 < p; t0 += F32_VALUE_KEYS) {
        const int64_t t1 = p - t0 < F32_VALUE_KEYS ? p : t0 + F32_VALUE_KEYS;
        for (int c0 = 0; c0 < chunks; c0 += step)
            for (int r0 = 0; r0 < n; r0 += F32_TILE) {
                const float *w[F32_TILE];
                float *o[F32_TILE];
                for (int u = 0; u < F32_TILE; u++) {
                    w[u] = rows[r0 + u < n ? r0 + u : n - 1].s;
                    o[u] = rows[r0 + u < n ? r0 + u : n - 1].o + F32_LANES * c0;
                }
                __m256 acc[F32_TILE][F32_MAX_DIM / F32_LANES];
                for (int u = 0; u < F32_TILE; u++)
                    for (int c = 0; c < step; c++) acc[u][c] = t0 ? _mm256_loadu_ps(o[u] + F32_LANES * c) : _mm256_setzero_ps();
                for (int64_t t = t0; t < t1; t++) {
                    const float *vr = vh + t * dim + F32_LANES * c0;
                    for (int u = 0; u < F32_TILE; u++) {
                        const __m256 wt = _mm256_broadcast_ss(w[u] + t);
                        for (int c = 0; c < step; c++) acc[u][c] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vr + F32_LANES * c), acc[u][c]);
                    }
                }
                for (int u = 0; u < F32_TILE && r0 + u < n; u++)
                    for (int c = 0; c < step; c++) _mm256_storeu_ps(o[u] + F32_LANES * c, acc[u][c]);
            }
    }
}

/* One row's output: its sums so far (``from`` entries, in o) continued over its own entries
 * [from, m), times ``inv`` */
static inline __attribute__((always_inline)) void f32_values_row(const f32_row *row, const float *vh, const int64_t dim,
                                                                 int64_t from, float inv) {
    const int chunks = (int)(dim / F32_LANES);
    __m256 acc[F32_MAX_DIM / F32_LANES];
    for (int c = 0; c < chunks; c++) acc[c] = from ? _mm256_loadu_ps(row->o + F32_LANES * c) : _mm256_setzero_ps();
    for (int64_t t = from; t < row->m; t++) {
        const float *vr = vh + (int64_t)row->idx[t] * dim;
        const __m256 wt = _mm256_broadcast_ss(row->s + t);
        for (int c = 0; c < chunks; c++) acc[c] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vr + F32_LANES * c), acc[c]);
    }
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int c = 0; c < chunks; c++) _mm256_storeu_ps(row->o + F32_LANES * c, _mm256_mul_ps(acc[c], vinv));
}

/* ``n`` rows of one key/value head whose lists share their first ``p`` entries (entry t is key t) */
static inline __attribute__((always_inline)) void f32_attend_rows(const f32_row *rows, int n, const float *kh,
                                                                  const float *vh, const int64_t dim, int64_t p,
                                                                  float scale) {
    const __m256 vscale = _mm256_set1_ps(scale);
    const int64_t p8 = p - p % F32_LANES;
    f32_scores_shared(rows, n, kh, dim, p8, vscale);
    for (int r = 0; r < n; r++) f32_scores_row(rows + r, kh, dim, p8, vscale);
    float inv[F32_BLOCK_ROWS];
    for (int r = 0; r < n; r++) inv[r] = f32_softmax_row(rows + r);
    if (p) f32_values_shared(rows, n, vh, dim, p);
    for (int r = 0; r < n; r++) f32_values_row(rows + r, vh, dim, p, inv[r]);
}

static void f32_attend_rows_64(const f32_row *rows, int n, const float *kh, const float *vh, int64_t p, float scale) {
    f32_attend_rows(rows, n, kh, vh, 64, p, scale);
}
static void f32_attend_rows_128(const f32_row *rows, int n, const float *kh, const float *vh, int64_t p, float scale) {
    f32_attend_rows(rows, n, kh, vh, 128, p, scale);
}
static void f32_attend_rows_any(const f32_row *rows, int n, const float *kh, const float *vh, int64_t dim, int64_t p,
                                float scale) {
    f32_attend_rows(rows, n, kh, vh, dim, p, scale);
}

/* q [heads, nq, dim], k / v [kv_heads, nk, dim] (rows contiguous, heads *_head_stride apart),
 * mask [nq, nk] additive (rows mask_stride apart; NULL: every key, as a 1-token step's), out
 * [nq, heads, dim]. A key is allowed where its mask value is above -1e30; a row with no allowed
 * key gives zeros. Returns 0, -1 where dim is not a multiple of 8 up to 256 or the heads do not
 * group, -2 where scratch memory could not be had. */
int specstore_attention_f32(const float *q, int64_t heads, int64_t nq, int64_t dim, const float *k,
                            int64_t k_head_stride, const float *v, int64_t v_head_stride, int64_t kv_heads, int64_t nk,
                            const float *mask, int64_t mask_stride, float scale, float *out, int threads) {
    if (dim <= 0 || dim % F32_LANES || dim > F32_MAX_DIM || kv_heads <= 0 || heads % kv_heads || nq <= 0) return -1;
    const int64_t rep = heads / kv_heads;
    int32_t *idx = malloc((size_t)(nq * nk + 1) * sizeof(int32_t));
    int64_t *count = malloc((size_t)nq * sizeof(int64_t));
    int64_t *live = malloc((size_t)nq * sizeof(int64_t)); /* the tokens with an allowed key */
    const float **masks = malloc((size_t)nq * sizeof(*masks));
    if (!idx || !count || !live || !masks) {
        free(idx);
        free(count);
        free(live);
        free(masks);
        return -2;
    }
    const __m256 floor = _mm256_set1_ps(-1e30f), zero = _mm256_setzero_ps();
    int64_t shared = nk, nlive = 0; /* the leading keys every live token attends */
    for (int64_t i = 0; i < nq; i++) { /* each query token's allowed keys, in order */
        int64_t c = 0, j = 0, lead = -1;
        int32_t *row = idx + i * nk;
        const float *mr = mask ? mask + i * mask_stride : 0;
        int plain = 1; /* every allowed key's mask is +-0: adding it changes no score */
        __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (; j + F32_LANES <= nk; j += F32_LANES, at = _mm256_add_epi32(at, _mm256_set1_epi32(F32_LANES))) {
            int allowed = 0xff;
            if (mr) {
                const __m256 w = _mm256_loadu_ps(mr + j);
                allowed = _mm256_movemask_ps(_mm256_cmp_ps(w, floor, _CMP_GT_OQ));
                plain &= (allowed & ~_mm256_movemask_ps(_mm256_cmp_ps(w, zero, _CMP_EQ_OQ))) == 0;
            }
            if (allowed == 0xff) {
                _mm256_storeu_si256((__m256i *)(row + c), at);
                c += F32_LANES;
                continue;
            }
            if (lead < 0) lead = j + __builtin_ctz(~(unsigned)allowed);
            for (int b = 0; b < F32_LANES; b++)
                if (allowed >> b & 1) row[c++] = (int32_t)(j + b);
        }
        for (; j < nk; j++) {
            if (!mr || mr[j] > -1e30f) {
                row[c++] = (int32_t)j;
                plain &= !mr || mr[j] == 0.0f;
            } else if (lead < 0) {
                lead = j;
            }
        }
        count[i] = c;
        masks[i] = plain ? 0 : mr;
        if (c) {
            live[nlive++] = i;
            shared = lead >= 0 && lead < shared ? lead : shared;
        } else {
            memset(out + i * heads * dim, 0, (size_t)(heads * dim) * sizeof(float)); /* nothing to attend (SDPA: NaN) */
        }
    }
    /* items: (key/value head, block of its rows), at least two a thread where the rows allow */
    const int64_t rows_per_head = nlive * rep;
    int64_t blocks = (rows_per_head + F32_BLOCK_ROWS - 1) / F32_BLOCK_ROWS;
    const int64_t team = threads > 0 ? threads : 1, want = (2 * team + kv_heads - 1) / kv_heads;
    if (blocks < want) blocks = want < rows_per_head ? want : rows_per_head;
    const int64_t per_block = blocks ? (rows_per_head + blocks - 1) / blocks : 0;
    const int64_t s_stride = nk + F32_LANES;
    int failed = 0;
    if (rows_per_head) {
#pragma omp parallel num_threads(team)
        {
            float *s = malloc((size_t)(F32_BLOCK_ROWS * s_stride) * sizeof(float));
            if (!s) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t item = 0; item < kv_heads * blocks; item++) {
                if (!s) continue;
                const int64_t g = item / blocks, first = (item % blocks) * per_block;
                const int64_t last = first + per_block < rows_per_head ? first + per_block : rows_per_head;
                if (first >= last) continue;
                f32_row rows[F32_BLOCK_ROWS];
                int n = 0;
                for (int64_t x = first; x < last; x++, n++) { /* row x: live token x / rep, head g rep + x % rep */
                    const int64_t i = live[x / rep], h = g * rep + x % rep;
                    rows[n] = (f32_row){q + (h * nq + i) * dim, masks[i], idx + i * nk, count[i], s + n * s_stride,
                                        out + (i * heads + h) * dim};
                }
                const float *kh = k + g * k_head_stride, *vh = v + g * v_head_stride;
                if (dim == 64)
                    f32_attend_rows_64(rows, n, kh, vh, shared, scale);
                else if (dim == 128)
                    f32_attend_rows_128(rows, n, kh, vh, shared, scale);
                else
                    f32_attend_rows_any(rows, n, kh, vh, dim, shared, scale);
            }
            free(s);
        }
    }
    free(idx);
    free(count);
    free(live);
    free(masks);
    return failed ? -2 : 0;
}

/* A float32 decoder's layer stack in one call (runtime/kernel_forward.py): a step of plain
 * decoding or a tree verification of a Llama-style model (pre-norm RMS norms, rotary positions,
 * grouped-query attention, a SiLU-gated MLP) without a Python module call or a torch op per layer.
 * Products are specstore_linear_f32's, attention is specstore_attention_f32's; the pieces between
 * them are below. Each piece computes a row from that row alone, so a row's result is bitwise the
 * same whatever the number of rows (plain decoding and a verification agree bit for bit). The
 * pieces round as float32 arithmetic does but not always as torch's ops do (sums in another order,
 * products that the compiler may fuse): their results agree with transformers' to rounding. */

/* x [rows, dim] += delta (where delta is not NULL), then out = w (x / sqrt(mean(x^2) + eps)): the
 * squares summed in 8 lanes (one fused multiply-add each, in order), the lanes in a fixed order,
 * then any last dim % 8 in order; x times the inverse root, then the weight times that. */
static void add_rmsnorm_f32(float *x, const float *delta, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
    const int64_t vec = dim - dim % F32_LANES;
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        float *o = out + r * dim;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < vec; j += F32_LANES) {
            __m256 val = _mm256_loadu_ps(xr + j);
            if (delta) {
                val = _mm256_add_ps(val, _mm256_loadu_ps(delta + r * dim + j));
                _mm256_storeu_ps(xr + j, val);
            }
            acc = _mm256_fmadd_ps(val, val, acc);
        }
        float sum = lanes_sum8(acc);
        for (int64_t j = vec; j < dim; j++) {
            if (delta) xr[j] += delta[r * dim + j];
            sum += xr[j] * xr[j];
        }
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int64_t j = 0; j < vec; j += F32_LANES)
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(xr + j), vinv)));
        for (int64_t j = vec; j < dim; j++) o[j] = w[j] * (xr[j] * inv);
    }
}

/* out [rows, inter] = silu(g) u, the gate g and the up projection u side by side in each row of
 * gu [rows, 2 inter]; silu(x) = x / (1 + e^-x) (exp8_ps's e^x, also for a last inter % 8). */
static inline __m256 silu8(__m256 x) { return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8_ps(_mm256_sub_ps(_mm256_setzero_ps(), x)))); }

static void silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t j = 0; j < inter; j += F32_LANES) {
            const __m256i live = live8(inter - j);
            _mm256_maskstore_ps(o + j, live, _mm256_mul_ps(silu8(_mm256_maskload_ps(g + j, live)), _mm256_maskload_ps(u + j, live)));
        }
    }
}

/* o = x cos + rotate_half(x) sin for one head's row of dim values (rotate_half(x) = (-x2, x1) for
 * its halves x1, x2), in 8 lanes and masked lanes for a last half % 8. */
static inline void rope_row_f32(const float *x, const float *c, const float *s, float *o, int64_t dim) {
    const int64_t half = dim / 2;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t j = 0; j < half; j += F32_LANES) {
        const __m256i live = live8(half - j);
        const __m256 x1 = _mm256_maskload_ps(x + j, live), x2 = _mm256_maskload_ps(x + half + j, live);
        _mm256_maskstore_ps(o + j, live, _mm256_add_ps(_mm256_mul_ps(x1, _mm256_maskload_ps(c + j, live)),
                                                      _mm256_mul_ps(_mm256_xor_ps(x2, sign), _mm256_maskload_ps(s + j, live))));
        _mm256_maskstore_ps(o + half + j, live, _mm256_add_ps(_mm256_mul_ps(x2, _mm256_maskload_ps(c + half + j, live)),
                                                             _mm256_mul_ps(x1, _mm256_maskload_ps(s + half + j, live))));
    }
}

/* mid [m, inter] = silu(x W_gate^T + b_gate) (x W_up^T + b_up) for a stacked gate/up panel (the gate's
 * inter outputs, then the up projection's; inter a multiple of NB, so each panel is one or the
 * other): the gate's panel b and the up projection's panel b are worked by one thread, one after
 * the other as ``product`` works a panel (the same sums in the same order: the same bits), and
 * their 16 outputs a row go through the SiLU gate while they are in L1 (silu_mul_f32's arithmetic
 * on each value: the same bits), both threads sharing it. */
static void product_glu_f32(const float *x, int64_t m, const float *panel, const float *bias, float *mid, int64_t inter,
                            int64_t k, int threads) {
    const int64_t pairs = inter / NB;
    const size_t panel_bytes = (size_t)k * NB * sizeof(float);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t b = 0; b < pairs; b++) {
        float acc[2][GROUP * NB];
        for (int64_t g0 = 0; g0 < m; g0 += GROUP) {
            int64_t g = m - g0 < GROUP ? m - g0 : GROUP;
            int sizes[GROUP];
            const int64_t tiles = split_rows(g, MR, sizes);
            for (int half = 0; half < 2; half++)
                panel_sums(BLOCK_F32, (const char *)(x + g0 * k), k * sizeof(float), k,
                           (const char *)panel + (b + half * pairs) * panel_bytes, k, sizes, tiles, acc[half]);
            for (int64_t r = 0; r < g; r++) {
                float *gate = acc[0] + r * NB, *up = acc[1] + r * NB;
                if (bias)
                    for (int j = 0; j < NB; j++) {
                        gate[j] += bias[b * NB + j];
                        up[j] += bias[inter + b * NB + j];
                    }
                float *o = mid + (g0 + r) * inter + b * NB;
                for (int j = 0; j < NB; j += F32_LANES)
                    _mm256_storeu_ps(o + j, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + j)), _mm256_loadu_ps(up + j)));
            }
        }
    }
}

/* Each row of qkv [rows, (heads + 2 kv_heads) dim] (query heads, then key heads, then value
 * heads): the queries rotated into q [heads, rows, dim]; the keys rotated and the values copied
 * into the cache, row ``at + r`` of each key/value head (k, v: head h's rows at + h head_stride).
 * cos, sin: [rows, dim]. */
static void qkv_rope_f32(const float *qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, const float *cos,
                         const float *sin, float *q, float *k, float *v, int64_t head_stride, int64_t at) {
    const int64_t width = (heads + 2 * kv_heads) * dim;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = qkv + r * width, *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) rope_row_f32(row + h * dim, c, s, q + (h * rows + r) * dim, dim);
        for (int64_t g = 0; g < kv_heads; g++) {
            rope_row_f32(row + (heads + g) * dim, c, s, k + g * head_stride + (at + r) * dim, dim);
            memcpy(v + g * head_stride + (at + r) * dim, row + (heads + kv_heads + g) * dim, (size_t)dim * sizeof(float));
        }
    }
}

/* The layer stack over ``rows`` new tokens after ``cached`` ones. x [rows, hidden]: the tokens'
 * embeddings (overwritten: the residual stream). Per layer l, weights as gemm.pack's panels:
 * qkv[l] (query, key and value projections stacked, (heads + 2 kv_heads) dim outputs), o[l],
 * gate_up[l] (gate and up stacked, 2 inter outputs), down[l]; each bias array NULL or one entry a
 * layer (an entry NULL: no bias); RMS norm weights norm_in[l], norm_post[l]. k[l], v[l]: the
 * layer's cache buffers [kv_heads, capacity, dim] (heads head_stride apart), the new rows written
 * at cached .. cached + rows - 1. cos, sin [rows, dim]: the rows' rotary tables. mask [rows,
 * cached + rows] additive (rows mask_stride apart), NULL for one row that sees every key. out
 * [rows, hidden]: the last layer's output after the final norm. Returns 0, -1 where the shapes are
 * not taken (a head dim not a multiple of 8 up to 256, odd, or heads not grouped), -2 without
 * memory. */
int specstore_decoder_f32(int64_t layers, int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t inter, float eps, float scale, float *x, const float *const *norm_in,
                          const float *const *norm_post, const float *const *qkv, const float *const *qkv_bias,
                          const float *const *o, const float *const *o_bias, const float *const *gate_up,
                          const float *const *gate_up_bias, const float *const *down, const float *const *down_bias,
                          float *const *k, float *const *v, int64_t head_stride, int64_t cached, const float *cos,
                          const float *sin, const float *mask, int64_t mask_stride, const float *norm_final, float *out,
                          int threads) {
    if (rows <= 0 || hidden <= 0 || inter <= 0 || dim <= 0 || dim % F32_LANES || dim > F32_MAX_DIM || kv_heads <= 0 ||
        heads % kv_heads || (!mask && rows != 1) || head_stride < (cached + rows) * dim)
        return -1;
    const int64_t qn = heads * dim, width = (heads + 2 * kv_heads) * dim;
    float *scratch = malloc((size_t)(rows * (hidden + width + 2 * qn + hidden + 3 * inter)) * sizeof(float));
    if (!scratch) return -2;
    float *h = scratch, *proj = h + rows * hidden, *q = proj + rows * width, *att = q + rows * qn;
    float *delta = att + rows * qn, *gu = delta + rows * hidden, *mid = gu + rows * 2 * inter;
    int code = 0;
    for (int64_t l = 0; l < layers && !code; l++) {
        add_rmsnorm_f32(x, l ? delta : 0, norm_in[l], h, rows, hidden, eps);
        specstore_linear_f32(h, rows, qkv[l], qkv_bias ? qkv_bias[l] : 0, proj, width, hidden, threads);
        qkv_rope_f32(proj, rows, heads, kv_heads, dim, cos, sin, q, k[l], v[l], head_stride, cached);
        code = specstore_attention_f32(q, heads, rows, dim, k[l], head_stride, v[l], head_stride, kv_heads, cached + rows,
                                       mask, mask_stride, scale, att, threads);
        specstore_linear_f32(att, rows, o[l], o_bias ? o_bias[l] : 0, delta, hidden, qn, threads);
        add_rmsnorm_f32(x, delta, norm_post[l], h, rows, hidden, eps);
        if (inter % NB == 0) { /* the gate in the product's threads, on its outputs in L1 */
            product_glu_f32(h, rows, gate_up[l], gate_up_bias ? gate_up_bias[l] : 0, mid, inter, hidden, threads);
        } else {
            specstore_linear_f32(h, rows, gate_up[l], gate_up_bias ? gate_up_bias[l] : 0, gu, 2 * inter, hidden, threads);
            silu_mul_f32(gu, mid, rows, inter);
        }
        specstore_linear_f32(mid, rows, down[l], down_bias ? down_bias[l] : 0, delta, hidden, inter, threads);
    }
    if (!code) add_rmsnorm_f32(x, layers ? delta : 0, norm_final, out, rows, hidden, eps);
    free(scratch);
    return code;
}

/* The index of the first largest of n float32 logits (greedy acceptance and plain decoding's
 * pick, runtime/sampling.py; the bf16 twin is specstore_argmax_bf16): -1 where one is NaN or n is
 * 0 or past 2^31 (torch's argmax, which the caller then runs, takes NaN as the largest). One pass:
 * each lane keeps its largest and where it first came (a later equal value does not replace it),
 * then the lanes' largest, the lowest place among the lanes that hold it, then the tail. */
int64_t specstore_argmax_f32(const float *x, int64_t n) {
    if (n <= 0 || n > INT32_MAX) return -1;
    const int64_t n8 = n - n % F32_LANES;
    float best = x[0];
    int64_t arg = 0;
    if (n8) {
        __m256 top = _mm256_loadu_ps(x), bad = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
        __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), here = at;
        const __m256i step = _mm256_set1_epi32(F32_LANES);
        for (int64_t i = F32_LANES; i < n8; i += F32_LANES) {
            const __m256 v = _mm256_loadu_ps(x + i);
            here = _mm256_add_epi32(here, step);
            const __m256 gt = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
            top = _mm256_blendv_ps(top, v, gt);
            at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(here), gt));
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        if (_mm256_movemask_ps(bad)) return -1;
        float l[8];
        int32_t a[8];
        _mm256_storeu_ps(l, top);
        _mm256_storeu_si256((__m256i *)a, at);
        best = l[0], arg = a[0];
        for (int j = 1; j < 8; j++)
            if (l[j] > best || (l[j] == best && a[j] < arg)) best = l[j], arg = a[j];
    }
    for (int64_t i = n8 ? n8 : 1; i < n; i++) {
        if (x[i] != x[i]) return -1;
        if (x[i] > best) best = x[i], arg = i;
    }
    if (best != best) return -1; /* x[0] NaN with no vector part */
    return arg;
}

/* Entropy in nats of softmax(x [n]) for float32 logits (runtime/drafters/respec.py: entropy; the
 * bf16 twin is specstore_entropy_bf16): two passes, the max, then H = log Z - (sum e d) / Z with
 * d = x - max clamped at -100 and e = e^d (exp8_ps), summed in 8 lanes. NaN where a logit is NaN
 * or +inf, or all are -inf; -inf logits (p = 0) add nothing. */
double specstore_entropy_f32(const float *x, int64_t n) {
    if (n <= 0) return NAN;
    const int64_t n8 = n - n % F32_LANES;
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n8; i += F32_LANES) top = _mm256_max_ps(_mm256_loadu_ps(x + i), top);
    float l[8], best = -INFINITY;
    _mm256_storeu_ps(l, top);
    for (int j = 0; j < 8; j++) best = l[j] > best ? l[j] : best;
    for (int64_t i = n8; i < n; i++) best = x[i] > best ? x[i] : best;
    if (!(best > -INFINITY && best < INFINITY)) return NAN;
    const __m256 shift = _mm256_set1_ps(best), floor = _mm256_set1_ps(-100.0f);
    __m256 z = _mm256_setzero_ps(), w = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += F32_LANES) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 d = _mm256_max_ps(_mm256_sub_ps(v, shift), floor);
        const __m256 e = exp8_ps(d);
        z = _mm256_add_ps(z, e);
        w = _mm256_fmadd_ps(e, d, w);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(bad)) return NAN;
    double zs = lanes_sum8(z), ws = lanes_sum8(w);
    for (int64_t i = n8; i < n; i++) {
        const float v = x[i];
        if (v != v) return NAN;
        const float d = v - best < -100.0f ? -100.0f : v - best;
        const float e = expf(d);
        zs += e;
        ws += (double)e * d;
    }
    return log(zs) - ws / zs;
}

/* DReSD's dense search of one query in one block (runtime/dense.py: DenseIndex.search_hidden),
 * in one call instead of a dozen small torch and numpy ones, each on cold caches right after a
 * forward. The query: p = h W + b (h [H] bf16 or float32, the normaliser's folded affine map
 * W [H][D], b [D], float32), p / max(|p|, eps) (written to ``query`` where it is not NULL: an
 * approximate index searches with it), then divided by the codes' per-dimension ``scales``
 * (NULL: float32 rows). Scores: each of the n rows (int8 codes, or float32 rows; D values
 * each, rows contiguous) dotted with it in float32. The k best (score descending, ties to the
 * lower offset, as dense._top) go to idx and scores; returns how many (fewer where n < k or
 * scores are NaN). float32 sums in 16 lanes (8 in the AVX2 build): scores agree with torch's to
 * rounding, not bits. */
#define DENSE_MAX_DIM 1024
#define DENSE_MAX_K 256
#define DENSE_PARALLEL_ROWS 16384 /* blocks this long are scanned by every thread, halves merged */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
static inline float row_score(const void *codes, int codes_int8, int64_t r, int64_t dim, const float *q) {
    __m512 acc = _mm512_setzero_ps();
    int64_t j = 0;
    if (codes_int8) {
        const int8_t *row = (const int8_t *)codes + r * dim;
        for (; j + 16 <= dim; j += 16)
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + j)))),
                                  _mm512_loadu_ps(q + j), acc);
        float tail = 0.0f;
        for (; j < dim; j++) tail += (float)row[j] * q[j];
        return _mm512_reduce_add_ps(acc) + tail;
    }
    const float *row = (const float *)codes + r * dim;
    for (; j + 16 <= dim; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(row + j), _mm512_loadu_ps(q + j), acc);
    float tail = 0.0f;
    for (; j < dim; j++) tail += row[j] * q[j];
    return _mm512_reduce_add_ps(acc) + tail;
}
#else /* AVX2: the same in 8 lanes (scores then differ from the AVX-512 build's in rounding) */
static inline float row_score(const void *codes, int codes_int8, int64_t r, int64_t dim, const float *q) {
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    if (codes_int8) {
        const int8_t *row = (const int8_t *)codes + r * dim;
        for (; j + 8 <= dim; j += 8)
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + j)))),
                                  _mm256_loadu_ps(q + j), acc);
        float tail = 0.0f;
        for (; j < dim; j++) tail += (float)row[j] * q[j];
        return lanes_sum8(acc) + tail;
    }
    const float *row = (const float *)codes + r * dim;
    for (; j + 8 <= dim; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(row + j), _mm256_loadu_ps(q + j), acc);
    float tail = 0.0f;
    for (; j < dim; j++) tail += row[j] * q[j];
    return lanes_sum8(acc) + tail;
}
#endif

int64_t specstore_dense_top(const void *hidden, int hidden_bf16, int64_t hsize, const float *weight, const float *bias,
                            int64_t dim, float eps, const float *scales, const void *codes, int codes_int8, int64_t n,
                            int64_t k, int threads, float *query, int64_t *idx, float *scores) {
    if (dim <= 0 || dim > DENSE_MAX_DIM || k > DENSE_MAX_K || k < 0) return -1;
    float p[DENSE_MAX_DIM], q[DENSE_MAX_DIM];
    for (int64_t j = 0; j < dim; j++) p[j] = bias ? bias[j] : 0.0f;
    for (int64_t i = 0; i < hsize; i++) { /* p += h[i] W[i]: the weight read once, in rows */
        float h = hidden_bf16 ? bf16_to_f32(((const uint16_t *)hidden)[i]) : ((const float *)hidden)[i];
        const float *w = weight + i * dim;
        int64_t j = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
        const __m512 hv = _mm512_set1_ps(h);
        for (; j + 16 <= dim; j += 16) _mm512_storeu_ps(p + j, _mm512_fmadd_ps(hv, _mm512_loadu_ps(w + j), _mm512_loadu_ps(p + j)));
#else
        const __m256 hv = _mm256_set1_ps(h);
        for (; j + 8 <= dim; j += 8) _mm256_storeu_ps(p + j, _mm256_fmadd_ps(hv, _mm256_loadu_ps(w + j), _mm256_loadu_ps(p + j)));
#endif
        for (; j < dim; j++) p[j] += h * w[j];
    }
    float norm = 0.0f;
    for (int64_t j = 0; j < dim; j++) norm += p[j] * p[j];
    norm = sqrtf(norm);
    if (!(norm > eps)) norm = norm == norm ? eps : norm;
    for (int64_t j = 0; j < dim; j++) {
        p[j] /= norm;
        q[j] = scales ? p[j] / scales[j] : p[j];
    }
    if (query) memcpy(query, p, (size_t)dim * sizeof(float));
    if (n <= 0 || k == 0) return 0;
    int64_t count = 0;
    if (n < DENSE_PARALLEL_ROWS || threads < 2) {
        for (int64_t r = 0; r < n; r++) top_insert(row_score(codes, codes_int8, r, dim, q), r, k, &count, idx, scores);
        return count;
    }
    int parts = threads > 8 ? 8 : threads;
    int64_t part_idx[8][DENSE_MAX_K], part_count[8] = {0};
    float part_scores[8][DENSE_MAX_K];
#pragma omp parallel for schedule(static) num_threads(parts)
    for (int t = 0; t < parts; t++) {
        int64_t lo = n * t / parts, hi = n * (t + 1) / parts;
        for (int64_t r = lo; r < hi; r++)
            top_insert(row_score(codes, codes_int8, r, dim, q), r, k, &part_count[t], part_idx[t], part_scores[t]);
    }
    for (int t = 0; t < parts; t++)
        for (int64_t i = 0; i < part_count[t]; i++) top_insert(part_scores[t][i], part_idx[t][i], k, &count, idx, scores);
    return count;
}

/* The approximate path's rerank (runtime/dense.py: DenseIndex._search_ann) in one call: the k
 * best of the block's rows at ids[0 .. m) (offsets into codes' n rows; those outside [0, n) and
 * repeats dropped), scored against query / scales (scales NULL: the query itself) and ordered
 * as specstore_dense_top scores and orders them (ties to the lower offset). Returns how many;
 * -1 where it does not take the call (the caller reranks in numpy). */
#define RERANK_MAX_IDS 4096
int64_t specstore_dense_rerank(const float *query, const float *scales, int64_t dim, const void *codes, int codes_int8,
                               int64_t n, const int64_t *ids, int64_t m, int64_t k, int64_t *idx, float *scores) {
    if (dim <= 0 || dim > DENSE_MAX_DIM || k > DENSE_MAX_K || k < 0 || m < 0 || m > RERANK_MAX_IDS) return -1;
    float q[DENSE_MAX_DIM];
    int64_t sorted[RERANK_MAX_IDS], s = 0, count = 0;
    for (int64_t j = 0; j < dim; j++) q[j] = scales ? query[j] / scales[j] : query[j];
    for (int64_t i = 0; i < m; i++) { /* ascending offsets, each once: ties then go to the lower one */
        int64_t id = ids[i], j = s;
        if (id < 0 || id >= n) continue;
        while (j > 0 && sorted[j - 1] > id) j--;
        if (j > 0 && sorted[j - 1] == id) continue;
        memmove(sorted + j + 1, sorted + j, (size_t)(s - j) * sizeof(int64_t));
        sorted[j] = id;
        s++;
    }
    if (k == 0) return 0;
    for (int64_t i = 0; i < s; i++) top_insert(row_score(codes, codes_int8, sorted[i], dim, q), sorted[i], k, &count, idx, scores);
    return count;
}

/* bf16 products through AVX-512 BF16 dot products (VDPBF16PS), where the library is compiled
 * with -mavx512bf16 (runtime/gemm.py does so on CPUs with the avx512_bf16 flag).
 *
 * Emulated bf16 (above) widens every weight to float32 and runs one FMA per weight and row; a dot
 * product instruction takes 32 bf16 weights and a broadcast pair of inputs at once, so a row
 * costs a quarter of the instructions and trees of 8-16 nodes stay close to what reading the
 * weights costs.
 *
 * Layout: panels of 16 outputs as before, but each panel row holds a pair of k: panel b, pair kp
 * holds W[16b + j][2kp], W[16b + j][2kp + 1] for j = 0 .. 15 (32 bf16, one cache line),
 * zero-padded past n. k must be even (gemm.py packs this layout only then).
 *
 * Arithmetic: every output accumulates in float32, one dot-product step per pair, in increasing
 * k, from zero, the bias added last, the result rounded to bf16 to nearest, ties to even. As
 * above, that order does not depend on the number of rows, the row's place or the threads, so a
 * row's result is bitwise the same in a 1-row product as in a 72-row one. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MRD 12 /* rows per register block: 12 accumulators, a weight register, a broadcast */

int specstore_gemm_features(void) { return 2047; } /* 1: bf16 dot products, 2: attention, 4: norm and MLP gate, 8: dense search, 16: rotary, 32: draft head, 64: float32 draft head, 128: float32 attention, 256: float32 decoder stack, 512: float32 entropy, 1024: float32 argmax */

static inline __attribute__((always_inline)) void block_dp(const int M, const uint16_t *x, int64_t ldx,
                                                           const uint16_t *panel, int64_t k0, int64_t k1, float *acc) {
    __m512 a[MRD];
#pragma GCC unroll 12
    for (int r = 0; r < M; r++) a[r] = k0 ? _mm512_loadu_ps(acc + r * NB) : _mm512_setzero_ps();
    for (int64_t kk = k0; kk < k1; kk++) {
        const uint16_t *p = panel + kk * 2 * NB;
        _mm_prefetch((const char *)p + PREFETCH, _MM_HINT_T0);
        __m512bh w = (__m512bh)_mm512_loadu_si512((const void *)p);
#pragma GCC unroll 12
        for (int r = 0; r < M; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * kk, sizeof pair);
            a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(pair), w);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < M; r++) _mm512_storeu_ps(acc + r * NB, a[r]);
}

#define BLOCK_DP(R)                                                                                             \
    static void block_dp_##R(const void *x, int64_t ldx, const void *p, int64_t k0, int64_t k1, float *acc) {    \
        block_dp(R, (const uint16_t *)x, ldx, (const uint16_t *)p, k0, k1, acc); }
BLOCK_DP(1) BLOCK_DP(2) BLOCK_DP(3) BLOCK_DP(4) BLOCK_DP(5) BLOCK_DP(6)
BLOCK_DP(7) BLOCK_DP(8) BLOCK_DP(9) BLOCK_DP(10) BLOCK_DP(11) BLOCK_DP(12)
static const block_fn BLOCKS_DP[MRD + 1] = {0, block_dp_1, block_dp_2, block_dp_3, block_dp_4, block_dp_5,
                                               block_dp_6, block_dp_7, block_dp_8, block_dp_9, block_dp_10,
                                               block_dp_11, block_dp_12};

/* bf16 x [m, k] (k even) times the pair panels; bf16 bias and output (the bias added in float32,
 * as product() adds it). Returns 0, or -1 where the bias's float32 copy could not be allocated. */
int specstore_linear_bf16dp(const uint16_t *x, int64_t m, const uint16_t *panel, const uint16_t *bias,
                            uint16_t *out, int64_t n, int64_t k, int threads) {
    float *bf = 0;
    if (bias) {
        bf = malloc((size_t)n * sizeof(float));
        if (!bf) return -1;
        for (int64_t i = 0; i < n; i++) bf[i] = bf16_to_f32(bias[i]);
    }
    product(BLOCKS_DP, MRD, 1, x, sizeof(uint16_t), m, panel, k / 2, 2 * NB * sizeof(uint16_t), bf, out, n, k, threads);
    free(bf);
    return 0;
}

/* Attention of a few query rows over a cache, bf16 in and out, float32 inside (runtime/attention.py
 * takes it for decoding's steps and trees in bf16 on the CPU).
 *
 * q [heads][nq][dim], k and v [kv_heads][nk][dim] (rows contiguous, heads ``*_head_stride``
 * elements apart: the cache grows in place), an additive mask [nq][nk] (row stride
 * ``mask_stride``; NULL: every key), out [nq][heads][dim]. Query head h reads key/value head
 * h / (heads / kv_heads).
 *
 * A row attends its allowed keys (mask above -1e30) in their order, as a list: scores
 * scale x (q . k) + mask (not added where all of a row's allowed entries are +-0: x + 0 = x), one
 * dot product per key in a fixed order; their maximum (exact in any order); exp(s - max)
 * of the list's entries in groups of 16 (the t-th allowed key in lane t mod 16); the sum of those
 * lanes, reduced at the end; the weighted sum of values in list order (attend_group: the weights
 * rounded to bf16, one dot-product step per pair of list entries; attend_row: one fused
 * multiply-add per key). Everything a row computes depends only on its query and its allowed keys in order, not
 * on the other rows, the masked keys or where the allowed ones sit: a tree node's row attending
 * the cache and its ancestors gives the bits plain decoding's 1-token step gives for that token
 * after the same tokens. */
#define ATT_MAX_DIM 256
#define ATT_LANES 16

static inline __m512 exp_ps(__m512 x) { /* exp8_ps's e^x (EXP2_TAYLOR), 16 lanes */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP2_TAYLOR[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_TAYLOR[i]));
    return _mm512_scalef_ps(p, n);
}

/* s[0 .. m-1] <- exp(s - best), 16 entries at a time (entry t in lane t mod 16); returns their
 * sum, the lanes reduced at the end */
static inline float exp_list(float *s, int64_t m, float best) {
    __m512 sum = _mm512_setzero_ps(), top = _mm512_set1_ps(best);
    for (int64_t t = 0; t < m; t += ATT_LANES) {
        __mmask16 live = m - t >= ATT_LANES ? (__mmask16)0xffff : (__mmask16)((1u << (m - t)) - 1u);
        __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), top)));
        _mm512_mask_storeu_ps(s + t, live, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* the largest of s[0 .. m-1] (NaN entries ignored, as a scalar ``s > best ? s : best`` would):
 * max is exact, so the order does not matter */
static inline float max_list(const float *s, int64_t m) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < m; t += ATT_LANES) {
        __mmask16 live = m - t >= ATT_LANES ? (__mmask16)0xffff : (__mmask16)((1u << (m - t)) - 1u);
        top = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, s + t), top);
    }
    return _mm512_reduce_max_ps(top);
}

/* one row: its allowed keys idx[0 .. m-1]; scratch s[m + 16] */
static void attend_row(const uint16_t *qr, const uint16_t *kh, const uint16_t *vh, int64_t dim, const uint16_t *mrow,
                       const int32_t *idx, int64_t m, float scale, float *s, uint16_t *o) {
    const int64_t chunks = dim / 32; /* 32 bf16 per register */
    __m512bh qv[ATT_MAX_DIM / 32];
    for (int64_t c = 0; c < chunks; c++) qv[c] = (__m512bh)_mm512_loadu_si512((const void *)(qr + 32 * c));
    for (int64_t t = 0; t < m; t++) {
        const uint16_t *kr = kh + (int64_t)idx[t] * dim;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++)
            acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512((const void *)(kr + 32 * c)));
        float v = _mm512_reduce_add_ps(acc) * scale;
        if (mrow) v += bf16_to_f32(mrow[idx[t]]);
        s[t] = v;
    }
    float total = exp_list(s, m, max_list(s, m));
    __m512 acc[ATT_MAX_DIM / 16];
    const int64_t lanes = dim / 16;
    for (int64_t c = 0; c < lanes; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < m; t++) {
        const uint16_t *vr = vh + (int64_t)idx[t] * dim;
        __m512 w = _mm512_set1_ps(s[t]);
        for (int64_t c = 0; c < lanes; c++) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr + 16 * c)));
            acc[c] = _mm512_fmadd_ps(w, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)), acc[c]);
        }
    }
    __m512 inv = _mm512_set1_ps(1.0f / total);
    for (int64_t c = 0; c < lanes; c++) {
        float r[16];
        _mm512_storeu_ps(r, _mm512_mul_ps(acc[c], inv));
        for (int j = 0; j < 16; j++) o[16 * c + j] = f32_to_bf16(r[j]);
    }
}

/* 16 vectors of partial sums -> one vector whose lane L holds the total of one of them (which one:
 * reduce16_lanes), by halving: the same additions for every lane, whatever the values */
static inline __m512 reduce16(const __m512 *v) {
    __m512 x[8], y[4], z[2];
    for (int j = 0; j < 8; j++)
        x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[j], v[j + 8], 0x44), _mm512_shuffle_f32x4(v[j], v[j + 8], 0xEE));
    for (int j = 0; j < 4; j++)
        y[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[j], x[j + 4], 0x88), _mm512_shuffle_f32x4(x[j], x[j + 4], 0xDD));
    for (int j = 0; j < 2; j++)
        z[j] = _mm512_add_ps(_mm512_shuffle_ps(y[j], y[j + 2], 0x44), _mm512_shuffle_ps(y[j], y[j + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
}

/* the permutation that puts reduce16's totals in the order of its inputs */
static __m512i reduce16_order(void) {
    __m512 v[16];
    float lanes[16];
    int32_t order[16];
    for (int j = 0; j < 16; j++) v[j] = _mm512_set1_ps((float)j);
    _mm512_storeu_ps(lanes, reduce16(v));
    for (int l = 0; l < 16; l++) order[(int)(lanes[l] / 16.0f + 0.5f)] = l;
    return _mm512_loadu_si512((const void *)order);
}

#define GROUP_MAX_REP 4   /* query heads per key/value head the grouped path takes */
#define GROUP_MAX_DIM 64  /* head dims it takes */

/* The query rows of one query token over one key/value head (its ``rep`` query heads): each
 * row's arithmetic as in attend_row's contract (its allowed keys in order, every sum in a fixed
 * order: scores of 16 list entries at a time, reduced by reduce16), the keys' and values' reads
 * shared by the rows. q: the first head's row, heads q_head_stride apart; o: the first head's
 * output, heads dim apart; s: scratch [GROUP_MAX_REP][m + 16]. */
static inline __attribute__((always_inline)) void attend_group(const uint16_t *q, int64_t q_head_stride, const int rep,
                                                               const uint16_t *kh, const uint16_t *vh, const int64_t dim,
                                                               const uint16_t *mrow, const int32_t *idx, int64_t m,
                                                               float scale, float *s, int64_t s_stride, uint16_t *o,
                                                               __m512i order) {
    const int chunks = (int)(dim / 32), lanes = (int)(dim / 16);
    __m512bh qv[GROUP_MAX_REP][GROUP_MAX_DIM / 32];
    for (int r = 0; r < rep; r++)
        for (int c = 0; c < chunks; c++)
            qv[r][c] = (__m512bh)_mm512_loadu_si512((const void *)(q + r * q_head_stride + 32 * c));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < m; t0 += ATT_LANES) {
        const int n = m - t0 < ATT_LANES ? (int)(m - t0) : ATT_LANES;
        __m512bh kv[ATT_LANES][GROUP_MAX_DIM / 32];
        for (int j = 0; j < ATT_LANES; j++)
            for (int c = 0; c < chunks; c++)
                kv[j][c] = j < n ? (__m512bh)_mm512_loadu_si512((const void *)(kh + (int64_t)idx[t0 + j] * dim + 32 * c))
                                 : (__m512bh)_mm512_setzero_si512();
        for (int r = 0; r < rep; r++) {
            __m512 part[ATT_LANES];
            for (int j = 0; j < ATT_LANES; j++) {
                __m512 acc = _mm512_setzero_ps();
                for (int c = 0; c < chunks; c++) acc = _mm512_dpbf16_ps(acc, qv[r][c], kv[j][c]);
                part[j] = acc;
            }
            _mm512_storeu_ps(s + r * s_stride + t0, _mm512_mul_ps(_mm512_permutexvar_ps(order, reduce16(part)), vscale));
        }
    }
    float total[GROUP_MAX_REP];
    for (int r = 0; r < rep; r++) {
        float *sr = s + r * s_stride;
        if (mrow)
            for (int64_t t = 0; t < m; t++) sr[t] += bf16_to_f32(mrow[idx[t]]);
        total[r] = exp_list(sr, m, max_list(sr, m));
    }
    /* the weights rounded to bf16 (to nearest, ties to even), two list entries to a 32-bit pair,
     * in place over the row's float scratch (written behind where it is read) */
    const int64_t pairs = (m + 1) / 2;
    for (int r = 0; r < rep; r++) {
        float *sr = s + r * s_stride;
        for (int64_t t = 0; t < m; t += 2 * ATT_LANES) {
            __mmask16 lo = m - t >= ATT_LANES ? (__mmask16)0xffff : (__mmask16)((1u << (m - t)) - 1u);
            int64_t rest = m - t - ATT_LANES;
            __mmask16 hi = rest >= ATT_LANES ? (__mmask16)0xffff : rest > 0 ? (__mmask16)((1u << rest) - 1u) : 0;
            __m512bh both = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, sr + t + ATT_LANES), _mm512_maskz_loadu_ps(lo, sr + t));
            _mm512_storeu_si512((void *)((uint16_t *)sr + t), (__m512i)both);
        }
    }
    __m512 acc[GROUP_MAX_REP][GROUP_MAX_DIM / 16];
    for (int r = 0; r < GROUP_MAX_REP; r++)
        for (int c = 0; c < GROUP_MAX_DIM / 16; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j++) { /* entries 2j and 2j + 1: one dot-product step each */
        const uint16_t *v0 = vh + (int64_t)idx[2 * j] * dim;
        const uint16_t *v1 = 2 * j + 1 < m ? vh + (int64_t)idx[2 * j + 1] * dim : 0;
        __m512bh both[GROUP_MAX_DIM / 16];
        for (int c = 0; c < lanes; c++) {
            __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + 16 * c)));
            __m512i b = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + 16 * c))) : _mm512_setzero_si512();
            both[c] = (__m512bh)_mm512_or_si512(a, _mm512_slli_epi32(b, 16));
        }
        for (int r = 0; r < rep; r++) {
            int32_t w;
            memcpy(&w, (const uint16_t *)(s + r * s_stride) + 2 * j, sizeof w);
            __m512bh wv = (__m512bh)_mm512_set1_epi32(w);
            for (int c = 0; c < lanes; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv, both[c]);
        }
    }
    for (int r = 0; r < rep; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / total[r]);
        for (int c = 0; c < lanes; c++) {
            float out[16];
            _mm512_storeu_ps(out, _mm512_mul_ps(acc[r][c], inv));
            for (int j = 0; j < 16; j++) o[r * dim + 16 * c + j] = f32_to_bf16(out[j]);
        }
    }
}

/* attend_group with its rows and dims known to the compiler (its sums then stay in registers) */
typedef void (*group_fn)(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, const uint16_t *, const int32_t *,
                         int64_t, float, float *, int64_t, uint16_t *, __m512i);
#define ATT_GROUP(R, D)                                                                                          \
    static void attend_group_##R##_##D(const uint16_t *q, int64_t qs, const uint16_t *kh, const uint16_t *vh,   \
                                       const uint16_t *mrow, const int32_t *idx, int64_t m, float scale, float *s, \
                                       int64_t ss, uint16_t *o, __m512i order) {                                 \
        attend_group(q, qs, R, kh, vh, D, mrow, idx, m, scale, s, ss, o, order);                                  \
    }
ATT_GROUP(1, 32) ATT_GROUP(2, 32) ATT_GROUP(3, 32) ATT_GROUP(4, 32)
ATT_GROUP(1, 64) ATT_GROUP(2, 64) ATT_GROUP(3, 64) ATT_GROUP(4, 64)
static const group_fn ATT_GROUPS[2][GROUP_MAX_REP] = {
    {attend_group_1_32, attend_group_2_32, attend_group_3_32, attend_group_4_32},
    {attend_group_1_64, attend_group_2_64, attend_group_3_64, attend_group_4_64}};

/* Returns 0, -1 where dim is not a multiple of 32 up to ATT_MAX_DIM or the heads do not group,
 * -2 where scratch memory could not be had. */
int specstore_attention_bf16(const uint16_t *q, int64_t heads, int64_t nq, int64_t dim, const uint16_t *k,
                             int64_t k_head_stride, const uint16_t *v, int64_t v_head_stride, int64_t kv_heads,
                             int64_t nk, const uint16_t *mask, int64_t mask_stride, float scale, uint16_t *out,
                             int threads) {
    if (dim % 32 || dim > ATT_MAX_DIM || kv_heads <= 0 || heads % kv_heads) return -1;
    const int64_t rep = heads / kv_heads;
    int32_t *idx = malloc((size_t)(nq * nk + 1) * sizeof(int32_t));
    int64_t *count = malloc((size_t)nq * sizeof(int64_t));
    const uint16_t **masks = malloc((size_t)nq * sizeof(*masks)); /* a row's mask, NULL where it adds nothing */
    if (!idx || !count || !masks) {
        free(idx);
        free(count);
        free(masks);
        return -2;
    }
    for (int64_t i = 0; i < nq; i++) { /* each query row's allowed keys, in order */
        int64_t c = 0;
        int32_t *row = idx + i * nk;
        const uint16_t *mr = mask ? mask + i * mask_stride : 0;
        int zero = 1; /* every allowed key's mask is +-0: adding it changes no score (x + 0 = x) */
        int64_t j = 0;
        const __m512i step = _mm512_set1_epi32(ATT_LANES), magnitude = _mm512_set1_epi32(0x7fff);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (; j + ATT_LANES <= nk; j += ATT_LANES, at = _mm512_add_epi32(at, step)) { /* 16 keys at a time */
            __mmask16 allowed = 0xffff;
            if (mr) {
                __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(mr + j)));
                allowed = _mm512_cmp_ps_mask(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), _mm512_set1_ps(-1e30f), _CMP_GT_OQ);
                zero &= !_mm512_mask_test_epi32_mask(allowed, w, magnitude);
            }
            _mm512_mask_compressstoreu_epi32(row + c, allowed, at);
            c += __builtin_popcount((unsigned)allowed);
        }
        for (; j < nk; j++)
            if (!mr || bf16_to_f32(mr[j]) > -1e30f) {
                row[c++] = (int32_t)j;
                zero &= !mr || (mr[j] & 0x7fff) == 0;
            }
        count[i] = c;
        masks[i] = zero ? 0 : mr;
    }
    int failed = 0;
    if (rep <= GROUP_MAX_REP && dim <= GROUP_MAX_DIM) { /* the grouped path: a query token's rows of a key/value head together */
        const __m512i order = reduce16_order();
        const int64_t s_stride = nk + ATT_LANES;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
        {
            float *s = malloc((size_t)(GROUP_MAX_REP * s_stride) * sizeof(float));
            if (!s) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t gi = 0; gi < kv_heads * nq; gi++) {
                if (!s) continue;
                int64_t g = gi / nq, i = gi % nq;
                uint16_t *o = out + (i * heads + g * rep) * dim;
                if (count[i] == 0) {
                    memset(o, 0, (size_t)(rep * dim) * sizeof(uint16_t));
                    continue;
                }
                ATT_GROUPS[dim / 32 - 1][rep - 1](q + (g * rep * nq + i) * dim, nq * dim, k + g * k_head_stride,
                                                  v + g * v_head_stride, masks[i],
                                                  idx + i * nk, count[i], scale, s, s_stride, o, order);
            }
            free(s);
        }
        free(idx);
        free(count);
        free(masks);
        return failed ? -2 : 0;
    }
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float *s = malloc((size_t)(nk + ATT_LANES) * sizeof(float));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t hi = 0; hi < heads * nq; hi++) {
            if (!s) continue;
            int64_t h = hi / nq, i = hi % nq, g = h / rep;
            if (count[i] == 0) { /* nothing to attend: zeros (SDPA would give NaN) */
                memset(out + (i * heads + h) * dim, 0, (size_t)dim * sizeof(uint16_t));
                continue;
            }
            attend_row(q + (h * nq + i) * dim, k + g * k_head_stride, v + g * v_head_stride, dim,
                       masks[i], idx + i * nk, count[i], scale, s, out + (i * heads + h) * dim);
        }
        free(s);
    }
    free(idx);
    free(count);
    free(masks);
    return failed ? -2 : 0;
}

/* Entropy in nats of softmax(x) for bf16 logits x[0 .. n-1] (ReSpec's trigger, every step):
 * H = log Z - (sum e^d d) / Z with d = x - max x, Z = sum e^d, in two passes (float32 sums in 16
 * lanes). Logits of -inf add nothing; NaN where a logit is NaN or +inf, or n is 0. */
double specstore_entropy_bf16(const uint16_t *x, int64_t n) {
    if (n <= 0) return NAN;
    __m512 top = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        top = _mm512_max_ps(top, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))), 16)));
    float best = _mm512_reduce_max_ps(top);
    for (; i < n; i++) best = bf16_to_f32(x[i]) > best ? bf16_to_f32(x[i]) : best;
    if (!(best > -INFINITY && best < INFINITY)) return NAN;
    const __m512 shift = _mm512_set1_ps(best), floor = _mm512_set1_ps(-100.0f);
    __m512 z = _mm512_setzero_ps(), w = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 v = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))), 16));
        __m512 d = _mm512_max_ps(_mm512_sub_ps(v, shift), floor); /* NaN logits give NaN below */
        __m512 e = exp_ps(d);
        z = _mm512_add_ps(z, e);
        w = _mm512_fmadd_ps(e, d, w);
        if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return NAN;
    }
    double zs = _mm512_reduce_add_ps(z), ws = _mm512_reduce_add_ps(w);
    for (; i < n; i++) {
        float v = bf16_to_f32(x[i]);
        if (v != v) return NAN;
        float d = v - best < -100.0f ? -100.0f : v - best;
        float e = expf(d);
        zs += e;
        ws += (double)e * d;
    }
    return log(zs) - ws / zs;
}

/* The elementwise parts of a decoding step's layers (runtime/fused.py), bf16 in and out, each
 * value computed in float32 and rounded to bf16 (to nearest, ties to even, as f32_to_bf16) where
 * transformers' bf16 modules round: a row's result depends only on that row. */

/* float32 -> bf16 of 16 lanes, rounded as f32_to_bf16 rounds (NaN stays a quiet NaN) */
static inline __m256i round_bf16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f), one = _mm512_set1_epi32(1);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static inline __m512 widen_bf16(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* 16 bf16 from p (the n < 16 left at the end: the rest zeros) */
static inline __m256i load16(const uint16_t *p, int64_t n) {
    if (n >= ATT_LANES) return _mm256_loadu_si256((const __m256i *)p);
    uint16_t tmp[ATT_LANES] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(uint16_t));
    return _mm256_loadu_si256((const __m256i *)tmp);
}

static inline void store16(uint16_t *p, __m256i v, int64_t n) {
    if (n >= ATT_LANES) {
        _mm256_storeu_si256((__m256i *)p, v);
        return;
    }
    uint16_t tmp[ATT_LANES];
    _mm256_storeu_si256((__m256i *)tmp, v);
    memcpy(p, tmp, (size_t)n * sizeof(uint16_t));
}

/* The index of the first largest of n bf16 logits (greedy acceptance, runtime/sampling.py:
 * greedy_choice, every row a verification walks): -1 where one is NaN or n is 0 (torch's argmax,
 * which the caller then runs, takes NaN as the largest). One pass for the maximum, one for its
 * first place, in float32 (exact for bf16). */
int64_t specstore_argmax_bf16(const uint16_t *x, int64_t n) {
    if (n <= 0) return -1;
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = widen_bf16(_mm256_loadu_si256((const __m256i *)(x + i)));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, v);
    }
    float best = _mm512_reduce_max_ps(top);
    for (; i < n; i++) {
        float v = bf16_to_f32(x[i]);
        if (v != v) return -1;
        best = v > best ? v : best;
    }
    if (nan) return -1;
    const __m512 want = _mm512_set1_ps(best);
    for (i = 0; i + 16 <= n; i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(widen_bf16(_mm256_loadu_si256((const __m256i *)(x + i))), want, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < n; i++)
        if (bf16_to_f32(x[i]) == best) return i;
    return -1; /* every logit -inf below 16 lanes: not reached (then best is -inf and equal) */
}

/* RMS norm of each row of x [rows, dim]: h x / sqrt(mean(h^2) + eps) rounded to bf16, times the
 * weight, rounded again (transformers' LlamaRMSNorm in bf16); the mean's sum in 16 lanes (one
 * fused multiply-add per value, in order), reduced at the end */
void specstore_rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *o = out + r * dim;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += ATT_LANES) {
            __m512 h = widen_bf16(load16(xr + i, dim - i));
            sum = _mm512_fmadd_ps(h, h, sum);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += ATT_LANES) {
            __m512 h = widen_bf16(round_bf16(_mm512_mul_ps(widen_bf16(load16(xr + i, dim - i)), inv)));
            store16(o + i, round_bf16(_mm512_mul_ps(widen_bf16(load16(w + i, dim - i)), h)), dim - i);
        }
    }
}

/* out = silu(g) rounded to bf16, times u, rounded (a gated MLP's middle in bf16, as transformers'
 * silu and product each round); silu(x) = x / (1 + e^-x) */
void specstore_silu_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += ATT_LANES) {
        __m512 x = widen_bf16(load16(g + i, n - i));
        __m512 act = widen_bf16(round_bf16(_mm512_div_ps(x, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))))));
        store16(out + i, round_bf16(_mm512_mul_ps(act, widen_bf16(load16(u + i, n - i)))), n - i);
    }
}

/* Rotary position embedding of one sequence's rows (transformers' apply_rotary_pos_emb in bf16,
 * runtime/fused.py): out = x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) for the halves
 * x1, x2 of each head's row; each product and the sum computed in float32 and rounded to bf16, as
 * torch's three bf16 ops round (a negated bf16 is exact). x: heads x n rows of dim, row (h, i) at
 * x + h head_stride + i token_stride; cos, sin: n rows of dim, row i at + i cs_stride; out: heads
 * x n x dim, contiguous. A row's result depends only on that row. */
void specstore_rotary_bf16(const uint16_t *x, int64_t heads, int64_t n, int64_t dim, int64_t head_stride,
                           int64_t token_stride, const uint16_t *cos, const uint16_t *sin, int64_t cs_stride,
                           uint16_t *out) {
    const int64_t half = dim / 2;
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t h = 0; h < heads; h++)
        for (int64_t i = 0; i < n; i++) {
            const uint16_t *xr = x + h * head_stride + i * token_stride, *c = cos + i * cs_stride, *s = sin + i * cs_stride;
            uint16_t *o = out + (h * n + i) * dim;
            for (int64_t j = 0; j < half; j += ATT_LANES) {
                const int64_t left = half - j;
                __m512 x1 = widen_bf16(load16(xr + j, left)), x2 = widen_bf16(load16(xr + half + j, left));
                __m512 a = widen_bf16(round_bf16(_mm512_mul_ps(x1, widen_bf16(load16(c + j, left)))));
                __m512 b = widen_bf16(round_bf16(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), sign)), widen_bf16(load16(s + j, left)))));
                store16(o + j, round_bf16(_mm512_add_ps(a, b)), left);
                a = widen_bf16(round_bf16(_mm512_mul_ps(x2, widen_bf16(load16(c + half + j, left)))));
                b = widen_bf16(round_bf16(_mm512_mul_ps(x1, widen_bf16(load16(s + half + j, left)))));
                store16(o + half + j, round_bf16(_mm512_add_ps(a, b)), left);
            }
        }
}

/* The draft head's guess (runtime/draft_head.py: DraftHead.guess_beside), bf16, beside other work.
 *
 * Right after a verification every weight the head reads (~6 MB: fc1's hidden half, fc2, the
 * output rows) comes from memory, ~0.3-0.4 ms on one core of this project's CPU, while the
 * decoding thread's own drafting work (ReSpec's pool: prompt lookup, the dense search) is
 * Python and leaves the second core idle: specstore_head_beside runs the two side by side. The
 * same arithmetic as the torch path,
 * rounded to bf16 where it rounds:
 *   a = bf16(fc1h h), t = bf16(a + pending), u = bf16(silu(t)),
 *   z = bf16(h + bf16(fc2 u + b2)), logits = bf16(out z), probs = softmax(logits) in float32;
 * each product accumulates in float32, one dot-product step per pair of k (block_dp), so sums
 * agree with oneDNN's to rounding, not bits. The k likeliest (probability descending, ties to
 * the lower index) go to top. Weights as gemm.pack gives them (pair panels); hidden and inner
 * even. */
typedef struct {
    const uint16_t *h, *pending, *fc1, *fc2, *b2, *out;
    int64_t hidden, inner, vocab, k;
    float *probs;
    int64_t *top;
    uint16_t *u, *z;
    float *y;
} head_job;

/* y [n] = W x for one bf16 row x [k] over pair panels: HEAD_PANELS panels at a time, each its own
 * chain of dot products (one chain alone waits on the instruction's latency); in each output the
 * pairs of k in increasing order, as block_dp sums them */
#define HEAD_PANELS 6
static void matvec_dp(const uint16_t *x, const uint16_t *panel, int64_t n, int64_t k, float *y) {
    const int64_t steps = k / 2, panels = (n + NB - 1) / NB;
    for (int64_t b0 = 0; b0 < panels; b0 += HEAD_PANELS) {
        const int g = panels - b0 < HEAD_PANELS ? (int)(panels - b0) : HEAD_PANELS;
        __m512 a[HEAD_PANELS];
        const uint16_t *p[HEAD_PANELS];
        for (int t = 0; t < HEAD_PANELS; t++) {
            a[t] = _mm512_setzero_ps();
            p[t] = panel + (b0 + (t < g ? t : 0)) * steps * 2 * NB;
        }
        for (int64_t kk = 0; kk < steps; kk++) {
            int32_t pair;
            memcpy(&pair, x + 2 * kk, sizeof pair);
            const __m512bh v = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 6
            for (int t = 0; t < HEAD_PANELS; t++)
                a[t] = _mm512_dpbf16_ps(a[t], v, (__m512bh)_mm512_loadu_si512((const void *)(p[t] + kk * 2 * NB)));
        }
        for (int t = 0; t < g; t++) {
            float acc[NB];
            _mm512_storeu_ps(acc, a[t]);
            const int64_t b = b0 + t, cols = n - b * NB < NB ? n - b * NB : NB;
            memcpy(y + b * NB, acc, (size_t)cols * sizeof(float));
        }
    }
}

static inline float round_to_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

static void head_run(void *arg) {
    head_job *j = arg;
    const int64_t H = j->hidden, I = j->inner, V = j->vocab;
    matvec_dp(j->h, j->fc1, I, H, j->y);
    for (int64_t i = 0; i < I; i++) {
        float t = round_to_bf16(round_to_bf16(j->y[i]) + bf16_to_f32(j->pending[i]));
        j->u[i] = f32_to_bf16(t / (1.0f + expf(-t)));
    }
    matvec_dp(j->u, j->fc2, H, I, j->y);
    for (int64_t i = 0; i < H; i++) {
        float r = round_to_bf16(j->y[i] + (j->b2 ? bf16_to_f32(j->b2[i]) : 0.0f));
        j->z[i] = f32_to_bf16(bf16_to_f32(j->h[i]) + r);
    }
    float *p = j->probs;
    matvec_dp(j->z, j->out, V, H, p);
    for (int64_t i = 0; i < V; i++) p[i] = round_to_bf16(p[i]);
    const float best = max_list(p, V);
    const float sum = exp_list(p, V, best);
    const __m512 scale = _mm512_set1_ps(1.0f / sum);
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) _mm512_storeu_ps(p + i, _mm512_mul_ps(_mm512_loadu_ps(p + i), scale));
    for (; i < V; i++) p[i] /= sum;
    int64_t count = 0;
    float scores[HEAD_MAX_K];
    for (i = 0; i < V; i++) top_insert(p[i], i, j->k, &count, j->top, scores);
    for (i = count; i < j->k; i++) j->top[i] = -1;
}

/* The bf16 guess beside ``beside`` (run_beside). Returns 0, or -1 for arguments the kernel does
 * not take (nothing run). */
int specstore_head_beside(beside_fn beside, const uint16_t *h, const uint16_t *pending, const uint16_t *fc1,
                          const uint16_t *fc2, const uint16_t *b2, const uint16_t *out, int64_t hidden, int64_t inner,
                          int64_t vocab, int64_t k, float *probs, int64_t *top) {
    if (hidden <= 0 || inner <= 0 || vocab <= 0 || (hidden | inner) & 1 || k < 0 || k > HEAD_MAX_K) return -1;
    const int64_t wide = hidden > inner ? hidden : inner;
    float *y = malloc((size_t)wide * sizeof(float) + (size_t)(hidden + inner) * sizeof(uint16_t));
    if (!y) return -1;
    head_job j = {h, pending, fc1, fc2, b2, out, hidden, inner, vocab, k, probs, top,
                  (uint16_t *)(y + wide), (uint16_t *)(y + wide) + inner, y};
    run_beside(beside, head_run, &j);
    free(y);
    return 0;
}
#else
int specstore_gemm_features(void) { return 1992; } /* 8: dense search, 64: float32 draft head, 128: float32 attention, 256: float32 decoder stack, 512: float32 entropy, 1024: float32 argmax (the rest needs AVX-512 BF16) */
#endif
