"""Cost model (fit, cache keyed by model/device/dtype/torch, refresh, corrupt files) and the
cost-aware pruner and calibrator; timing is a fake clock wherever a real one would be flaky."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specstore.runtime.cost import (
    PLAIN_REPEATS,
    CostModel,
    ForwardStep,
    PrefillStep,
    _line,
    _monotone,
    bushy_tree,
    cache_path,
    cost_key,
    load_cost_model,
    measure,
    measure_prefill,
)
from specstore.runtime.decode import decode
from specstore.runtime.drafters.cost_aware import (
    Calibrator,
    CostAwareDrafter,
    best_size,
    path_probabilities,
    prune,
)
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.models import model_info
from specstore.runtime.sampling import Sampling
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import VerifyResult
from tests.decoding_helpers import random_prompt, tiny_lm


class FakeTimer:
    """``step(n, context)`` advances a fake clock by ``seconds(n, context)`` and counts calls."""

    def __init__(self, seconds):
        self.now, self.calls, self.seconds = 0.0, 0, seconds

    def clock(self) -> float:
        return self.now

    def step(self, n: int, context: int) -> None:
        self.calls += 1
        self.now += self.seconds(n, context)


def linear(n, c):
    return 0.02 + 0.001 * n + 0.00001 * c


def test_measure_fits_the_timed_forwards_and_interpolates():
    timer = FakeTimer(linear)
    cost = measure(timer.step, nodes=(0, 1, 4, 16, 64), contexts=(100, 1000), repeats=3, clock=timer.clock)
    # warm-up once per cell, then three timed repeats (plain decoding's cells PLAIN_REPEATS times each)
    assert timer.calls == 2 * 5 + 3 * 2 * (4 + PLAIN_REPEATS)
    for n in (0, 1, 3, 10, 64, 100):
        for c in (100, 550, 1000):
            assert cost.seconds_for(n, c) == pytest.approx(linear(n, c), rel=1e-6)
    assert cost.relative(0, 500) == pytest.approx(1.0)
    assert cost.relative(64, 100) == pytest.approx(linear(64, 100) / linear(0, 100))


def test_fit_is_plain_decoding_and_a_curve_never_falling_with_nodes_through_the_medians():
    # per node count: warm-up, then repeats (plain decoding's PLAIN_REPEATS times a round)
    values = {0: [1.0] + [1.0, 9.0, 1.0] * PLAIN_REPEATS, 8: [0.5, 0.5, 50.0, 0.5], 16: [0.48, 0.48, 0.48, 60.0]}
    order = []

    def seconds(n, c):
        order.append(n)
        return values[n][sum(1 for x in order if x == n) - 1]

    timer = FakeTimer(seconds)
    cost = measure(timer.step, nodes=(0, 8, 16), contexts=(10,), repeats=3, clock=timer.clock, max_repeats=3)
    assert cost.seconds[0] == pytest.approx([1.0, 0.5, 0.48])  # medians (of plain times; of tree times over their round's plain)
    assert cost.plain == [1.0]  # plain decoding as measured, off the trees' curve
    assert cost.curve[0] == ([8.0, 16.0], pytest.approx([0.49, 0.49]))  # a falling cost is noise: pooled, flat
    assert cost.seconds_for(0) == pytest.approx(1.0) and cost.seconds_for(8) == pytest.approx(0.49)
    assert cost.relative(64) == pytest.approx(0.49)
    noisy = CostModel([0, 1, 2, 4, 8, 16, 32, 64], [1], [[1.0, 1.3, 1.0, 1.0, 1.1, 1.2, 1.4, 1.8]], {})
    assert noisy.curve[0][1] == pytest.approx([1.0, 1.0, 1.0, 1.1, 1.2, 1.4, 1.8])  # 1 node verified as 2 (padded)
    assert noisy.relative(1) == pytest.approx(1.0)  # one noisy median does not make one node dear
    dips = CostModel([0, 1, 2, 4, 8], [1], [[1.0, 1.1, 1.2, 1.15, 1.3]], {})  # a dip too small to pad: pooled
    assert dips.curve[0][1] == pytest.approx([1.1, 1.175, 1.175, 1.3])


def test_measure_prices_trees_against_their_round_and_times_more_rounds_while_prices_are_uncertain():
    """A load that slows a whole round (every cell alike) cancels out of the trees' prices;
    noise of single steps makes measure time more rounds, up to max_repeats."""
    rng = np.random.default_rng(3)
    state = {"round": 0, "calls": 0}
    per_round = 2 * (3 + PLAIN_REPEATS)  # timed calls a round: two contexts, three trees and plain decoding
    warmup = 2 * 4

    def loaded(n, c):  # rounds 0, 2, 4, ... run at twice the speed of 1, 3, 5, ...: drift between rounds
        state["calls"] += 1
        k = max(state["calls"] - warmup - 1, 0) // per_round
        return (1.0 if k % 2 else 2.0) * linear(n, c)

    timer = FakeTimer(loaded)
    cost = measure(timer.step, nodes=(0, 4, 16, 64), contexts=(100, 1000), repeats=4, clock=timer.clock)
    assert cost.rounds == 4  # prices exact in every round: nothing uncertain, no round beyond the fourth
    for n in (4, 16, 64):
        for c in (100, 1000):
            assert cost.relative(n, c) == pytest.approx(linear(n, c) / linear(0, c), rel=1e-9)

    def noisy(n, c):
        return linear(n, c) * float(rng.lognormal(0.0, 0.1))

    timer = FakeTimer(noisy)
    cost = measure(timer.step, nodes=(0, 4, 16), contexts=(100,), repeats=4, clock=timer.clock, max_repeats=40)
    assert 4 < cost.rounds <= 40
    assert timer.calls == 3 + cost.rounds * (2 + PLAIN_REPEATS)
    assert cost.relative(16, 100) == pytest.approx(linear(16, 100) / linear(0, 100), rel=0.06)
    few = measure(FakeTimer(noisy).step, nodes=(0, 4, 16), contexts=(100,), repeats=4, max_repeats=6,
                  clock=FakeTimer(noisy).clock)
    assert few.rounds <= 6
    assert CostModel.from_json(json.loads(json.dumps(cost.to_json()))).rounds == cost.rounds == cost.table_only().rounds


def test_trees_are_priced_on_the_measured_staircase_not_a_line():
    """A CPU kernel reads the weights once: a few nodes cost what the first does, then the cost
    steps up where the rows fill another register block. The curve through the measured sizes
    keeps those steps (linear between sizes, the last slope beyond); a line through all sizes
    prices small trees under what they cost."""
    nodes = [0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 32, 64]

    def stair(n):  # 6 rows a block: 1-5 nodes one block, 6-11 two, ...
        return 0.034 + 0.0004 * n + 0.004 * (n // 6)

    table = [0.033] + [stair(n) for n in nodes[1:]]
    cost = CostModel(nodes, [128], [table], {})
    for n in nodes[1:]:
        assert cost.table_seconds(n, 128) == pytest.approx(stair(n))
    assert cost.table_seconds(7, 128) == pytest.approx((stair(6) + stair(8)) / 2)  # between sizes: linear
    slope = (stair(64) - stair(32)) / 32
    assert cost.table_seconds(100, 128) == pytest.approx(stair(64) + slope * 36)  # beyond: the last slope
    assert cost.table_seconds(0.5, 128) == pytest.approx(stair(1))  # below the first size: flat
    assert cost.relative(6, 128) - cost.relative(5, 128) > 0.1  # the step is priced where it is
    grid = np.arange(0, 90)
    assert list(cost.table_seconds(grid, 128)) == pytest.approx([cost.table_seconds(int(n), 128) for n in grid])
    line = _line(nodes[1:], table[1:])
    assert line[0] + line[1] < stair(1) - 0.0005  # a line through all sizes: the 1-node tree under its cost
    # the curve never falls: the least-squares non-decreasing sequence (pooled adjacent violators)
    assert _monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert _monotone([3.0, 1.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert _monotone([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.0, 2.5, 2.5, 4.0])
    rng = np.random.default_rng(0)
    for _ in range(100):
        y = rng.uniform(0, 1, int(rng.integers(1, 9)))
        m = np.array(_monotone(y))
        assert np.all(np.diff(m) >= -1e-12) and m.sum() == pytest.approx(y.sum())  # pooled means keep the total


def test_the_step_to_a_first_tree_node_is_priced_apart_from_the_slope():
    """float32 on this CPU: a 1-node verification costs 28% more than plain decoding, then ~1%
    a node; a line through plain decoding would price the first node at a few percent."""
    table = [[0.065, 0.083, 0.083, 0.083, 0.105, 0.117, 0.149, 0.206]]
    cost = CostModel([0, 1, 2, 4, 8, 16, 32, 64], [128], table, {})
    assert cost.relative(0, 128) == 1.0
    assert cost.relative(1, 128) == pytest.approx(1.25, abs=0.05)
    assert cost.relative(64, 128) == pytest.approx(0.206 / 0.065, rel=0.05)
    assert CostModel([1, 8], [128], [[0.08, 0.09]], {}).table_seconds(0) == pytest.approx(0.08)  # no plain column: the smallest tree's


def test_cost_cache_is_keyed_refreshed_and_survives_corruption(tmp_path):
    model, tok = tiny_lm()
    info = model_info(model, tok, "tiny")
    timer = FakeTimer(linear)
    kw = dict(root=tmp_path, step=timer.step, clock=timer.clock, nodes=(0, 2, 8), contexts=(16, 64), repeats=2)
    first = load_cost_model(model, info, **kw)
    measured = timer.calls
    assert measured > 0
    path = cache_path(cost_key(info, torch.device("cpu"), torch.float32), tmp_path)
    assert path.is_file() and json.loads(path.read_text())["key"]["dtype"] == "float32"
    again = load_cost_model(model, info, **kw)
    assert timer.calls == measured and again.seconds == first.seconds  # from the cache
    load_cost_model(model, info, refresh=True, **kw)
    assert timer.calls == 2 * measured  # refresh measures again
    path.write_text("{ not json")
    load_cost_model(model, info, **kw)
    assert timer.calls == 3 * measured  # corrupt file: measured again and rewritten
    assert CostModel.from_json(json.loads(path.read_text())).key == first.key
    # another dtype or model is another key, another file
    other = cost_key(info, torch.device("cpu"), torch.bfloat16)
    assert cache_path(other, tmp_path) != path
    assert cost_key(info.model_copy(update={"revision": "x"}), torch.device("cpu"), torch.float32) != first.key


def test_the_cost_key_tells_cpu_models_apart(tmp_path, monkeypatch):
    """A table measured on one processor is not reused on another (a home cache copied between
    machines): the CPU's model name is in the key, read from /proc/cpuinfo."""
    from specstore.runtime import cost

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)  Processor @ 2.60GHz\nflags\t\t: fpu\n")
    assert cost.cpu_model(cpuinfo) == "Intel(R) Xeon(R) Processor @ 2.60GHz"
    assert cost.cpu_model(tmp_path / "missing") == ""
    model, tok = tiny_lm()
    info = model_info(model, tok, "tiny")
    keys = []
    for name in ("Intel(R) Xeon(R) Processor @ 2.60GHz", "AMD EPYC 9B14"):
        monkeypatch.setattr(cost, "cpu_model", lambda cpuinfo="/proc/cpuinfo", name=name: name)
        keys.append(cost_key(info, torch.device("cpu"), torch.float32))
        assert name in keys[-1]["device"]
    assert keys[0] != keys[1] and cache_path(keys[0], tmp_path) != cache_path(keys[1], tmp_path)


