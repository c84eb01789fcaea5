"""ReSpec: entropy trigger, EMA scores, threshold gate, greedy identity with ar (relaxed off),
the relaxed rule checked against the logits (relaxed on), the model fallback, CLI options."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specstore.runtime.api import generate
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.drafters.model import ModelDrafter
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.drafters.respec import ReSpecConfig, ReSpecDrafter, entropy, resync_candidates
from specstore.runtime.drafters.respec_pool import Candidate
from specstore.runtime.relaxed import RelaxedRule, accept_relaxed
from specstore.runtime.sampling import Sampling
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import TreeVerifier, VerifyResult

V = 50


def logits_with_entropy(h: float) -> torch.Tensor:
    """[V] logits whose softmax has entropy ``h`` nats (bisection on a two-level distribution)."""
    lo, hi = 0.0, 60.0  # logit gap of token 0 over the rest: entropy falls as the gap grows
    for _ in range(200):
        mid = (lo + hi) / 2
        x = torch.zeros(V, dtype=torch.float64)
        x[0] = mid
        lo, hi = (mid, hi) if entropy(x) > h else (lo, mid)
    x = torch.zeros(V)
    x[0] = (lo + hi) / 2
    return x


class StubDrafter:
    """A fallback that records calls and drafts a fixed chain."""

    name, lossless, source = "stub", True, "model"

    def __init__(self):
        self.calls = 0

    def reset(self, prompt_ids):
        pass

    def propose(self, state):
        self.calls += 1
        return DraftTree.chain([7, 8])

    def observe(self, state, tree, result):
        pass


def test_entropy_matches_the_definition():
    x = torch.randn(V)
    p = torch.softmax(x.double(), -1)
    assert entropy(x) == pytest.approx(float(-(p * p.log()).sum()), rel=1e-5)
    assert entropy(torch.zeros(V)) == pytest.approx(math.log(V), rel=1e-6)
    masked = torch.full((V,), float("-inf"))  # a masked vocabulary: those tokens add nothing, no NaN
    masked[:4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    q = torch.softmax(masked[:4], 0)
    assert entropy(masked) == pytest.approx(float(-(q * q.log()).sum()), rel=1e-5)
    assert entropy(x.to(torch.bfloat16)) == pytest.approx(entropy(x.to(torch.bfloat16).float()), rel=1e-5)
    peaked = torch.zeros(V)
    peaked[7] = 80.0  # one token takes it all: about 0, never negative beyond rounding
    assert abs(entropy(peaked)) < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("size", [V, 49152, 49152 + 7])
def test_entropy_of_bf16_and_float32_logits_matches_the_definition(size, dtype):
    """bf16 and float32 logits (the kernel's one call where it has one, torch's ops elsewhere):
    spread, uniform, masked with -inf, one token taking all, a length that is no multiple of 8 or
    16; NaN or +inf logits give NaN or torch's answer, never a number that looks like a confident
    step."""
    from specstore.runtime import gemm

    g = torch.Generator().manual_seed(size)
    masked = torch.full((size,), float("-inf"))
    masked[:5] = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.5])
    peaked = torch.zeros(size)
    peaked[3] = 90.0
    for logits in (3 * torch.randn(size, generator=g), torch.zeros(size), masked, peaked):
        b = logits.to(dtype)
        p = torch.softmax(b.double(), 0)
        want = float(-(p[p > 0] * p[p > 0].log()).sum())
        # torch's way (CPUs without the kernel's call) sums 49k float32 terms: ~1e-5 relative
        assert entropy(b) == pytest.approx(want, rel=5e-5, abs=1e-4)
        fast = gemm.entropy(b)
        assert fast is None or fast == pytest.approx(want, rel=5e-5, abs=1e-4)
    if dtype == torch.float32 and gemm.available():  # every CPU the kernel runs on has the float32 call
        assert gemm.entropy(torch.zeros(size)) == pytest.approx(math.log(size), rel=1e-6)
    for bad in (float("nan"), float("inf")):
        broken = torch.zeros(size, dtype=dtype)
        broken[size // 2] = bad
        assert math.isnan(entropy(broken))
        assert gemm.entropy(broken) is None or math.isnan(gemm.entropy(broken))


@pytest.mark.parametrize("threshold", [0.3, 1.0, 2.5])
def test_trigger_fires_exactly_below_the_entropy_threshold(threshold):
    fallback = StubDrafter()
    drafter = ReSpecDrafter(None, ReSpecConfig(entropy_threshold=threshold), fallback)
    tokens = [1, 2, 3, 4, 1, 2, 3]  # the context source always has a candidate: 4 1 2 3
    for h in np.linspace(0.05, 3.5, 40):
        logits = logits_with_entropy(float(h))
        state = DecodeState(tokens=list(tokens), num_prompt=3, last_logits=logits, budget=8)
        calls = fallback.calls
        tree = drafter.propose(state)
        fired = entropy(logits) < threshold
        assert drafter.triggers(state) == fired
        assert (fallback.calls == calls) == fired, (h, threshold)
        assert ("candidate_keys" in tree.meta) == fired


def test_ema_follows_its_update_rule():
    cfg = ReSpecConfig(ema_alpha=0.3, prior_score=2.0)
    drafter = ReSpecDrafter(None, cfg, StubDrafter())
    key, expected = ("suffix", -5), 2.0
    for accepted in [3, 0, 0, 5, 1, 8]:
        expected = 0.7 * expected + 0.3 * accepted
        assert drafter.update(key, accepted) == pytest.approx(expected)
    assert drafter.score(("dense", 1)) == 2.0  # unseen keys start at the prior


def test_observe_credits_each_candidate_with_its_accepted_prefix():
    drafter = ReSpecDrafter(None, ReSpecConfig(ema_alpha=0.5, prior_score=1.0), StubDrafter())
    paths = {("context", -3): [5, 6, 7], ("suffix", -9): [5, 6, 9], ("dense", 4): [8]}
    tree = DraftTree.from_paths(paths.values())
    tree.meta["candidate_keys"] = list(paths)
    nodes = tree.paths
    state = DecodeState(tokens=[1, 5, 6, 7, 2], num_prompt=1)
    drafter.observe(state, tree, VerifyResult(nodes[0], [5, 6, 7], 2, len(tree)))
    assert drafter.scores == {("context", -3): 0.5 + 1.5, ("suffix", -9): 0.5 + 1.0, ("dense", 4): 0.5}


@pytest.mark.parametrize("source_prior", [True, False])
def test_a_new_key_starts_at_its_sources_score_where_that_is_higher(source_prior):
    drafter = ReSpecDrafter(None, ReSpecConfig(ema_alpha=0.5, prior_score=1.0, source_prior=source_prior), StubDrafter())
    state = DecodeState(tokens=[1, 5, 6, 7, 2], num_prompt=1)
    for _ in range(3):  # three steps: one context thread accepted whole (4), another 2 of 3, a dense one none
        paths = {("context", -3): [5, 6, 7, 8], ("context", -7): [5, 6, 9], ("dense", 4): [3]}
        tree = DraftTree.from_paths(paths.values())
        tree.meta["candidate_keys"] = list(paths)
        drafter.observe(state, tree, VerifyResult(tree.paths[0], [5, 6, 7, 8], 2, len(tree)))
    # per step the source's best candidate counts once: 1 -> 2.5 -> 3.25 -> 3.625
    assert drafter.source_scores == {"context": 3.625, "dense": 0.125}
    assert drafter.score(("context", -3)) == pytest.approx(0.5 * (0.5 * (0.5 * 1 + 2) + 2) + 2)  # its own EMA
    assert drafter.score(("context", 40)) == (3.625 if source_prior else 1.0)  # a new thread of a source on a roll
    assert drafter.score(("dense", 40)) == 1.0  # a failing source's new threads keep the prior's try
    drafter.reset([1])
    assert drafter.score(("context", 40)) == 1.0 and drafter.source_scores == {}


class FixedPool:
    """A candidate pool that always offers copies of the same candidates."""

    def __init__(self, candidates):
        self.candidates = candidates

    def gather(self, state, length):
        return [Candidate(c.key, list(c.tokens[:length]), c.match) for c in self.candidates]


def test_candidates_under_the_threshold_never_reach_the_verifier():
    pool = [Candidate(("context", -1), [10, 11]), Candidate(("suffix", -2), [12, 13]),
            Candidate(("dense", -3), [14, 15]), Candidate(("dense", -4), [16])]
    fallback = StubDrafter()
    drafter = ReSpecDrafter(None, ReSpecConfig(score_threshold=1.0, entropy_threshold=math.inf, max_candidates=2), fallback)
    drafter.pool = FixedPool(pool)
    drafter.scores = {("context", -1): 0.2, ("suffix", -2): 3.0, ("dense", -3): 0.99, ("dense", -4): 1.0}
    state = DecodeState(tokens=[1, 2, 3], num_prompt=1, budget=8)
    tree = drafter.propose(state)
    assert tree.meta["candidate_keys"] == [("suffix", -2), ("dense", -4)]  # best first, below-threshold out
    assert set(tree.tokens.tolist()) == {12, 13, 16}
    drafter.scores = dict.fromkeys(drafter.scores, 0.0)  # nobody qualifies: the fallback drafts
    tree = drafter.propose(state)
    assert tree.tokens.tolist() == [7, 8] and fallback.calls == 1 and tree.node_data["retrieved"].tolist() == [False, False]


def test_resync_candidates_go_on_past_the_token_the_target_replaced():
    drafts = [[5, 6, 7, 8, 9], [5, 6, 9, 10], [5, 7, 1, 2], [5, 6, 7], [5, 6, 3, 4, 11, 12], [5, 6, 2, 8, 9], [5, 6, 4, 8]]
    found = resync_candidates(drafts, [5, 6], 4)
    # a substitution ([8, 9], [10]), a skipped token (3: the target's 4 was the draft's next), each
    # continuation once; a draft off the committed path, one with nothing after the replaced
    # token and one the target followed (4) give none
    assert [c.tokens for c in found] == [[8, 9], [10], [11, 12]]
    assert {c.key for c in found} == {("resync", 0)} and all(c.match == 0 for c in found)
    assert resync_candidates([[1, 2, 3]], [], 9) == [Candidate(("resync", 0), [2, 3])]  # nothing committed: the first token replaced


@pytest.mark.parametrize("resync", [True, False])
def test_respec_drafts_the_resync_candidate_the_step_after_a_substitution(resync):
    pool = FixedPool([Candidate(("suffix", -1), [10, 11, 12, 13, 14])])
    drafter = ReSpecDrafter(None, ReSpecConfig(entropy_threshold=math.inf, length_factor=0.0, draft_length=3, resync=resync), StubDrafter())
    drafter.pool = pool
    state = DecodeState(tokens=[1, 2, 3], num_prompt=1, budget=8)
    tree = drafter.propose(state)
    assert tree.tokens.tolist() == [10, 11, 12] and tree.meta["candidate_tokens"] == [[10, 11, 12, 13, 14]]
    drafter.observe(state, tree, VerifyResult(tree.paths[0][:1], [10], 99, len(tree)))  # 11 replaced by 99
    tree = drafter.propose(DecodeState(tokens=[1, 2, 3, 10, 99], num_prompt=1, budget=8))
    paths = {key: tree.tokens[nodes].tolist() for key, nodes in zip(tree.meta["candidate_keys"], tree.paths, strict=True)}
    assert paths == ({("suffix", -1): [10, 11, 12], ("resync", 0): [12, 13, 14]} if resync else {("suffix", -1): [10, 11, 12]})
    # a relaxed acceptance (lossy mode) starts no resync; the next observe forgets the last one
    drafter.observe(state, tree, VerifyResult([], [], 5, len(tree), relaxed=[False]))
    assert drafter.resync == []


def test_a_fallback_chain_resyncs_too():
    class Chain(StubDrafter):
        source = "lookup"

        def propose(self, state):
            return DraftTree.chain([7, 8, 9, 10])

    drafter = ReSpecDrafter(None, ReSpecConfig(entropy_threshold=0.0), Chain())  # never retrieves: the fallback drafts
    state = DecodeState(tokens=[1, 2, 3], num_prompt=1, budget=8)
    tree = drafter.propose(state)
    assert tree.meta["candidate_tokens"] == [[7, 8, 9, 10]]
    drafter.observe(state, tree, VerifyResult([0], [7], 42, len(tree)))  # 8 replaced by 42
    assert [c.tokens for c in drafter.resync] == [[9, 10]]


def test_draft_length_follows_the_score():
    pool = FixedPool([Candidate(("suffix", -1), list(range(10, 20))), Candidate(("dense", -2), list(range(20, 30)))])
    drafter = ReSpecDrafter(None, ReSpecConfig(entropy_threshold=math.inf, length_factor=2.0, draft_length=8), StubDrafter())
    drafter.pool = pool
    drafter.scores = {("suffix", -1): 0.6, ("dense", -2): 2.2}
    assert drafter.draft_length_for(("suffix", -1), 8) == 3 and drafter.draft_length_for(("dense", -2), 8) == 6
    assert drafter.draft_length_for(("new", 0), 8) == 3  # prior score 1: ceil(2) + 1
    assert drafter.draft_length_for(("dense", -2), 4) == 4 and drafter.draft_length_for(("zero", 0), 8) == 3
    drafter.scores[("zero", 0)] = 0.0
    assert drafter.draft_length_for(("zero", 0), 8) == 1
    tree = drafter.propose(DecodeState(tokens=[1, 2, 3], num_prompt=1, budget=8))
    paths = [tree.tokens[nodes].tolist() for nodes in tree.paths]
    assert paths == [list(range(20, 26)), list(range(10, 13))]  # best score first, each cut to its length
    off = ReSpecDrafter(None, ReSpecConfig(entropy_threshold=math.inf, length_factor=0.0, draft_length=8), StubDrafter())
    off.pool = pool
    tree = off.propose(DecodeState(tokens=[1, 2, 3], num_prompt=1, budget=8))
    assert sorted(len(n) for n in tree.paths) == [8, 8]  # 0: every candidate at draft_length
    with pytest.raises(ValueError, match="length_factor"):
        ReSpecConfig(length_factor=-1)


def test_a_long_context_match_drafts_whole():
    """A context candidate continuing a match of the pool's longest n-gram drafts context_length
    tokens from its first step (prompt lookup's rule: a copy from the prompt earns its length);
    a shorter context match and the datastore's candidates keep the score rule."""
    long_match = Candidate(("context", -5), list(range(100, 130)), 4)
    short_match = Candidate(("context", -9), list(range(200, 230)), 2)
    suffix = Candidate(("suffix", -1), list(range(10, 30)))
    config = ReSpecConfig(entropy_threshold=math.inf, draft_length=8, context_length=16, max_nodes=64)
    assert config.pool.max_ngram == 4
    drafter = ReSpecDrafter(None, config, StubDrafter())
    drafter.pool = FixedPool([long_match, short_match, suffix])
    tree = drafter.propose(DecodeState(tokens=[1, 2, 3], num_prompt=1, budget=32))
    paths = {tree.tokens[nodes][0].item(): len(nodes) for nodes in tree.paths}
    assert paths == {100: 16, 200: 3, 10: 3}  # new keys: ceil(2 x prior 1) + 1 = 3 under the score rule
    tree = drafter.propose(DecodeState(tokens=[1, 2, 3], num_prompt=1, budget=6))
    assert max(len(nodes) for nodes in tree.paths) == 6  # never past the budget
    off = ReSpecDrafter(None, ReSpecConfig(entropy_threshold=math.inf, context_length=0), StubDrafter())
    off.pool = FixedPool([long_match])
    tree = off.propose(DecodeState(tokens=[1, 2, 3], num_prompt=1, budget=32))
    assert [len(n) for n in tree.paths] == [3]
    with pytest.raises(ValueError, match="context_length"):
        ReSpecConfig(context_length=-1)


def test_context_continuations_record_their_match_length():
    from specstore.runtime.retrieval import context_continuations

    tokens = np.array([5, 6, 7, 8, 9, 1, 2, 6, 7, 8])  # suffix 6 7 8 occurs at 1..3: a 3-gram, continued by 9 1 2
    found = context_continuations(tokens, 3, 2, max_ngram=4)
    assert [(c.offset, c.tokens, c.match) for c in found] == [(4, [9, 1, 2], 3)]
    # match_cap: how far back the occurrence matches, past max_ngram (a copy of a long span)
    copy = np.array([1, 2, 3, 4, 5, 6, 9, 0, 7, 2, 3, 4, 5, 6])  # 2..6 again: a 5-token match
    assert [c.match for c in context_continuations(copy, 3, 1, max_ngram=2)] == [2]
    assert [(c.offset, c.match) for c in context_continuations(copy, 3, 1, max_ngram=2, match_cap=16)] == [(6, 5)]
    assert [c.match for c in context_continuations(copy, 3, 1, max_ngram=2, match_cap=4)] == [4]


@pytest.mark.parametrize("options", [{}, {"entropy_threshold": math.inf}, {"entropy_threshold": math.inf, "length_factor": 0.0}])
def test_respec_greedy_output_is_identical_to_ar_and_accepts(own_output_store, options):
    store, loaded, ar = own_output_store
    drafter = make_drafter("respec", Datastore.open(store, "own", loaded.info), **options)
    assert drafter.lossless
    retrieved = 0
    mats = []
    for prompt, expected in ar.items():
        result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=len(expected))
        assert result.token_ids == expected
        assert result.stats.num_relaxed == 0
        mats.append(result.stats.mat)
        retrieved += drafter.num_retrieved_steps
    assert min(mats) > 1.5
    if options:  # the tiny model's entropy is high: only an infinite threshold always retrieves
        assert retrieved > 0 and drafter.scores  # feedback reached the EMA table


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The tiny model's own answers built into a datastore by the pipeline, its suffix array in
    shards (``--sa-shard-tokens``), with the plain greedy outputs."""
    import json

    from specstore.pipelines.build import build
    from specstore.runtime.models import load_model
    from specstore.runtime.sharded_suffix import ShardedSuffixIndex
    from tests.datastore_helpers import PROMPTS
    from tests.helpers import make_tiny_model

    folder = tmp_path_factory.mktemp("respec-shards")
    model = make_tiny_model(folder / "model", seed=3)
    loaded = load_model(str(model), dtype="float32", device="cpu")
    ar = {p: generate(loaded.model, loaded.tokenizer, p, "ar", max_new_tokens=24) for p in PROMPTS}
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"instruction": p, "output": r.text}) + "\n" for p, r in ar.items()))
    build(folder / "store", "own", [str(folder / "corpus.jsonl")], model=str(model), pca_dims=8, continuation_length=6,
          sa_shard_tokens=60, progress=False)
    ds = Datastore.open(folder / "store", "own", loaded.info)
    assert isinstance(ds.suffix, ShardedSuffixIndex) and len(ds.suffix.shards) > 1
    return ds, loaded, {p: r.token_ids for p, r in ar.items()}


def test_respec_on_a_sharded_datastore_is_identical_to_ar(sharded):
    ds, loaded, ar = sharded
    for options in ({}, {"entropy_threshold": math.inf, "num_dense": 0}):
        drafter = make_drafter("respec", ds, **options)
        suffix_keys, mats = set(), []
        for prompt, expected in ar.items():
            result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=len(expected))
            assert result.token_ids == expected, (options, prompt)
            suffix_keys |= {k for k in drafter.scores if k[0] == "suffix"}
            mats.append(result.stats.mat)
        assert max(mats) > 1.5
    assert suffix_keys  # the sharded suffix-array source drafted (and was scored)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, 49151), min_size=1, max_size=12), threshold=st.sampled_from([0.5, 3.0, math.inf]))
def test_respec_matches_ar_on_random_prompts(own_output_store, prompt, threshold):
    store, loaded, _ = own_output_store
    drafter = make_drafter("respec", Datastore.open(store, "own", loaded.info), entropy_threshold=threshold)
    ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=16)
    assert generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=16).token_ids == ar.token_ids


def test_model_fallback_is_identical_to_ar_and_strict(own_output_store, tmp_path):
    from specstore.runtime.models import load_model
    from tests.helpers import make_tiny_model

    store, loaded, ar = own_output_store
    draft = load_model(str(make_tiny_model(tmp_path / "draft", seed=3)), dtype="float32", device="cpu").model
    drafter = make_drafter("respec", Datastore.open(store, "own", loaded.info), entropy_threshold=0.0,
                           relaxed="on", fallback=ModelDrafter(draft))
    for prompt, expected in ar.items():
        result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=len(expected))
        assert result.token_ids == expected  # the draft model is the target's twin: all accepted, strictly
        assert result.stats.num_relaxed == 0 and result.stats.mat > 2.0


class RecordingRule:
    """Wraps the relaxed rule, keeping each call's logits, tree and outcome to check afterwards."""

    def __init__(self, rule: RelaxedRule):
        self.rule, self.calls = rule, []

    def __call__(self, logits, tree, sampling):
        out = self.rule(logits, tree, sampling)
        self.calls.append((logits.clone(), tree, out))
        return out


