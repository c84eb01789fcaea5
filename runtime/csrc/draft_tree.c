/* The cost-aware pruner's per-step work over a draft tree's few dozen nodes, one call each
 * (runtime/drafters/cost_aware.py and respec.py hold the rules; runtime/tree_kernel.py calls
 * these): ReSpec's trie and its signal per node, the calibrated probabilities with the best
 * size of the tree, and the calibration's counts after a verification. In Python these were a
 * loop per node each, about 0.25 ms of a step's ~0.8 ms of drafting on this project's CPU; a
 * step pays them right after a forward, on cold caches, every step.
 *
 * Arithmetic: the same operations in the same order as the Python path, in IEEE double, so the
 * results are the same bits and the trees the same (tests/test_tree_kernel.py compares them on
 * random trees and tables). Contracting a * b + c into one fused multiply-add would round once
 * instead of twice: it is off in this file (the library is built with -mfma). Python's min and
 * max are written out as Python has them (the first argument unless the second is strictly
 * smaller / larger), which differs from fmin / fmax on NaN.
 *
 * The calibration table (cost_aware.Calibrator): a row of TABLE_COLS doubles per bucket, its
 * trials and acceptances at each depth (1 .. DEPTH_BINS, deeper ones with the last),
 * then over all depths: tried[0 .. DEPTH_BINS - 1], accepted[DEPTH_BINS .. 2 DEPTH_BINS - 1],
 * tried over all depths at 2 DEPTH_BINS, accepted over all depths at 2 DEPTH_BINS + 1. */

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#define TREE_MAX 256 /* nodes a call takes (a proposal has at most 64); more: -2, the caller's Python path */
#define DEPTH_BINS 8 /* cost_aware.MAX_DEPTH_BIN: depths 8 and beyond share the last bin */
#define TABLE_COLS (2 * DEPTH_BINS + 2)

int specstore_tree_abi(void) { return 2; }

static inline double py_max(double a, double b) { return b > a ? b : a; }
static inline double py_min(double a, double b) { return b < a ? b : a; }

/* depth[i] (1 for a child of the root); -1 where a parent is not an earlier node */
static int depths_of(int64_t n, const int64_t *parents, int64_t *depth) {
    for (int64_t i = 0; i < n; i++) {
        int64_t p = parents[i];
        if (p < -1 || p >= i) return -1;
        depth[i] = p < 0 ? 1 : depth[p] + 1;
    }
    return 0;
}

static inline int64_t depth_bin(int64_t d) { return (d < DEPTH_BINS ? d : DEPTH_BINS) - 1; }

/* cost_aware.Calibrator.probabilities: p[i] for each node. -1: a bucket outside [0, cap). */
static int calibrated(int64_t n, const int64_t *parents, const int64_t *depth, const int64_t *buckets,
                      const double *priors, double default_prior, const double *table, int64_t cap, double w,
                      double explore, double *p) {
    double trials[TREE_MAX], total[TREE_MAX + 1];
    for (int64_t i = 0; i < n; i++) {
        int64_t b = buckets[i];
        if (b < 0 || b >= cap) return -1;
        double prior = priors ? py_min(py_max(priors[i], 0.0), 1.0) : default_prior;
        const double *row = table + b * TABLE_COLS;
        int64_t d = depth_bin(depth[i]);
        double pb = (row[2 * DEPTH_BINS + 1] + w * prior) / (row[2 * DEPTH_BINS] + w);
        double t = row[d];
        p[i] = (row[DEPTH_BINS + d] + w * pb) / (t + w);
        trials[i] = t;
    }
    for (int64_t i = 0; i <= n; i++) total[i] = 0.0;
    for (int64_t i = 0; i < n; i++) total[parents[i] + 1] += p[i]; /* siblings exclude each other */
    for (int64_t i = 0; i < n; i++) p[i] = p[i] / py_max(total[parents[i] + 1], 1.0);
    if (explore > 0)
        for (int64_t i = 0; i < n; i++) p[i] = py_min(p[i] + explore / sqrt(1.0 + trials[i]), 1.0);
    return 0;
}

/* cost_aware.best_size with the calibrated probabilities: the nodes best first into order[n]
 * (path probability descending, then depth, then index: parents before children), the best
 * number of them to keep returned (0: plain decoding), its rate relative to plain decoding in
 * *rate. depth: each node's (depths_of). p (n doubles): the calibrated probabilities. -1: a
 * bucket outside the table. */