def test_prefill_is_measured_fitted_cached_and_scaled_by_the_level(tmp_path):
    """A request's prefill (fresh verifier + the prompt's forward) is timed at a few prompt
    lengths, a line prices any prompt, the cache file keeps it, and the online level scales it."""
    seen = []

    class Clock:
        now = 0.0

    def prefill(tokens):
        seen.append(tokens)
        Clock.now += 0.01 + 0.0002 * tokens

    points = measure_prefill(prefill, (64, 512), repeats=3, clock=lambda: Clock.now)
    assert seen == [64, 512] + [64, 512] * 3  # a warm-up each, then interleaved rounds
    assert points == [[64, pytest.approx(0.0228)], [512, pytest.approx(0.1124)]]
    cost = CostModel([0, 8], [0], [[1.0, 1.2]], {}, prefill=points)
    assert cost.prefill_seconds(100) == pytest.approx(0.01 + 0.0002 * 100)
    assert CostModel.from_json(json.loads(json.dumps(cost.to_json()))).prefill_seconds(100) == pytest.approx(0.03)
    assert CostModel([0, 8], [0], [[1.0, 1.2]], {}).prefill_seconds(100) is None  # not measured: no price
    cost.level = 2.0
    assert cost.prefill_seconds(100) == pytest.approx(0.06)
    # load_cost_model measures it with the table and the cache file holds it
    model, tok = tiny_lm()
    info = model_info(model, tok, "tiny")
    timer = FakeTimer(linear)
    loaded = load_cost_model(model, info, root=tmp_path, step=timer.step, clock=timer.clock, nodes=(0, 2), contexts=(16,),
                             repeats=2, prefill_step=lambda n: setattr(timer, "now", timer.now + 0.001 * n))
    assert [n for n, _ in loaded.prefill] == [64, 512] and loaded.prefill_seconds(128) == pytest.approx(0.128)
    again = load_cost_model(model, info, root=tmp_path, step=timer.step, clock=timer.clock, nodes=(0, 2), contexts=(16,))
    assert again.prefill == loaded.prefill  # from the cache file
    # the real step: a fresh verifier's prefill of the given length, on the tiny model
    PrefillStep(model)(12)