@pytest.fixture(scope="module")
def near_miss(tmp_path_factory):
    """A datastore whose documents are the tiny model's greedy text except that every 4th token is
    its runner-up: retrieval drafts near misses the relaxed rule can take."""
    from specstore.runtime.models import load_model
    from specstore.runtime.store import Store
    from tests.datastore_helpers import model_hidden, write_datastore
    from tests.helpers import make_tiny_model

    folder = tmp_path_factory.mktemp("respec-near")
    loaded = load_model(str(make_tiny_model(folder / "model", seed=3)), dtype="float32", device="cpu")
    docs = []
    for prompt in NEAR_PROMPTS:
        doc = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=0).prompt_ids
        for i in range(24):
            with torch.inference_mode():
                top = loaded.model(input_ids=torch.tensor([doc])).logits[0, -1].topk(2)
            doc.append(int(top.indices[1 if i % 4 == 2 else 0]))
        docs.append(doc)
    store = Store(folder / "store", create=True)
    write_datastore(store, "near", docs, model_hidden(loaded.model, docs), loaded.info)
    return Datastore.open(store, "near", loaded.info), loaded


NEAR_PROMPTS = ["def mul(a, b):", "Tell me a story about a fox.", "Name three colours."]


def test_relaxed_on_counts_relaxed_tokens_and_each_satisfies_the_rule(near_miss):
    ds, loaded = near_miss
    drafter = make_drafter("respec", ds, relaxed="on", relaxed_top_k=3, relaxed_ratio=0.1,
                           entropy_threshold=math.inf, num_context=0)
    assert not drafter.lossless
    rule = drafter.acceptance = RecordingRule(drafter.acceptance)
    for prompt in NEAR_PROMPTS:
        rule.calls.clear()
        result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=24)
        ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=24)
        flagged = 0
        for logits, tree, (accepted, bonus, flags) in rule.calls:
            assert len(flags) == len(accepted)
            choice = logits.argmax(-1)
            parent_row = 0
            for i, (node, relaxed) in enumerate(zip(accepted, flags, strict=True)):
                tok = int(tree.tokens[node])
                if relaxed:
                    row = logits[parent_row]
                    probs = torch.softmax(row.double(), -1)
                    assert tok != int(choice[parent_row]) and tree.node_data["retrieved"][node]
                    assert tok in torch.topk(row, 3).indices.tolist()
                    assert probs[tok] >= 0.1 * probs.max() * (1 - 1e-6)
                    assert i + 1 < len(accepted) and not flags[i + 1]  # look-ahead: the next one is strict
                else:
                    assert tok == int(choice[parent_row])
                parent_row = node + 1
            assert bonus == int(choice[parent_row])
            flagged += sum(flags)
        assert result.stats.num_relaxed <= flagged
        assert result.stats.num_accepted >= result.stats.num_relaxed > 0  # counted separately, inside accepted
        assert result.token_ids != ar.token_ids  # lossy: the runner-ups made it into the output


