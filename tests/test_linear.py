"""linear.py's packed CPU linears on oneDNN's packed weights (specstore's own kernel, which takes
float32 and emulated-bf16 products where it runs, is switched off here: tests/test_gemm.py): bf16
products bit-identical to ``F.linear`` and float32 ones within rounding, at the row counts
decoding uses; the model's parameters and state dict untouched; a weight changed in place is
packed again; copies, gradients, other dtypes and the off switch fall back to ``F.linear``; the
verifier switches a model's linears and greedy decoding stays equal to the unpacked model's."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from specstore.runtime import linear
from specstore.runtime.device import native_bf16_cpu
from specstore.runtime.linear import PackedLinear, is_packed, use_packed_linears
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import TreeVerifier
from tests.decoding_helpers import alternate_steps, tiny_lm

pytestmark = pytest.mark.skipif(not linear._available(), reason="this torch build has no oneDNN linear packing")


@pytest.fixture(autouse=True)
def _onednn_only(monkeypatch):
    monkeypatch.setattr(linear, "_kernel_takes", lambda dtype: False)


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs this dtype here (bf16 needs AVX-512 or AVX-NE-CONVERT: not on an
    AVX2-only CPU, where linear.py leaves such weights to F.linear)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


needs_bf16_packing = pytest.mark.skipif(not _onednn_packs(torch.bfloat16), reason="oneDNN cannot pack bf16 on this CPU")


def _layer(dtype: torch.dtype, bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(96, 160, bias=bias).to(dtype).eval()


def _packed(layer: torch.nn.Linear) -> torch.nn.Linear:
    model = torch.nn.Sequential(layer)
    assert use_packed_linears(model) == 1
    return layer


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_products_are_bit_identical_and_float32_within_rounding(rows, bias):
    for dtype, tol in ((torch.bfloat16, 0.0), (torch.float32, 1e-5)):
        if not _onednn_packs(dtype):
            continue
        layer = _layer(dtype, bias)
        x = torch.randn(1, rows, 96).to(dtype)
        with torch.inference_mode():
            want = torch.nn.functional.linear(x, layer.weight, layer.bias)
            got = _packed(layer)(x)
        assert isinstance(layer, PackedLinear) and is_packed(layer)
        assert got.dtype == want.dtype and got.shape == want.shape == (1, rows, 160)
        if tol == 0.0:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_parameters_and_state_dict_are_untouched_and_switching_is_idempotent():
    model = copy.deepcopy(tiny_lm("llama")[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    count = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert use_packed_linears(model) == count > 0
    assert use_packed_linears(model) == count  # again: nothing new
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(type(m) is PackedLinear for m in model.modules() if isinstance(m, torch.nn.Linear))


@needs_bf16_packing
def test_packing_leaves_the_global_random_state_alone():
    layer = _layer(torch.bfloat16, seed=2)
    torch.manual_seed(11)
    want = torch.rand(3)
    torch.manual_seed(11)
    _packed(layer)
    assert torch.equal(torch.rand(3), want)  # a seeded sampling run is not shifted by the first verifier


@needs_bf16_packing
def test_a_weight_changed_in_place_is_packed_again():
    layer = _packed(_layer(torch.bfloat16))
    x = torch.randn(4, 96).to(torch.bfloat16)
    with torch.no_grad():
        first = layer(x)
        layer.weight.mul_(2)
        second = layer(x)
    assert torch.equal(second, torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert not torch.equal(first, second)


@needs_bf16_packing
def test_a_copy_packs_its_own_weight():
    layer = _packed(_layer(torch.bfloat16))
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.zero_()
        x = torch.randn(2, 96).to(torch.bfloat16)
        assert torch.equal(twin(x), torch.nn.functional.linear(x, twin.weight, twin.bias))
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))  # the original is its own
    assert is_packed(twin)


def test_gradients_and_other_dtypes_go_to_the_plain_product():
    layer = _packed(_layer(torch.float32))
    x = torch.randn(3, 96, requires_grad=True)
    layer(x).sum().backward()  # packed products carry no gradient: F.linear's do
    assert x.grad is not None and layer.weight.grad is not None
    with torch.no_grad():
        wide = torch.randn(3, 96, dtype=torch.float64)
        with pytest.raises(RuntimeError):  # F.linear's own error for mixed dtypes, not a packed kernel's
            layer(wide)


def test_the_off_switch_and_a_weight_that_cannot_pack(monkeypatch):
    monkeypatch.setenv("SPECSTORE_PACKED_LINEARS", "0")
    layer = _layer(torch.bfloat16)
    assert use_packed_linears(torch.nn.Sequential(layer)) == 0 and type(layer) is torch.nn.Linear
    monkeypatch.delenv("SPECSTORE_PACKED_LINEARS")

    def refuse(*_a, **_k):
        raise RuntimeError("no packing on this CPU")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    layer = _layer(torch.float32, seed=1)
    assert use_packed_linears(torch.nn.Sequential(layer)) == 0 and not is_packed(layer)
    x = torch.randn(2, 96)
    with torch.no_grad():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_verifier_packs_and_greedy_decoding_is_unchanged(dtype, monkeypatch):
    if not _onednn_packs(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    """A tiny model decoded greedily with packed linears and with the switch off: the same
    tokens, and logits within rounding (bit-equal in bf16 on a CPU with native bf16; where bf16 is
    emulated the whole model's products were seen to round differently, the single layers above
    still bit-equal)."""
    prompt = np.random.default_rng(5).integers(3, 200, size=24).tolist()
    tree = DraftTree.from_paths([[7, 8, 9], [7, 11], [12]])
    calls = []
    product = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or product(*a))
    out = {}
    monkeypatch.setenv("SPECSTORE_LINEAR_SMALL_ROWS", "packed")  # every product packed (small rows: the test below)
    for packed in (True, False):
        monkeypatch.setenv("SPECSTORE_PACKED_LINEARS", "1" if packed else "0")
        model = copy.deepcopy(tiny_lm("llama")[0]).to(dtype)
        if not packed:  # a deep copy of a shared model that another test packed stays packed
            for m in model.modules():
                if isinstance(m, PackedLinear):
                    m.__class__ = torch.nn.Linear
        verifier = TreeVerifier(model)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert all(is_packed(m) for m in linears) == packed
        calls.clear()
        out[packed] = alternate_steps(verifier, prompt, tree)
        assert len(calls) == (11 * len(linears) if packed else 0)  # every linear of the prefill and each step
    assert out[True][1] == out[False][1]
    if dtype == torch.bfloat16 and native_bf16_cpu()[0]:
        assert torch.equal(out[True][0], out[False][0])
    elif dtype == torch.bfloat16:  # emulated bf16 (no amx_bf16 / avx512_bf16): oneDNN's kernels round differently
        torch.testing.assert_close(out[True][0], out[False][0], atol=1e-2, rtol=1e-2)  # seen: 1e-3 at most
    else:
        torch.testing.assert_close(out[True][0], out[False][0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("plain_faster", "rows_packed"), [(True, [5, 17]), (False, [1, 2, 3, 5, 17])])
def test_small_products_go_where_they_measured_faster(monkeypatch, plain_faster, rows_packed):
    """Where F.linear measured faster at 1 and SMALL_ROWS rows (timings faked here), inputs of up
    to SMALL_ROWS rows take it and larger ones the packed product; otherwise all are packed. The
    decision is made once per shape and dtype; the results are F.linear's within rounding."""
    monkeypatch.delenv("SPECSTORE_LINEAR_SMALL_ROWS", raising=False)
    monkeypatch.setattr(linear, "_small", {})
    timed = []

    def fake_seconds(fn, x, reps):
        is_plain = "functional" in fn.__code__.co_names  # F.linear's lambda, not the packed product's
        timed.append(x.shape[0])
        return (1.0 if is_plain else 2.0) if plain_faster else (2.0 if is_plain else 1.0)

    monkeypatch.setattr(linear, "_seconds", fake_seconds)
    layers = [_layer(torch.float32, seed=s) for s in (0, 1)]  # two of one shape: timed once
    for layer in layers:
        _packed(layer)
    assert sorted(set(timed)) == [1, linear.SMALL_ROWS] and len(timed) == 4
    calls = []
    product = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].numel() // 96) or product(*a))
    for rows in (1, 2, 3, 5, 17):
        x = torch.randn(1, rows, 96)
        with torch.inference_mode():
            got, want = layers[0](x), torch.nn.functional.linear(x, layers[0].weight, layers[0].bias)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert calls == rows_packed


@pytest.mark.parametrize("mode", ["packed", "plain"])
def test_small_rows_policy_can_be_fixed_without_measuring(monkeypatch, mode):
    monkeypatch.setenv("SPECSTORE_LINEAR_SMALL_ROWS", mode)
    monkeypatch.setattr(linear, "_small", {})
    monkeypatch.setattr(linear, "_seconds", lambda *a: pytest.fail("measured although fixed"))
    layer = _packed(_layer(torch.float32))
    assert layer.__dict__[linear._ATTR][3] == (mode == "plain") and not linear._small
