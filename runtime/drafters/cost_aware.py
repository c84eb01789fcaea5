"""Cost-aware tree sizing: keep the part of a drafter's tree that maximises expected committed
tokens per second, the empty tree (plain decoding) included.

Owns three pieces, applied in one place (``CostAwareDrafter``, wrapped around a drafter by the
registry when a cost model is given):

1. Signals. A drafter records per node a small integer ``node_data["bucket"]`` (its raw
   acceptance signal, quantised: pld the match length; rest the share of occurrences that agree
   and their number; dresd the share of neighbours through the node and the best one's rank;
   respec the candidate's source and EMA score) and may record ``node_data["prior"]``, its own
   guess of the node's acceptance probability (default 0.5).
2. Calibration (``Calibrator``). Per method, the probability that a node is accepted given its
   parent was, for (bucket, depth): accepted / tried counts learned online from each
   VerifyResult, shrunk towards the bucket's rate over all depths, which is shrunk towards the
   node's prior (``weight`` pseudo-trials each), so it starts sensible. Siblings exclude each
   other (one next token), so their probabilities are scaled to sum to at most 1. Then an
   exploration bonus ``explore / sqrt(1 + trials of the cell)`` is added (at most 1): a cell
   whose first trials failed would otherwise fall to ~0, be pruned every step and never be tried
   again (respec's context source starved so on a chat set, BENCHMARKS.md); the bonus fades as
   the cell gathers trials.
3. Pruning (``prune``). A node's path probability is the product along its path; nodes sorted
   by it (parents first on ties) give, for each size k, the subtree of k nodes with the largest
   expected number of accepted tokens. The size maximising
   ``(1 + sum of the kept path probabilities) / (seconds(k nodes, context) + drafting)`` wins;
   k = 0 is plain decoding (drafting: the step's own drafting time, spent whatever k is). Only
   nodes are removed, so a lossless drafter stays lossless.
4. Padding. Where the cost table says a forward of a few more rows is cheaper (float32 matmuls
   of 2-3 rows on some CPUs), ``tree.meta["verify_as"]`` asks the verifier to verify the kept
   tree as that many nodes (masked rows that nothing attends to; cost.CostModel.padded_nodes);
   the prices above are those of the padded forward already.

5. No gate. Until the thirty-fourth session a gate (``DraftGate``) stopped drafting for 8-64
   steps where, over its last steps, drafting had committed fewer tokens per second than plain
   decoding: pruning takes plain decoding when a tree does not pay, but the step's drafting is
   spent by then. It saved at most that drafting time (0.3-1 ms of a 35-40 ms float32 step
   here) and skipped the copies and matches that came while it was closed; a fresh one (each
   request of an Engine, each prompt in a one-shot run) closed early in a response, before
   anything had matched. Replayed on the tune splits, every method it applied to (pld, rest,
   dresd) did as well or better without it, from a fresh drafter per prompt and across prompts
   alike, and with drafting priced at twice its measured time (BENCHMARKS.md, thirty-fourth
   session).

6. The kernel. Steps 2 and 3 are a loop per node each; where the CPU kernel is loaded they run
   in one C call (tree_kernel.py, csrc/draft_tree.c: the same arithmetic in the same order, so
   the same trees), and a drafter with ``propose_sized`` (ReSpec) builds, signals and sizes its
   proposal in the same call (``Sizing``). The calibration's counts live in a table the kernel
   reads and counts into (``Calibrator.table``). About 0.1-0.2 ms a step less drafting for
   ReSpec here (BENCHMARKS.md, twenty-eighth session).

The calibration lives as long as the wrapper (across prompts, like the bench's drafters; an
Engine keeps one per method across requests and processes: calibration_cache.py); ``reset``
does not clear it.
"""

from __future__ import annotations

import math
import time

import numpy as np

from specstore.runtime import tree_kernel
from specstore.runtime.cost import CostModel
from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.tree import DraftTree, clip_depth
from specstore.runtime.verify import VerifyResult

MAX_DEPTH_BIN = 8  # depths 8 and beyond share one calibration cell
DEFAULT_PRIOR = 0.5
DRAFT_MEMORY = 50.0  # steps over which CostAwareDrafter averages its drafting time
EXPLORE = 0.1  # the exploration bonus at a cell's first trial (module doc, 2; chosen in BENCHMARKS.md)


def bucketize(values, edges) -> np.ndarray:
    """Index of the bin of each value: 0 below ``edges[0]``, ``len(edges)`` at or above the last."""
    return np.searchsorted(np.asarray(edges, dtype=float), np.asarray(values, dtype=float), side="right").astype(np.int64)


