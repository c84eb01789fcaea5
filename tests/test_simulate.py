"""The simulator replays a stored greedy reference through decode()'s own loop: per step it
commits, drafts and observes exactly what decoding with the target does, whichever way ar
stopped (EOS inside a draft, max_new_tokens, the context), and never reads past the reference."""

from __future__ import annotations

import numpy as np
import pytest

from specstore.runtime.bench.simulate import Reference, ReplayVerifier, reference_states, simulate_one
from specstore.runtime.decode import decode
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.sampling import Sampling
from specstore.runtime.tree import DraftTree
from tests.decoding_helpers import OracleDrafter, tiny_lm


class Recorder(OracleDrafter):
    """The oracle drafter, keeping every state it was shown (tokens, budget, hidden, logits)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def propose(self, state):
        self.seen.append((list(state.tokens), state.budget, state.last_hidden, state.last_logits))
        return super().propose(state)


def _same_run(model, prompt, max_new, eos=(), context=None, depth=8):
    ar = decode(model, prompt, make_drafter("ar"), max_new, Sampling(), eos, context=context)
    vocab = model.config.vocab_size
    truth = ar.token_ids + [7] * 20  # the oracle also drafts past the reference's end
    real = Recorder(truth, vocab, seed=1, depth=depth)
    want = decode(model, prompt, real, max_new, Sampling(), eos, context=context)
    replayed = Recorder(truth, vocab, seed=1, depth=depth)
    ref = Reference(prompt, ar.token_ids)
    got = simulate_one(replayed, ref, max_new, context, reference_states(model, ref))
    assert got.accepted_per_step == want.stats.accepted_per_step
    assert (got.num_drafted, got.num_accepted, got.steps) == (want.stats.num_drafted, want.stats.num_accepted, want.stats.steps)
    assert len(replayed.seen) == len(real.seen)
    for (tokens, budget, hidden, logits), (t2, b2, h2, l2) in zip(real.seen, replayed.seen, strict=True):
        assert (tokens, budget) == (t2, b2)
        assert int(logits.argmax()) == int(l2.argmax()) == tokens[-1]
        assert (hidden - h2).abs().max() < 1e-3
    return ar


def test_replay_equals_decoding_when_ar_stops_on_eos():
    model, _ = tiny_lm("llama")
    prompt = list(range(200, 230))
    ref = decode(model, prompt, make_drafter("ar"), 25, Sampling()).token_ids
    ar = _same_run(model, prompt, 25, eos={ref[9]})
    assert ar.stop_reason == "eos" and len(ar.token_ids) < 25


def test_replay_equals_decoding_at_max_new_tokens():
    model, _ = tiny_lm("llama")
    ar = _same_run(model, list(range(100, 120)), 30)
    assert ar.stop_reason == "length"


def test_replay_equals_decoding_at_the_context_limit():
    model, _ = tiny_lm("llama")
    ar = _same_run(model, list(range(300, 330)), 50, context=40)
    assert ar.stop_reason == "context" and len(ar.token_ids) == 10


def test_replay_verifier_accepts_along_the_reference():
    ref = Reference([1, 2, 3], [4, 5, 6, 7])
    replay = ReplayVerifier(ref)
    assert replay.prefill([1, 2, 3]).bonus == 4
    out = replay.step(4, DraftTree.from_paths([[5, 9], [5, 6, 8]]))
    assert out.result.accepted_tokens == [5, 6] and out.result.bonus == 7 and out.hidden is None
    assert out.result.num_drafted == 4
    with pytest.raises(AssertionError, match="past its reference"):
        replay.step(7, DraftTree.empty())


def test_a_lossy_acceptance_rule_cannot_be_replayed():
    replay = ReplayVerifier(Reference([1, 2], [3, 4]))
    replay.prefill([1, 2])
    with pytest.raises(SpecstoreError, match="cannot be replayed"):
        replay.step(3, DraftTree.chain([4]), acceptance=lambda logits, tree, sampling: ([], 0, []))


def test_predicted_speedup_prices_each_replayed_tree():
    """Each replayed verification is priced at its tree size and context; ar pays one 0-node
    forward per token after the first; drafting time is added to the method's side."""
    from specstore.runtime.bench.simulate import predicted_seconds, predicted_speedup, replay_one
    from specstore.runtime.cost import CostModel

    model, _ = tiny_lm()
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    ar = decode(model, prompt, make_drafter("ar"), 24, Sampling())
    rep = replay_one(OracleDrafter(ar.token_ids + [7] * 20, model.config.vocab_size, seed=2), Reference(prompt, ar.token_ids), 24, None)
    sizes = [n for n, _ in rep.trees]
    assert len(rep.trees) == rep.stats.steps - 1 and [c for _, c in rep.trees][0] == len(prompt)
    per_node = CostModel([0, 1, 10], [0], [[1.0, 1.1, 2.0]], {})  # 1 s + 0.1 s per node, any context
    method, ar_s = predicted_seconds([rep], per_node)
    assert ar_s == pytest.approx(len(ar.token_ids) - 1)
    assert method == pytest.approx(sum(1.0 + 0.1 * n for n in sizes) + rep.stats.drafting_s)
    assert predicted_speedup([rep], per_node) == pytest.approx(ar_s / method)
    flat, _ = predicted_seconds([rep], CostModel.flat())
    assert flat - rep.stats.drafting_s == pytest.approx(rep.stats.steps - 1)  # flat costs: forwards only
    # a cost model with a prefill line prices each request's prefill on both sides (the bench's
    # wall times hold it), which pulls the predicted speedup towards 1
    with_prefill = CostModel([0, 1, 10], [0], [[1.0, 1.1, 2.0]], {}, prefill=[[4, 2.0], [20, 6.0]])
    assert with_prefill.prefill_seconds(len(prompt)) == pytest.approx(2.0 + 0.25 * (len(prompt) - 4))
    method_p, ar_p = predicted_seconds([rep], with_prefill)
    extra = with_prefill.prefill_seconds(len(prompt))
    assert (method_p, ar_p) == (pytest.approx(method + extra), pytest.approx(ar_s + extra))
    assert 1.0 < predicted_speedup([rep], with_prefill) < predicted_speedup([rep], per_node)


