"""The cost-aware pruner's per-node loops in one kernel call each (csrc/draft_tree.c, built into
the CPU kernel's library: gemm.library()).

A drafting step sizes a proposal of a few dozen nodes: ReSpec's trie and signals, the calibrated
probabilities, the best size, and after the verification the calibration's counts. As Python
loops these took about 0.25 ms of a step's ~0.8 ms of drafting here, right after each forward.
Each function below returns None where the kernel is not loaded or does not take the call; the
caller then runs its Python path, which gives the same bits (the C code does the same double
arithmetic in the same order, without fused multiply-adds: tests/test_tree_kernel.py).

The calibration table these read and count into is ``cost_aware.Calibrator.table``: float64
[buckets, TABLE_COLS], C-contiguous (the column layout: csrc/draft_tree.c).
"""

from __future__ import annotations

import ctypes

import numpy as np

from specstore.runtime import gemm

DEPTH_BINS = 8  # csrc/draft_tree.c; cost_aware.MAX_DEPTH_BIN (depths 8 and beyond share the last bin)
TABLE_COLS = 2 * DEPTH_BINS + 2
TREE_MAX = 256  # nodes a call takes (csrc/draft_tree.c)
OUT_OF_TABLE = -1  # a bucket past the table's rows: the caller grows it and calls again


def _lib():
    lib = gemm._lib or gemm.library()
    return lib if lib is not None and hasattr(lib, "specstore_tree_size") else None


def available() -> bool:
    return _lib() is not None


def _check_table(table: np.ndarray) -> bool:
    return table.dtype == np.float64 and table.ndim == 2 and table.shape[1] == TABLE_COLS and table.flags.c_contiguous


def tree_size(ws: Workspace, parents: np.ndarray, buckets: np.ndarray, priors: np.ndarray | None, default_prior: float,
              table: np.ndarray, weight: float, explore: float, price_terms: tuple, extra: float,
              want_p: bool = False):
    """Calibrated probabilities and the best size of a tree in one call through ``ws``
    (cost_aware: the Calibrator's probabilities, then best_size): ``(order, k, rate, p)`` with
    ``order`` the nodes best first (int64), ``k`` how many of them to keep, ``rate`` the expected
    tokens per plain step's time, ``p`` the probabilities (None unless ``want_p``);
    ``OUT_OF_TABLE`` where a bucket has no row; None where the kernel does not take it.
    ``price_terms``: what the prices of 0 .. n nodes' verification in plain steps are computed
    from (cost.CostModel.price_terms for at least n nodes); ``extra``: the step's drafting in
    the same unit, >= 0."""
    lib = _lib()
    n = len(parents)
    first, last, *terms = price_terms
    if (lib is None or n > TREE_MAX or len(first) < n + 1 or len(last) < n + 1 or not _check_table(table)
            or first.dtype != np.float64 or last.dtype != np.float64):
        return None
    # ints: parents, buckets | out: order; floats: priors, the price terms | out: the rate, p
    ws = ws.fit(3 * n, 2 * n + 6)
    ints, floats = ws.i, ws.f
    ints[:n] = parents
    ints[n:2 * n] = buckets
    if priors is not None:
        floats[:n] = priors
    floats[n:n + 5] = terms
    k = lib.specstore_tree_size(n, ws.ia, ws.ia + 8 * n, None if priors is None else ws.fa, float(default_prior),
                                table.ctypes.data, table.shape[0], float(weight), float(explore), first.ctypes.data,
                                last.ctypes.data, ws.fa + 8 * n, float(extra), ws.ia + 16 * n, ws.fa + 8 * (n + 5),
                                ws.fa + 8 * (n + 6) if want_p else None)
    if k == -1:
        return OUT_OF_TABLE
    if k < 0:
        return None
    return (ints[2 * n:3 * n].copy(), int(k), float(floats[n + 5]),
            floats[n + 6:2 * n + 6].copy() if want_p else None)


