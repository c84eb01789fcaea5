"""Verification cost model: seconds per target forward over a draft tree of ``n`` nodes at a
context of ``c`` cached tokens, for one loaded model, device, dtype and torch build.

Owns measuring it (timed verification steps through the TreeVerifier, the forward and
everything around it: warm-up first, then interleaved rounds over node counts 0 (plain
decoding, timed ``PLAIN_REPEATS`` times a round: every tree is priced against it), 1, 2, 3, ...
64 at two context lengths; each tree's seconds as a ratio to its round's plain steps, more
rounds while a price is uncertain: ``measure``), the fit (per context, plain decoding as measured and, through
the tree sizes, the closest non-decreasing sequence to their medians (``_monotone``), linear
between them; linear between contexts), the per-request prefill (a fresh verifier and the prompt's forward, timed at
``PREFILL_LENGTHS`` prompt tokens, a line in them: what every method pays once per prompt, which
the bench's wall times hold and the simulator's speed prediction must too), and the JSON cache under
``cache_dir()/cost``, keyed by the model's hash, the device, the dtype, torch's version and
(on the CPU) its thread count. A corrupt or mismatched cache file is measured again;
``refresh=True`` (the CLI's ``--refresh-cost``) always measures. Device-agnostic: on CUDA each
timed forward is synchronised, and the same fit tells that wide trees are cheap there.

Used by the cost-aware pruner (drafters/cost_aware.py) and the simulator's speed prediction.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from specstore.runtime.device import cpu_model, dtype_name
from specstore.runtime.kernel_forward import enabled as kernel_forward_enabled
from specstore.runtime.linear import backend as linear_backend
from specstore.runtime.models import cache_dir
from specstore.runtime.sampling import Sampling, pick
from specstore.runtime.tree import DraftTree

# dense where drafters' trees live: a CPU's product kernel steps up in cost where its rows fill
# another register block (6 rows, 12, ...: csrc/small_gemm.c), which 1, 2, 4, 8 missed
NODE_COUNTS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
CONTEXTS = (128, 1024)
REPEATS = 7  # rounds at least (measure)
MAX_REPEATS = 25  # rounds at most, while some tree size's price is uncertain by more than TOLERANCE
TOLERANCE = 0.03  # relative half-width of the 95% interval of a tree size's price (in plain steps)
PREFILL_LENGTHS = (64, 512)  # prompt tokens the prefill is timed at (a line through them prices any prompt)
PREFILL_REPEATS = 5
PLAIN_REPEATS = 3  # plain decoding's cell is timed this many times per round (its median prices every tree)
ONLINE_PRIOR = 20.0  # observe: the measured table counts as this many steps
ONLINE_MEMORY = 200.0  # observe: steps of memory (older ones fade by 1 - 1/this per step)
# observe: a step counts as at most this many times (and at least 1/this of) what the corrected
# model predicts for it: one preempted step (a compile beside the bench made one take 135 ms a
# step where 38 was usual, BENCHMARKS.md, thirty-third session) would otherwise move the level by
# its excess over ONLINE_MEMORY (a 100x step: +50%) and the tree line with it; a lasting change of
# speed is still followed, by up to this factor a step's worth
ONLINE_CLIP = 2.0
# of the cache file's layout and how its table is measured (2: whole verification steps, not forwards
# alone; 3: the prefill line; 4: tree prices as ratios to their round's plain steps, more rounds while uncertain)
VERSION = 4
# what the verifier's steps cost depends on how it runs them: a new revision re-measures cached
# tables (2: tree attention without copying the cache, attention.py; 3: bf16/fp16 1-token steps
# packed on the CPU too; 4: CPU linears on weights packed once, linear.py; 5: bf16/fp16 CPU
# attention over long caches through matmuls, attention.py; 6: products of up to 3 rows through
# F.linear where it measured faster, linear.py; 7: float32 and emulated-bf16 products of up to
# gemm.MAX_ROWS rows through specstore's own kernel, gemm.py; 8: that kernel in 32-row turns
# over a panel, 10-20% faster at 7-17 rows, csrc/small_gemm.c; 9: NODE_COUNTS dense to 12, the
# curve through them in place of a hinge; 10: the cache grows in place, kv_cache.py; 11: bf16 products
# through the kernel's AVX-512 BF16 dot products, gemm.py, and SDPA over longer caches, attention.py;
# 12: the kernel's attention skips zero masks, finds maxima in vectors and sums values by bf16 dot
# products, csrc/small_gemm.c; bf16 RMS norms and MLP middles in the kernel, fused.py; 13: greedy
# acceptance's bf16 argmax in the kernel, sampling.py, and the timing rule's argmax through it;
# 14: bf16 rotary embedding in the kernel, fused.py; 15: float32 attention in the kernel, csrc/small_gemm.c;
# 16: its keys scored a row at a time and its values summed in blocks, 14-32% faster a layer;
# 17: float32 steps of Llama-style models through the kernel's layer stack in one call, kernel_forward.py;
# 18: float32 prefills through it too, in calls of up to gemm.MAX_ROWS tokens: the table's prefill times;
# 19: the float32 SiLU gate in the gate/up product's threads, on its outputs in L1, csrc/small_gemm.c)
VERIFIER_REVISION = 19
# a tree is verified as a larger one (padded with masked rows, CostModel.padded_nodes) only where
# the table says the larger forward is at least this much cheaper: kernels that are slow at a
# few rows (float32 matmuls of 2-3 rows on some CPUs), not the noise of single medians
PAD_MARGIN = 0.1


@dataclass(slots=True)
class CostModel:
    """``seconds[i][j]``: median seconds of one verification forward over ``nodes[j]`` tree
    nodes (plus the pending token) after ``contexts[i]`` cached tokens; ``plain[i]``: plain
    decoding's (0 nodes) seconds at context i, as measured; ``curve[i]``: ``(nodes, seconds)``
    of row i's tree sizes, the seconds made non-decreasing in nodes (``_monotone``: a larger
    tree never costs less, so a noisy median that dips is pooled with its neighbours), which the
    predictions interpolate linearly (flat below the first size, the last segment's slope past
    the last). A staircase, not a line or a hinge: on a CPU the products cost what reading the
    weights costs up to a few rows and step up where the rows fill another register block
    (runtime/gemm.py); a hinge through 1-64 nodes priced 8 nodes at 36 ms where they measured
    40 (BENCHMARKS.md, twelfth session), and pruning by it lost 3.7-6.3% on chat in replay.

    Plain decoding is not on the curve: the step from no tree to a tree of one node costs what a
    masked multi-row forward costs over a 1-row one (on some CPUs in float32 28% of a step,
    BENCHMARKS.md), which a line through 0 would spread over the slope and price at ~2%."""

    nodes: list[int]
    contexts: list[int]
    seconds: list[list[float]]
    key: dict
    level: float = 1.0  # online: measured steps of plain decoding over the table's (observe)
    tree_scale: float = 1.0  # online: the slope of a step's measured tree part on the table's (observe)
    tree_offset: float = 0.0  # online: what any tree adds beyond that, relative to plain decoding (observe)
    observed: int = 0  # steps observed
    online: bool = True  # observe corrects the table; False: the table as measured (reproducible trees)
    # [[prompt tokens, seconds], ...]: a request's prefill as measured (empty: not measured)
    prefill: list[list[float]] = field(default_factory=list)
    rounds: int = 0  # measure's rounds over the table (0: not measured here, or an older cache file)
    curve: list[tuple[list[float], list[float]]] = field(init=False, default_factory=list)
    plain: list[float] = field(init=False, default_factory=list)
    # per measured node count, the node count its trees are verified as (padded_nodes)
    pad_targets: list[int] = field(init=False, default_factory=list)
    _sums: list[float] | None = field(init=False, default=None, repr=False)  # observe's faded sums, from its first step
    _prior: list[float] | None = field(init=False, default=None, repr=False)  # observe's tree prior (never fades)
    _rows: list[list[float]] | None = field(init=False, default=None, repr=False, compare=False)  # relative_upto's table rows
    # the same first and last rows as float64 arrays (price_terms, for the kernel)
    _row_arrays: tuple | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.nodes or len(self.seconds) != len(self.contexts) or any(len(r) != len(self.nodes) for r in self.seconds):
            raise ValueError("a cost model needs one row of seconds per context, one value per node count")
        if list(self.nodes) != sorted(set(self.nodes)) or list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError("node counts and contexts must be strictly increasing")
        self.pad_targets = _pad_targets(self.nodes, self.seconds)
        # what each tree size costs as verified (padded where padding is cheaper), non-decreasing
        where = [self.nodes.index(t) for t in self.pad_targets]
        trees = [j for j, n in enumerate(self.nodes) if n > 0]
        self.curve, self.plain = [], []
        for row in self.seconds:
            ys = _monotone([row[where[j]] for j in trees]) if trees else [float(row[0])]
            self.curve.append(([float(self.nodes[j]) for j in trees] if trees else [1.0], ys))
            # a table without a plain column (or trees only): plain decoding at the smallest tree's price
            self.plain.append(max(float(row[0]), 1e-9) if self.nodes[0] == 0 else ys[0])

    def padded_nodes(self, nodes: int) -> int:
        """The node count to verify an ``nodes``-node tree as: ``nodes`` itself, or a larger
        measured size whose forward the table says is at least ``PAD_MARGIN`` cheaper than the
        first measured size at or above ``nodes`` (the verifier adds masked rows; the output is
        the same)."""
        j = bisect.bisect_left(self.nodes, nodes)  # the first measured size at or above it
        if nodes <= 0 or j == len(self.nodes) or self.pad_targets[j] == self.nodes[j]:
            return max(int(nodes), 0)
        return self.pad_targets[j]

    def seconds_for(self, nodes, context: int | None = None) -> np.ndarray | float:
        """Predicted seconds of a verification step over ``nodes`` (int or array) tree nodes
        after ``context`` cached tokens (None: the first measured context): the measured table's
        (``table_seconds``) with the online corrections: ``level * t0 * relative(nodes)``, ``t0``
        the table's plain decoding step at that context."""
        t0 = self._scalar_seconds(0, context)
        return self.level * t0 * self._relative(nodes, context, t0)

    def prefill_seconds(self, tokens: int) -> float | None:
        """Predicted seconds of a request's prefill over a ``tokens``-token prompt (a fresh
        verifier and the prompt's forward): the least-squares line through the measured
        prefills (non-negative slope), scaled by the online ``level``; None when the table has
        no prefill measurement (an older cache file, or a table made by hand)."""
        if not self.prefill:
            return None
        a, b = _line([p[0] for p in self.prefill], [p[1] for p in self.prefill])
        return self.level * (a + b * max(int(tokens), 0))

    def observe(self, nodes: int, context: int | None, seconds: float) -> None:
        """One verification step the decode loop timed: corrects the table online for what the
        machine does now (its load, clocks and caches drift; the table was measured once).
        Plain decoding steps (0 nodes) estimate ``level``, the ratio of measured to tabled
        seconds, starting where it is (1 for a measured table) as ``ONLINE_PRIOR`` steps' worth
        that fade like any step, with a memory of ``ONLINE_MEMORY`` steps.

        Every step counts as at most ``ONLINE_CLIP`` times (and at least 1 / ``ONLINE_CLIP`` of)
        what the corrected model predicts for it: a step the host preempted is not the machine's
        speed (on a quiet host no step measured past 1.74x the table's).

        Tree steps fit a line to their measured extra over plain decoding (relative, ``y``)
        against the table's (``x``): ``y = tree_offset + tree_scale * x``, least squares over
        the fading steps with a prior that does not fade, pulling the line to where it started:
        its offset as ``ONLINE_PRIOR / 2`` steps' worth, its slope as ``ONLINE_PRIOR / 2`` steps
        at the table's 8-node tree would. Two numbers, not one ratio, because a tree's cost
        over the table's is not proportional: in decoding a tree step cost a near-constant more
        over a plain one than the table (timed apart, under the hinge it then had) said, so a
        lone ratio learnt from small trees reached 2.41 and priced 10-node chains at 1.94x a plain step, where a 9-node
        step measured about 1.36x (BENCHMARKS.md). Small trees say little about the
        slope, so it stays near where it was until trees of other sizes are seen. Bounds: level
        and tree_scale in [1/4, 4], tree_offset in [-1/2, 2]."""
        if not self.online or not math.isfinite(seconds) or seconds <= 0:
            return
        t0 = self._scalar_seconds(0, context)
        if self._sums is None:  # [level sum, level weight, then the trees': w, x, y, xx, xy]
            self._sums = [ONLINE_PRIOR * self.level, ONLINE_PRIOR, 0.0, 0.0, 0.0, 0.0, 0.0]
            x8 = max(self._scalar_seconds(8, context) / t0 - 1.0, 1e-3)
            # the prior: (offset weight, offset, slope weight, slope)
            self._prior = [ONLINE_PRIOR / 2, self.tree_offset, ONLINE_PRIOR / 2 * x8 * x8, self.tree_scale]
        decay = 1.0 - 1.0 / ONLINE_MEMORY
        self._sums = [x * decay for x in self._sums]
        if nodes <= 0:
            self._sums[0] += _clip(seconds / t0, self.level)
            self._sums[1] += 1.0
        else:
            x = self._scalar_seconds(nodes, context) / t0 - 1.0  # the table's relative tree part
            predicted = 1.0 + self.tree_scale * x + self.tree_offset  # relative to plain decoding
            y = _clip(seconds / (self.level * t0), predicted) - 1.0  # the measured one
            for k, v in enumerate((1.0, x, y, x * x, x * y), start=2):
                self._sums[k] += v
        self.observed += 1
        self.level = min(max(self._sums[0] / self._sums[1], 0.25), 4.0)
        w, sx, sy, sxx, sxy = self._sums[2:]
        wc, c0, ws, s0 = self._prior
        # minimise sum (y - c - s x)^2 + wc (c - c0)^2 + ws (s - s0)^2: a 2x2 system
        a, b, d = w + wc, sx, sxx + ws
        scale = (a * (sxy + ws * s0) - b * (sy + wc * c0)) / (a * d - b * b)
        self.tree_scale = min(max(scale, 0.25), 4.0)
        self.tree_offset = min(max((sy + wc * c0 - b * self.tree_scale) / a, -0.5), 2.0)

    def table_seconds(self, nodes, context: int | None = None) -> np.ndarray | float:
        """The measured table's seconds: per context plain decoding's for 0 nodes and the
        curve through the tree sizes for trees (``curve``), linear between (and beyond) the
        measured contexts."""
        if np.ndim(nodes) == 0:
            return self._scalar_seconds(float(nodes), context)
        n = np.asarray(nodes, dtype=float)
        rows = [np.where(n > 0, _on_curve(xs, ys, n), t0) for (xs, ys), t0 in zip(self.curve, self.plain, strict=True)]
        if context is None or len(self.contexts) == 1:
            out = rows[0]
        else:
            c0, c1 = self.contexts[0], self.contexts[-1]
            w = (float(context) - c0) / (c1 - c0)
            out = rows[0] + w * (rows[-1] - rows[0])
            out = np.maximum(out, np.minimum(rows[0], rows[-1]) * 0.5)  # far below the first context: bounded
        return float(out) if out.ndim == 0 else out

    def _scalar_seconds(self, nodes: float, context: int | None) -> float:
        """``table_seconds`` of one node count in Python floats: the decode loop asks for a few
        every step (observe, the drafting overhead), right after a forward, where every numpy
        call runs on cold caches."""
        rows = [t0 if nodes <= 0 else _on_curve_scalar(xs, ys, nodes) for (xs, ys), t0 in zip(self.curve, self.plain, strict=True)]
        if context is None or len(self.contexts) == 1:
            return float(rows[0])
        c0, c1 = self.contexts[0], self.contexts[-1]
        out = rows[0] + (float(context) - c0) / (c1 - c0) * (rows[-1] - rows[0])
        return float(max(out, min(rows[0], rows[-1]) * 0.5))

    def relative(self, nodes, context: int | None = None):
        """``seconds_for(nodes)`` over a plain decoding step's (0 nodes) at the same context
        (``level`` cancels): ``1 + tree_scale * (t / t0 - 1)``, plus ``tree_offset`` for a tree."""
        return self._relative(nodes, context, self._scalar_seconds(0, context))

    def relative_upto(self, count: int, context: int | None = None) -> list[float]:
        """``relative(np.arange(count + 1), context)`` as Python floats, the same bits: the
        pruner asks for it every step, and the table's rows over node counts (which never
        change) are computed once (numpy's interpolation) and kept, so a step does only the
        interpolation in ``context`` and the online corrections, in the array path's order."""
        rows = self._price_rows(count)
        t0 = self._scalar_seconds(0, context)
        first, last = rows[0], rows[-1]
        scale, offset = self.tree_scale, self.tree_offset
        if context is None or len(self.contexts) == 1:
            table = first[: count + 1]
        else:
            c0, c1 = self.contexts[0], self.contexts[-1]
            w = (float(context) - c0) / (c1 - c0)
            table = [max(a + w * (b - a), min(a, b) * 0.5) for a, b in zip(first[: count + 1], last, strict=False)]
        return [1.0 + scale * (t / t0 - 1.0) + (offset if k > 0 else 0.0) for k, t in enumerate(table)]

    def _price_rows(self, count: int) -> list[list[float]]:
        """The table's rows over node counts 0 .. at least ``count`` (relative_upto's), kept."""
        rows = self._rows
        if rows is None or len(rows[0]) <= count:
            n = np.arange(max(count + 1, 65), dtype=float)
            rows = [np.where(n > 0, _on_curve(xs, ys, n), t0).tolist() for (xs, ys), t0 in zip(self.curve, self.plain, strict=True)]
            self._rows = rows
            self._row_arrays = (np.array(rows[0], dtype=np.float64), np.array(rows[-1], dtype=np.float64))
        return rows

    def price_terms(self, count: int, context: int | None = None) -> tuple:
        """What ``relative_upto(count, context)`` computes its prices from, for the kernel to
        compute them itself in the same order (csrc/draft_tree.c: prices_of): the table's first and
        last rows (float64 arrays, at least ``count + 1`` long, kept by this model),
        whether to interpolate between them (1.0) or take the first (0.0), the weight of the last,
        plain decoding's seconds at ``context``, ``tree_scale`` and ``tree_offset``."""
        self._price_rows(count)
        first, last = self._row_arrays
        t0 = self._scalar_seconds(0, context)
        if context is None or len(self.contexts) == 1:
            return first, last, 0.0, 0.0, t0, self.tree_scale, self.tree_offset
        c0, c1 = self.contexts[0], self.contexts[-1]
        return first, last, 1.0, (float(context) - c0) / (c1 - c0), t0, self.tree_scale, self.tree_offset

    def _relative(self, nodes, context: int | None, t0: float):
        if np.ndim(nodes) == 0:
            return 1.0 + self.tree_scale * (self._scalar_seconds(float(nodes), context) / t0 - 1.0) + (self.tree_offset if nodes > 0 else 0.0)
        n = np.asarray(nodes)
        return 1.0 + self.tree_scale * (self.table_seconds(n, context) / t0 - 1.0) + np.where(n > 0, self.tree_offset, 0.0)

    def to_json(self) -> dict:
        out = {"version": VERSION, **asdict(self)}
        del out["_sums"], out["_prior"], out["_rows"], out["_row_arrays"]
        return out

    def table_only(self) -> CostModel:
        """The measured table without online corrections (what the cache file holds)."""
        return CostModel(list(self.nodes), list(self.contexts), [list(r) for r in self.seconds], dict(self.key),
                         prefill=[list(p) for p in self.prefill], rounds=self.rounds)

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        if data.get("version") != VERSION:
            raise ValueError(f"cost cache version {data.get('version')!r}, expected {VERSION}")
        return cls([int(n) for n in data["nodes"]], [int(c) for c in data["contexts"]],
                   [[float(s) for s in row] for row in data["seconds"]], dict(data["key"]),
                   level=float(data.get("level", 1.0)), tree_scale=float(data.get("tree_scale", 1.0)),
                   tree_offset=float(data.get("tree_offset", 0.0)),
                   observed=int(data.get("observed", 0)), online=bool(data.get("online", True)),
                   prefill=[[int(n), float(t)] for n, t in data.get("prefill", [])], rounds=int(data.get("rounds", 0)))

    @classmethod
    def flat(cls, seconds: float = 1.0) -> CostModel:
        """Every tree costs what plain decoding costs (for tests and what-ifs)."""
        return cls([0, 64], [0], [[seconds, seconds]], {"flat": seconds})


