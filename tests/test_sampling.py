"""Lossless multi-draft speculative sampling: the tokens a step emits are distributed exactly as
plain sampling would emit them, whatever the tree proposes. Checked statistically (total
variation against the exact distribution), with a wrong rule as a negative control so the test
is shown to have the power to fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstore.runtime.decode import decode
from specstore.runtime.sampling import Sampling, accept, target_probs
from specstore.runtime.tree import DraftTree

V = 6
N = 12000
# with N samples over <= 36 outcomes the empirical TV is ~0.02 at most by chance (about 3 sigma)
TV_BOUND = 0.03


def tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def first_two(logits: torch.Tensor, tree: DraftTree, sampling: Sampling, rule=accept) -> list[tuple[int, int]]:
    """(first emitted token, second emitted token or -1) per sample."""
    out = []
    for _ in range(N):
        nodes, bonus = rule(logits, tree, sampling)
        emitted = [int(tree.tokens[i]) for i in nodes] + [bonus]
        out.append((emitted[0], emitted[1] if len(emitted) > 1 else -1))
    return out


def greedy_like_rule(logits, tree, sampling):
    """Wrong: accept the first child whose token the target would sample, else draw again."""
    first = torch.multinomial(target_probs(logits[0], sampling), 1, generator=sampling.generator).item()
    nodes = [i for i in range(len(tree)) if tree.parents[i] == -1]
    hit = next((i for i in nodes if tree.tokens[i] == tree.tokens[nodes[0]]), None)
    if hit is not None and torch.rand((), generator=sampling.generator) < 0.5:
        return [hit], int(torch.multinomial(target_probs(logits[hit + 1], sampling), 1, generator=sampling.generator))
    return [], int(first)


def no_residual_rule(logits, tree, sampling):
    """Wrong: accept child x with probability p(x) but never renormalise after a rejection."""
    p = target_probs(logits[0], sampling)
    for node in [i for i in range(len(tree)) if tree.parents[i] == -1]:
        tok = int(tree.tokens[node])
        if torch.rand((), dtype=torch.float64, generator=sampling.generator) < p[tok]:
            child = target_probs(logits[node + 1], sampling)
            return [node], int(torch.multinomial(child, 1, generator=sampling.generator))
    return [], int(torch.multinomial(p, 1, generator=sampling.generator))


def check(samples, logits, tree, sampling) -> tuple[float, float]:
    """TV of the first token's law and of the second token's law given the most drafted first."""
    p0 = target_probs(logits[0], sampling).numpy()
    firsts = np.array([a for a, _ in samples])
    tv_first = tv(np.bincount(firsts, minlength=V).astype(float), p0)
    root_children = [i for i in range(len(tree)) if tree.parents[i] == -1]
    node = max(root_children, key=lambda i: p0[tree.tokens[i]])
    seconds = np.array([b for a, b in samples if a == tree.tokens[node]])
    p1 = target_probs(logits[node + 1], sampling).numpy()
    # -1 (nothing emitted after an accepted child) is its own outcome, which the exact law never has
    tv_second = tv(np.bincount(seconds + 1, minlength=V + 1).astype(float), np.concatenate([[0.0], p1]))
    return tv_first, tv_second


def setup_case(seed: int, top_p: float):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, V, generator=gen, dtype=torch.float64) * 1.5
    # three children of the root (two likely tokens, one unlikely), a chain below the first
    order = torch.argsort(logits[0], descending=True).tolist()
    tree = DraftTree([order[1], order[0], order[-1], 2, 3, 1, 0], [-1, -1, -1, 0, 3, 1, 1])
    return logits[: len(tree) + 1], tree, Sampling(1.0, top_p, gen)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_multi_draft_sampling_is_lossless(top_p):
    logits, tree, sampling = setup_case(0, top_p)
    tv_first, tv_second = check(first_two(logits, tree, sampling), logits, tree, sampling)
    assert tv_first < TV_BOUND and tv_second < TV_BOUND, (tv_first, tv_second)


@pytest.mark.parametrize("rule", [greedy_like_rule, no_residual_rule])
def test_wrong_rules_fail_the_same_check(rule):
    logits, tree, sampling = setup_case(0, 1.0)
    tv_first, tv_second = check(first_two(logits, tree, sampling, rule), logits, tree, sampling)
    assert max(tv_first, tv_second) > 2 * TV_BOUND, (tv_first, tv_second)


def test_greedy_acceptance_in_sampling_mode_would_fail():
    logits, tree, sampling = setup_case(1, 1.0)
    greedy_samples = first_two(logits, tree, Sampling())  # greedy acceptance: deterministic
    tv_first, _ = check(greedy_samples, logits, tree, sampling)
    assert tv_first > 2 * TV_BOUND


def test_top_p_keeps_the_nucleus():
    probs = target_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), Sampling(1.0, 0.75))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64))
    assert target_probs(torch.tensor([2.0, 1.0]), Sampling(1.0, 0.01)).tolist() == [1.0, 0.0]


class TopTokensDrafter:
    """After the first generated token t1, proposes a trie of the target's likeliest tokens for
    that context (precomputed), the likeliest not first, with a child under each."""

    name, lossless = "top", True

    def __init__(self, trees: dict[int, DraftTree]):
        self.trees = trees

    def reset(self, prompt_ids):
        pass

    def propose(self, state):
        return self.trees[state.tokens[-1]] if len(state.generated) == 1 else DraftTree.empty()

    def observe(self, state, tree, result):
        pass


@pytest.mark.slow
def test_end_to_end_sampling_matches_plain_sampling():
    """Through the model, the cache and the decode loop: the joint law of the first two tokens
    (prefill, then one tree step) equals p(t1) p(t2 | t1) exactly (vocabulary of 8, top-p 0.95)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    sampling = Sampling(1.0, 0.95, torch.Generator())
    prompt = [1, 2, 3, 4]
    with torch.inference_mode():
        p1 = target_probs(model(input_ids=torch.tensor([prompt])).logits[0, -1], sampling).numpy()
        rows = model(input_ids=torch.tensor([prompt + [t] for t in range(8)])).logits[:, -1]
    p2 = np.stack([target_probs(r, sampling).numpy() for r in rows])
    trees = {}
    for t in range(8):
        a, b, c = np.argsort(-p2[t])[:3].tolist()
        trees[t] = DraftTree.from_paths([[b, 0], [a, 1], [c], [a, 2]])
    exact = (p1[:, None] * p2).reshape(-1)
    runs = 3000
    counts = np.zeros(64)
    for seed in range(runs):
        sampling.generator.manual_seed(seed)
        res = decode(model, prompt, TopTokensDrafter(trees), 2, sampling)
        counts[res.token_ids[0] * 8 + res.token_ids[1]] += 1
    # expected TV by chance at 3000 samples over <= 64 outcomes: ~0.05
    assert tv(counts, exact) < 0.1, tv(counts, exact)