class Calibrator:
    """P(node accepted | parent accepted) per (bucket, depth), from counts with a prior.

    The counts live in ``table`` (float64 [buckets, tree_kernel.TABLE_COLS], grown as buckets
    appear; csrc/draft_tree.c has the columns), so that the kernel reads and counts into it in
    one call a step (tree_kernel.py); the Python path here gives the same bits where it is not
    loaded. Buckets are small non-negative integers (at most ``MAX_BUCKETS``)."""

    MAX_BUCKETS = 1 << 16

    def __init__(self, weight: float = 4.0, explore: float = EXPLORE):
        self.weight, self.explore = weight, explore
        self.table = np.zeros((64, tree_kernel.TABLE_COLS), dtype=np.float64)
        # the kernel's buffers, room for its largest tree (a copy of this calibrator gets its own)
        self.workspace = tree_kernel.Workspace(3 * tree_kernel.TREE_MAX, 2 * tree_kernel.TREE_MAX + 6)

    def grow(self, bucket: int) -> None:
        """Room in ``table`` for ``bucket`` (a clear error for one no drafter makes)."""
        bucket = int(bucket)
        if not 0 <= bucket < self.MAX_BUCKETS:
            raise ValueError(f"calibration bucket {bucket} is outside [0, {self.MAX_BUCKETS})")
        rows = size = len(self.table)
        if bucket >= rows:
            while size <= bucket:  # doubling: the size depends on the largest bucket only, not the order seen
                size *= 2
            table = np.zeros((size, tree_kernel.TABLE_COLS), dtype=np.float64)
            table[:rows] = self.table
            self.table = table

    def cell(self, bucket: int, depth: int) -> tuple[float, float]:
        """(trials, acceptances) of one cell; depths past MAX_DEPTH_BIN share the last."""
        if not 0 <= bucket < len(self.table):
            return 0.0, 0.0
        d = min(depth, MAX_DEPTH_BIN) - 1
        return self.table.item(bucket, d), self.table.item(bucket, _ACCEPTED + d)

    def totals(self, bucket: int | None = None) -> tuple[float, float]:
        """(trials, acceptances) of ``bucket`` over all depths; None: of every bucket."""
        if bucket is None:
            return float(self.table[:, _TRIED_ALL].sum()), float(self.table[:, _ACCEPTED_ALL].sum())
        if not 0 <= bucket < len(self.table):
            return 0.0, 0.0
        return self.table.item(bucket, _TRIED_ALL), self.table.item(bucket, _ACCEPTED_ALL)

    def add(self, bucket: int, depth: int, tried: float, accepted: float) -> None:
        """Count ``tried`` trials with ``accepted`` acceptances into one cell and its bucket."""
        self.grow(bucket)
        d = min(depth, MAX_DEPTH_BIN) - 1
        row = self.table[bucket]
        row[d] += tried
        row[_ACCEPTED + d] += accepted
        row[_TRIED_ALL] += tried
        row[_ACCEPTED_ALL] += accepted

    def probabilities(self, tree: DraftTree) -> np.ndarray:
        """Calibrated conditional acceptance probability of each node of ``tree``. In Python
        floats, node by node: a proposal has a few dozen nodes, and each numpy call right after
        a forward (cold caches) cost more than this whole loop (the arithmetic is numpy's, in the
        same order: the same bits). The kernel's ``size`` does the same in C."""
        n = len(tree)
        if n == 0:
            return np.zeros(0)
        buckets = _buckets(tree).tolist()
        priors = tree.node_data.get("prior")
        priors = [DEFAULT_PRIOR] * n if priors is None else [min(max(float(x), 0.0), 1.0) for x in np.asarray(priors, dtype=float).tolist()]
        depths = tree.depth_list()
        w = self.weight
        p, trials = [], []
        for b, d, prior in zip(buckets, depths, priors, strict=True):
            tried_b, acc_b = self.totals(b)
            tried, acc = self.cell(b, d)
            pb = (acc_b + w * prior) / (tried_b + w)
            p.append((acc + w * pb) / (tried + w))
            trials.append(tried)
        # siblings are exclusive: their probabilities may sum to 1 at most
        parents = tree.parents.tolist()
        total = [0.0] * (n + 1)  # by parent + 1 (0: children of the root), summed in node order
        for i, parent in enumerate(parents):
            total[parent + 1] += p[i]
        p = [x / max(total[parent + 1], 1.0) for x, parent in zip(p, parents, strict=True)]
        if self.explore > 0:
            p = [min(x + self.explore / math.sqrt(1.0 + t), 1.0) for x, t in zip(p, trials, strict=True)]
        return np.array(p)

    def size(self, tree: DraftTree, price_terms: tuple, extra: float):
        """``best_size`` with these probabilities in one kernel call: (order, k, rate), or None
        where the kernel does not take the tree (the caller's Python path). ``price_terms``: the
        cost model's (cost.CostModel.price_terms, for at least the tree's node count)."""
        priors = tree.node_data.get("prior")
        for _ in range(2):
            done = tree_kernel.tree_size(self.workspace, tree.parents, _buckets(tree), priors, DEFAULT_PRIOR, self.table,
                                         self.weight, self.explore, price_terms, extra)
            if done is not tree_kernel.OUT_OF_TABLE:
                return None if done is None else done[:3]
            self.grow(int(_buckets(tree).max()))
        return None

    def update(self, tree: DraftTree, result: VerifyResult) -> None:
        """Count every node whose parent was accepted (or is the root) as one trial."""
        if len(tree) == 0:
            return
        buckets = _buckets(tree)
        for _ in range(2):
            done = tree_kernel.calibrate(self.workspace, tree.parents, buckets, result.accepted_nodes, self.table)
            if done is True:
                return
            if done is None:
                break
            self.grow(int(buckets.max()))
        depths = tree.depth_list()  # Python ints and lists: a few dozen nodes (probabilities' doc)
        accepted = set(result.accepted_nodes)
        for i, (b, parent) in enumerate(zip(buckets.tolist(), tree.parents.tolist(), strict=True)):
            if parent >= 0 and parent not in accepted:
                continue
            self.add(b, depths[i], 1.0, float(i in accepted))

    def rate(self, bucket: int, depth: int) -> float | None:
        """The observed acceptance rate of one cell (None before any trial)."""
        t, a = self.cell(bucket, depth)
        return a / t if t else None


