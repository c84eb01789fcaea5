"""The float32 layer stack in one kernel call (runtime/kernel_forward.py): which models it takes,
its logits against transformers' modules, each row's bits the same as in a plain step (so a tree
verification is plain decoding's), the cache past its first buffer, stale weights, and the real
default model."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from specstore.runtime import gemm, kernel_forward
from specstore.runtime.decode import decode
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.kernel_forward import KernelForward
from specstore.runtime.linear import kernel_panel, use_packed_linears
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import TreeVerifier
from tests.decoding_helpers import tiny_lm

needs_kernel = pytest.mark.skipif(not (gemm.available() and getattr(gemm.library(), "decoder_f32", False)),
                                  reason=f"the kernel's float32 decoder is not built here ({gemm.unavailable_reason()})")
TAKEN = ("llama", "qwen2")


ODD_MLP = "llama-mlp40"  # an MLP width that is no multiple of the kernel's 16-output panels: the gate after the product


def _model(family: str):
    """A tiny random model of ``family``; ``ODD_MLP``: a Llama whose gate/up panels mix the two."""
    if family != ODD_MLP:
        return tiny_lm(family)[0]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)  # not near-uniform logits (tests/helpers.py)
    return model


@torch.inference_mode()
def _module_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0]


def _verifier(model, kernel: bool, monkeypatch) -> TreeVerifier:
    monkeypatch.setenv("SPECSTORE_KERNEL_FORWARD", "1" if kernel else "0")
    v = TreeVerifier(model)
    assert (v.kernel_forward is not None) == kernel
    return v


@needs_kernel
@pytest.mark.parametrize("family", TAKEN)
def test_takes_llama_and_qwen2_in_float32(family):
    model, _ = tiny_lm(family)
    use_packed_linears(model)
    assert kernel_forward.reason(model) is None
    assert KernelForward.of(model) is KernelForward.of(model)  # made once, kept on the model


@needs_kernel
def test_says_why_it_does_not_take_a_model(monkeypatch):
    gpt2, _ = tiny_lm("gpt2")
    assert "GPT2LMHeadModel is not one of" in kernel_forward.reason(gpt2)
    assert KernelForward.of(gpt2) is None
    llama, _ = tiny_lm("llama")
    half = copy.deepcopy(llama).to(torch.bfloat16)
    assert kernel_forward.reason(half) == "not a float32 model on the CPU"
    partial = copy.deepcopy(llama)
    partial.config.partial_rotary_factor = 0.5
    assert kernel_forward.reason(partial) == "its rotary embedding covers part of each head"
    bare = copy.deepcopy(llama)  # no linear packed yet
    assert "use_packed_linears" in kernel_forward.reason(bare)
    with pytest.raises(ValueError, match="does not take this model"):
        KernelForward(bare)
    monkeypatch.setenv("SPECSTORE_KERNEL_FORWARD", "0")
    use_packed_linears(llama)
    assert kernel_forward.reason(llama).startswith("off")
    assert TreeVerifier(llama).kernel_forward is None


@needs_kernel
@pytest.mark.parametrize("family", [*TAKEN, ODD_MLP])
def test_logits_and_cache_agree_with_the_modules(family, monkeypatch):
    model = _model(family)
    rng = np.random.default_rng(5)
    vocab = model.config.vocab_size
    prompt = rng.integers(3, vocab, size=17).tolist()
    ours, theirs = _verifier(model, True, monkeypatch), _verifier(model, False, monkeypatch)
    pending = ours.prefill(prompt).bonus
    assert theirs.prefill(prompt).bonus == pending
    tree = DraftTree.from_paths([rng.integers(3, vocab, size=4).tolist(), rng.integers(3, vocab, size=3).tolist()])
    a, ha = ours.tree_logits(pending, tree)
    b, hb = theirs.tree_logits(pending, tree)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ha, hb, atol=1e-4, rtol=1e-4)
    assert ours.num_cached == theirs.num_cached == len(prompt) + 1 + len(tree)
    for x, y in zip(ours.cache.layers, theirs.cache.layers, strict=True):
        torch.testing.assert_close(x.keys, y.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(x.values, y.values, atol=1e-5, rtol=1e-4)
    # against a whole forward of the modules over each path
    torch.testing.assert_close(a[0], _module_logits(model, prompt + [pending])[-1], atol=1e-4, rtol=1e-4)
    for node in range(len(tree)):
        path = tree.tokens[tree.path_to(node)].tolist()
        torch.testing.assert_close(a[node + 1], _module_logits(model, prompt + [pending] + path)[-1], atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("family", TAKEN)
@pytest.mark.parametrize("size", [1, 17, kernel_forward.MAX_ROWS, kernel_forward.MAX_ROWS + 1, 2 * kernel_forward.MAX_ROWS + 9])
def test_prefill_in_kernel_calls_agrees_with_the_modules(family, size, monkeypatch):
    """A prompt's prefill in kernel calls of up to MAX_ROWS tokens (one call, or chunks that
    attend to the earlier ones): the modules' first token, last logits, hidden state and cache to
    rounding, and a plain step after it through the kernel the modules' logits to rounding."""
    model, _ = tiny_lm(family)
    rng = np.random.default_rng(size)
    prompt = rng.integers(3, model.config.vocab_size, size=size).tolist()
    ours, theirs = _verifier(model, True, monkeypatch), _verifier(model, False, monkeypatch)
    a, b = ours.prefill(prompt), theirs.prefill(prompt)
    assert a.bonus == b.bonus
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.hidden, b.hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.logits, _module_logits(model, prompt)[-1], atol=1e-4, rtol=1e-4)
    assert ours.num_cached == theirs.num_cached == size
    for x, y in zip(ours.cache.layers, theirs.cache.layers, strict=True):
        assert x.__dict__.get("_own")  # the kernel's buffers, which its steps then write
        torch.testing.assert_close(x.keys, y.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(x.values, y.values, atol=1e-5, rtol=1e-4)
    logits, _ = ours.tree_logits(a.bonus, DraftTree.empty())
    torch.testing.assert_close(logits[0], _module_logits(model, prompt + [a.bonus])[-1], atol=1e-4, rtol=1e-4)


@needs_kernel
def test_prefill_takes_the_modules_where_the_cache_is_not_an_empty_growing_one(monkeypatch):
    from transformers import DynamicCache

    model, _ = tiny_lm("llama")
    made = _verifier(model, True, monkeypatch).kernel_forward
    prompt = list(range(30, 45))
    assert made.prefill(prompt, DynamicCache(config=model.config)) is None  # transformers' own layers
    used = _verifier(model, True, monkeypatch)
    used.prefill(prompt)
    assert made.prefill(prompt, used.cache) is None and used.num_cached == len(prompt)  # untouched
    assert made.prefill([], _verifier(model, True, monkeypatch).cache) is None


@needs_kernel
@pytest.mark.parametrize("family", [*TAKEN, ODD_MLP])
def test_each_tree_row_has_the_bits_of_a_plain_step(family, monkeypatch):
    """A verification's rows against plain decoding through the same kernel, token by token:
    equal bits, with the path as a tree's second branch and masked padding rows after it."""
    model = _model(family)
    rng = np.random.default_rng(6)
    vocab = model.config.vocab_size
    prompt = rng.integers(3, vocab, size=23).tolist()
    path = rng.integers(3, vocab, size=5).tolist()
    plain = _verifier(model, True, monkeypatch)
    pending = plain.prefill(prompt).bonus
    rows = []
    for token in [pending, *path]:
        logits, _ = plain.tree_logits(token, DraftTree.empty())
        rows.append(logits[0])
    tree_verifier = _verifier(model, True, monkeypatch)
    tree_verifier.prefill(prompt)
    tree = DraftTree.from_paths([rng.integers(3, vocab, size=3).tolist(), path])
    logits, _ = tree_verifier.tree_logits(pending, tree, pad=3)
    assert tree_verifier.num_cached == len(prompt) + 1 + len(tree)  # the padding cropped again
    assert torch.equal(logits[0], rows[0])
    second = tree.paths[1]
    for depth, node in enumerate(second, start=1):
        assert torch.equal(logits[node + 1], rows[depth]), f"depth {depth}"


@needs_kernel
def test_steps_past_the_first_buffer_and_decoding_like_the_modules(monkeypatch):
    """A prompt just under the cache's first capacity (kv_cache.MIN_CAPACITY), then plain steps
    and trees past it: the same tokens as decoding through the modules, and pld's as ar's."""
    model, _ = tiny_lm("llama")
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, model.config.vocab_size, size=250).tolist()
    prompt += prompt[100:140]  # spans to look up
    prompt = prompt[-252:]
    outs = {}
    for kernel in (False, True):
        monkeypatch.setenv("SPECSTORE_KERNEL_FORWARD", "1" if kernel else "0")
        for method in ("ar", "pld"):
            outs[kernel, method] = decode(model, prompt, make_drafter(method), 40).token_ids
    assert outs[True, "ar"] == outs[False, "ar"]
    assert outs[True, "pld"] == outs[True, "ar"] and outs[False, "pld"] == outs[False, "ar"]


