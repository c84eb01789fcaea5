"""The tree verifier against brute force: per-node logits equal a plain forward of each
root-to-node path, the cache after a step equals plain decoding's, and the batch fallback
agrees with tree attention. Llama (sdpa and eager), GPT-2 and Qwen2 tiny random models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from specstore.runtime.relaxed import RelaxedRule
from specstore.runtime.sampling import Sampling
from specstore.runtime.tree import DraftTree, clip_depth
from specstore.runtime.verify import TreeVerifier, ancestor_matrix, tree_attention_inputs
from tests.decoding_helpers import FAMILIES, tiny_lm

CASES = [(f, "sdpa") for f in FAMILIES] + [("llama", "eager"), ("gpt2", "eager")]


def random_tree(rng: np.random.Generator, vocab: int, num_nodes: int) -> DraftTree:
    parents = [int(rng.integers(-1, i)) for i in range(num_nodes)]
    return DraftTree(rng.integers(3, vocab, size=num_nodes), parents)


@torch.inference_mode()
def plain_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


def test_ancestor_matrix_and_inputs():
    #        pending
    #        /     \
    #      n0       n2
    #      |
    #      n1
    tree = DraftTree([10, 11, 12], [-1, 0, -1])
    anc = ancestor_matrix(tree)
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=bool)
    assert (anc == expected).all()
    pos, mask = tree_attention_inputs(tree, 5, torch.float32, torch.device("cpu"))
    assert pos.tolist() == [[5, 6, 7, 6]]
    assert mask.shape == (1, 1, 4, 9)
    assert (mask[0, 0, :, :5] == 0).all()  # the whole prefix is visible to every node
    minimum = torch.finfo(torch.float32).min
    assert torch.equal(mask[0, 0, :, 5:] == 0, torch.as_tensor(expected))
    assert (mask[0, 0, :, 5:][~torch.as_tensor(expected)] == minimum).all()


def test_clip_depth_reindexes():
    tree = DraftTree.from_paths([[1, 2, 3], [1, 4], [5, 6, 7, 8]])
    clipped = clip_depth(tree, 2)
    assert clipped.depths().max() == 2
    assert [clipped.tokens[clipped.path_to(n[-1])].tolist() for n in clipped.paths] == [[1, 2], [1, 4], [5, 6]]
    assert clip_depth(tree, 0).tokens.tolist() == []
    assert clip_depth(tree, 9) is tree


def test_clip_depth_keeps_every_per_node_field_consistent():
    paths = [[1, 2, 3], [1, 4], [5, 6, 7, 8], [9, 10, 11]]
    tree = DraftTree.from_paths(paths, max_nodes=10)
    n = len(tree)
    # per-node fields that identify their node: its token, and its token times 10
    tree.node_data["counts"] = tree.tokens * 10
    tree.node_data["retrieved"] = tree.tokens % 2 == 0
    tree.meta["candidate_keys"] = [("k", i) for i in range(len(paths))]
    for depth in (0, 1, 2, 3):
        clipped = clip_depth(tree, depth)
        assert len(clipped) == int((tree.depths() <= depth).sum()) < n
        assert clipped.node_data["counts"].tolist() == (clipped.tokens * 10).tolist()
        assert clipped.node_data["retrieved"].tolist() == (clipped.tokens % 2 == 0).tolist()
        assert clipped.meta["candidate_keys"] == tree.meta["candidate_keys"]  # per-path values stay aligned
        assert len(clipped.paths) == len(paths)
        for k, nodes in enumerate(clipped.paths):
            # each path keeps the prefix of its nodes that survived, in order, as a root path
            want = [t for t in tree.tokens[tree.paths[k]].tolist()][: len(nodes)]
            assert clipped.tokens[nodes].tolist() == want
            assert nodes == (clipped.path_to(nodes[-1]) if nodes else [])
    with pytest.raises(ValueError, match="node_data"):
        DraftTree([1, 2], [-1, 0], node_data={"counts": np.zeros(3)})
    with pytest.raises(ValueError, match="parent"):
        tree.subset(np.arange(n) != 0)  # drops node 0 but keeps its child


def test_take_is_subset_for_every_parent_closed_choice():
    """``take`` (the pruner's) builds the same tree as ``subset`` from the same kept nodes, in
    whatever order they are given: tokens, parents, per-node fields, paths and meta."""
    rng = np.random.default_rng(3)
    for _ in range(60):
        paths = [rng.integers(0, 4, size=int(rng.integers(1, 6))).tolist() for _ in range(int(rng.integers(1, 6)))]
        tree = DraftTree.from_paths(paths)
        tree.node_data["bucket"] = rng.integers(0, 50, size=len(tree))
        tree.node_data["prior"] = rng.random(len(tree))
        tree.meta["candidate_keys"] = [("k", i) for i in range(len(paths))]
        keep = np.zeros(len(tree), dtype=bool)
        for node, parent in enumerate(tree.parents.tolist()):  # a random parent-closed set
            keep[node] = (parent < 0 or keep[parent]) and rng.random() < 0.7
        nodes = np.flatnonzero(keep).tolist()
        rng.shuffle(nodes)
        a, b = tree.subset(keep), tree.take(nodes)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert b.tokens.dtype == a.tokens.dtype == np.int64 and b.parents.dtype == np.int64
        assert all(np.array_equal(a.node_data[k], b.node_data[k]) for k in a.node_data) and a.node_data.keys() == b.node_data.keys()
        assert a.paths == b.paths and a.meta == b.meta and b.meta is not tree.meta
        kept = np.flatnonzero(keep).tolist()  # each kept node keeps its root path's tokens
        assert all(b.tokens[b.path_to(i)].tolist() == tree.tokens[tree.path_to(node)].tolist() for i, node in enumerate(kept))


@pytest.mark.parametrize("family,attn", CASES)
def test_tree_logits_match_per_path_forward(family, attn):
    model, _ = tiny_lm(family, attn)
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    for num_nodes in (1, 5, 12):
        prompt = rng.integers(3, vocab, size=int(rng.integers(2, 20))).tolist()
        pending = int(rng.integers(3, vocab))
        tree = random_tree(rng, vocab, num_nodes)
        verifier = TreeVerifier(model)
        verifier.prefill(prompt)
        logits, _ = verifier.tree_logits(pending, tree)
        torch.testing.assert_close(logits[0], plain_logits(model, prompt + [pending]), atol=1e-4, rtol=1e-4)
        for node in range(num_nodes):
            path = tree.tokens[tree.path_to(node)].tolist()
            torch.testing.assert_close(logits[node + 1], plain_logits(model, prompt + [pending] + path), atol=1e-4, rtol=1e-4)


def greedy_reference(model, ids: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(plain_logits(model, ids + out).argmax()))
    return out


@torch.inference_mode()
def plain_cache(model, ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("family,attn", CASES)
@pytest.mark.parametrize("fallback", [False, True])
def test_step_accepts_path_and_cache_equals_plain_decoding(family, attn, fallback):
    model, _ = tiny_lm(family, attn)
    rng = np.random.default_rng(2)
    vocab = model.config.vocab_size
    prompt = rng.integers(3, vocab, size=9).tolist()
    verifier = TreeVerifier(model, Sampling())
    verifier.tree_attention = not fallback
    pending = verifier.prefill(prompt).bonus
    ref = greedy_reference(model, prompt + [pending], 4)
    # the right path is the *second* branch, so compaction must re-index (not just crop)
    wrong = [(ref[0] + 1) % vocab, ref[1]]
    tree = DraftTree.from_paths([wrong, ref[:3] + [(ref[3] + 7) % vocab], [ref[0], (ref[1] + 5) % vocab]])
    out = verifier.step(pending, tree)
    assert out.result.accepted_tokens == ref[:3]
    assert out.result.bonus == ref[3]
    assert [int(tree.tokens[i]) for i in out.result.accepted_nodes] == ref[:3]
    committed = prompt + [pending] + ref[:3]
    expected = plain_cache(model, committed)
    assert verifier.num_cached == len(committed)
    for got, want in zip(verifier.cache.layers, expected.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.logits, plain_logits(model, committed), atol=1e-4, rtol=1e-4)
    # the next 1-token step continues exactly like plain decoding
    nxt = verifier.step(ref[3], DraftTree.empty())
    assert nxt.result.bonus == greedy_reference(model, committed + [ref[3]], 1)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_rejected_tree_keeps_only_pending(family):
    model, _ = tiny_lm(family)
    prompt = list(range(5, 15))
    verifier = TreeVerifier(model)
    pending = verifier.prefill(prompt).bonus
    ref = greedy_reference(model, prompt + [pending], 1)[0]
    tree = DraftTree.from_paths([[(ref + 1) % 1000 + 3, 4, 5], [(ref + 2) % 1000 + 3]])
    out = verifier.step(pending, tree)
    assert out.result.accepted_tokens == [] and out.result.bonus == ref
    assert verifier.num_cached == len(prompt) + 1
    torch.testing.assert_close(out.hidden.shape[-1], model.config.hidden_size)


def test_sliding_window_model_falls_back_to_batches():
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, use_sliding_window=True, sliding_window=6,
                         max_window_layers=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.warns(UserWarning, match="batch of paths"):
        verifier = TreeVerifier(model)
    assert not verifier.tree_attention
    prompt = list(range(20, 40))
    pending = verifier.prefill(prompt).bonus
    ref = greedy_reference(model, prompt + [pending], 3)
    out = verifier.step(pending, DraftTree.from_paths([[ref[0], 99], ref[:2]]))
    assert out.result.accepted_tokens == ref[:2] and out.result.bonus == ref[2]


class SpyRule:
    """An acceptance rule that records its calls and otherwise accepts like the sampling rule."""

    def __init__(self, inner=None):
        self.inner, self.calls = inner, 0

    def __call__(self, logits, tree, sampling):
        self.calls += 1
        if self.inner is not None:
            return self.inner(logits, tree, sampling)
        from specstore.runtime.sampling import accept

        accepted, bonus = accept(logits, tree, sampling)
        return accepted, bonus, [False] * len(accepted)


@pytest.mark.parametrize("fallback", [False, True])
def test_acceptance_rule_is_an_explicit_argument(fallback):
    """A relaxed rule given to ``step`` accepts a near miss the sampling rule refuses; the same
    rule left in ``tree.meta`` (where it used to be read from) changes nothing."""
    model, _ = tiny_lm("llama")
    prompt = list(range(30, 45))
    pending = int(plain_logits(model, prompt).argmax())

    def verifier():
        v = TreeVerifier(model)
        v.tree_attention = not fallback
        v.prefill(prompt)
        return v

    # the runner-up after the pending token, then what the target says after it
    second = greedy_reference(model, prompt + [pending], 1)[0]
    runner_up = int(torch.topk(plain_logits(model, prompt + [pending]), 2).indices[1])
    look_ahead = int(plain_logits(model, prompt + [pending, runner_up]).argmax())
    tree = DraftTree.chain([runner_up, look_ahead])
    tree.node_data["retrieved"] = np.array([True, True])
    rule = RelaxedRule(top_k=2, ratio=1e-6)
    tree.meta["acceptance"] = rule
    strict = verifier().step(pending, tree)
    assert strict.result.accepted_tokens == [] and strict.result.bonus == second and strict.result.relaxed == []
    relaxed = verifier().step(pending, tree, rule)
    assert relaxed.result.accepted_tokens == [runner_up, look_ahead] and relaxed.result.relaxed == [True, False]
    spy = SpyRule()
    assert verifier().step(pending, tree, spy).result.accepted_tokens == [] and spy.calls == 1


def test_decode_passes_the_drafters_acceptance_rule():
    from specstore.runtime.decode import decode
    from tests.decoding_helpers import OracleDrafter

    model, _ = tiny_lm("llama")
    prompt = list(range(50, 70))
    ref = greedy_reference(model, prompt, 12)
    drafter = OracleDrafter(ref, model.config.vocab_size, depth=4)
    drafter.acceptance = SpyRule()
    out = decode(model, prompt, drafter, 12, Sampling())
    assert out.token_ids == ref
    assert drafter.acceptance.calls == out.stats.steps - 1  # every verification after the prefill


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("gpt2", "eager")])
def test_padded_step_equals_unpadded_step(family, attn):
    """``tree.meta["verify_as"]`` adds masked rows: the same acceptance, logits and cache."""
    model, _ = tiny_lm(family, attn)
    rng = np.random.default_rng(8)
    vocab = model.config.vocab_size
    for num_nodes in (1, 2, 5):
        prompt = rng.integers(3, vocab, size=12).tolist()
        pending = int(rng.integers(3, vocab))
        tree = random_tree(rng, vocab, num_nodes)
        padded = DraftTree(tree.tokens, tree.parents, meta={"verify_as": num_nodes + 3})
        outs = []
        for t in (tree, padded):
            verifier = TreeVerifier(model)
            verifier.prefill(prompt)
            outs.append((verifier.step(pending, t), verifier))
        (plain, v1), (pad, v2) = outs
        assert pad.result.accepted_nodes == plain.result.accepted_nodes and pad.result.bonus == plain.result.bonus
        torch.testing.assert_close(pad.logits, plain.logits, atol=1e-4, rtol=1e-4)
        assert v2.num_cached == v1.num_cached == len(prompt) + 1 + len(plain.result.accepted_nodes)
        for a, b in zip(v1.cache.layers, v2.cache.layers, strict=True):
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
