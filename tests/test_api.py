"""The public API: ``generate`` (prompt through the chat template, messages, streaming, seeds,
defaults) and ``custom_generate`` through transformers' own ``model.generate``, checked against
transformers' plain greedy decoding."""

from __future__ import annotations

import pytest
import torch

import specstore.runtime as rt
from specstore.runtime.api import custom_generate, prompt_ids
from specstore.runtime.errors import SpecstoreError
from tests.decoding_helpers import FAMILIES, tiny_lm


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_matches_transformers_greedy(family):
    model, tok = tiny_lm(family)
    ids = prompt_ids(tok, "Say hello twice: hello hello")
    ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20, min_new_tokens=20, pad_token_id=0)
    ref = ref[0, len(ids) :].tolist()
    for drafter in (None, "ar", "pld"):
        out = rt.generate(model, tok, "Say hello twice: hello hello", drafter=drafter, max_new_tokens=20)
        eos = out.token_ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in out.token_ids else 20
        assert out.token_ids == ref[: len(out.token_ids)] and len(out.token_ids) == eos
        assert out.prompt_ids == ids
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_prompt_string_goes_through_the_chat_template():
    _, tok = tiny_lm("llama")
    ids = prompt_ids(tok, "hi")
    text = tok.decode(ids)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert "Be brief." in tok.decode(prompt_ids(tok, messages))
    assert prompt_ids(tok, [5, 6, 7]) == [5, 6, 7]


def test_stream_receives_the_text_in_pieces():
    model, tok = tiny_lm("llama")
    pieces: list[str] = []
    out = rt.generate(model, tok, "Count: one two three one two three", drafter="pld", max_new_tokens=30, stream=pieces.append)
    assert "".join(pieces) == out.text and len(pieces) >= 1


def test_sampling_seed_is_reproducible_and_stats_serialise():
    model, tok = tiny_lm("llama")
    a = rt.generate(model, tok, "hello", drafter="pld", max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)
    b = rt.generate(model, tok, "hello", drafter="pld", max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)
    assert a.token_ids == b.token_ids
    d = a.to_dict()
    assert set(d["stats"]) >= {"steps", "mat", "accepted_per_step", "drafting_s", "verifying_s", "num_drafted", "num_accepted"}
    assert d["stats"]["steps"] == len(d["stats"]["accepted_per_step"])


def test_bad_arguments():
    model, tok = tiny_lm("llama")
    with pytest.raises(SpecstoreError, match="unknown drafting method"):
        rt.generate(model, tok, "hi", drafter="nope")
    with pytest.raises(ValueError, match="temperature"):
        rt.generate(model, tok, "hi", temperature=-1.0)
    with pytest.raises(SpecstoreError, match="empty"):
        rt.generate(model, tok, [])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_custom_generate_through_model_generate(family):
    model, tok = tiny_lm(family)
    ids = torch.tensor([prompt_ids(tok, "Repeat: red green blue red green blue")])
    plain = model.generate(ids, do_sample=False, max_new_tokens=16, pad_token_id=0)
    ours = model.generate(ids, custom_generate=custom_generate, drafter="pld", do_sample=False, max_new_tokens=16, pad_token_id=0)
    assert torch.equal(ours, plain)
    ar = model.generate(ids, custom_generate=custom_generate, max_new_tokens=5, pad_token_id=0)
    assert torch.equal(ar, plain[:, : ids.shape[1] + 5])
    sampled = model.generate(ids, custom_generate=custom_generate, do_sample=True, temperature=0.7, max_new_tokens=4, pad_token_id=0)
    assert sampled.shape[1] <= ids.shape[1] + 4
    with pytest.raises(ValueError, match="one sequence"):
        model.generate(torch.cat([ids, ids]), custom_generate=custom_generate, max_new_tokens=2, pad_token_id=0)


def test_public_names_are_reexported():
    from specstore.runtime import api
    from specstore.runtime.drafters import registry

    assert rt.generate is api.generate and rt.custom_generate is api.custom_generate
    assert rt.make_drafter is registry.make_drafter and rt.make_drafter("ar").name == "ar"
    assert {"generate", "custom_generate", "GenerateResult", "make_drafter"} <= set(rt.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rt.nope  # noqa: B018