@needs_kernel
def test_a_changed_weight_makes_it_again(monkeypatch):
    model, _ = tiny_lm("llama")
    model = copy.deepcopy(model)
    prompt = list(range(30, 50))
    first = _verifier(model, True, monkeypatch)
    made = first.kernel_forward
    q = model.model.layers[0].self_attn.q_proj
    stack = made._keep[0]  # layer 0's stacked query, key and value panel
    panel = kernel_panel(q)
    assert stack.data_ptr() <= panel.data_ptr() < stack.data_ptr() + stack.numel() * stack.element_size()  # a view, not a copy
    with torch.no_grad():
        q.weight.mul_(0.5)
        model.model.layers[1].post_attention_layernorm.weight.add_(0.25)
    assert not made.fresh()
    again = _verifier(model, True, monkeypatch)
    assert again.kernel_forward is not made
    pending = again.prefill(prompt).bonus
    logits, _ = again.tree_logits(pending, DraftTree.empty())
    torch.testing.assert_close(logits[0], _module_logits(model, prompt + [pending])[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.model
@needs_kernel
def test_default_model_kernel_forward_decodes_like_the_modules(monkeypatch):
    """SmolLM2-135M-Instruct in float32 on real text: a step's logits within rounding of the
    modules', the same greedy tokens, and pld's tokens identical to ar's through the kernel."""
    from specstore.runtime.api import eos_ids, prompt_ids
    from specstore.runtime.models import load_model

    loaded = load_model(dtype="float32", device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    ids = prompt_ids(tok, "Write a Python function that returns the squares of a list of numbers, with a docstring.")
    tokens = {}
    for kernel in (False, True):
        monkeypatch.setenv("SPECSTORE_KERNEL_FORWARD", "1" if kernel else "0")
        tokens[kernel, "ar"] = decode(model, ids, make_drafter("ar"), 40, eos_ids=eos_ids(model, tok)).token_ids
        tokens[kernel, "pld"] = decode(model, ids, make_drafter("pld"), 40, eos_ids=eos_ids(model, tok)).token_ids
    assert tokens[True, "pld"] == tokens[True, "ar"]
    assert tokens[True, "ar"] == tokens[False, "ar"]
    verifier = _verifier(model, True, monkeypatch)
    pending = verifier.prefill(ids).bonus
    logits, _ = verifier.tree_logits(pending, DraftTree.empty())
    want = _module_logits(model, ids + [pending])[-1]
    assert (logits[0] - want).abs().max().item() < 1e-3 * max(want.abs().max().item(), 1.0)
