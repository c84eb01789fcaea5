"""attention.py's packed SDPA against transformers' own (repeat_kv) SDPA: the same rows under
tree masks (float and bool, several query lengths and group sizes), the verifier switches sdpa
models to it and leaves the others alone, and tree logits stay equal to a plain forward."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specstore.runtime import attention
from specstore.runtime.attention import PACKED_SDPA, packed_sdpa_forward, use_packed_attention
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import TreeVerifier, ancestor_matrix
from tests.decoding_helpers import tiny_lm


class _Module:
    is_causal = True

    def __init__(self, groups: int):
        self.num_key_value_groups = groups


def _tree_mask(rng: np.random.Generator, cached: int, q: int, as_bool: bool) -> torch.Tensor:
    parents = [int(rng.integers(-1, i)) for i in range(q - 1)]
    allowed = torch.as_tensor(ancestor_matrix(DraftTree(rng.integers(0, 9, size=q - 1), parents)))
    full = torch.ones(1, 1, q, cached + q, dtype=torch.bool)
    full[0, 0, :, cached:] = allowed
    if as_bool:
        return full
    return torch.zeros(full.shape).masked_fill_(~full, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("q", [2, 7, 17])
@pytest.mark.parametrize("as_bool", [False, True])
def test_packed_rows_equal_repeat_kv_rows(groups, q, as_bool):
    rng = np.random.default_rng(q * 10 + groups)
    kv_heads, cached, dim = 2, 37, 16
    gen = torch.Generator().manual_seed(q)
    query = torch.randn(1, kv_heads * groups, q, dim, generator=gen)
    key = torch.randn(1, kv_heads, cached + q, dim, generator=gen)
    value = torch.randn(1, kv_heads, cached + q, dim, generator=gen)
    mask = _tree_mask(rng, cached, q, as_bool)
    stock, _ = sdpa_attention_forward(_Module(groups), query, key, value, mask, scaling=0.25)
    packed, _ = packed_sdpa_forward(_Module(groups), query, key, value, mask, scaling=0.25)
    assert packed.shape == stock.shape == (1, q, kv_heads * groups, dim)
    torch.testing.assert_close(packed, stock, atol=1e-6, rtol=1e-5)


def test_falls_back_to_transformers_where_it_cannot_pack():
    gen = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 4, 5, 8, generator=gen), torch.randn(1, 2, 9, 8, generator=gen)
    value = torch.randn(1, 2, 9, 8, generator=gen)
    for mask in (None, torch.zeros(1, 4, 5, 9)):  # causal (no mask), a per-head mask
        stock, _ = sdpa_attention_forward(_Module(2), query, key, value, mask)
        packed, _ = packed_sdpa_forward(_Module(2), query, key, value, mask)
        assert torch.equal(packed, stock)


def test_verifier_switches_sdpa_models_only():
    llama, _ = tiny_lm("llama", "sdpa")
    TreeVerifier(llama)
    assert llama.config._attn_implementation == PACKED_SDPA
    assert use_packed_attention(llama)  # idempotent
    eager, _ = tiny_lm("llama", "eager")
    TreeVerifier(eager)
    assert eager.config._attn_implementation == "eager"


@torch.inference_mode()
def test_packed_tree_logits_equal_stock_tree_logits():
    model, _ = tiny_lm("llama", "sdpa")
    rng = np.random.default_rng(3)
    vocab = model.config.vocab_size
    prompt = rng.integers(3, vocab, size=40).tolist()
    tree = DraftTree(rng.integers(3, vocab, size=9), [-1, 0, 1, 0, -1, 4, 5, 2, -1])
    pending = int(rng.integers(3, vocab))
    out = {}
    for impl in ("sdpa", PACKED_SDPA):
        verifier = TreeVerifier(model)
        model.config._attn_implementation = impl  # after the verifier's switch: this forward's implementation
        verifier.prefill(prompt)
        out[impl] = verifier.tree_logits(pending, tree)[0]
    torch.testing.assert_close(out[PACKED_SDPA], out["sdpa"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups", [2, 3])
def test_packed_one_token_step_equals_transformers(dtype, groups):
    """Plain decoding's 1-token step, packed on the CPU in reduced precision: the rows of
    transformers' own (enable_gqa) attention."""
    gen = torch.Generator().manual_seed(groups)
    kv_heads, cached, dim = 3, 300, 64
    query = torch.randn(1, kv_heads * groups, 1, dim, generator=gen).to(dtype)
    key = torch.randn(1, kv_heads, cached, dim, generator=gen).to(dtype)
    value = torch.randn(1, kv_heads, cached, dim, generator=gen).to(dtype)
    stock, _ = sdpa_attention_forward(_Module(groups), query, key, value, None, scaling=0.125)
    packed, _ = packed_sdpa_forward(_Module(groups), query, key, value, None, scaling=0.125)
    assert packed.shape == stock.shape == (1, 1, kv_heads * groups, dim)
    reference = torch.nn.functional.scaled_dot_product_attention(  # float32, heads repeated: the exact rows
        query.float(), key.float().repeat_interleave(groups, 1), value.float().repeat_interleave(groups, 1), scale=0.125)
    reference = reference.transpose(1, 2)
    torch.testing.assert_close(packed.float(), reference, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(packed.float(), stock.float(), atol=2e-2, rtol=2e-2)


def test_float32_one_token_step_takes_the_kernel_or_keeps_transformers_path(monkeypatch):
    """The kernel's float32 attention where it loads (transformers' result to float32 rounding);
    without it (or switched off) transformers' own path, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    query, key = torch.randn(1, 6, 1, 16, generator=gen), torch.randn(1, 2, 40, 16, generator=gen)
    value = torch.randn(1, 2, 40, 16, generator=gen)
    stock, _ = sdpa_attention_forward(_Module(3), query, key, value, None)
    packed, _ = packed_sdpa_forward(_Module(3), query, key, value, None)
    assert packed.shape == stock.shape
    torch.testing.assert_close(packed, stock, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(attention, "_KERNEL_ATTENTION", False)
    packed, _ = packed_sdpa_forward(_Module(3), query, key, value, None)
    assert torch.equal(packed, stock)


@torch.inference_mode()
def test_bf16_plain_steps_follow_the_packed_path_and_decode_alike(monkeypatch):
    """Greedy plain decoding of a bf16 tiny model: the packed 1-token steps give the tokens
    transformers' own SDPA gives (a tiny model has no near-ties at this scale)."""
    taken = []
    check = attention._packable_step
    monkeypatch.setattr(attention, "_packable_step", lambda *a: taken.append(check(*a)) or taken[-1])
    model = copy.deepcopy(tiny_lm("llama", "sdpa")[0]).to(torch.bfloat16)  # the shared float32 one stays as it is
    prompt = np.random.default_rng(4).integers(3, model.config.vocab_size, size=30).tolist()
    out = {}
    for impl in ("sdpa", PACKED_SDPA):
        verifier = TreeVerifier(model)
        model.config._attn_implementation = impl
        pending = verifier.prefill(prompt).bonus
        logits, tokens = [], []
        for _ in range(8):
            row = verifier.step(pending, DraftTree.empty())
            logits.append(row.logits.float())
            pending = row.result.bonus
            tokens.append(pending)
        out[impl] = (torch.stack(logits), tokens)
    torch.testing.assert_close(out[PACKED_SDPA][0], out["sdpa"][0], atol=3e-2, rtol=3e-2)
    assert out[PACKED_SDPA][1] == out["sdpa"][1]
    assert sum(taken) == 8 * model.config.num_hidden_layers  # every layer of every step packed


@pytest.mark.parametrize("as_bool", [False, True])
@pytest.mark.parametrize("q", [1, 9])
def test_matmul_attention_over_a_long_cache_gives_sdpa_rows(monkeypatch, q, as_bool):
    """bf16 on the CPU over a cache past MATMUL_MIN_KEYS: the packed forward takes the matmul
    path (counted) and its rows are SDPA's, within bf16 rounding of the float32 ones (the kernel's
    attention, which would take these first where it runs, switched off)."""
    monkeypatch.setattr(attention, "_KERNEL_ATTENTION", False)
    calls = []
    real = attention._matmul_attention
    monkeypatch.setattr(attention, "_matmul_attention", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(q)
    groups, kv_heads, dim = 3, 2, 32
    cached = attention.MATMUL_MIN_KEYS + 5 - q
    gen = torch.Generator().manual_seed(q)
    query = torch.randn(1, kv_heads * groups, q, dim, generator=gen)
    key = torch.randn(1, kv_heads, cached + q, dim, generator=gen)
    value = torch.randn(1, kv_heads, cached + q, dim, generator=gen)
    mask = None if q == 1 else _tree_mask(rng, cached, q, as_bool)
    reference, _ = sdpa_attention_forward(_Module(groups), query, key, value, mask, scaling=0.2)
    low = mask if mask is None or as_bool else mask.to(torch.bfloat16)
    packed, _ = packed_sdpa_forward(_Module(groups), query.bfloat16(), key.bfloat16(), value.bfloat16(), low, scaling=0.2)
    assert calls == [1] and packed.dtype == torch.bfloat16
    torch.testing.assert_close(packed.float(), reference, atol=2e-2, rtol=2e-2)
    float32, _ = packed_sdpa_forward(_Module(groups), query, key, value, mask, scaling=0.2)
    assert calls == [1]  # float32 keeps SDPA
    torch.testing.assert_close(float32, reference, atol=1e-5, rtol=1e-5)


def test_the_repeated_mask_is_made_once_per_mask():
    """Every layer of a forward gets the same mask: its repeat is made once and reused; another
    mask (the next step's) or another group size gets its own."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(1, 1, 3, 7, generator=gen)
    first = attention._repeated_mask(a, 3)
    assert torch.equal(first, a.repeat(1, 1, 3, 1))
    assert attention._repeated_mask(a, 3) is first
    assert torch.equal(attention._repeated_mask(a, 2), a.repeat(1, 1, 2, 1))
    b = a.clone() + 1.0
    assert torch.equal(attention._repeated_mask(b, 3), b.repeat(1, 1, 3, 1))
