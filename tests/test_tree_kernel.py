"""The cost-aware pruner's kernel calls (runtime/tree_kernel.py, csrc/draft_tree.c) give the
same bits as the Python path they replace: the sized tree, the calibration's counts, ReSpec's
trie and signals, on random trees and tables; and decoding is the same with and without them."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from specstore.pipelines.draft_head import HeadTraining, collect, train
from specstore.runtime import tree_kernel
from specstore.runtime.api import generate
from specstore.runtime.cost import CostModel
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters import respec as rs
from specstore.runtime.drafters.cost_aware import Calibrator, Sizing, best_size, calibrated_prune, prune
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.drafters.respec_pool import Candidate
from specstore.runtime.tree import DraftTree, clip_depth
from specstore.runtime.verify import VerifyResult

needs_kernel = pytest.mark.skipif(not tree_kernel.available(), reason="the CPU kernel is not loaded here")


@pytest.fixture
def no_kernel(monkeypatch):
    """The Python paths: tree_kernel finds no library."""
    monkeypatch.setattr(tree_kernel, "_lib", lambda: None)


def random_tree(rng, n, buckets=6):
    tree = DraftTree(rng.integers(0, 50, n), [-1] + [int(rng.integers(-1, i)) for i in range(1, n)])
    tree.node_data["bucket"] = rng.integers(0, buckets, n)
    if rng.random() < 0.6:
        tree.node_data["prior"] = rng.random(n) * 1.2 - 0.1  # a few outside [0, 1]: clamped
    return tree


def random_calibrator(rng, buckets=6):
    cal = Calibrator(weight=float(rng.choice([2.0, 4.0])), explore=float(rng.choice([0.0, 0.1])))
    for _ in range(int(rng.integers(0, 40))):
        cal.add(int(rng.integers(0, buckets)), int(rng.integers(1, 12)), float(rng.integers(1, 9)), float(rng.integers(0, 2)))
    return cal


def random_cost(rng):
    """A cost table at one context, or at two (prices interpolated in the context between them)."""
    contexts = [0] if rng.random() < 0.4 else [128, 1024]
    rows = []
    for _ in contexts:
        curve = np.cumsum(rng.random(65) * 0.2)
        rows.append(list(rng.uniform(0.5, 2.0) + curve - curve[0]))
    cost = CostModel(list(range(65)), contexts, rows, {})
    cost.tree_scale, cost.tree_offset = rng.uniform(0.5, 1.5), rng.uniform(-0.1, 0.3)
    return cost


@needs_kernel
def test_kernel_sizing_is_the_python_pruner_bit_for_bit():
    rng = np.random.default_rng(7)
    for trial in range(600):
        n = int(rng.integers(1, 65))
        tree, cal, cost = random_tree(rng, n), random_calibrator(rng), random_cost(rng)
        if trial % 7 == 0:  # ties: equal path probabilities break by depth, then index
            tree.node_data["bucket"] = np.zeros(n, dtype=np.int64)
            tree.node_data.pop("prior", None)
        overhead = float(rng.choice([0.0, 0.05, 0.3]))
        context = None if trial % 3 == 0 else int(rng.integers(1, 3000))  # between, at and past the measured contexts
        order, k, rate, p = tree_kernel.tree_size(cal.workspace, tree.parents, tree.node_data["bucket"],
                                                  tree.node_data.get("prior"), 0.5, cal.table, cal.weight, cal.explore,
                                                  cost.price_terms(n, context), overhead, want_p=True)
        p_py = cal.probabilities(tree)
        order_py, k_py, rate_py = best_size(tree, p_py, cost, context, overhead)
        assert p.tolist() == p_py.tolist()  # exact: the same operations in the same order
        assert order.tolist() == order_py.tolist() and k == k_py and rate == rate_py
        kept, kept_py = calibrated_prune(tree, cal, cost, context, overhead), prune(tree, p_py, cost, context, overhead)
        assert kept.tokens.tolist() == kept_py.tokens.tolist() and kept.parents.tolist() == kept_py.parents.tolist()


@needs_kernel
def test_kernel_counts_are_the_python_counts(monkeypatch):
    rng = np.random.default_rng(8)
    fast, slow = Calibrator(), Calibrator()
    for _ in range(300):
        n = int(rng.integers(1, 40))
        tree = random_tree(rng, n, buckets=300)  # past the first table: it grows
        accepted = sorted(rng.choice(n, int(rng.integers(0, n + 1)), replace=False).tolist())
        result = VerifyResult(accepted, [0] * len(accepted), 1, n)
        fast.update(tree, result)
        with monkeypatch.context() as m:
            m.setattr(tree_kernel, "_lib", lambda: None)
            slow.update(tree, result)
    assert fast.table.shape == slow.table.shape and (fast.table == slow.table).all() and fast.totals()[0] > 0


def test_the_table_grows_and_refuses_a_bucket_no_drafter_makes(no_kernel):
    cal = Calibrator()
    tree = DraftTree.chain([1, 2])
    tree.node_data["bucket"] = np.array([5000, 5000])
    cal.update(tree, VerifyResult([0], [1], 2, 2))
    assert len(cal.table) > 5000 and cal.cell(5000, 1) == (1.0, 1.0) and cal.cell(5000, 2) == (1.0, 0.0)
    assert cal.rate(5000, 1) == 1.0 and cal.rate(7, 1) is None and cal.totals(10**9) == (0.0, 0.0)
    tree.node_data["bucket"] = np.array([-1, 0])
    with pytest.raises(ValueError, match="calibration bucket -1"):
        cal.update(tree, VerifyResult([0], [1], 2, 2))


@needs_kernel
def test_kernel_grows_the_table_for_a_new_bucket():
    cal = Calibrator(explore=0.0)
    tree = DraftTree.chain([1, 2])
    tree.node_data["bucket"] = np.array([900, 901])
    cal.update(tree, VerifyResult([0, 1], [1, 2], 3, 2))
    assert cal.cell(900, 1) == (1.0, 1.0) and cal.cell(901, 2) == (1.0, 1.0)
    found = cal.size(tree, CostModel.flat().price_terms(2), 0.0)
    assert found is not None and found[1] == 2
    tree.node_data["bucket"] = np.array([2000, 1])
    assert cal.size(tree, CostModel.flat().price_terms(2), 0.0) is not None and len(cal.table) > 2000


class _Head:
    """The two things respec's signal asks of a draft head: its rows and a token's probability."""

    def __init__(self, rows, vocab):
        self.rows, self.vocab = rows, vocab

    def probability(self, probs, token):
        row = int(self.rows[token]) if 0 <= token < len(self.rows) else self.vocab
        return float(probs[row]) if row < self.vocab else None


def random_proposal(rng, signal):
    """A ReSpec drafter with random scores and head, and its chosen candidates (shared prefixes)."""
    vocab = 12
    rows = np.full(30, vocab, dtype=np.int64)  # tokens 0..29, the head knows 12 of them
    rows[rng.choice(30, vocab, replace=False)] = np.arange(vocab)
    sources = list(rs.SOURCE_INDEX) + ["elsewhere"]
    drafter = rs.ReSpecDrafter(None, rs.ReSpecConfig(head="off", cost_signal=signal, max_nodes=int(rng.choice([4, 8, 24, 64]))))
    chosen = []
    for _ in range(int(rng.integers(1, 7))):
        key = (str(rng.choice(sources)), int(rng.integers(0, 3)))
        prefix = chosen[int(rng.integers(0, len(chosen)))].tokens[: int(rng.integers(0, 4))] if chosen and rng.random() < 0.5 else []
        tokens = list(prefix) + rng.integers(0, 30, int(rng.integers(1, 12))).tolist()
        chosen.append(Candidate(key, tokens, int(rng.choice([0, 1, 2, 3, 4, 5, 9, 16, 17]))))
        drafter.scores[key] = float(rng.choice([0.0, 0.5, 1.0, 2.0, 3.0, 7.5, rng.random() * 8]))
    if rng.random() < 0.7:
        drafter.head = _Head(rows, vocab)
        drafter.head_probs = rng.dirichlet(np.full(vocab, 0.3)).astype(np.float32)
    return drafter, chosen


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return (a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist() and a.paths == b.paths
            and a.node_data["bucket"].tolist() == b.node_data["bucket"].tolist()
            and a.node_data["prior"].tolist() == b.node_data["prior"].tolist())


@needs_kernel
@pytest.mark.parametrize("signal", ["full", "source"])
def test_kernel_trie_and_signals_are_respecs_python_ones(signal, monkeypatch):
    rng = np.random.default_rng(9)
    for _ in range(400):
        drafter, chosen = random_proposal(rng, signal)
        fast, unsized = drafter._trie(chosen)
        with monkeypatch.context() as m:
            m.setattr(tree_kernel, "_lib", lambda: None)
            slow, _ = drafter._trie(chosen)
        assert unsized is None and same_tree(fast, slow)


@needs_kernel
@pytest.mark.parametrize("signal", ["full", "source"])
def test_kernel_sized_proposal_is_the_wrappers_pruned_tree(signal, monkeypatch):
    """respec's one-call proposal (trie, signals, depth clip, calibrated sizing) keeps what the
    cost-aware wrapper's Python steps keep, and counts the nodes it proposed the same."""
    rng = np.random.default_rng(10)
    for trial in range(400):
        drafter, chosen = random_proposal(rng, signal)
        cal, cost = random_calibrator(rng, buckets=rs.FALLBACK_BUCKET), random_cost(rng)
        for _ in range(int(rng.integers(0, 200))):  # counts where the pool's buckets fall
            cal.add(int(rng.integers(0, rs.FALLBACK_BUCKET)), int(rng.integers(1, 10)), float(rng.integers(1, 9)),
                    float(rng.integers(0, 2)))
        if trial == 0:
            cal = Calibrator()  # a table the pool's buckets are past: it grows
        sizing = Sizing(cal, cost, int(rng.integers(10, 500)), float(rng.choice([0.0, 0.05, 0.3])), int(rng.integers(1, 14)))
        fast, proposed = drafter._trie(chosen, sizing)
        with monkeypatch.context() as m:
            m.setattr(tree_kernel, "_lib", lambda: None)
            slow, unsized = drafter._trie(chosen, sizing)
        assert unsized is None
        slow = clip_depth(slow, sizing.max_depth)
        assert proposed == len(slow)
        if len(slow):
            slow = prune(slow, cal.probabilities(slow), cost, sizing.context, sizing.extra)
        assert same_tree(fast, slow)