static int64_t size_tree(int64_t n, const int64_t *parents, const int64_t *depth, const int64_t *buckets,
                         const double *priors, double default_prior, const double *table, int64_t cap, double w,
                         double explore, const double *prices, double extra, int64_t *order, double *rate, double *p) {
    double q[TREE_MAX];
    if (calibrated(n, parents, depth, buckets, priors, default_prior, table, cap, w, explore, p) != 0) return -1;
    for (int64_t i = 0; i < n; i++) q[i] = p[i] * (parents[i] < 0 ? 1.0 : q[parents[i]]);
    for (int64_t i = 0; i < n; i++) { /* insertion sort: a few dozen nodes */
        int64_t j = i;
        while (j > 0) {
            int64_t a = order[j - 1];
            if (q[a] > q[i] || (q[a] == q[i] && (depth[a] < depth[i] || (depth[a] == depth[i] && a < i)))) break;
            order[j] = a;
            j--;
        }
        order[j] = i;
    }
    int64_t best_k = 0;
    double best = 1.0 / (prices[0] + extra), kept = 0.0;
    for (int64_t k = 1; k <= n; k++) { /* the first maximum: the smaller tree on ties */
        kept += q[order[k - 1]];
        double r = (1.0 + kept) / (prices[k] + extra);
        if (r > best) {
            best_k = k;
            best = r;
        }
    }
    *rate = best;
    return best_k;
}

static void prices_of(int64_t n, const double *first, const double *last, const double *terms, double *prices);

/* size_tree for a tree given as parents, buckets and priors (NULL: default_prior for every
 * node); the prices of 0 .. n nodes from prices_of's rows (at least n + 1 long) and terms;
 * extra: the step's drafting in plain decoding steps (>= 0). p_out (or NULL): the calibrated
 * probabilities. -1: a bucket outside the table; -2: a tree this call does not take (too many
 * nodes, a parent after its child). */
int64_t specstore_tree_size(int64_t n, const int64_t *parents, const int64_t *buckets, const double *priors,
                            double default_prior, const double *table, int64_t cap, double w, double explore,
                            const double *first, const double *last, const double *terms, double extra,
                            int64_t *order, double *rate, double *p_out) {
    int64_t depth[TREE_MAX];
    double p[TREE_MAX], prices[TREE_MAX + 1];
    if (n < 0 || n > TREE_MAX || depths_of(n, parents, depth) != 0) return -2;
    prices_of(n, first, last, terms, prices);
    int64_t k = size_tree(n, parents, depth, buckets, priors, default_prior, table, cap, w, explore, prices, extra,
                          order, rate, p);
    if (k >= 0 && p_out)
        for (int64_t i = 0; i < n; i++) p_out[i] = p[i];
    return k;
}

/* cost_aware.Calibrator.update: every node whose parent was accepted (or is the root) is one
 * trial of its cell, an acceptance where it is among accepted[0 .. n_accepted). -1: a bucket
 * outside the table (nothing counted); -2: a tree this call does not take. */
int64_t specstore_calibrate(int64_t n, const int64_t *parents, const int64_t *buckets, const int64_t *accepted,
                            int64_t n_accepted, double *table, int64_t cap) {
    int64_t depth[TREE_MAX];
    unsigned char hit[TREE_MAX];
    if (n < 0 || n > TREE_MAX || depths_of(n, parents, depth) != 0) return -2;
    for (int64_t i = 0; i < n; i++)
        if (buckets[i] < 0 || buckets[i] >= cap) return -1;
    memset(hit, 0, sizeof hit);
    for (int64_t j = 0; j < n_accepted; j++)
        if (accepted[j] >= 0 && accepted[j] < n) hit[accepted[j]] = 1;
    for (int64_t i = 0; i < n; i++) {
        int64_t p = parents[i];
        if (p >= 0 && !hit[p]) continue;
        double *row = table + buckets[i] * TABLE_COLS, h = hit[i] ? 1.0 : 0.0;
        int64_t d = depth_bin(depth[i]);
        row[d] += 1.0;
        row[DEPTH_BINS + d] += h;
        row[2 * DEPTH_BINS] += 1.0;
        row[2 * DEPTH_BINS + 1] += h;
    }
    return 0;
}

static inline int64_t count_le_i(const int64_t *edges, int64_t m, int64_t x) { /* bisect_right */
    int64_t c = 0;
    while (c < m && edges[c] <= x) c++;
    return c;
}

static inline int64_t count_le_d(const double *edges, int64_t m, double x) {
    int64_t c = 0;
    while (c < m && edges[c] <= x) c++;
    return c;
}

/* ReSpec's trie (tree.DraftTree.from_paths) and cost-aware signal (respec.ReSpecDrafter.
 * _add_signals) in one call. Path k is tokens[offsets[k] .. offsets[k + 1]); it merges into the
 * trie in order, nodes added until max_nodes; out_nodes[offsets[k] + j] is the node of its j-th
 * token, -1 past where the cap cut it. Per path: its EMA score, source index and context match.
 * layout: [full, support cap, sources, head bins, the context's source index, the long-copy
 * match, match edges m, score edges s, head edges h, then the m match edges]; edges: [the s score
 * edges, then the h head edges]. head_probs (NULL: no head signal this step) [head_vocab] and
 * head_rows [n_rows] (a token's row, head_vocab for one outside the head's vocabulary).
 * Per node out: token, parent, bucket, prior. Returns the node count; -2 where max_nodes is past
 * TREE_MAX. */