def test_accept_relaxed_on_crafted_logits():
    # root -> a(5) -> b(6); argmax at root is 9 (not drafted), 5 is second with p ratio e^-1
    tree = DraftTree(np.array([5, 6, 7]), np.array([-1, 0, -1]))
    logits = torch.full((4, V), -10.0)
    logits[0, 9], logits[0, 5], logits[0, 7] = 1.0, 0.0, 0.5
    logits[1, 6] = 3.0  # after 5, the target's argmax is 6: look-ahead holds
    logits[2, 1] = 3.0
    logits[3, 2] = 3.0
    rule = RelaxedRule(top_k=3, ratio=0.3)
    assert accept_relaxed(logits, tree, rule, [True, True, True]) == ([0, 1], 1, [True, False])
    assert accept_relaxed(logits, tree, rule, [False, False, False]) == ([], 9, [])  # model-made: strict
    assert accept_relaxed(logits, tree, RelaxedRule(3, 0.5), [True] * 3) == ([], 9, [])  # e^-1 < 0.5: refused
    logits[1, 6] = -20.0  # look-ahead fails for 5; 7 (ratio e^-0.5) has no child to look ahead to
    assert accept_relaxed(logits, tree, rule, [True] * 3) == ([], 9, [])
    sampled = rule(logits, tree, Sampling.seeded(1.0, seed=0))  # sampling: the lossless rule, no flags
    assert not any(sampled[2])