@needs_kernel
def test_respec_decodes_the_same_with_and_without_the_kernel(own_output_store, tmp_path, monkeypatch):
    """Cost-aware respec with a draft head over the tiny model's own answers: the same tokens,
    the same kept nodes and the same calibration counts with the kernel's calls as without."""
    store, loaded, ar = own_output_store
    docs = [np.asarray(loaded.tokenizer(p, add_special_tokens=False)["input_ids"] + ids) for p, ids in ar.items()]
    head = train(loaded.model, loaded.info, collect(loaded.model, docs, max_tokens=2_000),
                 HeadTraining(epochs=3, batch=16, lr=1e-2, holdout=0.0, vocabulary=256))
    path = head.save(tmp_path / "head.safetensors")
    ds = Datastore.open(store, "own", loaded.info)
    runs, calls = [], {True: [], False: []}
    sized = tree_kernel.respec_sized

    def counted(*args):  # the kernel's sized trie with the head's signal was what the first run used
        found = sized(*args)
        calls[kernel].append(found is not None and args[7] is not None)
        return found

    for kernel in (True, False):
        with monkeypatch.context() as m:
            m.setattr(tree_kernel, "respec_sized", counted)
            if not kernel:
                m.setattr(tree_kernel, "_lib", lambda: None)
            cost = CostModel([0, 1, 64], [0], [[1.0, 1.05, 3.0]], {}, online=False)  # prices that do not follow the clock
            drafter = make_drafter("respec", ds, cost=cost, head=str(path), entropy_threshold=math.inf)
            drafter.fix_drafting(0.0)  # the trees must not depend on how long drafting took
            outs = [generate(loaded.model, loaded.tokenizer, p, drafter, max_new_tokens=len(ids)).token_ids for p, ids in ar.items()]
            runs.append((outs, drafter.num_kept, drafter.num_proposed, drafter.calibrator.table.copy()))
    (outs, kept, proposed, table), (outs_py, kept_py, proposed_py, table_py) = runs
    assert calls[True] and all(calls[True]) and calls[False] and not any(calls[False])
    assert outs == outs_py == list(ar.values())
    assert kept == kept_py and proposed == proposed_py > kept > 0
    assert table.shape == table_py.shape and (table == table_py).all()