class Workspace:
    """Buffers a caller reuses for its kernel calls every step, their addresses taken once: a
    step's inputs go in with one slice assignment per kind and its outputs come out of the same
    buffers (numpy's ``.ctypes.data`` and array creations cost about a microsecond each warm,
    several right after a forward, and a call would need a dozen). Not shared between threads."""

    def __init__(self, ints: int = 1024, floats: int = 256):
        self._ints, self._floats = (ctypes.c_int64 * ints)(), (ctypes.c_double * floats)()
        self.i, self.f = np.frombuffer(self._ints, dtype=np.int64), np.frombuffer(self._floats, dtype=np.float64)
        self.ia, self.fa = ctypes.addressof(self._ints), ctypes.addressof(self._floats)

    def __reduce__(self):  # a copy (or a pickle) gets buffers of its own, not the addresses of these
        return Workspace, (len(self.i), len(self.f))

    def fit(self, ints: int, floats: int) -> Workspace:
        """This workspace, or a larger one where it is too small."""
        if ints <= len(self.i) and floats <= len(self.f):
            return self
        return Workspace(max(ints, 2 * len(self.i)), max(floats, 2 * len(self.f)))


def calibrate(ws: Workspace, parents: np.ndarray, buckets: np.ndarray, accepted: list[int], table: np.ndarray):
    """Count a verified tree's trials into ``table`` (cost_aware.Calibrator.update) through
    ``ws``: True when counted, ``OUT_OF_TABLE`` where a bucket has no row (nothing counted), None
    where the kernel does not take it (nothing counted)."""
    lib = _lib()
    n, a = len(parents), len(accepted)
    if lib is None or n > TREE_MAX or 2 * n + a > len(ws.i) or not _check_table(table):
        return None
    ws.i[:n] = parents
    ws.i[n:2 * n] = buckets
    ws.i[2 * n:2 * n + a] = accepted
    done = lib.specstore_calibrate(n, ws.ia, ws.ia + 8 * n, ws.ia + 16 * n, a, table.ctypes.data, table.shape[0])
    if done == -1:
        return OUT_OF_TABLE
    return True if done == 0 else None


class TrieLayout:
    """ReSpec's signal layout for ``respec_trie`` (respec.py's bins), packed once."""

    def __init__(self, full: bool, support_cap: int, sources: int, head_bins: int, context_source: int, copy: int,
                 match_edges, score_edges, head_edges):
        self.ints = np.array([int(full), support_cap, sources, head_bins, context_source, copy, len(match_edges),
                              len(score_edges), len(head_edges), *match_edges], dtype=np.int64)
        self.floats = np.array([*score_edges, *head_edges], dtype=np.float64)
        self.ints_at, self.floats_at = self.ints.ctypes.data, self.floats.ctypes.data

    def __deepcopy__(self, memo):  # constants: a copy is this one (its addresses stay its arrays')
        return self