static int64_t build_trie(int64_t npaths, const int64_t *tokens, const int64_t *offsets, int64_t max_nodes,
                              const double *scores, const int64_t *sources, const int64_t *matches,
                              const int64_t *layout, const double *edges, const float *head_probs,
                              const int64_t *head_rows, int64_t n_rows, int64_t head_vocab, int64_t *out_tokens,
                              int64_t *out_parents, int64_t *out_nodes, int64_t *out_bucket, double *out_prior) {
    const int64_t full = layout[0], support_cap = layout[1], n_sources = layout[2], head_bins = layout[3];
    const int64_t context = layout[4], copy = layout[5], nm = layout[6], ns = layout[7], nh = layout[8];
    const int64_t *match_edges = layout + 9;
    const double *score_edges = edges, *head_edges = edges + ns;
    double best[TREE_MAX];
    int64_t source[TREE_MAX], match[TREE_MAX], support[TREE_MAX], n = 0;
    for (int64_t k = 0; k < npaths; k++) {
        int64_t parent = -1, j = offsets[k];
        for (; j < offsets[k + 1]; j++) {
            int64_t tok = tokens[j], node = -1;
            for (int64_t c = parent + 1; c < n; c++) /* children come after their parent */
                if (out_parents[c] == parent && out_tokens[c] == tok) {
                    node = c;
                    break;
                }
            if (node < 0) {
                if (n >= max_nodes) break;
                node = n++;
                out_tokens[node] = tok;
                out_parents[node] = parent;
                best[node] = -1.0;
                source[node] = match[node] = support[node] = 0;
            }
            out_nodes[j] = node;
            parent = node;
        }
        for (; j < offsets[k + 1]; j++) out_nodes[j] = -1;
    }
    for (int64_t k = 0; k < npaths; k++) { /* the best-scored path through each node gives its source and match */
        double s = scores[k];
        for (int64_t j = offsets[k]; j < offsets[k + 1] && out_nodes[j] >= 0; j++) {
            int64_t node = out_nodes[j];
            support[node]++;
            if (s > best[node]) {
                best[node] = s;
                source[node] = sources[k];
                match[node] = matches[k];
            }
        }
    }
    for (int64_t i = 0; i < n; i++) {
        double b = py_max(best[i], 0.0);
        int64_t head = head_bins - 1;
        out_prior[i] = b / (b + 1.0);
        if (full && head_probs && out_parents[i] < 0) { /* a first draft token: the head's probability */
            int64_t tok = out_tokens[i], row = (tok >= 0 && tok < n_rows) ? head_rows[tok] : head_vocab;
            if (row < 0 || row >= head_vocab) {
                head = head_bins - 2;
            } else {
                double hp = (double)head_probs[row];
                head = count_le_d(head_edges, nh, hp);
                if (!(source[i] == context && match[i] >= copy)) out_prior[i] = hp;
            }
        }
        int64_t cell = 0;
        if (full) {
            int64_t s = support[i] > 1 ? support[i] : 1;
            cell = ((s < support_cap ? s : support_cap) - 1) * (nm + 1) + count_le_i(match_edges, nm, match[i]);
        }
        cell = (cell * n_sources + source[i]) * head_bins + head;
        out_bucket[i] = cell * (ns + 1) + count_le_d(score_edges, ns, b);
    }
    return n;
}

int64_t specstore_respec_trie(int64_t npaths, const int64_t *tokens, const int64_t *offsets, int64_t max_nodes,
                              const double *scores, const int64_t *sources, const int64_t *matches,
                              const int64_t *layout, const double *edges, const float *head_probs,
                              const int64_t *head_rows, int64_t n_rows, int64_t head_vocab, int64_t *out_tokens,
                              int64_t *out_parents, int64_t *out_nodes, int64_t *out_bucket, double *out_prior) {
    if (max_nodes < 0 || max_nodes > TREE_MAX) return -2;
    return build_trie(npaths, tokens, offsets, max_nodes, scores, sources, matches, layout, edges, head_probs, head_rows,
                      n_rows, head_vocab, out_tokens, out_parents, out_nodes, out_bucket, out_prior);
}

/* The nodes i < n where keep[i], parents kept with their children, re-indexed in order
 * (DraftTree.take): their token, parent, bucket, prior and (where depth is not NULL) depth go
 * to the out arrays, which may be the inputs themselves (a node moves only to a lower index);
 * index[i]: node i's new index, -1 where it is dropped. Returns how many are kept. */