def test_forward_step_times_whole_steps_and_leaves_the_cache_as_it_was(monkeypatch):
    """The cost model times what the decode loop pays per step: TreeVerifier.step over a
    branching tree, accepting a path (so the cache compaction runs), not the forward alone."""
    model, _ = tiny_lm()
    step = ForwardStep(model)
    seen = []
    real_step = type(step.verifier(20)).step
    monkeypatch.setattr(type(step.verifier(20)), "step", lambda self, pending, tree, rule=None: seen.append(
        (len(tree), int((tree.parents == -1).sum()), len(rule(torch.zeros(len(tree) + 1, 5), tree, None)[0]))) or real_step(self, pending, tree, rule))
    with torch.inference_mode():
        for nodes in (4, 16, 64, 0):
            step(nodes, 20)
            assert step.verifier(20).num_cached == 20
    assert [n for n, _, _ in seen] == [4, 16, 64, 0]
    assert seen[2][1] > 1  # a 64-node tree branches under the root
    assert all(0 < a <= 10 for n, _, a in seen if n)  # a path of the tree was accepted
    tree = bushy_tree(37, 100, np.random.default_rng(1))
    assert len(tree) == 37 and max(len(tree.path_to(i)) for i in range(37)) == 10
    ticks = iter(range(1000))
    cost = measure(step, nodes=(0, 4), contexts=(8,), repeats=2, clock=lambda: float(next(ticks)))
    assert cost.nodes == [0, 4] and cost.seconds[0][0] > 0


# --- pruner ----------------------------------------------------------------------------------


def wide_tree() -> DraftTree:
    """Three chains of four under the root, then a second child at depth 2."""
    return DraftTree.from_paths([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [1, 20, 21]])


def steep_cost() -> CostModel:
    return CostModel([0, 1, 64], [0], [[1.0, 3.0, 200.0]], {})


def is_subtree(small: DraftTree, big: DraftTree) -> bool:
    """Every root-to-node token path of ``small`` is one of ``big``'s."""
    def paths(t):
        return {tuple(t.tokens[t.path_to(i)].tolist()) for i in range(len(t))}
    return paths(small) <= paths(big)


def test_pruner_picks_plain_decoding_when_verifying_is_dear_and_acceptance_low():
    tree = wide_tree()
    assert len(prune(tree, np.full(len(tree), 0.2), steep_cost())) == 0


def test_pruner_keeps_whole_paths_when_acceptance_is_high_and_cost_flat():
    tree = wide_tree()
    p = np.full(len(tree), 0.9)
    assert len(prune(tree, p, CostModel.flat())) == len(tree)
    chain = DraftTree.chain([4, 5, 6, 7, 8, 9])
    assert len(prune(chain, np.full(6, 0.95), CostModel([0, 64], [0], [[1.0, 1.3]], {}))) == 6