def test_relaxed_off_verifier_result_has_no_flags(own_output_store):
    _, loaded, _ = own_output_store
    verifier = TreeVerifier(loaded.model)
    out = verifier.prefill([1, 2, 3])
    step = verifier.step(out.bonus, DraftTree.chain([4, 5]))
    assert step.result.relaxed == []


def test_cli_generate_parser_has_respec_options():
    from specstore.runtime.cli import _build_parser
    from specstore.runtime.drafters import registry
    from specstore.runtime.errors import SpecstoreError

    args = _build_parser().parse_args(["generate", "--store", "s", "--method", "respec", "--prompt", "x",
                                       "--entropy-threshold", "1.5", "--relaxed", "on", "--relaxed-ratio", "0.2",
                                       "--context-length", "0", "--head", "off", "--head-guesses", "2", "--head-signal", "off"])
    assert registry.options_from_args("respec", args) == {"entropy_threshold": 1.5, "relaxed": True, "relaxed_ratio": 0.2,
                                                         "context_length": 0, "head": "off", "head_guesses": 2, "head_signal": "off"}
    registry.check_cli_options("respec", args)
    with pytest.raises(SpecstoreError, match="--entropy-threshold is an option of method 'respec'"):
        registry.check_cli_options("rest", args)
    args = _build_parser().parse_args(["generate", "--store", "s", "--method", "rest", "--prompt", "x"])
    assert registry.options_from_args("rest", args) == {} and registry.options_from_args("respec", args) == {}
    registry.check_cli_options("rest", args)
    args = _build_parser().parse_args(["generate", "--store", "s", "--method", "respec", "--prompt", "x", "--draft-tokens", "2"])
    with pytest.raises(SpecstoreError, match="give --draft-model too"):
        registry.options_from_args("respec", args)


