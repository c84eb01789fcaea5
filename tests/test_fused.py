"""The kernel's RMS norm, gated-MLP middle and rotary embedding (gemm.rmsnorm, gemm.silu_mul,
gemm.rotary) and the modules switched to them (fused.py): torch's bf16 results, rows
independent of each other, and the module's own forward wherever the kernel does not apply."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from specstore.runtime import fused, gemm
from tests.decoding_helpers import tiny_lm

needs_elementwise = pytest.mark.skipif(not gemm.has_elementwise(), reason="the kernel has no bf16 elementwise calls here (needs AVX-512 BF16)")


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 steps between same-signed values (0: equal bits)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


@needs_elementwise
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (7, 576), (3, 40), (2, 7)])
def test_rmsnorm_is_transformers_bf16_norm(rows, dim):
    """Within one bf16 step of LlamaRMSNorm in bf16 (its mean sums in another order), nearly
    always the same bits; dims that are no multiple of 16 included."""
    g = torch.Generator().manual_seed(rows * dim)
    norm = LlamaRMSNorm(dim, eps=1e-5).bfloat16()
    norm.weight.data = torch.randn(dim, generator=g).bfloat16()
    x = (torch.randn(1, rows, dim, generator=g) * 3).bfloat16()
    with torch.no_grad():
        want = norm(x)
    got = gemm.rmsnorm(x, norm.weight, 1e-5)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert _bf16_ulps(got, want) <= 1
    assert float((got != want).float().mean()) < 0.02


@needs_elementwise
@pytest.mark.parametrize("n", [1536, 7 * 1536, 37])
def test_silu_mul_is_torchs_bf16_silu_times_up(n):
    g = torch.Generator().manual_seed(n)
    gate = (torch.randn(n, generator=g) * 4).bfloat16()
    up = torch.randn(n, generator=g).bfloat16()
    want = torch.nn.functional.silu(gate) * up
    got = gemm.silu_mul(gate, up)
    assert _bf16_ulps(got, want) <= 1
    assert float((got != want).float().mean()) < 0.02
    big = torch.tensor([-200.0, -88.0, 0.0, 88.0, 200.0]).bfloat16()  # e^-x far out of range either way
    torch.testing.assert_close(gemm.silu_mul(big, torch.ones_like(big)).float(),
                               (torch.nn.functional.silu(big.float())).bfloat16().float(), rtol=1e-2, atol=1e-30)


@needs_elementwise
def test_a_rows_norm_and_mlp_middle_do_not_depend_on_the_other_rows():
    """Plain decoding's one row and a tree's many give that row the same bits."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 576, generator=g).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    gate, up = torch.randn(9, 1536, generator=g).bfloat16(), torch.randn(9, 1536, generator=g).bfloat16()
    together, middle = gemm.rmsnorm(x, w, 1e-5), gemm.silu_mul(gate, up)
    for i in range(9):
        assert torch.equal(gemm.rmsnorm(x[i : i + 1].clone(), w, 1e-5), together[i : i + 1])
        assert torch.equal(gemm.silu_mul(gate[i].clone(), up[i].clone()), middle[i])


def test_the_kernel_declines_what_it_does_not_compute():
    x = torch.randn(2, 8)
    assert gemm.rmsnorm(x, torch.ones(8), 1e-6) is None  # float32
    assert gemm.silu_mul(x, x) is None
    b = torch.randn(4, 8).bfloat16()
    assert gemm.rmsnorm(b[:, ::2], torch.ones(4).bfloat16(), 1e-6) is None  # not contiguous
    assert gemm.rmsnorm(b, torch.ones(6).bfloat16(), 1e-6) is None  # widths differ
    assert gemm.silu_mul(b, b[:2]) is None


def _fresh_llama():
    """A tiny Llama of the test's own, loaded from the files (the cached ``tiny_lm`` may have been
    switched by a verifier already)."""
    from transformers import AutoModelForCausalLM

    from tests import decoding_helpers

    tiny_lm("llama")  # writes the files once
    return AutoModelForCausalLM.from_pretrained(decoding_helpers._ROOT / "llama", dtype=torch.float32).eval()


@needs_elementwise
def test_switched_llama_modules_give_the_same_tokens_in_bf16_and_the_same_bits_elsewhere(monkeypatch):
    calls = {"rmsnorm": 0, "silu_mul": 0}
    for name in calls:
        real = getattr(gemm, name)

        def counted(*args, _real=real, _name=name):
            out = _real(*args)
            calls[_name] += out is not None
            return out

        monkeypatch.setattr(gemm, name, counted)
    ids = torch.tensor([[5, 9, 14, 3, 27, 8, 41, 2]])
    plain = _fresh_llama().bfloat16()
    switched = copy.deepcopy(plain)
    count = fused.use_fused_elementwise(switched)
    layers = len(switched.model.layers)
    assert count == 3 * layers + 1 + gemm.has_rotary()  # two norms and an MLP a layer, the final norm, the rotary
    assert fused.use_fused_elementwise(switched) == count  # idempotent
    assert type(switched.model.norm).__name__ == "FusedLlamaRMSNorm" and isinstance(switched.model.norm, LlamaRMSNorm)
    assert switched.state_dict().keys() == plain.state_dict().keys()
    with torch.no_grad():
        a, b = plain(ids).logits, switched(ids).logits
    torch.testing.assert_close(b.float(), a.float(), rtol=0.05, atol=0.05)
    assert calls == {"rmsnorm": 2 * layers + 1, "silu_mul": layers}  # the switched forward took the kernel
    # float32, or a gradient wanted: each module's own forward, bit for bit
    plain32, switched32 = plain.float(), switched.float()
    with torch.no_grad():
        assert torch.equal(plain32(ids).logits, switched32(ids).logits)
    plain_b, switched_b = plain32.bfloat16(), switched32.bfloat16()
    assert torch.equal(plain_b(ids).logits, switched_b(ids).logits)  # grad enabled: not the kernel
    assert calls == {"rmsnorm": 2 * layers + 1, "silu_mul": layers}
    restored = pickle.loads(pickle.dumps(switched_b))
    assert type(restored.model.norm) is type(switched_b.model.norm)