def test_pruner_result_is_the_best_size_and_always_a_subtree():
    rng = np.random.default_rng(3)
    cost = CostModel([0, 1, 8, 64], [0], [[1.0, 1.05, 1.3, 3.0]], {})
    for _ in range(200):
        paths = [rng.integers(0, 4, size=int(rng.integers(1, 7))).tolist() for _ in range(int(rng.integers(1, 6)))]
        tree = DraftTree.from_paths(paths)
        tree.node_data["bucket"] = np.arange(len(tree))
        p = rng.uniform(0, 1, size=len(tree))
        kept = prune(tree, p, cost)
        assert is_subtree(kept, tree)
        assert kept.node_data["bucket"].tolist() == sorted(kept.node_data["bucket"].tolist())  # rows kept in order
        # no subtree of the same size holds more expected tokens than the best-first prefix
        order, k, rate = best_size(tree, p, cost)
        q = path_probabilities(tree, p)
        assert rate == pytest.approx((1 + q[order[:k]].sum()) / cost.relative(k))
        for size in range(len(tree) + 1):
            assert (1 + np.sort(q)[::-1][:size].sum()) / cost.relative(size) <= rate + 1e-9


def test_drafting_time_is_priced_into_the_rule_as_spent_whatever_the_size():
    """A node at 8% acceptance is not worth 10% of a step on its own (1.08 / 1.1 < 1), but is
    when the step already spends half a plain step drafting (1.08 / 1.6 > 1 / 1.5)."""
    cost = CostModel([0, 1, 8], [0], [[1.0, 1.1, 1.8]], {})
    chain = DraftTree.chain([4])
    assert len(prune(chain, np.array([0.08]), cost)) == 0
    assert len(prune(chain, np.array([0.08]), cost, overhead=0.5)) == 1
    _, k, rate = best_size(chain, np.array([0.08]), cost, overhead=0.5)
    assert k == 1 and rate == pytest.approx(1.08 / 1.6)


class _Chain:
    name, lossless = "fixed", True

    def __init__(self):
        self.observed = 0

    def reset(self, prompt_ids):
        pass

    def propose(self, state):
        tree = DraftTree.chain([4])
        tree.node_data["prior"] = np.array([0.08])
        return tree

    def observe(self, state, tree, result):
        self.observed += 1


def test_the_wrapper_times_its_drafting_and_prunes_with_it():
    """A fake clock: each propose and each observe takes 0.5 s against a 1 s plain step; the
    first step has no drafting time yet and prunes the node, the second prices 0.5 s and keeps it."""
    from specstore.runtime.drafters.base import DecodeState

    ticks = iter(np.arange(0, 100, 0.5))
    cost = CostModel([0, 1, 8], [0], [[1.0, 1.1, 1.8]], {})
    wrapped = CostAwareDrafter(_Chain(), cost, Calibrator(explore=0.0, weight=1e6), clock=lambda: float(next(ticks)))
    state = DecodeState(tokens=[1, 2, 3], num_prompt=3)
    state.budget = 8
    first = wrapped.propose(state)
    assert len(first) == 0 and wrapped.draft_s == pytest.approx(0.5)  # no drafting priced yet: pruned
    wrapped.observe(state, first, VerifyResult([], [], 5, 0))
    assert len(wrapped.propose(state)) == 1 and wrapped.draft_s == pytest.approx(0.5 + 0.5 / 50)
    off = CostAwareDrafter(_Chain(), cost, Calibrator(explore=0.0, weight=1e6), count_drafting=False,
                           clock=lambda: float(next(ticks)))
    for _ in range(3):
        assert len(off.propose(state)) == 0 and off.overhead(3) == 0.0
        off.observe(state, DraftTree.empty(), VerifyResult([], [], 5, 0))


def test_calibration_learns_from_verify_results():
    cal = Calibrator(weight=2.0, explore=0.0)
    tree = DraftTree.chain([5, 6, 7])
    tree.node_data["bucket"] = np.array([1, 1, 1])
    start = cal.probabilities(tree)
    assert np.allclose(start, 0.5)
    for _ in range(30):  # the first two nodes are always accepted, the third never
        cal.update(tree, VerifyResult([0, 1], [5, 6], 9, 3))
    assert cal.rate(1, 1) == 1.0 and cal.rate(1, 2) == 1.0 and cal.rate(1, 3) == 0.0
    p = cal.probabilities(tree)
    assert p[0] > 0.9 and p[1] > 0.9 and p[2] < 0.2
    # a node whose parent was rejected is no trial
    cal.update(tree, VerifyResult([], [], 9, 3))
    assert cal.cell(1, 1)[0] == 31 and cal.cell(1, 2)[0] == 30 and cal.totals(1) == (31 + 30 + 30, 60)


def test_sibling_probabilities_sum_to_at_most_one():
    tree = DraftTree.from_paths([[1], [2], [3], [4]])
    tree.node_data["prior"] = np.full(4, 0.9)
    assert cal_sum(tree) == pytest.approx(1.0)


def cal_sum(tree):
    return float(Calibrator(explore=0.0).probabilities(tree).sum())


