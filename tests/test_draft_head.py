"""The draft head (runtime/draft_head.py, pipelines/draft_head.py) and ReSpec's head source."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from specstore.pipelines.draft_head import HeadTraining, collect, corpus_documents, train
from specstore.runtime.api import generate
from specstore.runtime.datastore import Datastore
from specstore.runtime.draft_head import DraftHead, default_path
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.errors import SpecstoreError
from tests.datastore_helpers import TEXTS


@pytest.fixture(scope="module")
def head_setup(own_output_store, tmp_path_factory):
    """A head trained on the tiny model's own answers (the ``own`` datastore's documents), with
    those positions; ``(store, loaded, ar, head, data, path)``."""
    store, loaded, ar = own_output_store
    docs = [np.asarray(loaded.tokenizer(p, add_special_tokens=False)["input_ids"] + ids) for p, ids in ar.items()]
    docs += [np.asarray(loaded.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in TEXTS]
    data = collect(loaded.model, docs, max_tokens=10_000)
    head = train(loaded.model, loaded.info, data, HeadTraining(epochs=60, batch=16, lr=1e-2, holdout=0.0, vocabulary=256))
    path = head.save(tmp_path_factory.mktemp("head") / "head.safetensors")
    return store, loaded, ar, head, data, path


def _agreement(head: DraftHead, data) -> float:
    right = [head.guess(h, int(p))[0][0] == int(t) for h, p, t in zip(data["hidden"], data["pending"], data["target"], strict=True)]
    return float(np.mean(right))


def test_collect_pairs_each_hidden_state_with_the_next_token_and_the_targets_choice_after_it(own_output_store):
    _, loaded, ar = own_output_store
    ids = np.asarray(loaded.tokenizer("def add(a, b):", add_special_tokens=False)["input_ids"] + next(iter(ar.values())))
    data = collect(loaded.model, [ids], max_tokens=100)
    with torch.no_grad():
        out = loaded.model(torch.as_tensor(ids[None]), output_hidden_states=True)
    n = len(ids) - 2
    assert len(data["target"]) == n and (data["doc"] == 0).all()
    assert torch.equal(data["pending"], torch.as_tensor(ids[1 : n + 1]))
    assert torch.equal(data["target"], out.logits[0, 1 : n + 1].argmax(-1))
    torch.testing.assert_close(data["hidden"].float(), out.hidden_states[-1][0, :n].float())
    assert len(collect(loaded.model, [ids, ids], max_tokens=5)["target"]) == 5


def test_a_trained_head_says_what_the_target_says_next(head_setup):
    """On its training text the head learns the target's next choice, far above the untrained
    head (the target's own logits at ``t``: right only where its choice repeats)."""
    _, loaded, _, head, data, _ = head_setup
    untrained = train(loaded.model, loaded.info, data, HeadTraining(epochs=1, batch=10_000, lr=1e-9, holdout=0.0))
    trained, before = _agreement(head, data), _agreement(untrained, data)
    assert trained > 0.8 and trained > before + 0.3, (trained, before)
    assert head.info.training["positions"] == len(data["target"]) and head.info.model["revision"] == loaded.info.revision


def test_a_saved_head_loads_with_the_same_guesses_and_refuses_another_model(head_setup, tmp_path):
    _, loaded, _, head, data, path = head_setup
    again = DraftHead.load(path, expect=loaded.info)
    for h, p in list(zip(data["hidden"], data["pending"], strict=True))[:20]:
        a, b = head.guess(h, int(p), 3), again.guess(h, int(p), 3)
        assert [t for t, _ in a] == [t for t, _ in b]
        assert np.allclose([q for _, q in a], [q for _, q in b], atol=1e-5)
    assert again.info == head.info
    other = loaded.info.model_copy(update={"revision": "0" * 64})
    with pytest.raises(SpecstoreError, match="revision"):
        DraftHead.load(path, expect=other)
    with pytest.raises(SpecstoreError, match="does not exist"):
        DraftHead.load(tmp_path / "none.safetensors")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(SpecstoreError, match="cannot read draft head"):
        DraftHead.load(broken)
    # a token outside the head's vocabulary (or the model's) is guessed from the hidden state alone
    assert len(again.guess(data["hidden"][0], 10**9, 2)) == 2


@pytest.mark.parametrize("options", [{}, {"entropy_threshold": math.inf, "max_candidates": 8},
                                     {"head_guesses": 2, "entropy_threshold": math.inf, "max_candidates": 8}])
def test_respec_with_a_head_is_identical_to_ar_and_takes_its_guesses(head_setup, options):
    store, loaded, ar, _, _, path = head_setup
    ds = Datastore.open(store, "own", loaded.info)
    drafter = make_drafter("respec", ds, head=str(path), **options)
    assert drafter.head is not None
    steps = taken = 0
    for prompt, expected in ar.items():
        result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=len(expected))
        assert result.token_ids == expected
        steps, taken = steps + drafter.stats()["head_steps"], taken + drafter.stats()["head_accepted"]
    if options:  # the tiny model's entropy is high: only an infinite threshold always retrieves
        assert steps > 0 and taken > 0
        assert any(k[0] == "head" for k in drafter.scores)