def _clip(measured: float, predicted: float) -> float:
    """``measured`` within a factor ``ONLINE_CLIP`` of ``predicted`` (observe)."""
    if predicted <= 0:
        return measured
    return min(max(measured, predicted / ONLINE_CLIP), predicted * ONLINE_CLIP)


def _pad_targets(nodes: Sequence[int], seconds: Sequence[Sequence[float]]) -> list[int]:
    """Per measured node count (0 excluded: plain decoding is never padded), the cheapest
    measured count at or above it (seconds averaged over the contexts) when that is at least
    ``PAD_MARGIN`` cheaper at every measured context (a kernel's dip shows at all of them, one
    noisy median at one), else itself."""
    table = np.asarray(seconds, dtype=float)
    mean = table.mean(axis=0)
    targets = []
    for j, n in enumerate(nodes):
        best = j + int(np.argmin(mean[j:]))
        cheaper = n > 0 and bool(np.all(table[:, best] < (1.0 - PAD_MARGIN) * table[:, j]))
        targets.append(int(nodes[best]) if cheaper else int(n))
    return targets


def _monotone(seconds: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``seconds`` in least squares (pool adjacent
    violators): a run whose medians dip is replaced by its mean."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in seconds:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [m for m, w in blocks for _ in range(int(w))]


def _on_curve_scalar(xs: list[float], ys: list[float], n: float) -> float:
    """Linear in ``n`` between the curve's points, flat below the first, the last segment's slope past the last."""
    if n <= xs[0]:
        return ys[0]
    j = bisect.bisect_left(xs, n)
    if j == len(xs):
        return ys[-1] + _last_slope(xs, ys) * (n - xs[-1])
    return ys[j - 1] + (ys[j] - ys[j - 1]) * (n - xs[j - 1]) / (xs[j] - xs[j - 1])


def _on_curve(xs: list[float], ys: list[float], n: np.ndarray) -> np.ndarray:
    """``_on_curve_scalar`` over an array."""
    return np.where(n > xs[-1], ys[-1] + _last_slope(xs, ys) * (n - xs[-1]), np.interp(n, xs, ys))


def _last_slope(xs: list[float], ys: list[float]) -> float:
    """The curve's slope past its last point: its last segment's (0 for a single point)."""
    return (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0


def _line(nodes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``a + b * nodes`` through the medians, with ``b >= 0`` (a forward over more
    nodes never costs less; a negative slope is noise) and ``a > 0``."""
    x, y = np.asarray(nodes, dtype=float), np.asarray(seconds, dtype=float)
    if len(x) < 2:
        return max(float(y[0]), 1e-9), 0.0
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        a, b = float(y.mean()), 0.0
    return max(float(a), 1e-9), float(b)


def cost_key(info, device: torch.device, dtype: torch.dtype) -> dict:
    """What a measurement depends on: model hash, device (name; on the CPU its model name and
    core count), dtype, torch, CPU threads, the CPU's linear products (linear.backend: the
    kernel switched off measures apart), the kernel forward switched off (kernel_forward.py;
    a field only then, so tables measured with it keep their names), and the verifier's revision."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:  # platform.processor() is empty on most Linux systems: the CPU's model name tells CPUs apart
        name = f"{platform.machine()} {cpu_model() or platform.processor()} x{os.cpu_count()}".strip()
    key = {"model": info.revision, "device": f"{device.type}: {name}", "dtype": dtype_name(dtype),
            "torch": torch.__version__, "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "linears": linear_backend(dtype) if device.type == "cpu" else None, "verifier": VERIFIER_REVISION}
    if device.type == "cpu" and dtype == torch.float32 and not kernel_forward_enabled():
        key["forward"] = "modules"
    return key


def cache_path(key: dict, root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return (root or cache_dir() / "cost") / f"{digest}.json"


def measure(step: Callable[[int, int], None], nodes: Sequence[int] = NODE_COUNTS, contexts: Sequence[int] = CONTEXTS,
            repeats: int = REPEATS, clock: Callable[[], float] = time.perf_counter, key: dict | None = None,
            max_repeats: int | None = None, tolerance: float = TOLERANCE) -> CostModel:
    """Time ``step(nodes, context)`` (one verification step): one warm-up call per cell, then
    rounds over every (context, node count) cell, interleaved so that drift and other load on
    the machine hit every cell alike. Plain decoding is timed ``PLAIN_REPEATS`` times a round
    per context, spread through the round's tree sizes; each tree time is kept as a ratio to
    the median of its round's plain times at that context, so what a round's load or clock
    adds to every cell cancels out of the tree's price. A cell's seconds: the median of its
    plain times, times the median of its ratios.

    At least ``repeats`` rounds, then more while some tree cell's ratio median is uncertain
    by more than ``tolerance`` (the 95% interval of a median, ``1.58 IQR / sqrt(rounds)``;
    a noisy first measurement priced 8 nodes at 1.37 plain steps where re-measurements found
    1.19-1.21, BENCHMARKS.md), up to ``max_repeats`` rounds (None: ``MAX_REPEATS``, at least
    ``repeats``)."""
    cap = max(repeats, MAX_REPEATS if max_repeats is None else max_repeats)
    trees = [n for n in nodes if n > 0]
    # where plain decoding is timed in a round: before the tree sizes, and PLAIN_REPEATS - 1 times between them
    marks = {round(k * len(trees) / PLAIN_REPEATS) for k in range(1, PLAIN_REPEATS)} if 0 in nodes else set()
    for c in contexts:
        for n in nodes:
            step(n, c)

    def timed(n: int, c: int) -> float:
        start = clock()
        step(n, c)
        return clock() - start

    plain: dict[int, list[float]] = {c: [] for c in contexts}
    ratios: dict[tuple[int, int], list[float]] = {(c, n): [] for c in contexts for n in trees}
    rounds = 0
    while rounds < cap:
        for c in contexts:
            this_round, tree_times = [], []
            if 0 in nodes:
                this_round.append(timed(0, c))
            for j, n in enumerate(trees):
                if j in marks:
                    this_round.append(timed(0, c))
                tree_times.append(timed(n, c))
            if 0 in nodes:
                while len(this_round) < PLAIN_REPEATS:
                    this_round.append(timed(0, c))
                plain[c] += this_round
            base = statistics.median(this_round) if this_round else 1.0
            for n, t in zip(trees, tree_times, strict=True):
                ratios[(c, n)].append(t / base if base > 0 else t)
        rounds += 1
        if rounds >= repeats and all(_uncertainty(r) <= tolerance for r in ratios.values()):
            break
    table = []
    for c in contexts:
        t0 = statistics.median(plain[c]) if plain[c] else 1.0
        table.append([t0 if n == 0 else t0 * statistics.median(ratios[(c, n)]) for n in nodes])
    return CostModel(list(nodes), list(contexts), table, key or {}, rounds=rounds)


def _uncertainty(values: Sequence[float]) -> float:
    """Relative half-width of the 95% interval of ``values``' median (``1.58 IQR / sqrt(n)``,
    the notch of a box plot): 0 for a single value."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    mid = statistics.median(values)
    return 1.58 * (q3 - q1) / math.sqrt(len(values)) / abs(mid) if mid else math.inf


def measure_prefill(step: Callable[[int], None], lengths: Sequence[int] = PREFILL_LENGTHS,
                    repeats: int = PREFILL_REPEATS, clock: Callable[[], float] = time.perf_counter) -> list[list[float]]:
    """Time ``step(tokens)`` (one request's prefill): one warm-up call per length, then
    ``repeats`` rounds over the lengths; ``[[tokens, median seconds], ...]``."""
    for n in lengths:
        step(n)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(repeats):
        for n in lengths:
            start = clock()
            step(n)
            times[n].append(clock() - start)
    return [[int(n), statistics.median(times[n])] for n in lengths]


class PrefillStep:
    """``step(tokens)`` for ``measure_prefill``: what a request pays before its first decoding
    step, as the decode loop does it: a fresh TreeVerifier over the model and the prefill of a
    random ``tokens``-token prompt."""

    def __init__(self, model, seed: int = 1):
        from specstore.runtime.verify import TreeVerifier

        self.model, self._verifier_cls = model, TreeVerifier
        self.device = next(model.parameters()).device
        self.vocab = int(model.config.vocab_size)
        self.rng = np.random.default_rng(seed)

    def __call__(self, tokens: int) -> None:
        out = self._verifier_cls(self.model).prefill(self.rng.integers(0, self.vocab, size=max(int(tokens), 1)).tolist())
        if self.device.type == "cuda":
            out.logits.sum().item()
            torch.cuda.synchronize(self.device)


def bushy_tree(nodes: int, vocab: int, rng: np.random.Generator, depth: int = 10) -> DraftTree:
    """A ``nodes``-node tree shaped like the drafters': paths down to ``depth`` tokens, each
    forking from the root or (as often) from a random earlier node above that depth."""
    parents: list[int] = []
    depths: list[int] = []
    while len(parents) < nodes:
        inner = [i for i, d in enumerate(depths) if d < depth]
        fork = int(rng.choice(inner)) if inner and rng.random() < 0.5 else -1
        level = depths[fork] if fork >= 0 else 0
        for _ in range(min(depth - level, nodes - len(parents))):
            parents.append(fork)
            level += 1
            depths.append(level)
            fork = len(parents) - 1
    return DraftTree(rng.integers(0, vocab, size=nodes), np.asarray(parents, dtype=np.int64))


def _accept_a_path(rng: np.random.Generator):
    """An acceptance rule for timing: the path to a random node (as a verification that
    accepts part of a branch), so the cache compaction a real step does is timed too."""

    def rule(logits: torch.Tensor, tree: DraftTree, sampling) -> tuple[list[int], int, list[bool]]:
        path = tree.path_to(int(rng.integers(0, len(tree)))) if len(tree) else []
        return path, pick(logits[len(path)], sampling or Sampling()), []  # the argmax greedy acceptance runs

    return rule


class ForwardStep:
    """``step(n, context)`` for ``measure``: one whole verification step of the decode loop
    (``TreeVerifier.step``: the tree's attention inputs, the forward, the acceptance and the cache
    compaction) over an ``n``-node tree shaped like the drafters', accepting the path to a random
    node, after ``context`` cached tokens (one verifier per context, prefilled once); the cache
    is cropped back to ``context`` after each call."""

    def __init__(self, model, seed: int = 0):
        from specstore.runtime.verify import TreeVerifier

        self.model = model
        self.device = next(model.parameters()).device
        self.vocab = int(model.config.vocab_size)
        self.rng = np.random.default_rng(seed)
        self._verifier_cls = TreeVerifier
        self.verifiers: dict[int, object] = {}
        self.accept = _accept_a_path(self.rng)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def verifier(self, context: int):
        if context not in self.verifiers:
            v = self._verifier_cls(self.model)
            v.prefill(self.rng.integers(0, self.vocab, size=max(context, 1)).tolist())
            self.verifiers[context] = v
        return self.verifiers[context]

    def __call__(self, nodes: int, context: int) -> None:
        verifier = self.verifier(context)
        before = verifier.num_cached
        tree = bushy_tree(nodes, self.vocab, self.rng)
        out = verifier.step(int(self.rng.integers(0, self.vocab)), tree, self.accept)
        if self.device.type == "cuda":
            out.logits.sum().item()  # the step's results reach the host, as the decode loop's do
        self._sync()
        grown = verifier.num_cached - before
        if grown:
            verifier.cache.crop(-grown)  # back to the context (transformers 5.x: negative = tokens to remove)


def usable_contexts(model, nodes: Sequence[int] = NODE_COUNTS, contexts: Sequence[int] = CONTEXTS) -> list[int]:
    """``contexts`` that leave room for the largest tree within the model's position limit."""
    limit = getattr(model.config, "max_position_embeddings", None)
    room = (int(limit) if limit else 1 << 30) - max(nodes) - 2
    out = sorted({max(1, min(c, room)) for c in contexts})
    return out


def load_cost_model(model, info, *, refresh: bool = False, root: Path | None = None,
                    step: Callable[[int, int], None] | None = None, clock: Callable[[], float] = time.perf_counter,
                    nodes: Sequence[int] = NODE_COUNTS, contexts: Sequence[int] | None = None,
                    repeats: int = REPEATS, quiet: bool = True,
                    prefill_step: Callable[[int], None] | None = None) -> CostModel:
    """The cached cost model of ``model`` (its ``info`` from load_model), measured when there is
    none, when the cached file is unreadable or for another key, or when ``refresh``.
    ``step``/``prefill_step``/``clock``: replace the real verification step, prefill and timer
    (tests); with a ``step`` and no ``prefill_step`` the prefill is not measured."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    key = cost_key(info, device, dtype)
    path = cache_path(key, root)
    if not refresh and path.exists():
        try:
            cached = CostModel.from_json(json.loads(path.read_text()))
            if cached.key == key:
                return cached
        except (ValueError, KeyError, TypeError, OSError):
            pass  # corrupt or from another layout: measure again
    if not quiet:
        print(f"specstore: measuring the verification cost of {info.model_id} on {key['device']} {key['dtype']} "
              f"(once; {repeats} to {max(repeats, MAX_REPEATS)} rounds; cached in {path})", file=sys.stderr, flush=True)
    ctx = list(contexts) if contexts is not None else usable_contexts(model, nodes)
    started = time.perf_counter()
    with torch.inference_mode():
        fitted = measure(step or ForwardStep(model), nodes, ctx, repeats, clock, key)
        if prefill_step is None and step is None:
            prefill_step = PrefillStep(model)
        if prefill_step is not None:
            limit = getattr(model.config, "max_position_embeddings", None)
            lengths = sorted({max(1, min(n, int(limit) - 1)) for n in PREFILL_LENGTHS} if limit else set(PREFILL_LENGTHS))
            fitted.prefill = measure_prefill(prefill_step, lengths, PREFILL_REPEATS, clock)
    if not quiet:
        print(f"specstore: measured in {fitted.rounds} rounds, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(fitted.table_only().to_json(), indent=1))
    os.replace(tmp, path)
    return fitted