def _probabilities_by_node(cal: Calibrator, tree: DraftTree) -> np.ndarray:
    """The calibration's definition, node by node (module doc of cost_aware, point 2)."""
    n, w = len(tree), cal.weight
    buckets = tree.node_data["bucket"].tolist()
    priors = tree.node_data.get("prior", np.full(n, 0.5))
    depths = np.minimum(tree.depths(), 8).tolist()
    p = np.empty(n)
    for i, (b, d) in enumerate(zip(buckets, depths, strict=True)):
        (tried_b, accepted_b), (tried, accepted) = cal.totals(b), cal.cell(b, d)
        pb = (accepted_b + w * priors[i]) / (tried_b + w)
        p[i] = (accepted + w * pb) / (tried + w)
    for parent in set(tree.parents.tolist()):  # siblings exclude each other
        members = np.flatnonzero(tree.parents == parent)
        if p[members].sum() > 1.0:
            p[members] /= p[members].sum()
    trials = np.array([cal.cell(b, d)[0] for b, d in zip(buckets, depths, strict=True)])
    return np.minimum(p + cal.explore / np.sqrt(1.0 + trials), 1.0)


def test_calibrated_probabilities_follow_the_definition_on_random_trees():
    rng = np.random.default_rng(3)
    for _ in range(500):
        n = int(rng.integers(1, 65))
        tree = DraftTree(rng.integers(0, 50, n), [-1] + [int(rng.integers(-1, i)) for i in range(1, n)])
        tree.node_data["bucket"] = rng.integers(0, 6, n)
        if rng.random() < 0.5:
            tree.node_data["prior"] = rng.random(n)
        cal = Calibrator(explore=float(rng.choice([0.0, 0.1])))
        for _ in range(int(rng.integers(0, 30))):
            b, d = int(rng.integers(0, 6)), int(rng.integers(1, 9))
            cal.add(b, d, float(rng.integers(1, 9)), float(rng.integers(0, 2)))
        assert np.allclose(cal.probabilities(tree), _probabilities_by_node(cal, tree), rtol=0, atol=1e-12)


def test_exploration_bonus_keeps_a_failed_cell_in_play_and_fades():
    """A cell whose first trials all failed keeps an optimistic bonus explore / sqrt(1 + trials)
    on top of its calibrated rate, so it is still proposed now and then; it fades with trials."""
    tree = DraftTree.chain([5])
    tree.node_data["bucket"] = np.array([3])
    plain, bonus = Calibrator(explore=0.0), Calibrator(explore=0.1)
    assert bonus.probabilities(tree)[0] == pytest.approx(plain.probabilities(tree)[0] + 0.1)  # no trial yet: the whole bonus
    for cal in (plain, bonus):
        for _ in range(20):
            cal.update(tree, VerifyResult([], [], 9, 1))  # rejected every time
    gap = bonus.probabilities(tree)[0] - plain.probabilities(tree)[0]
    assert gap == pytest.approx(0.1 / np.sqrt(21))
    for _ in range(380):
        bonus.update(tree, VerifyResult([], [], 9, 1))
    optimistic = bonus.probabilities(tree)[0]
    bonus.explore = 0.0
    assert optimistic - bonus.probabilities(tree)[0] == pytest.approx(0.1 / np.sqrt(401))  # still optimistic, less so
    full = DraftTree.chain([5])
    full.node_data["prior"] = np.array([0.97])
    assert Calibrator(explore=0.1).probabilities(full)[0] == 1.0  # capped at 1


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cost_aware_pld_is_identical_to_ar_and_prunes(family):
    model, _ = tiny_lm(family)
    rng = np.random.default_rng(11)
    dear = CostModel([0, 1, 64], [0], [[1.0, 1.2, 40.0]], {})
    for cost in (CostModel.flat(), dear):
        drafter = make_drafter("pld", cost=cost)
        assert isinstance(drafter, CostAwareDrafter) and drafter.inner.num_draft_tokens == 16
        for _ in range(3):
            prompt = random_prompt(rng, model.config.vocab_size, 24)
            ar = decode(model, prompt, make_drafter("ar"), 30, Sampling())
            out = decode(model, prompt, drafter, 30, Sampling())
            assert out.token_ids == ar.token_ids
        assert drafter.num_kept <= drafter.num_proposed
    assert make_drafter("ar", cost=dear).name == "ar" and not isinstance(make_drafter("ar", cost=dear), CostAwareDrafter)


def test_calibration_follows_what_the_verifier_accepts():
    """Through decode: the wrapper's calibrator counts exactly the trials the verified trees offered."""
    model, _ = tiny_lm()
    drafter = make_drafter("pld", cost=CostModel.flat())
    seen = []
    inner_observe = drafter.inner.observe
    drafter.inner.observe = lambda state, tree, result: (seen.append((tree, result)), inner_observe(state, tree, result))
    rng = np.random.default_rng(5)
    for _ in range(3):
        decode(model, random_prompt(rng, model.config.vocab_size, 30), drafter, 40, Sampling())
    cal = drafter.calibrator
    trials = sum(1 for tree, res in seen for i, p in enumerate(tree.parents.tolist()) if p < 0 or p in res.accepted_nodes)
    assert cal.totals()[0] == trials > 0
    assert cal.totals()[1] == sum(len(res.accepted_nodes) for _, res in seen) > 0


@pytest.mark.model
@pytest.mark.slow
def test_default_model_cost_aware_methods_identical_to_ar_float32(tmp_path):
    """The real default model, float32, real prompts, a pipeline-built code datastore: every
    lossless method with cost-aware sizing decodes exactly what ar decodes."""
    from specstore.runtime.api import generate
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.models import load_model
    from tests.datastore_helpers import CODE_RECORDS, pipeline_store

    loaded = load_model(None, dtype="float32", device="cpu")
    pipeline_store(tmp_path, None, CODE_RECORDS, "code")
    ds = Datastore.open(tmp_path / "store", "code@prod", loaded.info)
    cpu_like = CostModel([0, 1, 8, 16, 64], [0], [[1.0, 1.02, 1.1, 1.3, 1.8]], {})
    prompts = ["Write a Python function that reverses a string.", "List the days of the week, then list them again in reverse order."]
    for method in ("pld", "rest", "dresd", "respec"):
        drafter = make_drafter(method, ds, cost=cpu_like)
        for prompt in prompts:
            ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=48)
            out = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=48)
            assert out.token_ids == ar.token_ids, (method, prompt)
        assert drafter.num_kept <= drafter.num_proposed