def test_respec_finds_the_head_in_its_default_place_and_can_be_told_not_to(head_setup, tmp_path, monkeypatch):
    store, loaded, _, head, _, _ = head_setup
    monkeypatch.setenv("SPECSTORE_CACHE", str(tmp_path))
    ds = Datastore.open(store, "own", loaded.info)
    assert make_drafter("respec", ds).head is None  # none trained for this model here yet
    head.save(default_path(loaded.info.revision))
    assert make_drafter("respec", ds).head is not None
    assert make_drafter("respec", ds, head="off").head is None
    assert make_drafter("respec", ds, head_guesses=0).head is None
    with pytest.raises(SpecstoreError, match="does not exist"):
        make_drafter("respec", ds, head=str(tmp_path / "missing.safetensors"))


def test_train_head_command_writes_a_head_from_a_corpus(own_output_store, tmp_path, capsys):
    from specstore.runtime.cli import main

    _, loaded, ar = own_output_store
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"instruction": p, "output": loaded.tokenizer.decode(ids)}) + "\n"
                              for p, ids in ar.items()) * 4)
    docs = list(corpus_documents([str(corpus)], loaded.tokenizer, max_docs=5))
    assert len(docs) == 5 and all(d.dtype == np.int32 and len(d) > 3 for d in docs)
    out = tmp_path / "h.safetensors"
    assert main(["train-head", "--model", str(loaded.path), "--corpus", str(corpus), "--out", str(out),
                 "--epochs", "2", "--dtype", "float32", "--holdout", "0.25"]) == 0
    printed = capsys.readouterr().out
    assert "held-out agreement" in printed and str(out) in printed
    head = DraftHead.load(out, expect=loaded.info)
    assert head.info.training["held_out_positions"] > 0 and 0.0 <= head.info.training["agreement"] <= 1.0
    with pytest.raises(SpecstoreError, match="holdout"):
        HeadTraining(holdout=1.0)
    assert main(["train-head", "--model", str(loaded.path), "--corpus", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err


@pytest.mark.model
def test_default_model_respec_with_a_head_is_identical_to_ar_float32(tmp_path):
    """The real default model in float32: a head trained on a few records, respec drafting its
    guesses (always retrieving) decodes exactly what ar decodes, and the target takes guesses."""
    from specstore.runtime.models import load_model
    from specstore.runtime.store import Store
    from tests.datastore_helpers import CODE_RECORDS, model_hidden, write_datastore

    loaded = load_model(None, dtype="float32", device="cpu")
    prompts = [r["instruction"] for r in CODE_RECORDS]
    ar = {p: generate(loaded.model, loaded.tokenizer, p, "ar", max_new_tokens=40) for p in prompts}
    docs = [r.prompt_ids + r.token_ids for r in ar.values()]
    store = Store(tmp_path / "store", create=True)
    write_datastore(store, "own", docs, model_hidden(loaded.model, docs), loaded.info)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CODE_RECORDS))
    data = collect(loaded.model, [*map(np.asarray, docs), *corpus_documents([str(corpus)], loaded.tokenizer)], max_tokens=10_000)
    path = train(loaded.model, loaded.info, data, HeadTraining(epochs=20, batch=32, holdout=0.0)).save(tmp_path / "h.safetensors")
    drafter = make_drafter("respec", Datastore.open(store, "own", loaded.info), head=str(path),
                           entropy_threshold=math.inf, max_candidates=8)
    taken = 0
    for prompt, expected in ar.items():
        result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=40)
        assert result.token_ids == expected.token_ids, prompt
        taken += drafter.stats()["head_accepted"]
    assert taken > 0


def test_a_head_file_is_loaded_once_until_it_changes(head_setup, tmp_path):
    _, loaded, _, head, _, path = head_setup
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(path.read_bytes())
    first = DraftHead.cached(copy, expect=loaded.info)
    assert DraftHead.cached(copy, expect=loaded.info) is first
    with pytest.raises(SpecstoreError, match="revision"):  # the model check is made on every call
        DraftHead.cached(copy, expect=loaded.info.model_copy(update={"revision": "0" * 64}))
    head.save(copy)  # rewritten: read again
    assert DraftHead.cached(copy, expect=loaded.info) is not first