def test_unknown_option_and_missing_datastore_are_one_line_errors(own_output_store):
    from specstore.runtime.errors import SpecstoreError

    store, loaded, _ = own_output_store
    with pytest.raises(SpecstoreError, match="needs a datastore"):
        make_drafter("respec")
    with pytest.raises(SpecstoreError, match="unknown respec option 'entropy'"):
        make_drafter("respec", Datastore.open(store, "own", loaded.info), entropy=1.0)
    with pytest.raises(SpecstoreError, match="relaxed must be on or off"):
        make_drafter("respec", Datastore.open(store, "own", loaded.info), relaxed="maybe")
    # the pool's switches from text too (--option respec.suffix_beside_dense=on)
    ds = Datastore.open(store, "own", loaded.info)
    pool = make_drafter("respec", ds, suffix_beside_dense="on", context_full_first="0", head="off").config.pool
    assert pool.suffix_beside_dense is True and pool.context_full_first is False
    with pytest.raises(SpecstoreError, match="suffix_beside_dense must be on or off"):
        make_drafter("respec", ds, suffix_beside_dense="sometimes")


@pytest.mark.model
@pytest.mark.slow
def test_default_model_pipeline_datastore_respec_identical_to_ar_float32(tmp_path):
    """The real default model, float32, a code datastore built by the pipeline: respec (relaxed
    off, default thresholds and an always-on trigger) decodes exactly what ar decodes."""
    from specstore.runtime.models import load_model
    from tests.datastore_helpers import CODE_RECORDS, pipeline_store

    loaded = load_model(None, dtype="float32", device="cpu")
    pipeline_store(tmp_path, None, CODE_RECORDS, "code")
    ds = Datastore.open(tmp_path / "store", "code@prod", loaded.info)
    prompts = ["Write a Python function that reverses a string.", "Write a Python function that adds two numbers."]
    for options in ({}, {"entropy_threshold": math.inf}):
        drafter = make_drafter("respec", ds, **options)
        for prompt in prompts:
            ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=48)
            result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=48)
            assert result.token_ids == ar.token_ids, (options, prompt)
            assert result.stats.mat > 1.0 and result.stats.num_relaxed == 0


def test_cost_signal_tells_shared_nodes_and_long_matches_apart():
    """A node two candidates pass through, and one whose candidate continues a longer context
    match, fall in other calibration buckets than a lone, short-match node of the same source
    and score (drafters/respec.py ``_add_signals``)."""
    drafter = ReSpecDrafter(datastore=None)
    chosen = [Candidate(("suffix", 0), [1, 2, 3], match=9), Candidate(("suffix", 5), [1, 2, 7], match=9),
              Candidate(("suffix", 9), [4, 5], match=2)]
    tree = DraftTree.from_paths([c.tokens for c in chosen])
    drafter._add_signals(tree, chosen)
    by_token = {int(t): int(b) for t, b in zip(tree.tokens.tolist(), tree.node_data["bucket"].tolist(), strict=True)}
    assert by_token[1] == by_token[2]  # both shared by two candidates with a 9-token match
    assert by_token[3] == by_token[7] != by_token[1]  # one candidate each: another support cell
    assert by_token[4] == by_token[5] != by_token[3]  # one candidate, a 2-token match: another match cell
    assert np.allclose(tree.node_data["prior"], 0.5)  # a new key's score 1: prior 1 / (1 + 1)