def test_cost_aware_modes_select_methods():
    from specstore.runtime.bench.runner import drafter_labels
    from specstore.runtime.drafters.registry import uses_cost
    from specstore.runtime.errors import SpecstoreError

    assert [m for m in ("ar", "pld", "rest", "dresd", "respec") if uses_cost(m, "on")] == ["pld", "rest", "dresd", "respec"]
    assert [m for m in ("ar", "pld", "rest", "dresd", "respec") if uses_cost(m, "auto")] == ["pld", "rest", "dresd", "respec"]
    assert not any(uses_cost(m, "off") for m in ("ar", "pld", "rest", "dresd", "respec"))
    assert drafter_labels(["ar", "pld", "rest"], "both") == {"ar": ("ar", False), "pld": ("pld", False), "pld+cost": ("pld", True),
                                                            "rest": ("rest", False), "rest+cost": ("rest", True)}
    assert drafter_labels(["ar", "pld", "rest"], "auto") == {"ar": ("ar", False), "pld": ("pld", True), "rest": ("rest", True)}
    with pytest.raises(SpecstoreError, match="cost-aware must be one of"):
        drafter_labels(["pld"], "sometimes")
    # METHOD:NAME runs METHOD again under its own label, cost-aware as METHOD is
    assert drafter_labels(["ar", "respec", "respec:nohead"], "auto") == {"ar": ("ar", False), "respec": ("respec", True),
                                                                         "respec:nohead": ("respec", True)}
    assert drafter_labels(["pld:x"], "both") == {"pld:x": ("pld", False), "pld:x+cost": ("pld", True)}
    for bad in ("hf:x", "respec:"):
        with pytest.raises(SpecstoreError, match="a variant is METHOD:NAME"):
            drafter_labels([bad], "auto")


def test_a_variants_options_go_over_its_methods():
    from specstore.runtime.bench.runner import base_method, parse_options, variant_options

    options = parse_options(["respec.max_nodes=8", "respec:nohead.head=off", "respec:nohead.max_nodes=4"])
    assert options == {"respec": {"max_nodes": 8}, "respec:nohead": {"head": "off", "max_nodes": 4}}
    assert variant_options(options, "respec") == variant_options(options, "respec+cost") == {"max_nodes": 8}
    assert variant_options(options, "respec:nohead+cost") == {"max_nodes": 4, "head": "off"}
    assert variant_options(options, "rest") == {} and base_method("respec:nohead+cost") == "respec"


def test_online_corrections_follow_the_measured_steps():
    """observe: plain steps set the level, tree steps the scale of the tree part; the prior holds
    them at 1 before any step, the clamps bound them, the cache file keeps the table alone."""
    table = CostModel([0, 1, 2, 4, 8, 16], [100, 1000], [[linear(n, c) for n in (0, 1, 2, 4, 8, 16)] for c in (100, 1000)], {})
    assert (table.level, table.tree_scale) == (1.0, 1.0) and table.relative(8, 300) == pytest.approx(linear(8, 300) / linear(0, 300))
    rng = np.random.default_rng(0)
    for _ in range(600):  # the machine now: plain steps 1.2x the table's, a tree's extra 1.5x the table's extra
        n, c = int(rng.choice([0, 0, 1, 3, 6, 12])), int(rng.integers(100, 1000))
        t0, t = linear(0, c), linear(n, c)
        table.observe(n, c, (1.2 * t0 + 1.5 * (t - t0)) * rng.uniform(0.97, 1.03))
    assert table.level == pytest.approx(1.2, rel=0.03)
    assert table.tree_scale == pytest.approx(1.25, rel=0.05)  # relative to the level: 1.5 / 1.2
    c = 500
    want = (1.2 * linear(0, c) + 1.5 * (linear(8, c) - linear(0, c))) / (1.2 * linear(0, c))
    assert table.relative(8, c) == pytest.approx(want, rel=0.02)
    assert table.seconds_for(0, c) == pytest.approx(1.2 * linear(0, c), rel=0.03)
    back = CostModel.from_json(json.loads(json.dumps(table.to_json())))
    assert (back.level, back.tree_scale, back.observed) == (table.level, table.tree_scale, 600)
    assert back.relative(8, c) == pytest.approx(table.relative(8, c))
    assert (table.table_only().level, table.table_only().tree_scale) == (1.0, 1.0)
    back.observe(0, 200, linear(0, 200))  # a stored model goes on learning from where it was
    assert np.isfinite(back.tree_scale) and back.tree_scale == pytest.approx(table.tree_scale, rel=1e-6)
    for _ in range(2000):  # absurd timings are bounded
        table.observe(4, 200, 100.0)
        table.observe(0, 200, 1e-6)
    assert table.level == pytest.approx(0.25) and table.tree_scale == pytest.approx(4.0)
    table.observe(2, 200, float("nan"))  # not a timing: ignored
    assert table.observed == 4600
    frozen = CostModel.from_json(json.loads(json.dumps(table.table_only().to_json())) | {"online": False})
    frozen.observe(4, 200, 100.0)  # --cost-online off: the table as measured
    assert (frozen.level, frozen.tree_scale, frozen.observed) == (1.0, 1.0, 0)