def test_a_heads_distribution_gives_its_guesses_and_any_tokens_probability(head_setup):
    _, _, _, head, data, _ = head_setup
    h, pending = data["hidden"][3], int(data["pending"][3])
    probs = head.distribution(h, pending)
    assert probs.shape == (len(head.vocab),) and abs(float(probs.sum()) - 1.0) < 1e-4
    guesses = head.guess(h, pending, 3)
    assert guesses == head.top(probs, 3)
    for token, p in guesses:
        assert head.probability(probs, token) == pytest.approx(p)
    outside = next(t for t in range(10**6) if t not in set(head.vocab.tolist()))
    assert head.probability(probs, outside) is None and head.probability(probs, -1) is None


def _kernel_head(head):
    from specstore.runtime import gemm

    if not gemm.has_head(dtype=head.dtype) or head._kernel is None or torch.get_num_threads() < 2:
        pytest.skip(f"no CPU kernel head here ({gemm.unavailable_reason() or 'one thread'})")


def test_the_heads_guess_beside_other_work_is_its_guess(head_setup):
    """``guess_beside``: the kernel's guess on the second thread while ``fn`` runs on this one
    gives what ``fn`` gives and the head's distribution to bf16's rounding (the same likeliest
    token wherever it leads by more than a rounding); ``beside=False`` is torch's guess exactly."""
    _, _, _, head, data, _ = head_setup
    _kernel_head(head)
    same, positions = 0, range(0, len(data["target"]), 4)
    for i in positions:
        h, pending = data["hidden"][i], int(data["pending"][i])
        want = head.distribution(h, pending)
        value, probs, top = head.guess_beside(lambda i=i: i * 3, h, pending, 3)
        assert value == i * 3 and probs.dtype == np.float32 and probs.shape == (len(head.vocab),)
        assert abs(float(probs.sum()) - 1.0) < 1e-4
        assert np.allclose(probs, want.numpy(), rtol=0.05, atol=1e-5)
        assert len(top) == 3 and [p for _, p in top] == sorted((p for _, p in top), reverse=True)
        assert all(p == pytest.approx(float(probs[head._row(t)])) for t, p in top)
        same += top[0][0] == head.top(want, 1)[0][0]
        assert head.guess_beside(lambda: None, h, pending, 3, beside=False)[2] == head.top(want, 3)
    assert same >= 0.9 * len(positions), (same, len(positions))


@pytest.mark.parametrize("weights", ["float32", "bf16"])
def test_a_float32_heads_guess_beside_other_work_is_torchs_to_rounding(head_setup, weights):
    """The float32 guess beside (csrc/small_gemm.c: specstore_head_beside_f32, the one CPUs without
    AVX-512 BF16 run) on every CPU the kernel runs on: the head loaded in float32 gives torch's
    float32 distribution to float32's rounding and the same likeliest tokens, and ``fn``'s value;
    with its weights held in bf16 (the default), torch's distribution with the same rounded
    weights, the kernel reading half the bytes."""
    from specstore.runtime import gemm

    _, _, _, trained, data, path = head_setup
    if not gemm.has_head(dtype=torch.float32) or torch.get_num_threads() < 2:
        pytest.skip(f"no CPU kernel float32 head here ({gemm.unavailable_reason() or 'one thread'})")
    head = DraftHead.load(path, dtype=torch.float32, weights=weights)
    wide = torch.float32 if weights == "float32" else torch.bfloat16
    assert head._kernel is not None and all(head._kernel[i].dtype == wide for i in (0, 1, 3))
    for name in ("fc1h", "fc2", "out"):  # the torch path computes with the weights the kernel reads
        weight = head.infer[name].weight
        assert weight.dtype == torch.float32 and torch.equal(weight, weight.to(wide).float())
    for i in range(0, len(data["target"]), 3):
        h, pending = data["hidden"][i], int(data["pending"][i])
        want = head.distribution(h, pending)
        value, probs, top = head.guess_beside(lambda i=i: ("pool", i), h, pending, 4)
        assert value == ("pool", i) and probs.dtype == np.float32
        np.testing.assert_allclose(probs, want.numpy(), rtol=1e-4, atol=1e-7)
        assert [t for t, _ in top] == [t for t, _ in head.top(torch.from_numpy(probs), 4)]
        assert top[0][0] == head.top(want, 1)[0][0] or abs(top[0][1] - float(want.max())) < 1e-5