def test_the_replay_streams_the_cold_buffer_every_step_and_changes_nothing_else(monkeypatch):
    """Between replayed steps the verifier streams over a buffer of the target's weight bytes
    (the bench's dtype, capped), so drafting runs on caches as a decoding step leaves them; the
    replay's steps, trees and MAT are the same with and without it."""
    from specstore.runtime.bench import simulate as sim

    model, _ = tiny_lm()
    params = sum(p.numel() for p in model.parameters())
    assert sim.cold_buffer(model, "bfloat16").nbytes == params * 2
    assert sim.cold_buffer(model, "float32").nbytes == params * 4
    assert sim.cold_buffer(None, "bfloat16") is None
    monkeypatch.setattr(sim, "COLD_BUFFER_CAP", 4096)
    assert sim.cold_buffer(model, "float32").nbytes == 4096

    class Counting(np.ndarray):
        calls = 0

        def sum(self, *args, **kwargs):
            Counting.calls += 1
            return super().sum(*args, **kwargs)

    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    ar = decode(model, prompt, make_drafter("ar"), 24, Sampling())
    ref = Reference(prompt, ar.token_ids)
    def make():
        return OracleDrafter(ar.token_ids + [7] * 20, model.config.vocab_size, seed=2)

    cold = sim.replay_one(make(), ref, 24, None, evict=np.ones(64, dtype=np.float32).view(Counting))
    warm = sim.replay_one(make(), ref, 24, None)
    assert Counting.calls == len(cold.trees) > 0  # once a step
    assert cold.trees == warm.trees and cold.stats.accepted_per_step == warm.stats.accepted_per_step