_ACCEPTED = tree_kernel.DEPTH_BINS  # the table's columns (csrc/draft_tree.c)
_TRIED_ALL = 2 * tree_kernel.DEPTH_BINS
_ACCEPTED_ALL = _TRIED_ALL + 1
assert MAX_DEPTH_BIN == tree_kernel.DEPTH_BINS


def _buckets(tree: DraftTree) -> np.ndarray:
    b = tree.node_data.get("bucket")
    return np.zeros(len(tree), dtype=np.int64) if b is None else np.asarray(b, dtype=np.int64)


def path_probabilities(tree: DraftTree, p: np.ndarray) -> np.ndarray:
    """Product of ``p`` along each node's path (parents come before children)."""
    return np.array(_path_list(tree, p), dtype=float)


def _path_list(tree: DraftTree, p) -> list[float]:
    """``path_probabilities`` as Python floats (the same products: a node's own probability
    times its parent's path), without numpy's per-element cost on a proposal's few dozen nodes."""
    p = p.tolist() if isinstance(p, np.ndarray) else list(p)
    q: list[float] = []
    for i, parent in enumerate(tree.parents.tolist()):
        q.append(p[i] * (1.0 if parent < 0 else q[parent]))
    return q


def best_size(tree: DraftTree, p: np.ndarray, cost: CostModel, context: int | None = None,
              overhead: float = 0.0) -> tuple[np.ndarray, int, float]:
    """(nodes in best-first order, the best number of them to keep, its expected tokens/s
    relative to plain decoding). ``overhead``: what a step spends besides its verification
    (drafting), in plain decoding steps; it is paid whatever the size, so it lowers the price of
    a node relative to the whole step."""
    n = len(tree)
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0, 1.0
    q = _path_list(tree, p)
    depths = tree.depth_list()
    order = sorted(range(n), key=lambda i: (-q[i], depths[i], i))  # parents first on ties: prefix-closed
    prices = cost.relative_upto(n, context)
    extra = max(float(overhead), 0.0)
    best_k, best_rate, kept = 0, 1.0 / (prices[0] + extra), 0.0
    for k in range(1, n + 1):  # the first maximum: the smaller tree on ties
        kept += q[order[k - 1]]  # expected accepted tokens of the best k (numpy's cumsum order)
        rate = (1.0 + kept) / (prices[k] + extra)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return np.asarray(order, dtype=np.int64), best_k, best_rate


def prune(tree: DraftTree, p: np.ndarray, cost: CostModel, context: int | None = None,
          overhead: float = 0.0) -> DraftTree:
    """The subtree of ``tree`` maximising expected committed tokens per second (module doc, 3)."""
    order, k, _ = best_size(tree, p, cost, context, overhead)
    if k == len(tree):
        return tree
    return tree.take(order[:k].tolist())


def calibrated_prune(tree: DraftTree, calibrator: Calibrator, cost: CostModel, context: int | None = None,
                     overhead: float = 0.0) -> DraftTree:
    """``prune(tree, calibrator.probabilities(tree), ...)``: the same tree, in one kernel call
    where the kernel is loaded (tree_kernel.py), else in Python."""
    n = len(tree)
    if n == 0:
        return tree
    found = calibrator.size(tree, cost.price_terms(n, context), max(float(overhead), 0.0))
    if found is None:
        return prune(tree, calibrator.probabilities(tree), cost, context, overhead)
    order, k, _ = found
    return tree if k == n else tree.take(order[:k].tolist())