def test_what_runs_beside_the_heads_guess_raises_after_it_and_calls_nest(head_setup):
    _, _, _, head, data, _ = head_setup
    _kernel_head(head)
    h, pending = data["hidden"][1], int(data["pending"][1])

    def fails():
        raise KeyError("from the pool")

    with pytest.raises(KeyError, match="from the pool"):
        head.guess_beside(fails, h, pending, 2)
    assert head.guess_beside(lambda: "again", h, pending, 2)[0] == "again"
    # a guess beside work that itself guesses beside other work: each call gets its own result
    inner = head.guess_beside(lambda: head.guess_beside(lambda: "inner", h, pending, 2), h, pending, 2)
    assert inner[0][0] == "inner" and inner[0][2] == inner[2]


def test_respec_runs_the_heads_guess_beside_its_pool_unless_told_not_to(head_setup, monkeypatch):
    """With ``head_thread`` (the default) every retrieving step's head guess goes through the
    kernel beside the pool's search; ``head_thread=off`` never does. Both identical to ar."""
    from specstore.runtime import gemm

    store, loaded, ar, head, _, path = head_setup
    _kernel_head(head)
    calls = []
    real = gemm.head_beside
    monkeypatch.setattr(gemm, "head_beside", lambda *a, **k: calls.append(1) or real(*a, **k))
    ds = Datastore.open(store, "own", loaded.info)
    for thread, expect_calls in (("on", True), ("off", False)):
        calls.clear()
        drafter = make_drafter("respec", ds, head=str(path), entropy_threshold=math.inf, max_candidates=8, head_thread=thread)
        head_steps = 0
        for prompt, expected in list(ar.items())[:3]:
            assert generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=len(expected)).token_ids == expected
            head_steps += drafter.stats()["head_steps"]
        assert head_steps > 0
        assert (len(calls) >= head_steps) if expect_calls else not calls


def test_respec_loads_its_head_with_the_weights_it_is_told(head_setup):
    """``head_weights`` (bf16 by default, float32, `--head-weights`) reaches the head a ReSpec
    drafter loads, each form cached apart; the rounded head keeps ar's output; another value is
    refused."""
    from specstore.runtime.drafters.respec_cli import CONFIG_FLAGS

    store, loaded, ar, _, _, path = head_setup
    ds = Datastore.open(store, "own", loaded.info)
    default = make_drafter("respec", ds, head=str(path), entropy_threshold=math.inf, max_candidates=8)
    whole = make_drafter("respec", ds, head=str(path), head_weights="float32")
    assert default.head.weights == "bf16" and whole.head.weights == "float32" and default.head is not whole.head
    assert make_drafter("respec", ds, head=str(path), head_weights="float32").head is whole.head  # cached per form
    if default.head.dtype == torch.float32:  # on CPUs with AVX-512 BF16 the head computes in bf16 anyway
        assert torch.equal(default.head.infer["out"].weight, default.head.infer["out"].weight.bfloat16().float())
        assert not torch.equal(whole.head.infer["out"].weight, whole.head.infer["out"].weight.bfloat16().float())
    for prompt, expected in list(ar.items())[:2]:
        assert generate(loaded.model, loaded.tokenizer, prompt, default, max_new_tokens=len(expected)).token_ids == expected
    with pytest.raises(ValueError, match="head_weights must be bf16 or float32"):
        make_drafter("respec", ds, head=str(path), head_weights="int8")
    assert CONFIG_FLAGS["head_weights"] == "--head-weights"