def test_online_correction_fits_an_offset_so_small_trees_do_not_overprice_large_ones():
    """In decoding a tree step can cost a near-constant more over a plain one than the table
    (timed apart) says: small trees then measure several times the table's tiny extra. The
    online line learns that as an offset and keeps the slope, so a 9-node tree (never seen) is
    still priced near what it costs; a lone ratio (the old model) priced it at about twice its
    extra. Seeing large trees too, the line fits both ends."""
    nodes = (0, 1, 2, 4, 8, 16)

    def hinge(n, c):  # a CPU's table: trees of up to 4 nodes cost about what plain decoding does
        return linear(0, c) + (0.0003 + 0.001 * max(n - 4, 0) if n > 0 else 0.0)

    table = CostModel(list(nodes), [100, 1000], [[hinge(n, c) for n in nodes] for c in (100, 1000)], {})

    def truth(n, c):  # the machine now: any tree costs 4% of a plain step more than the table says
        return hinge(n, c) + (0.04 * linear(0, c) if n > 0 else 0.0)

    rng = np.random.default_rng(1)
    for _ in range(800):  # only plain steps and trees of 1-3 nodes, as a cost-aware drafter prunes them
        n, c = int(rng.choice([0, 1, 2, 3])), int(rng.integers(100, 1000))
        table.observe(n, c, truth(n, c) * rng.uniform(0.99, 1.01))
    c = 500
    x9 = hinge(9, c) / linear(0, c) - 1.0  # the table's extra of a 9-node tree
    assert table.tree_offset == pytest.approx(0.04, abs=0.01)
    assert table.relative(2, c) == pytest.approx(truth(2, c) / linear(0, c), rel=0.01)
    assert table.relative(9, c) == pytest.approx(truth(9, c) / linear(0, c), rel=0.03)
    ratio = (truth(2, c) / linear(0, c) - 1.0) / (hinge(2, c) / linear(0, c) - 1.0)  # what one ratio would learn
    assert ratio > 2 and 1 + ratio * x9 > table.relative(9, c) + 0.1
    assert list(table.relative(np.array([0, 2, 9]), c)) == pytest.approx([1.0, table.relative(2, c), table.relative(9, c)])
    assert table.seconds_for(9, c) == pytest.approx(table.level * linear(0, c) * table.relative(9, c))
    for _ in range(800):  # now large trees too, whose extra is 1.5x the table's besides the offset
        n, c = int(rng.choice([0, 2, 8, 16])), int(rng.integers(100, 1000))
        t0 = linear(0, c)
        table.observe(n, c, t0 + (0.04 * t0 + 1.5 * (hinge(n, c) - t0) if n > 0 else 0.0))
    assert (table.tree_offset, table.tree_scale) == (pytest.approx(0.04, abs=0.01), pytest.approx(1.5, rel=0.05))
    back = CostModel.from_json(json.loads(json.dumps(table.to_json())))
    assert (back.tree_offset, back.tree_scale) == (table.tree_offset, table.tree_scale)
    assert (table.table_only().tree_offset, table.table_only().tree_scale) == (0.0, 1.0)
    old = CostModel.from_json({k: v for k, v in table.to_json().items() if k != "tree_offset"})  # a result stored before the offset
    assert old.tree_offset == 0.0


def test_one_preempted_step_does_not_reprice_every_tree_but_a_lasting_change_is_followed(monkeypatch):
    """observe counts a step as at most ONLINE_CLIP times what the model predicts: a step the
    host stalled (100x) barely moves the level or a tree's price, where without the clip it
    moved the level past 2x and a tree's price by half; a host that stays 3x slower is still
    followed, plain and tree steps alike."""
    import specstore.runtime.cost as cost_module

    nodes = (0, 1, 2, 4, 8, 16)
    rows = [[linear(n, c) for n in nodes] for c in (100, 1000)]

    def steps(model, rng, count, speed=1.0):
        for _ in range(count):
            n, c = int(rng.choice([0, 0, 2, 4, 8])), int(rng.integers(100, 1000))
            model.observe(n, c, speed * linear(n, c) * rng.uniform(0.98, 1.02))

    def stalled(clip):  # (level, an 8-node tree's price) before and after each stalled step
        monkeypatch.setattr(cost_module, "ONLINE_CLIP", clip)
        rng = np.random.default_rng(2)
        model = CostModel(list(nodes), [100, 1000], rows, {})
        steps(model, rng, 300)
        level = model.level
        model.observe(0, 500, 100 * linear(0, 500))  # a plain step the host stalled
        after_plain = model.level
        steps(model, rng, 300)
        price = model.relative(8, 500)
        model.observe(8, 500, 100 * model.seconds_for(8, 500))  # a tree step it stalled
        return level, after_plain, price, model.relative(8, 500), model

    level, after, price, after_tree, model = stalled(cost_module.ONLINE_CLIP)
    assert after == pytest.approx(level, rel=0.03) and after_tree == pytest.approx(price, rel=0.03)
    assert model.relative(1, 500) > 1.0  # a tree still costs more than plain decoding
    level, after, price, after_tree, _ = stalled(float("inf"))  # what the clip prevents
    assert after > 2 * level and after_tree > 1.5 * price
    monkeypatch.undo()
    steps(model, np.random.default_rng(3), 800, speed=3.0)  # the host now 3x slower for good
    assert model.level == pytest.approx(3.0, rel=0.05)
    # the tree line, fitted against a level that lagged the change, comes back more slowly (with
    # or without the clip: docs/decoding.md, "Online correction")
    steps(model, np.random.default_rng(4), 700, speed=3.0)
    assert model.relative(8, 500) == pytest.approx(linear(8, 500) / linear(0, 500), rel=0.03)