static int64_t compact(int64_t n, const unsigned char *keep, const int64_t *tok, const int64_t *par,
                       const int64_t *bucket, const double *prior, const int64_t *depth, int64_t *index,
                       int64_t *tok_out, int64_t *par_out, int64_t *bucket_out, double *prior_out, int64_t *depth_out) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!keep[i]) {
            index[i] = -1;
            continue;
        }
        index[i] = m;
        tok_out[m] = tok[i];
        par_out[m] = par[i] < 0 ? -1 : index[par[i]];
        bucket_out[m] = bucket[i];
        prior_out[m] = prior[i];
        if (depth) depth_out[m] = depth[i];
        m++;
    }
    return m;
}

/* cost.CostModel.relative_upto(n, context) from its price_terms: prices[k] for k = 0 .. n, the
 * verification of k nodes in plain decoding steps. terms: [interpolate (0 or 1), the last row's
 * weight, plain decoding's seconds, tree_scale, tree_offset]; first and last: the table's rows. */
static void prices_of(int64_t n, const double *first, const double *last, const double *terms, double *prices) {
    const int interp = terms[0] != 0.0;
    const double w = terms[1], t0 = terms[2], scale = terms[3], offset = terms[4];
    for (int64_t k = 0; k <= n; k++) {
        double a = first[k], t = a;
        if (interp) {
            double b = last[k];
            t = py_max(a + w * (b - a), py_min(a, b) * 0.5);
        }
        prices[k] = 1.0 + scale * (t / t0 - 1.0) + (k > 0 ? offset : 0.0);
    }
}

/* ReSpec's proposal sized in one call: specstore_respec_trie's trie and signals, its nodes deeper
 * than max_depth dropped (tree.clip_depth), then specstore_tree_size's best subtree with
 * default prior 0.5, re-indexed in tree order (tree.DraftTree.take). Out: the kept nodes' token,
 * parent, bucket and prior; out_nodes as specstore_respec_trie's, in kept indices (-1 past a
 * path's kept part); *proposed: the nodes before sizing (after the depth clip). The prices:
 * prices_of's rows (at least max_nodes + 1 long) and terms. Returns the kept count; -1: a bucket outside the table (nothing written to it:
 * the caller grows it and calls again); -2: a call it does not take. */
int64_t specstore_respec_sized(int64_t npaths, const int64_t *tokens, const int64_t *offsets, int64_t max_nodes,
                               const double *scores, const int64_t *sources, const int64_t *matches,
                               const int64_t *layout, const double *edges, const float *head_probs,
                               const int64_t *head_rows, int64_t n_rows, int64_t head_vocab, int64_t max_depth,
                               const double *table, int64_t cap, double w, double explore, const double *first,
                               const double *last, const double *terms, double extra, int64_t *out_tokens,
                               int64_t *out_parents, int64_t *out_nodes, int64_t *out_bucket, double *out_prior,
                               int64_t *proposed) {
    int64_t tok[TREE_MAX], par[TREE_MAX], bucket[TREE_MAX], depth[TREE_MAX], order[TREE_MAX], index[TREE_MAX];
    double prior[TREE_MAX], p[TREE_MAX], prices[TREE_MAX + 1], rate;
    unsigned char keep[TREE_MAX];
    if (max_nodes < 0 || max_nodes > TREE_MAX) return -2;
    int64_t n = build_trie(npaths, tokens, offsets, max_nodes, scores, sources, matches, layout, edges, head_probs,
                           head_rows, n_rows, head_vocab, tok, par, out_nodes, bucket, prior);
    depths_of(n, par, depth);
    for (int64_t i = 0; i < n; i++) keep[i] = depth[i] <= max_depth; /* the depth clip, in place */
    int64_t m = compact(n, keep, tok, par, bucket, prior, depth, index, tok, par, bucket, prior, depth);
    *proposed = m;
    prices_of(m, first, last, terms, prices);
    int64_t k = size_tree(m, par, depth, bucket, prior, 0.5, table, cap, w, explore, prices, extra, order, &rate, p);
    if (k < 0) return k;
    memset(keep, 0, (size_t)m);
    for (int64_t j = 0; j < k; j++) keep[order[j]] = 1;
    int64_t at[TREE_MAX];
    int64_t kept = compact(m, keep, tok, par, bucket, prior, NULL, at, out_tokens, out_parents, out_bucket, out_prior, NULL);
    for (int64_t j = 0; j < offsets[npaths]; j++) {
        int64_t node = out_nodes[j];
        out_nodes[j] = node < 0 || index[node] < 0 ? -1 : at[index[node]];
    }
    return kept;
}