def respec_trie(paths: list[list[int]], max_nodes: int, scores: list[float], sources: list[int], matches: list[int],
                layout: TrieLayout, head_probs: np.ndarray | None = None, head_rows: np.ndarray | None = None):
    """ReSpec's trie of ``paths`` (DraftTree.from_paths with ``max_nodes``) and each node's
    cost-aware bucket and prior (ReSpecDrafter._add_signals) in one call: ``(tokens, parents,
    nodes of each path, buckets, priors)``, numpy int64 / float64 and Python lists; None where the
    kernel does not take it. ``head_probs`` (float32 [V'], the head's distribution this step) with
    ``head_rows`` (int64, a token's row in it, V' outside it), or None: no head signal."""
    lib = _lib()
    if lib is None or not 0 <= max_nodes <= TREE_MAX:
        return None
    if head_probs is not None and (head_probs.dtype != np.float32 or not head_probs.flags.c_contiguous
                                   or head_rows is None or head_rows.dtype != np.int64 or not head_rows.flags.c_contiguous):
        return None
    lengths = [len(path) for path in paths]
    offsets = np.zeros(len(paths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = [int(t) for path in paths for t in path]
    tokens = np.array(flat, dtype=np.int64) if flat else np.zeros(0, dtype=np.int64)
    score = np.array(scores, dtype=np.float64)
    source = np.array(sources, dtype=np.int64)
    match = np.array(matches, dtype=np.int64)
    out_tokens, out_parents = np.empty(max_nodes, dtype=np.int64), np.empty(max_nodes, dtype=np.int64)
    out_nodes = np.empty(max(len(flat), 1), dtype=np.int64)
    out_bucket, out_prior = np.empty(max_nodes, dtype=np.int64), np.empty(max_nodes, dtype=np.float64)
    n = lib.specstore_respec_trie(len(paths), tokens.ctypes.data, offsets.ctypes.data, max_nodes, score.ctypes.data,
                                  source.ctypes.data, match.ctypes.data, layout.ints_at, layout.floats_at,
                                  None if head_probs is None else head_probs.ctypes.data,
                                  None if head_probs is None else head_rows.ctypes.data,
                                  0 if head_probs is None else len(head_rows), 0 if head_probs is None else len(head_probs),
                                  out_tokens.ctypes.data, out_parents.ctypes.data, out_nodes.ctypes.data,
                                  out_bucket.ctypes.data, out_prior.ctypes.data)
    if n < 0:
        return None
    nodes = out_nodes.tolist()
    path_nodes = []
    for start, length in zip(offsets.tolist(), lengths, strict=False):
        seg = nodes[start:start + length]
        cut = seg.index(-1) if -1 in seg else length
        path_nodes.append(seg[:cut])
    return out_tokens[:n], out_parents[:n], path_nodes, out_bucket[:n], out_prior[:n]


def respec_sized(ws: Workspace, paths: list[list[int]], max_nodes: int, scores: list[float], sources: list[int],
                 matches: list[int], layout: TrieLayout, head_probs: np.ndarray | None, head_rows: np.ndarray | None,
                 max_depth: int, table: np.ndarray, weight: float, explore: float, price_terms: tuple,
                 extra: float):
    """ReSpec's proposal sized in one call through ``ws`` (csrc/draft_tree.c:
    specstore_respec_sized): ``respec_trie``'s tree, clipped to ``max_depth``, then the subtree
    cost_aware's pruner keeps with the calibration ``table`` and the prices of
    ``price_terms`` (cost.CostModel.price_terms for max_nodes nodes). Returns ``(tokens, parents, nodes of each path, buckets, priors, nodes
    proposed, the workspace to keep)``: the kept tree's, and ``ws`` or a larger one; ``OUT_OF_TABLE`` where a bucket has no row; None where the
    kernel does not take it."""
    lib = _lib()
    if lib is None or not 0 <= max_nodes <= TREE_MAX or not _check_table(table):
        return None
    if head_probs is not None and (head_probs.dtype != np.float32 or not head_probs.flags.c_contiguous
                                   or head_rows is None or head_rows.dtype != np.int64 or not head_rows.flags.c_contiguous):
        return None
    npaths = len(paths)
    offsets, flat = [0], []
    for path in paths:
        flat += path
        offsets.append(len(flat))
    total = len(flat)
    # ints: offsets, tokens, sources, matches | out: tokens, parents, nodes, buckets, proposed
    o_out = npaths + 1 + total + 2 * npaths
    o_par, o_nodes = o_out + max_nodes, o_out + 2 * max_nodes
    o_bucket = o_nodes + total
    o_proposed = o_bucket + max_nodes
    # floats: scores, the price terms | out: priors
    o_prior = npaths + 5
    ws = ws.fit(o_proposed + 1, o_prior + max_nodes)
    ints, ia, fa = ws.i, ws.ia, ws.fa
    ints[:o_out] = offsets + flat + sources + matches
    first, last, *terms = price_terms
    if len(first) < max_nodes + 1 or len(last) < max_nodes + 1:
        return None
    ws.f[:o_prior] = scores + terms
    at = npaths + 1 + total
    k = lib.specstore_respec_sized(
        npaths, ia + 8 * (npaths + 1), ia, max_nodes, fa, ia + 8 * at, ia + 8 * (at + npaths), layout.ints_at,
        layout.floats_at, None if head_probs is None else head_probs.ctypes.data,
        None if head_probs is None else head_rows.ctypes.data, 0 if head_probs is None else len(head_rows),
        0 if head_probs is None else len(head_probs), max_depth, table.ctypes.data, table.shape[0], float(weight),
        float(explore), first.ctypes.data, last.ctypes.data, fa + 8 * npaths, float(extra), ia + 8 * o_out, ia + 8 * o_par, ia + 8 * o_nodes, ia + 8 * o_bucket,
        fa + 8 * o_prior, ia + 8 * o_proposed)
    if k == -1:
        return OUT_OF_TABLE
    if k < 0:
        return None
    nodes = ints[o_nodes:o_nodes + total].tolist()
    path_nodes = []
    for start, end in zip(offsets, offsets[1:], strict=False):
        seg = nodes[start:end]
        path_nodes.append(seg[: seg.index(-1)] if -1 in seg else seg)
    return (ints[o_out:o_out + k].copy(), ints[o_par:o_par + k].copy(), path_nodes, ints[o_bucket:o_bucket + k].copy(),
            ws.f[o_prior:o_prior + k].copy(), int(ints[o_proposed]), ws)