def test_the_heads_probability_of_each_first_draft_token_is_its_signal(head_setup):
    """With a head, every first draft token (whatever its source) gets the head's probability as
    its prior and, binned, a calibration cell of its own; deeper nodes keep the score's prior.
    ``head_signal=off`` leaves the signal as it was without a head."""
    from specstore.runtime.drafters import respec
    from specstore.runtime.drafters.respec_pool import Candidate
    from specstore.runtime.tree import DraftTree

    store, loaded, _, head, data, path = head_setup
    ds = Datastore.open(store, "own", loaded.info)
    h, pending = data["hidden"][5], int(data["pending"][5])
    probs = head.distribution(h, pending)
    order = probs.argsort(descending=True).tolist()
    likely, unlikely = int(head.vocab[order[0]]), int(head.vocab[order[-1]])
    chosen = [Candidate(("suffix", 0), [likely, 7, 8], match=4), Candidate(("suffix", 1), [unlikely, 9], match=4),
              Candidate(("context", 0), [int(head.vocab[order[-2]]), 10], match=4)]  # a long copy from the context

    def signal(**options):
        drafter = respec.ReSpecDrafter(ds, respec.ReSpecConfig(head=str(path), **options))
        drafter.head_probs = probs
        tree = DraftTree.from_paths([c.tokens for c in chosen])
        drafter._add_signals(tree, chosen)
        by_token = dict(zip(tree.tokens.tolist(), zip(tree.node_data["bucket"].tolist(), tree.node_data["prior"].tolist(), strict=True), strict=True))
        return by_token

    on, off = signal(), signal(head_signal=False)
    assert on[likely][1] == pytest.approx(float(probs[order[0]])) and on[unlikely][1] == pytest.approx(float(probs[order[-1]]))
    assert on[likely][0] != on[unlikely][0]  # far apart in probability: different cells
    assert on[7][1] == pytest.approx(0.5) and on[7][0] == on[9][0]  # deeper nodes: the score's prior, no head bin
    copy = int(head.vocab[order[-2]])
    assert on[copy][1] == pytest.approx(0.5) and on[copy][0] != off[copy][0]  # a long copy keeps its prior, binned all the same
    assert off[likely] == off[unlikely] and off[likely][1] == pytest.approx(0.5)
    assert max(b for b, _ in on.values()) < respec.FALLBACK_BUCKET
    assert make_drafter("respec", ds, head=str(path), head_signal="off").config.head_signal is False  # the CLI's text
    with pytest.raises(SpecstoreError, match="head_signal must be on or off"):
        make_drafter("respec", ds, head=str(path), head_signal="sometimes")


def test_candidates_the_head_rules_out_are_not_proposed_unless_they_copy_the_context(head_setup):
    """``head_floor``: a candidate whose first token the head gives less than the floor never
    reaches the tree; a long context copy does, whatever the head says; 0 keeps every one."""
    from specstore.runtime.drafters import respec
    from specstore.runtime.drafters.respec_pool import Candidate

    store, loaded, _, head, data, path = head_setup
    ds = Datastore.open(store, "own", loaded.info)
    probs = head.distribution(data["hidden"][5], int(data["pending"][5]))
    order = probs.argsort(descending=True).tolist()
    likely, unlikely = int(head.vocab[order[0]]), int(head.vocab[order[-1]])
    assert float(probs[order[-1]]) < 0.001 < float(probs[order[0]])
    drafter = respec.ReSpecDrafter(ds, respec.ReSpecConfig(head=str(path)))
    drafter.head_probs = probs.numpy()
    assert drafter._head_agrees(Candidate(("suffix", 0), [likely, 5]))
    assert not drafter._head_agrees(Candidate(("suffix", 0), [unlikely, 5]))
    assert drafter._head_agrees(Candidate(("context", 0), [unlikely, 5], match=4))  # a long copy
    assert not drafter._head_agrees(Candidate(("context", 0), [unlikely, 5], match=2))
    keep_all = respec.ReSpecDrafter(ds, respec.ReSpecConfig(head=str(path), head_floor=0.0))
    keep_all.head_probs = drafter.head_probs
    assert keep_all._head_agrees(Candidate(("suffix", 0), [unlikely, 5]))
    with pytest.raises(ValueError, match="head_floor"):
        respec.ReSpecConfig(head_floor=1.5)


def test_a_heads_weights_in_bf16_guess_as_its_float32_weights_do(head_setup):
    """Rounding the three weights of a float32 head to bf16 (DraftHead's default ``weights``)
    changes its probabilities by rounding, not its guesses: the likeliest token the same at
    nearly every position. Weights other than float32 or bf16 are refused."""
    _, _, _, _, data, path = head_setup
    wide = DraftHead.load(path, dtype=torch.float32, weights="float32")
    narrow = DraftHead.load(path, dtype=torch.float32, weights="bf16")
    same, gap, positions = 0, 0.0, range(0, len(data["target"]), 2)
    for i in positions:
        h, pending = data["hidden"][i], int(data["pending"][i])
        a, b = wide.distribution(h, pending), narrow.distribution(h, pending)
        same += wide.top(a, 1)[0][0] == narrow.top(b, 1)[0][0]
        gap = max(gap, float((a - b).abs().max()))
    assert same >= 0.95 * len(positions), (same, len(positions))
    assert 0 < gap < 0.05
    with pytest.raises(ValueError, match="float32 or bf16"):
        DraftHead.load(path, dtype=torch.float32, weights="int8")