def test_cost_aware_decoding_feeds_the_cost_model_and_replays_do_not():
    from specstore.runtime.bench.simulate import Reference, replay_one

    model, tok = tiny_lm()
    cost = CostModel([0, 8], [0], [[1.0, 1.2]], {})
    drafter = make_drafter("pld", cost=cost)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    out = decode(model, prompt, drafter, 12)
    assert cost.observed == out.stats.steps - 1  # every step after the prefill was timed and seen
    # a tiny model's steps take far less than the table's second: the level falls (each step by at
    # most cost.ONLINE_CLIP's worth: a few steps do not take it all the way)
    assert cost.level < 0.99
    before = (cost.observed, cost.level, cost.tree_scale)
    replay_one(make_drafter("pld", cost=cost), Reference(prompt, out.token_ids), 12, None)
    assert (cost.observed, cost.level, cost.tree_scale) == before


def test_trees_are_padded_only_where_a_larger_forward_is_cheaper_at_every_context():
    # float32 on some CPUs: 2-3 row matmuls are slower than 5-row ones (BENCHMARKS.md)
    dip = CostModel([0, 1, 2, 4, 8, 16], [128, 1024], [[0.080, 0.126, 0.152, 0.102, 0.121, 0.137],
                                                        [0.080, 0.127, 0.164, 0.107, 0.122, 0.145]], {})
    assert [dip.padded_nodes(n) for n in (0, 1, 2, 3, 4, 5, 8, 16, 40)] == [0, 4, 4, 3, 4, 5, 8, 16, 40]
    # the prices are the padded forwards': the curve runs through 0.102 for 1 and 2 nodes, not 0.126/0.152
    assert dip.curve[0][1] == pytest.approx([0.102, 0.102, 0.102, 0.121, 0.137])
    assert dip.table_seconds(1, 128) == pytest.approx(0.102, abs=0.003) == dip.table_seconds(2, 128)
    flat = CostModel([0, 1, 2, 4, 8], [128], [[0.05, 0.051, 0.052, 0.053, 0.06]], {})
    assert all(flat.padded_nodes(n) == n for n in range(20))
    # a dip in one context only (a noisy median), or smaller than PAD_MARGIN: no padding
    noisy = CostModel([0, 1, 2, 4], [128, 1024], [[0.05, 0.07, 0.052, 0.053], [0.06, 0.061, 0.062, 0.063]], {})
    shallow = CostModel([0, 1, 2, 4], [128], [[0.05, 0.055, 0.052, 0.053]], {})
    assert all(m.padded_nodes(n) == n for m in (noisy, shallow) for n in range(6))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_padded_verification_is_identical_to_ar(family, monkeypatch):
    """A cost table with a dip pads pld's small trees (masked rows); the output stays ar's."""
    from specstore.runtime.verify import TreeVerifier

    model, _ = tiny_lm(family)
    dip = CostModel([0, 1, 2, 4, 8], [0], [[1.0, 1.6, 1.8, 1.2, 1.4]], {})
    drafter = make_drafter("pld", cost=dip)
    rows = []
    original = TreeVerifier.tree_logits

    def counting(self, pending, tree, pad=0):
        rows.append((len(tree), pad))
        return original(self, pending, tree, pad)

    monkeypatch.setattr(TreeVerifier, "tree_logits", counting)
    rng = np.random.default_rng(4)
    for _ in range(3):
        prompt = random_prompt(rng, model.config.vocab_size, 24)
        ar = decode(model, prompt, make_drafter("ar"), 30, Sampling())
        assert decode(model, prompt, drafter, 30, Sampling()).token_ids == ar.token_ids
    padded = [(n, pad) for n, pad in rows if pad]
    assert padded and all(1 <= n <= 2 and n + pad == 4 for n, pad in padded)
    assert all(pad == 0 for n, pad in rows if n == 0 or n >= 3)


def test_every_step_asks_the_drafter_there_is_no_gate():
    """The wrapper asks the inner drafter every step, however little its trees have paid (the
    gate that paused drafting went in the thirty-fourth session, module doc 5): a node that is
    never accepted is proposed and observed 30 times of 30, and kept while its prior says so."""
    from specstore.runtime.drafters import cost_aware
    from specstore.runtime.drafters.base import DecodeState

    class Counting(_Chain):
        def __init__(self):
            super().__init__()
            self.proposed = 0

        def propose(self, state):
            self.proposed += 1
            tree = DraftTree.chain([4])
            tree.node_data["prior"] = np.array([0.9])  # kept by the pruner
            return tree

    cost = CostModel([0, 1, 8], [0], [[1.0, 1.1, 1.8]], {})
    inner = Counting()
    wrapped = CostAwareDrafter(inner, cost, Calibrator(explore=0.0, weight=1e6), clock=lambda: 0.0)
    state = DecodeState(tokens=[1, 2, 3], num_prompt=3)
    state.budget = 8
    for _ in range(30):
        tree = wrapped.propose(state)
        assert len(tree) == 1
        wrapped.observe(state, tree, VerifyResult([], [], 5, len(tree)))
    assert inner.proposed == inner.observed == 30
    assert not hasattr(cost_aware, "DraftGate") and not hasattr(wrapped, "gate")