class Sizing:
    """What a drafter needs to size its own proposal in the same kernel call that builds it
    (``propose_sized``, ReSpec's): the calibration, the prices at this step's context, the
    step's drafting in plain steps, and the depth budget. ``price_terms(n)``: what the prices of
    trees of up to n nodes at this context are computed from (cost.CostModel.price_terms)."""

    __slots__ = ("calibrator", "cost", "context", "extra", "max_depth")

    def __init__(self, calibrator: Calibrator, cost: CostModel, context: int, extra: float, max_depth: int):
        self.calibrator, self.cost, self.context = calibrator, cost, context
        self.extra, self.max_depth = max(float(extra), 0.0), max_depth

    def price_terms(self, n: int) -> tuple:
        return self.cost.price_terms(n, self.context)


class CostAwareDrafter:
    """Wraps a drafter: its trees are pruned by ``prune`` with calibrated probabilities; its
    feedback also updates the calibration. Everything else is the inner drafter's.

    The step's own drafting (the inner drafter's propose and observe, and this wrapper's work),
    timed every step and averaged over ``DRAFT_MEMORY`` steps, is priced into the rule as the
    ``overhead`` of ``prune``: it is spent whatever the tree's size (``clock``: a fake timer for
    tests; ``count_drafting=False`` leaves it out; ``fix_drafting``: a fixed figure instead)."""

    def __init__(self, inner, cost: CostModel, calibrator: Calibrator | None = None, *,
                 count_drafting: bool = True, clock=time.perf_counter):
        self.inner, self.cost = inner, cost
        self.calibrator = calibrator or Calibrator()
        self.name, self.lossless = inner.name, getattr(inner, "lossless", True)
        self.num_kept = self.num_proposed = 0
        self.context = 0  # the context the last tree was pruned at
        self.count_drafting, self.clock = count_drafting, clock
        self.fixed_drafting_s: float | None = None  # fix_drafting
        self.draft_s: float | None = None  # drafting seconds a step, averaged (None before a step)
        self._observe_s = 0.0  # the last observe's seconds (counted with the next step's propose)

    @property
    def acceptance(self):
        return getattr(self.inner, "acceptance", None)

    def __getattr__(self, name):  # the inner drafter's own attributes (stats, config, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self, prompt_ids: list[int]) -> None:
        self.inner.reset(prompt_ids)

    def fix_drafting(self, seconds: float) -> None:
        """Price every step's drafting at ``seconds`` from now on, whatever it takes (the simulator's ``--drafting-ms``: a replay's trees then do not
        depend on how long its drafting happened to take)."""
        self.fixed_drafting_s = self.draft_s = float(seconds)

    def overhead(self, context: int | None) -> float:
        """The averaged drafting seconds of a step in plain decoding steps at ``context``."""
        if not self.count_drafting or self.draft_s is None:
            return 0.0
        plain = float(self.cost.seconds_for(0, context))
        return self.draft_s / plain if plain > 0 else 0.0

    def propose(self, state: DecodeState) -> DraftTree:
        start = self.clock()
        self.context = len(state.tokens)
        sized = getattr(self.inner, "propose_sized", None)
        proposed = None
        if sized is not None:  # the drafter sizes its tree in the call that builds it where it can
            tree, proposed = sized(state, Sizing(self.calibrator, self.cost, self.context, self.overhead(self.context),
                                                 max(state.budget, 0)))
        else:
            tree = self.inner.propose(state)
        if proposed is None:
            tree = clip_depth(tree, max(state.budget, 0))
            proposed = len(tree)
            if len(tree):
                tree = calibrated_prune(tree, self.calibrator, self.cost, self.context, self.overhead(self.context))
        self.num_proposed += proposed
        self.num_kept += len(tree)
        padded = self.cost.padded_nodes(len(tree))
        if padded > len(tree):  # the verifier adds masked rows: a forward this size is cheaper here
            tree.meta["verify_as"] = padded
        spent = self.clock() - start + self._observe_s
        if self.fixed_drafting_s is not None:
            spent = self.fixed_drafting_s
        if np.isfinite(spent) and spent >= 0:
            self.draft_s = spent if self.draft_s is None else self.draft_s + (spent - self.draft_s) / DRAFT_MEMORY
        return tree

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        start = self.clock()
        self.calibrator.update(tree, result)
        if state.verify_s is not None:  # the cost model follows the machine
            self.cost.observe(len(tree), self.context, state.verify_s)
        self.inner.observe(state, tree, result)
        self._observe_s = self.clock() - start