@needs_kernel
def test_copies_count_into_their_own_tables_and_price_from_their_own_rows():
    """A copied calibrator, cost model or drafter (the bench copies cost models) holds buffers of
    its own: the kernel never writes through a copy into the original, nor reads freed rows."""
    rng = np.random.default_rng(13)
    cal = Calibrator()
    tree = random_tree(rng, 20)
    result = VerifyResult([0], [1], 2, 20)
    twin = copy.deepcopy(cal)
    assert twin.workspace.ia != cal.workspace.ia
    twin.update(tree, result)
    assert cal.totals()[0] == 0 and twin.totals()[0] > 0  # the copy counted into its own table
    cal.update(tree, result)
    assert (cal.table == twin.table).all()
    cost = random_cost(rng)
    cost.relative_upto(64, 300)
    copied = copy.deepcopy(cost)
    cost.relative_upto(300, 300)  # the original's rows rebuilt: the copy keeps its own
    drafter, chosen = random_proposal(rng, "full")
    a, sized_a = drafter._trie(chosen, Sizing(cal, cost, 300, 0.1, 16))
    b, sized_b = drafter._trie(chosen, Sizing(cal, copied, 300, 0.1, 16))
    assert sized_a == sized_b is not None and same_tree(a, b)
    assert copy.deepcopy(drafter)._workspace.ia != drafter._workspace.ia