def test_each_side_of_a_prediction_is_priced_with_its_own_corrected_copy():
    """simulate prices a method's replayed trees with the copy of the cost model that method's
    bench steps corrected (its level and tree corrections together), and every plain forward (its
    steps without a tree, ar's, the prefills) with ar's copy (both stored in the result); the
    table for both where either copy is missing (an older result) or with --refresh-cost, never
    a mix."""
    from types import SimpleNamespace

    from specstore.runtime.bench.simulate import Replay, predicted_seconds, pricing
    from specstore.runtime.cost import CostModel
    from specstore.runtime.decode import DecodeStats

    table = CostModel.flat(0.02)
    ar_copy, rest_copy, rest_aware = CostModel.flat(0.015), CostModel.flat(0.016), CostModel.flat(0.017)
    bench = SimpleNamespace(cost_models={"ar": ar_copy.to_json(), "rest": rest_copy.to_json(),
                                         "rest+cost": rest_aware.to_json()})
    price, ar_price = pricing(bench, "rest", table, aware=True)
    assert price.seconds == rest_aware.seconds and ar_price.seconds == ar_copy.seconds  # the cost-aware run's copy
    price, _ = pricing(bench, "rest", table, aware=False)
    assert price.seconds == rest_copy.seconds  # the plain run's
    # the method's own level with its tree corrections (learnt against it), ar's for plain forwards
    ar_copy.level, rest_aware.level, rest_aware.tree_scale, rest_aware.tree_offset = 1.05, 1.21, 0.9, -0.2
    bench.cost_models.update({"ar": ar_copy.to_json(), "rest+cost": rest_aware.to_json()})
    price, ar_price = pricing(bench, "rest", table, aware=True)
    assert (price.level, price.tree_scale, price.tree_offset, ar_price.level) == (1.21, 0.9, -0.2, 1.05)
    stats = DecodeStats(steps=4, accepted_per_step=[1, 1, 3, 1], drafting_s=0.001)
    rep = Replay(stats, [(0, 10), (3, 11), (0, 14)], prompt_len=10)
    method, ar_s = predicted_seconds([rep], price, ar_price)
    assert method == pytest.approx(ar_price.seconds_for(0, 10) + price.seconds_for(3, 11) + ar_price.seconds_for(0, 14) + 0.001)
    assert ar_s == pytest.approx(sum(ar_price.seconds_for(0, c) for c in range(10, 10 + stats.num_tokens - 1)))
    assert price.seconds_for(0, 10) != ar_price.seconds_for(0, 10)  # so the plain steps' pricing was tested
    assert pricing(bench, "rest", table, aware=True, refresh=True) == (table, table)
    assert pricing(bench, "dresd", table, aware=True) == (table, table)  # no copy of its own
    older = SimpleNamespace(cost_models={"rest": rest_copy.to_json()})  # before ar kept one
    assert pricing(older, "rest", table, aware=True) == (table, table)


def test_fixed_drafting_makes_a_replay_independent_of_its_clock():
    """--drafting-ms: the cost-aware wrapper prices every step's drafting at a fixed figure, so
    two replays whose drafting took very different times give the same trees, and the
    prediction adds that figure a step; priced as measured, the trees differ."""
    import copy
    import itertools

    from specstore.runtime.bench.simulate import fixed_drafting, predicted_seconds, replay_one
    from specstore.runtime.cost import CostModel
    from tests.decoding_helpers import random_prompt

    model, _ = tiny_lm()
    prompt = random_prompt(np.random.default_rng(0), model.config.vocab_size, 40)
    ar = decode(model, prompt, make_drafter("ar"), 40, Sampling())
    ref = Reference(prompt, ar.token_ids)
    cost = CostModel([0, 1, 16], [0], [[1.0, 1.3, 4.0]], {})  # steep: what drafting costs decides trees

    def make(tick_s, fixed):
        drafter = make_drafter("pld", cost=copy.deepcopy(cost))
        ticks = itertools.count()
        drafter.clock = lambda: next(ticks) * tick_s  # each timed stretch of drafting takes tick_s
        return fixed_drafting(drafter, fixed)

    slow, fast = replay_one(make(5.0, None), ref, 40, None), replay_one(make(0.0, None), ref, 40, None)
    assert slow.trees != fast.trees
    a, b = replay_one(make(5.0, 0.002), ref, 40, None), replay_one(make(0.0, 0.002), ref, 40, None)
    assert a.trees == b.trees and a.stats.accepted_per_step == b.stats.accepted_per_step
    assert any(n for n, _ in a.trees)
    method, _ = predicted_seconds([a], cost, drafting_s=0.002)
    assert method == pytest.approx(sum(cost.seconds_for(n, c) for n, c in a.trees) + 0.002 * a.stats.steps)
    plain = make_drafter("pld")
    assert fixed_drafting(plain, 0.002) is plain and not hasattr(plain, "fixed_drafting_s")  # no wrapper: as it was
