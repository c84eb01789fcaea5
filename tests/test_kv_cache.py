"""The in-place KV cache (runtime/kv_cache.py): the same keys and values as transformers'
``DynamicLayer`` through appends, crops, in-place compaction and batch changes; appends that fit
write into the buffer (no copy of what is cached); and a verifier on it gives bitwise the same
logits and cache as one on transformers' layers."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specstore.runtime import gemm, verify
from specstore.runtime.kv_cache import GrowingLayer, compact, growing_cache
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import TreeVerifier
from tests.decoding_helpers import tiny_lm


def _states(rng: torch.Generator, rows: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 2, rows, 8, generator=rng), torch.randn(batch, 2, rows, 8, generator=rng)


def _same(a, b) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    if a.get_seq_length():
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_growing_layer_matches_dynamic_layer_through_appends_crops_and_compaction():
    rng = torch.Generator().manual_seed(0)
    grow, plain = GrowingLayer(), DynamicLayer()
    for step in range(400):
        k, v = _states(rng, int(torch.randint(1, 9, (1,), generator=rng)))
        out_g, out_p = grow.update(k, v), plain.update(k, v)
        assert torch.equal(out_g[0], out_p[0]) and torch.equal(out_g[1], out_p[1])
        drop = int(torch.randint(0, k.shape[-2], (1,), generator=rng))
        if step % 3 == 0 and k.shape[-2] > 1:  # the verifier's compaction: a row moves up in place
            for layer in (grow, plain):
                n = layer.get_seq_length()
                layer.keys[..., n - k.shape[-2], :] = layer.keys[..., n - 1, :]
                layer.values[..., n - k.shape[-2], :] = layer.values[..., n - 1, :]
        if drop:
            grow.crop(-drop)
            plain.crop(-drop)
        _same(grow, plain)
    assert grow._key_buffer.shape[-2] < 2 * 4 * 400  # doubled as needed, not per step


def test_appends_that_fit_write_into_the_buffer():
    rng = torch.Generator().manual_seed(1)
    layer = GrowingLayer()
    layer.update(*_states(rng, 10))
    buffer = layer._key_buffer
    for _ in range(20):
        layer.update(*_states(rng, 3))
        layer.crop(-1)
    assert layer._key_buffer is buffer  # 10 + 40 rows < MIN_CAPACITY: the first buffer all along
    assert layer.keys.data_ptr() == buffer.data_ptr() and layer.get_seq_length() == 50


def test_replaced_tensors_start_a_new_buffer():
    """batch_repeat_interleave and a deep copy (the verifier's batch fallback) replace the views;
    the next update must build on what the layer holds then, not on the old buffer."""
    rng = torch.Generator().manual_seed(2)
    grow, plain = GrowingLayer(), DynamicLayer()
    k, v = _states(rng, 12)
    grow.update(k, v)
    plain.update(k, v)
    grow_copy, plain_copy = copy.deepcopy(grow), copy.deepcopy(plain)
    for layer in (grow_copy, plain_copy):
        layer.batch_repeat_interleave(3)
    k3, v3 = _states(rng, 2, batch=3)
    grow_copy.update(k3, v3)
    plain_copy.update(k3, v3)
    _same(grow_copy, plain_copy)
    k, v = _states(rng, 2)  # the original is untouched by its copy
    grow.update(k, v)
    plain.update(k, v)
    _same(grow, plain)


def test_a_tensor_assigned_from_outside_is_kept_until_the_next_update():
    """While the layer owns its buffers its views are made when read; tensors assigned from
    outside are what the layer holds (its length theirs) until an update copies them in."""
    rng = torch.Generator().manual_seed(4)
    grow = GrowingLayer()
    grow.update(*_states(rng, 9))
    values_before = grow.values
    keys, values = torch.zeros(1, 2, 4, 8), torch.ones(1, 2, 4, 8)
    grow.keys = keys
    assert grow.keys is keys and torch.equal(grow.values, values_before)  # the other view handed out as it was
    grow.values = values
    assert grow.get_seq_length() == 4
    with pytest.raises(ValueError):
        grow.crop(3)  # transformers' rule for a positive count holds
    k, v = _states(rng, 2)
    grow.update(k, v)
    assert grow.get_seq_length() == 6  # 4 assigned + 2 appended (not 9 + 2)
    assert torch.equal(grow.keys[..., :4, :], keys) and torch.equal(grow.keys[..., 4:, :], k)
    assert torch.equal(grow.values[..., :4, :], values) and torch.equal(grow.values[..., 4:, :], v)


def test_a_reset_layer_starts_again():
    rng = torch.Generator().manual_seed(8)
    grow, plain = GrowingLayer(), DynamicLayer()
    for layer in (grow, plain):
        layer.update(*_states(torch.Generator().manual_seed(9), 5))
        layer.reset()
    assert grow.keys is None and grow.values is None and grow.get_seq_length() == plain.get_seq_length() == 0
    k, v = _states(rng, 3)
    grow.update(k, v)
    plain.update(k, v)
    _same(grow, plain)


def _filled_cache(rows: int, seed: int = 6):
    model, _ = tiny_lm("llama")
    rng = torch.Generator().manual_seed(seed)
    cache, plain = growing_cache(model.config), DynamicCache(config=model.config)
    for i in range(len(cache.layers)):
        k, v = _states(rng, rows)
        cache.layers[i].update(k, v)
        plain.layers[i].update(k.clone(), v.clone())
    return cache, plain


@pytest.mark.parametrize("rows", [[0, 1, 2], [1, 3], [0, 2, 5], []])
def test_compact_moves_the_accepted_rows_and_cuts_as_the_torch_path_does(rows):
    cache, plain = _filled_cache(20)
    start = 12  # the pending token's row is 11; tree nodes from 12
    moves = rows != list(range(len(rows)))
    if moves and not gemm.available():
        assert not compact(cache, start, rows, start + len(rows))
        pytest.skip(f"no CPU kernel here: {gemm.unavailable_reason()}")
    assert compact(cache, start, rows, start + len(rows))
    for layer in plain.layers:  # what TreeVerifier.compact does on transformers' layers
        if moves:
            keep = torch.tensor([start + r for r in rows])
            for name in ("keys", "values"):
                full = getattr(layer, name)
                full[..., start : start + len(rows), :] = full.index_select(-2, keep)
        layer.crop(-(20 - start - len(rows)))
    for a, b in zip(cache.layers, plain.layers, strict=True):
        _same(a, b)
    assert cache.get_seq_length() == start + len(rows)


def test_compact_leaves_other_layers_to_the_caller():
    _, plain = _filled_cache(10)
    before = [layer.keys.clone() for layer in plain.layers]
    assert not compact(plain, 5, [1, 2], 7)  # transformers' layers: the verifier's torch path
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, plain.layers, strict=True))
    cache, _ = _filled_cache(10)
    cache.layers[0].keys = cache.layers[0].keys.clone()  # replaced from outside: not owned
    assert not compact(cache, 5, [0, 1], 7) and cache.get_seq_length() == 10


def test_growing_cache_swaps_plain_layers_only(monkeypatch):
    model, _ = tiny_lm("llama")
    cache = growing_cache(model.config)
    assert cache.layers and all(type(layer) is GrowingLayer for layer in cache.layers)
    monkeypatch.setenv("SPECSTORE_GROWING_CACHE", "0")
    assert all(type(layer) is DynamicLayer for layer in growing_cache(model.config).layers)


@torch.inference_mode()
def _greedy(model, ids: list[int], count: int) -> list[int]:
    out = []
    for _ in range(count):
        out.append(int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_verifier_logits_and_cache_bitwise_as_with_transformers_layers(family, monkeypatch):
    model, _ = tiny_lm(family)
    monkeypatch.setenv("SPECSTORE_KERNEL_FORWARD", "0")  # both through the modules: the caches alone differ
    rng = np.random.default_rng(3)
    vocab = model.config.vocab_size
    committed = rng.integers(3, vocab, size=40).tolist()
    verifiers = []
    for growing in ("1", "0"):
        monkeypatch.setenv("SPECSTORE_GROWING_CACHE", growing)
        verifiers.append(TreeVerifier(model))
    assert isinstance(verifiers[0].cache.layers[0], GrowingLayer)
    assert type(verifiers[1].cache.layers[0]) is DynamicLayer
    pending = [v.prefill(committed).bonus for v in verifiers]
    assert pending[0] == pending[1]
    fast = []
    real = verify.compact_cache
    monkeypatch.setattr(verify, "compact_cache", lambda *a: fast.append(real(*a)) or fast[-1])
    moved = 0
    for step in range(40):
        # a random branch first, then the greedy continuation (accepted, not the first nodes:
        # the compaction moves it up in place), then more random nodes
        noise = [rng.integers(3, vocab, size=int(rng.integers(0, 4))).tolist() for _ in range(2)]
        good = _greedy(model, committed + [pending[0]], int(rng.integers(0, 4)))
        tree = DraftTree.from_paths([p for p in (noise[0], good, noise[1]) if p])
        outs = [v.step(pending[0], tree) for v in verifiers]
        assert outs[0].result == outs[1].result
        assert torch.equal(outs[0].logits, outs[1].logits), f"step {step}"
        for a, b in zip(verifiers[0].cache.layers, verifiers[1].cache.layers, strict=True):
            _same(a, b)
        accepted = outs[0].result.accepted_nodes
        moved += bool(accepted) and accepted != list(range(len(accepted)))
        committed += [pending[0], *outs[0].result.accepted_tokens]
        pending = [outs[0].result.bonus] * 2
    assert moved >= 5  # the in-place compaction ran on both caches
    if family == "llama" and gemm.available():  # each step with work: the growing cache's in one kernel call,
        assert fast.count(True) == fast.count(False) >= moved  # transformers' layers on the torch path