needs_rotary = pytest.mark.skipif(not gemm.has_rotary(), reason="the kernel has no bf16 rotary embedding here (needs AVX-512 BF16)")
_ROTARY = getattr(modeling_llama.apply_rotary_pos_emb, "__wrapped__", modeling_llama.apply_rotary_pos_emb)  # transformers' own


def _rotary_inputs(n: int, dim: int, heads: int = 9, kv_heads: int = 3, seed: int = 0):
    """Query and key as an attention layer makes them (a transposed view of the projections'
    rows) and cos/sin of large angles, as transformers' rotary module gives them."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, n, heads * dim, generator=g) * 3).bfloat16().view(1, n, heads, dim).transpose(1, 2)
    k = (torch.randn(1, n, kv_heads * dim, generator=g) * 3).bfloat16().view(1, n, kv_heads, dim).transpose(1, 2)
    angles = torch.randn(1, n, dim, generator=g) * 50
    return q, k, angles.cos().bfloat16(), angles.sin().bfloat16()


@needs_rotary
@pytest.mark.parametrize(("n", "dim"), [(1, 64), (7, 64), (17, 128), (3, 48), (2, 2)])
def test_rotary_is_transformers_bf16_rotary_bit_for_bit(n, dim):
    """Half widths that are no multiple of 16 included; infinities and NaN where torch has them."""
    q, k, cos, sin = _rotary_inputs(n, dim, seed=n * dim)
    q[0, 1, 0, 0], k[0, 0, 0, dim // 2] = float("inf"), float("nan")
    want = _ROTARY(q, k, cos, sin)
    got = gemm.rotary(q, k, cos, sin)
    for w, x in zip(want, got, strict=True):
        assert x.shape == w.shape and x.is_contiguous()
        assert torch.equal(torch.isnan(x), torch.isnan(w))
        finite = ~torch.isnan(w)
        assert torch.equal(x[finite], w[finite])
        assert torch.equal(x.view(torch.int16)[finite], w.contiguous().view(torch.int16)[finite])  # the bits, signed zeros too


@needs_rotary
def test_a_rows_rotary_does_not_depend_on_the_other_rows():
    q, k, cos, sin = _rotary_inputs(9, 64, seed=5)
    together = gemm.rotary(q, k, cos, sin)
    for i in range(9):
        alone = gemm.rotary(q[:, :, i : i + 1], k[:, :, i : i + 1], cos[:, i : i + 1], sin[:, i : i + 1])
        assert torch.equal(alone[0], together[0][:, :, i : i + 1]) and torch.equal(alone[1], together[1][:, :, i : i + 1])


def test_the_kernel_declines_rotary_it_does_not_compute():
    q, k, cos, sin = _rotary_inputs(3, 64)
    assert gemm.rotary(q.float(), k.float(), cos.float(), sin.float()) is None  # float32
    assert gemm.rotary(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), cos, sin) is None  # two sequences
    assert gemm.rotary(q, k, cos[:, :2], sin[:, :2]) is None  # positions differ
    assert gemm.rotary(q, k[..., :32], cos, sin) is None  # head widths differ
    assert gemm.rotary(q[..., ::2], k[..., ::2], cos[..., ::2], sin[..., ::2]) is None  # last dim strided


@needs_rotary
def test_the_switched_rotary_function_falls_back_to_transformers_own():
    model = _fresh_llama().bfloat16()
    fused.use_fused_elementwise(model)
    switched = modeling_llama.apply_rotary_pos_emb
    assert switched.__wrapped__ is _ROTARY
    fused.use_fused_elementwise(model)
    assert modeling_llama.apply_rotary_pos_emb is switched  # wrapped once
    q, k, cos, sin = _rotary_inputs(4, 64, seed=2)
    calls = []
    real = gemm.rotary
    try:
        gemm.rotary = lambda *a: calls.append(1) or real(*a)
        for got, want in zip(switched(q, k, cos, sin), _ROTARY(q, k, cos, sin), strict=True):
            assert torch.equal(got, want)
        assert calls == [1]
        # cos/sin broadcast over another dim, or a gradient wanted: transformers' own function
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        for got, want in zip(switched(qt, kt, cos, sin, unsqueeze_dim=2), _ROTARY(qt, kt, cos, sin, 2), strict=True):
            assert torch.equal(got, want)
        qg = q.float().requires_grad_()
        with torch.enable_grad():
            out = switched(qg.bfloat16(), k, cos, sin)
        assert out[0].requires_grad and calls == [1]
    finally:
        gemm.rotary = real


def test_the_off_switch_leaves_every_module(monkeypatch):
    monkeypatch.setenv("SPECSTORE_CPU_FUSED", "0")
    model = _fresh_llama()
    assert fused.use_fused_elementwise(model) == 0
    assert type(model.model.norm) is LlamaRMSNorm


def test_unknown_architectures_are_left_alone():
    model, _ = tiny_lm("gpt2")
    model = copy.deepcopy(model)
    before = [type(m) for m in model.modules()]
    fused.use_fused_elementwise(model)
    assert [type(m) for m in model.modules()] == before

