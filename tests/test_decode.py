"""The decode loop: greedy output of every lossless drafter is token-identical to ar (tiny random
llama/gpt2/qwen2 models with random prompts, and the real default model in float32), stops
where ar stops (EOS, also inside a draft; max_new_tokens; the context), stats add up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstore.runtime.decode import decode
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.sampling import Sampling
from tests.decoding_helpers import FAMILIES, OracleDrafter, random_prompt, tiny_lm


def run(model, prompt, drafter, n, eos=(), sampling=None):
    return decode(model, prompt, drafter, n, sampling or Sampling(), eos)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_random_prompts(family):
    model, _ = tiny_lm(family)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(FAMILIES.index(family))
    for trial in range(6):
        prompt = random_prompt(rng, vocab, int(rng.integers(1, 40)))
        n = int(rng.integers(1, 40))
        ar = run(model, prompt, make_drafter("ar"), n)
        assert len(ar.token_ids) == n and ar.stop_reason == "length"
        assert ar.stats.steps == n and ar.stats.mat == 1.0 and ar.stats.accepted_per_step == [1] * n
        pld = run(model, prompt, make_drafter("pld"), n)
        assert pld.token_ids == ar.token_ids, f"pld diverged on trial {trial}"
        oracle = run(model, prompt, OracleDrafter(ar.token_ids, vocab, seed=trial), n)
        assert oracle.token_ids == ar.token_ids, f"oracle diverged on trial {trial}"
        for out in (pld, oracle):
            assert sum(out.stats.accepted_per_step) == n == len(out.token_ids)
            assert len(out.stats.accepted_per_step) == out.stats.steps
            assert out.stats.num_accepted <= out.stats.num_drafted
        assert oracle.stats.steps < n or n <= 2  # the oracle's trees do get accepted


def test_oracle_accepts_deep_paths():
    model, _ = tiny_lm("llama")
    prompt = list(range(100, 120))
    ref = run(model, prompt, make_drafter("ar"), 30).token_ids
    out = run(model, prompt, OracleDrafter(ref, model.config.vocab_size, num_paths=4, depth=8), 30)
    assert out.token_ids == ref
    assert max(out.stats.accepted_per_step) >= 5


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_inside_a_draft_stops_where_ar_stops(family):
    model, _ = tiny_lm(family)
    prompt = list(range(200, 230))
    ref = run(model, prompt, make_drafter("ar"), 25).token_ids
    k = 7
    eos = {ref[k]}  # pretend a token the model emits is EOS
    first = ref.index(ref[k])
    ar = run(model, prompt, make_drafter("ar"), 25, eos)
    assert ar.token_ids == ref[: first + 1] and ar.stop_reason == "eos"
    oracle = run(model, prompt, OracleDrafter(ref, model.config.vocab_size, num_paths=2, depth=12), 25, eos)
    assert oracle.token_ids == ar.token_ids and oracle.stop_reason == "eos"
    assert sum(oracle.stats.accepted_per_step) == len(oracle.token_ids)


@pytest.mark.parametrize("drafter", ["ar", "pld"])
def test_max_new_tokens_zero_and_one(drafter):
    model, _ = tiny_lm("llama")
    zero = run(model, [5, 6, 7], make_drafter(drafter), 0)
    assert zero.token_ids == [] and zero.stats.steps == 0 and zero.stats.mat == 0.0
    one = run(model, [5, 6, 7, 5, 6], make_drafter(drafter), 1)
    assert len(one.token_ids) == 1 and one.stats.steps == 1 and one.stats.accepted_per_step == [1]
    assert one.token_ids == run(model, [5, 6, 7, 5, 6], make_drafter("ar"), 5).token_ids[:1]


def test_bad_prompts_are_clear_errors():
    model, _ = tiny_lm("llama", max_position_embeddings=32)
    with pytest.raises(SpecstoreError, match="empty"):
        run(model, [], make_drafter("ar"), 4)
    with pytest.raises(SpecstoreError, match="context is 32"):
        run(model, list(range(3, 35)), make_drafter("ar"), 4)
    with pytest.raises(SpecstoreError, match="max_new_tokens"):
        run(model, [3, 4], make_drafter("ar"), -1)
    assert run(model, list(range(3, 40)), make_drafter("ar"), 0).token_ids == []


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_drafts_never_run_past_the_context(family):
    ctx = 40
    model, _ = tiny_lm.__wrapped__(family)  # a private instance: its config is changed below
    model.config.max_position_embeddings = ctx  # GPT-2 maps this onto n_positions
    prompt = list(range(300, 330))
    ar = run(model, prompt, make_drafter("ar"), 50)
    assert len(ar.token_ids) == ctx - len(prompt) and ar.stop_reason == "context"
    seen = []

    class Spy(OracleDrafter):
        def propose(self, state):
            tree = super().propose(state)
            seen.append((len(state.tokens), state.budget))
            return tree

    out = run(model, prompt, Spy(ar.token_ids + [7] * 20, model.config.vocab_size, depth=12), 50)
    assert out.token_ids == ar.token_ids and out.stop_reason == "context"
    assert all(length + budget + 1 <= ctx for length, budget in seen)


@pytest.mark.parametrize("family", FAMILIES)
def test_drafters_see_the_hidden_state_and_logits_of_the_last_processed_token(family):
    """DReSD queries with ``last_hidden`` (the target's state at tokens[-2]); ReSpec reads the
    entropy of ``last_logits``. Both must equal a plain forward's, after accepted trees too."""
    model, _ = tiny_lm(family)
    prompt = list(range(400, 420))
    ref = run(model, prompt, make_drafter("ar"), 16).token_ids
    seen = []

    class Spy(OracleDrafter):
        def propose(self, state):
            seen.append((list(state.tokens), state.last_hidden.clone(), state.last_logits.clone()))
            return super().propose(state)

    run(model, prompt, Spy(ref, model.config.vocab_size, depth=4), 16)
    assert len(seen) >= 3
    with torch.inference_mode():
        for tokens, hidden, logits in seen:
            out = model(input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=True)
            torch.testing.assert_close(hidden, out.hidden_states[-1][0, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(logits, out.logits[0, -1], atol=1e-4, rtol=1e-4)
            assert int(logits.argmax()) == tokens[-1]


def test_pld_drafts_from_the_context():
    from specstore.runtime.drafters.base import DecodeState
    from specstore.runtime.drafters.pld import PromptLookupDrafter

    pld = PromptLookupDrafter(max_ngram=3, num_draft_tokens=4)
    state = DecodeState(tokens=[1, 2, 3, 4, 5, 6, 9, 2, 3], num_prompt=9, budget=10)
    assert pld.propose(state).tokens.tolist() == [4, 5, 6, 9]
    state.budget = 2
    assert pld.propose(state).tokens.tolist() == [4, 5]
    assert len(pld.propose(DecodeState(tokens=[1, 2, 3], num_prompt=3, budget=5))) == 0
    state = DecodeState(tokens=[7] * 12, num_prompt=12, budget=10)  # repetition drafts a full chain
    assert pld.propose(state).tokens.tolist() == [7, 7, 7, 7]


def test_registry_rejects_unknown_method():
    with pytest.raises(SpecstoreError, match="unknown drafting method 'nope'"):
        make_drafter("nope")


def _top2_gap(model, ids: list[int]) -> float:
    with torch.inference_mode():
        top = model(input_ids=torch.tensor([ids])).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


@pytest.mark.model
@pytest.mark.slow
def test_real_model_pld_identical_to_ar_float32():
    from specstore.runtime.api import eos_ids, prompt_ids
    from specstore.runtime.models import load_model

    loaded = load_model(dtype="float32", device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    prompts = [
        "Write a Python function that returns the squares of a list of numbers.",
        "List the days of the week, then list them again in reverse order.",
        "What is the capital of France? Answer in one sentence and repeat the answer.",
    ]
    for text in prompts:
        ids = prompt_ids(tok, text)
        ar = run(model, ids, make_drafter("ar"), 48, eos_ids(model, tok))
        pld = run(model, ids, make_drafter("pld"), 48, eos_ids(model, tok))
        if pld.token_ids != ar.token_ids:
            k = next(i for i, (a, b) in enumerate(zip(ar.token_ids, pld.token_ids, strict=False)) if a != b)
            gap = _top2_gap(model, ids + ar.token_ids[:k])
            assert gap < 1e-4, f"divergence at {k} with top-2 gap {gap} on {text!r}"
        assert pld.stats.steps <= ar.stats.steps
