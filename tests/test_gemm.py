"""specstore's few-row product kernel (runtime/gemm.py, csrc/small_gemm.c): products equal to
float64 ones within rounding on every path (partial panels, biases, register blocks, panel
turns, groups of rows); each row's result bitwise the same whatever rows and threads it is
computed with; bf16 rounding as torch rounds; linear.py routing decoding's products to it
and larger ones to F.linear; a weight changed in place packed again; the off switch and a
broken compiler leaving torch's products in place; greedy decoding unchanged through it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from specstore.runtime import gemm, linear
from specstore.runtime.linear import PackedLinear, is_packed, use_packed_linears
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import TreeVerifier
from tests.decoding_helpers import alternate_steps, tiny_lm

needs_kernel = pytest.mark.skipif(not gemm.available(), reason=f"no CPU kernel here: {gemm.unavailable_reason()}")


def _product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gemm.linear(x, gemm.pack(w), bias, w.shape[0])


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.double() @ w.double().T + (0 if bias is None else bias.double())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(16, 8), (37, 70), (200, 300), (48, 1000), (33, 45)])
def test_products_equal_float64_within_rounding(dtype, n, k):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    for rows in (1, 2, 5, 6, 7, 9, 13, 65, gemm.MAX_ROWS, gemm.MAX_ROWS + 5):
        for b in (None, bias):
            x = torch.randn(rows, k, generator=g).to(dtype)
            got = _product(x, w, b)
            assert got.dtype == dtype and got.shape == (rows, n)
            want = _reference(x, w, b)
            # float32: a sum of k products in float32; bf16: then rounded to 8 bits
            tol = 1e-5 * k ** 0.5 if dtype == torch.float32 else 8e-3
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_other_rows_or_threads(dtype):
    """Plain decoding multiplies 1 row, a verification up to MAX_ROWS: the same row gives the
    same bits in both, at any position, with any number of threads."""
    g = torch.Generator().manual_seed(3)
    w, bias = torch.randn(100, 600, generator=g).to(dtype), torch.randn(100, generator=g).to(dtype)
    panel = gemm.pack(w)
    x = torch.randn(gemm.MAX_ROWS, 600, generator=g).to(dtype)
    alone = torch.cat([gemm.linear(x[i : i + 1], panel, bias, 100) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for count in sorted({1, 2, threads}):
            torch.set_num_threads(count)
            for rows in (2, 5, 9, 17, 40, gemm.MAX_ROWS):
                assert torch.equal(gemm.linear(x[:rows], panel, bias, 100), alone[:rows])
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("k", [1, 2])
def test_bf16_outputs_round_as_torch_rounds(k):
    """With k <= 2 every product of two bf16 values is exact in float32, their sum one float32
    addition and the bias another, so the kernel's bf16 output is torch's float32 result rounded:
    to nearest, ties to even, infinities and NaNs kept (k = 2 takes the dot-product path where
    the CPU has AVX-512 BF16, k = 1 the widening one)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(64, generator=g).to(torch.bfloat16)
    x = torch.randn(30, k, generator=g).to(torch.bfloat16)
    x[0, 0], x[1, 0] = float("inf"), float("nan")
    got = _product(x, w, bias)
    want = (x.float() @ w.float().T + bias.float()).to(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.mark.skipif(not gemm.dot_bf16(), reason="the kernel has no AVX-512 BF16 dot products here")
def test_bf16_weights_of_even_width_are_packed_in_pairs_for_the_dot_product_path():
    """On a CPU with AVX-512 BF16 the kernel multiplies bf16 by dot products over pairs of k:
    such weights are packed in pairs (odd widths and float32 as before), and products through
    both layouts agree with float64 ones."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    assert gemm.pack(w).shape == (3, 32, 16, 2)
    assert gemm.pack(w[:, :63]).shape == (3, 63, 16)
    assert gemm.pack(w.float()).shape == (3, 64, 16)
    x = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    padded = torch.cat([w, w.new_zeros(8, 64)])
    widening_panel = padded.reshape(3, 16, 64).transpose(1, 2).contiguous()  # the layout without pairs
    want = _reference(x, w, None)
    for panel in (gemm.pack(w), widening_panel):
        got = gemm.linear(x, panel, None, 40).double()
        torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3 * float(want.abs().max()))
    assert linear._kernel_takes(torch.bfloat16) == ("amx_bf16" not in gemm.cpu_flags())


@needs_kernel
def test_inputs_of_any_layout_and_empty_ones():
    w = torch.randn(24, 40)
    x = torch.randn(40, 3).T  # not contiguous
    torch.testing.assert_close(_product(x, w, None).double(), _reference(x, w, None), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(1, 4, 40)
    assert _product(x3, w, None).shape == (1, 4, 24)
    assert _product(torch.randn(0, 40), w, None).shape == (0, 24)


@needs_kernel
def test_linear_routes_decoding_products_to_the_kernel_and_larger_ones_to_torch(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 160).eval()
    assert use_packed_linears(torch.nn.Sequential(layer)) == 1 and is_packed(layer)
    rows_seen = []
    product = gemm.linear
    monkeypatch.setattr(gemm, "linear", lambda x, *a: rows_seen.append(x.numel() // x.shape[-1]) or product(x, *a))
    with torch.inference_mode():
        for rows in (1, 9, gemm.MAX_ROWS, gemm.MAX_ROWS + 1, 300):
            x = torch.randn(1, rows, 96)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert rows_seen == [1, 9, gemm.MAX_ROWS]
    assert layer.__dict__[linear._ATTR][0] is None  # no oneDNN copy beside the kernel's panels


@needs_kernel
def test_a_weight_changed_in_place_is_packed_again_and_a_copy_packs_its_own():
    torch.manual_seed(1)
    layer = torch.nn.Linear(64, 48).eval()
    use_packed_linears(torch.nn.Sequential(layer))
    x = torch.randn(3, 64)
    with torch.no_grad():
        first = layer(x)
        layer.weight.mul_(2)
        torch.testing.assert_close(layer(x), 2 * first - layer.bias, rtol=1e-5, atol=1e-5)
        twin = copy.deepcopy(layer)
        twin.weight.zero_()
        torch.testing.assert_close(twin(x), twin.bias.expand(3, -1))
        torch.testing.assert_close(layer(x), 2 * first - layer.bias, rtol=1e-5, atol=1e-5)


def test_the_off_switch_and_a_broken_compiler_leave_torchs_products(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSTORE_CACHE", str(tmp_path))
    try:
        monkeypatch.setenv("SPECSTORE_CPU_KERNEL", "0")
        gemm._reset_for_tests()
        assert gemm.library() is None and gemm.unavailable_reason() == "SPECSTORE_CPU_KERNEL=0"
        monkeypatch.delenv("SPECSTORE_CPU_KERNEL")
        monkeypatch.setenv("CC", "false")  # a compiler that always fails
        monkeypatch.setattr(gemm, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
        monkeypatch.setattr(gemm.platform, "machine", lambda: "x86_64")
        gemm._reset_for_tests()
        assert gemm.library() is None and "compiling small_gemm.c and draft_tree.c failed" in gemm.unavailable_reason()
        assert not list((tmp_path / "kernels").glob("*"))  # no half-written library left behind
        layer = torch.nn.Linear(32, 16).eval()
        model = torch.nn.Sequential(layer)
        assert use_packed_linears(model) == 1 and layer.__dict__[linear._ATTR][4] is None  # oneDNN's copy instead
        x = torch.randn(2, 32)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    finally:
        gemm._reset_for_tests()


can_build = pytest.mark.skipif(
    gemm.platform.machine().lower() not in ("x86_64", "amd64") or not {"avx2", "fma"} <= gemm.cpu_flags()
    or gemm._compiler() is None, reason="the kernel is built for x86-64 CPUs with AVX2 and FMA, with a C compiler")


@can_build
@pytest.mark.parametrize("dot", ["1", "0"])
def test_the_kernel_loads_wherever_the_cpu_and_a_compiler_allow(monkeypatch, tmp_path, dot):
    """Not skipped where the kernel is missing: that is what it checks. The plain AVX2 build
    (SPECSTORE_CPU_KERNEL_BF16_DOT=0, and every CPU without AVX-512 BF16) holds none of the bf16
    dot-product symbols; loading it once failed on one of them, and every AVX2 machine lost the
    kernel without a failing test (the kernel tests skip where it is missing)."""
    monkeypatch.setenv("SPECSTORE_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECSTORE_CPU_KERNEL_BF16_DOT", dot)
    try:
        gemm._reset_for_tests()
        lib = gemm.library()
        assert lib is not None, gemm.unavailable_reason()
        if dot == "0":
            assert not lib.dot_bf16 and not gemm.has_attention() and not gemm.has_head()
        g = torch.Generator().manual_seed(5)
        w, bias = torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(3, 96, generator=g).to(dtype)
            got = _product(x, w.to(dtype), bias.to(dtype))
            want = _reference(x, w.to(dtype), bias.to(dtype))
            tol = 1e-4 if dtype == torch.float32 else 8e-3
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    finally:
        gemm._reset_for_tests()


@needs_kernel
def test_the_kernel_is_compiled_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSTORE_CACHE", str(tmp_path))
    try:
        gemm._reset_for_tests()
        assert gemm.library() is not None
        built = list((tmp_path / "kernels").glob("small_gemm-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        gemm._reset_for_tests()
        assert gemm.library() is not None and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    finally:
        gemm._reset_for_tests()


@needs_kernel
def test_greedy_decoding_through_the_kernel_matches_torchs_products(monkeypatch):
    """A tiny llama verified step by step (trees and plain steps) with the kernel and with
    torch's own products: the same tokens, logits within float32 rounding."""
    prompt = np.random.default_rng(5).integers(3, 200, size=24).tolist()
    tree = DraftTree.from_paths([[7, 8, 9], [7, 11], [12]])
    out = {}
    for kernel in (True, False):
        monkeypatch.setattr(linear, "_kernel_takes", lambda dtype, on=kernel: on and dtype == torch.float32)
        monkeypatch.setenv("SPECSTORE_PACKED_LINEARS", "1" if kernel else "0")
        model = copy.deepcopy(tiny_lm("llama")[0])
        for m in model.modules():
            if isinstance(m, PackedLinear):
                m.__class__ = torch.nn.Linear
                m.__dict__.pop(linear._ATTR, None)
        verifier = TreeVerifier(model)
        assert all(is_packed(m) == kernel for m in model.modules() if isinstance(m, torch.nn.Linear))
        out[kernel] = alternate_steps(verifier, prompt, tree)
    assert out[True][1] == out[False][1]
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-4, rtol=1e-4)


ATTENTION_DTYPES = [
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not gemm.has_attention(dtype=torch.bfloat16),
                                                          reason="the kernel has no bf16 attention here (needs AVX-512 BF16)")),
    pytest.param(torch.float32, marks=pytest.mark.skipif(not gemm.has_attention(dtype=torch.float32),
                                                         reason="no kernel here (needs AVX2, FMA and a C compiler)")),
]


def _attention_reference(q, k, v, mask, scale):
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.double() @ kr.transpose(-1, -2) * scale
    if mask is not None:
        s = s + mask.double().clamp(min=-1e300)
    return (s.softmax(-1) @ vr).transpose(1, 2)


def _tolerance(dtype):
    return 1e-2 if dtype == torch.bfloat16 else 1e-5


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "nq", "keys"),
                         [(9, 3, 64, 1, 70), (9, 3, 64, 9, 300), (4, 4, 32, 5, 33), (6, 2, 128, 17, 200), (14, 2, 64, 3, 77)])
def test_kernel_attention_equals_float64_within_its_dtypes_rounding(heads, kv_heads, dim, nq, keys, dtype):
    """Grouped heads (seven query heads a key/value head: taken four rows at a time), key/value
    rows in a larger buffer (the cache grows in place), an additive mask with masked keys anywhere
    (one query row masked whole: zeros), or one query unmasked."""
    g = torch.Generator().manual_seed(heads * nq + keys)
    q = torch.randn(1, heads, nq, dim, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, keys + 30, dim, generator=g).to(dtype)[:, :, :keys]
    v = torch.randn(1, kv_heads, keys + 30, dim, generator=g).to(dtype)[:, :, :keys]
    mask = None
    if nq > 1:
        allowed = torch.rand(nq, keys, generator=g) > 0.4
        allowed[0] = False
        mask = torch.zeros(1, 1, nq, keys, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    assert gemm.attention_takes(q, k, v, mask)
    got = gemm.attention(q, k, v, mask, 0.3)
    assert got.shape == (1, nq, heads, dim) and got.dtype == dtype
    want = _attention_reference(q, k, v, mask, 0.3)
    if mask is not None:
        assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))
        got, want = got[:, 1:], want[:, 1:]
    torch.testing.assert_close(got.double(), want, rtol=_tolerance(dtype), atol=_tolerance(dtype))


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_kernel_attention_adds_a_masks_finite_values_and_skips_only_zeros(dtype):
    """Rows whose allowed keys all have a mask of 0 skip the addition (x + 0 = x); a row whose
    mask holds other finite values (a bias) still has them added, and agrees with float64."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, nq, keys = 9, 3, 64, 4, 90
    q = torch.randn(1, heads, nq, dim, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, keys, dim, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, keys, dim, generator=g).to(dtype)
    mask = torch.zeros(1, 1, nq, keys, dtype=dtype)
    mask[0, 0, 1] = (torch.randn(keys, generator=g) * 3).to(dtype)  # a bias on one row
    mask[0, 0, 2, 50:] = torch.finfo(dtype).min
    mask[0, 0, 3, :10] = -0.0  # negative zeros add nothing either
    got = gemm.attention(q, k, v, mask, 0.2)
    want = _attention_reference(q, k, v, mask, 0.2)
    torch.testing.assert_close(got.double(), want, rtol=_tolerance(dtype), atol=_tolerance(dtype))
    unbiased = gemm.attention(q, k, v, torch.zeros_like(mask), 0.2)
    assert not torch.equal(got[0, 1], unbiased[0, 1])  # the bias moved row 1
    assert torch.equal(got[0, 0], unbiased[0, 0]) and torch.equal(got[0, 3], unbiased[0, 3])


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_kernel_attention_rows_are_the_bits_of_plain_decodings_step(dtype):
    """A row that attends some keys among masked ones (a tree node: the cache and its ancestors)
    gives the same bits as one query over exactly those keys without a mask (plain decoding's
    step for that token), whatever the other rows."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, keys, nq = 9, 3, 64, 140, 12
    q = torch.randn(1, heads, nq, dim, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, keys, dim, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, keys, dim, generator=g).to(dtype)
    allowed = torch.rand(nq, keys, generator=g) > 0.5
    allowed[:, :100] = True  # the cache
    mask = torch.zeros(1, 1, nq, keys, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    together = gemm.attention(q, k, v, mask, None)
    for i in range(nq):
        keep = allowed[i].nonzero().flatten()
        alone = gemm.attention(q[:, :, i : i + 1], k[:, :, keep].contiguous(), v[:, :, keep].contiguous(), None, None)
        assert torch.equal(alone[0, 0], together[0, i])
    assert not gemm.attention_takes(q, k, v, None)  # several queries without a mask: causal, not ours
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert not gemm.attention_takes(q, k, v, mask.to(other))  # a mask of another dtype
    assert not gemm.attention_takes(q.double(), k.double(), v.double(), mask.double())


@pytest.mark.skipif(not gemm.has_attention(dtype=torch.float32), reason="no kernel here (needs AVX2, FMA and a C compiler)")
@pytest.mark.parametrize("dim", [40, 136])
def test_float32_kernel_attention_takes_head_dims_not_a_multiple_of_32(dim):
    """Head dims that are a multiple of 8 but not of 32 (the values summed in one pass over all
    their chunks): float64's result to float32 rounding, over more cached keys than one pass of
    values holds, and each tree row the bits of one query over its own keys."""
    g = torch.Generator().manual_seed(dim)
    heads, kv_heads, keys, nq = 6, 2, 211, 7
    q, k, v = (torch.randn(1, h, n, dim, generator=g) for h, n in ((heads, nq), (kv_heads, keys), (kv_heads, keys)))
    allowed = torch.rand(nq, keys, generator=g) > 0.5
    allowed[:, : keys - nq] = True
    mask = torch.zeros(1, 1, nq, keys).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert gemm.attention_takes(q, k, v, mask)
    got = gemm.attention(q, k, v, mask, None)
    torch.testing.assert_close(got.double(), _attention_reference(q, k, v, mask, dim ** -0.5), rtol=1e-5, atol=1e-5)
    for i in range(nq):
        keep = allowed[i].nonzero().flatten()
        alone = gemm.attention(q[:, :, i : i + 1], k[:, :, keep].contiguous(), v[:, :, keep].contiguous(), None, None)
        assert torch.equal(alone[0, 0], got[0, i])


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_tree_verification_gives_plain_decodings_logits_bit_for_bit(dtype):
    """The default model on a CPU with the kernel's products and attention: the logits a tree
    verification computes for its accepted path are plain decoding's, bit for bit, so speculative
    decoding here is exactly plain decoding in that dtype (other paths round differently)."""
    from specstore.runtime.models import load_model

    loaded = load_model(None, dtype=dtype, device="cpu")
    ids = loaded.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
    plain = TreeVerifier(loaded.model)
    tokens, logits = [plain.prefill(ids).bonus], []
    for _ in range(24):
        out = plain.step(tokens[-1], DraftTree.empty())
        logits.append(out.logits.clone())
        tokens.append(out.result.bonus)
    tree_verifier = TreeVerifier(loaded.model)
    tree_verifier.prefill(ids)
    pos, checked = 0, 0
    while pos < 16:
        chain = tokens[pos + 1 : pos + 7]
        out = tree_verifier.step(tokens[pos], DraftTree.from_paths([[chain[0], 3, 4], chain, [5, 6]]))
        assert out.result.accepted_tokens == chain
        pos += len(chain) + 1
        assert torch.equal(out.logits, logits[pos - 1]) and out.result.bonus == tokens[pos]
        checked += 1
    assert checked >= 2


def test_attention_is_not_taken_where_the_kernel_has_none(monkeypatch):
    """A CPU without the kernel's attention (no AVX-512 BF16 for bf16; no AVX2, no compiler, or
    switched off for either): steps and trees stay on torch's attention, a plain 1-query step too."""
    monkeypatch.setattr(gemm, "has_attention", lambda lib=None, dtype=torch.bfloat16: False)
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(1, 9, 1, 64).to(dtype)
        k, v = torch.randn(1, 3, 10, 64).to(dtype), torch.randn(1, 3, 10, 64).to(dtype)
        assert not gemm.attention_takes(q, k, v, None)
        mask = torch.zeros(1, 1, 1, 10, dtype=dtype)
        assert not gemm.attention_takes(q, k, v, mask)


needs_dense = pytest.mark.skipif(not gemm.has_dense(), reason="the kernel is not loaded here (its dense search needs AVX2)")


def _dense_reference(hidden, weight, bias, eps, scales, rows, k):
    """The torch path of dense.py in float64: unit query, its scaled form, the k best rows by
    score (ties to the lower offset)."""
    p = hidden.double() @ weight.double() + bias.double()
    p = p / max(float(p.norm()), eps)
    q = p.numpy() / (scales.astype(np.float64) if scales is not None else 1.0)
    scores = rows.astype(np.float64) @ q
    order = np.lexsort((np.arange(len(scores)), -scores))[:k]
    return order, scores[order], p.numpy()


@needs_dense
@pytest.mark.parametrize("n", [0, 1, 5, 300, 20000])  # 20000: past DENSE_PARALLEL_ROWS, halves merged
@pytest.mark.parametrize("kind", ["int8", "float32"])
def test_dense_top_finds_the_best_rows_with_ties_to_the_lower_offset(n, kind):
    rng = np.random.default_rng(n)
    hsize, dim, k = 40, 24, 7  # dims not a multiple of 16: the tails too
    weight = torch.from_numpy(rng.normal(size=(hsize, dim)).astype(np.float32))
    bias = torch.from_numpy(rng.normal(size=dim).astype(np.float32))
    hidden = torch.from_numpy(rng.normal(size=hsize).astype(np.float32))
    if kind == "int8":
        rows = rng.integers(-127, 128, size=(n, dim)).astype(np.int8)
        scales = rng.uniform(50, 200, size=dim).astype(np.float32)
    else:
        rows, scales = rng.normal(size=(n, dim)).astype(np.float32), None
    if n >= 300:  # exact ties: copies of one row, early and late, each of which is among the best
        _, _, unit = _dense_reference(hidden, weight, bias, 1e-6, scales, rows[:1], 1)
        best = np.clip(np.round(unit * (scales if scales is not None else 1.0) * 40), -127, 127).astype(rows.dtype)
        for at in (n - 3, 17, 2, n // 2):
            rows[at] = best
    found = gemm.dense_top(hidden, weight, bias, 1e-6, scales, rows, k, want_query=True)
    order, scores, unit = _dense_reference(hidden, weight, bias, 1e-6, scales, rows, k)
    assert found is not None
    idx, got, query = found
    assert idx.tolist() == order.tolist()
    np.testing.assert_allclose(got, scores, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(query, unit, rtol=1e-5, atol=1e-6)
    if n >= 300:
        assert idx[:4].tolist() == [2, 17, n // 2, n - 3]  # the four copies first, lower offsets first
    bf16 = gemm.dense_top(hidden.bfloat16(), weight, bias, 1e-6, scales, rows, k)  # bf16 states, widened exactly
    order16, _, _ = _dense_reference(hidden.bfloat16().float(), weight, bias, 1e-6, scales, rows, k)
    assert bf16[0].tolist() == order16.tolist()


@needs_dense
def test_dense_top_refuses_what_it_does_not_take_and_drops_nan_scores():
    weight, bias = torch.randn(8, 4), torch.randn(4)
    rows = np.zeros((3, 4), dtype=np.int8)
    scales = np.ones(4, dtype=np.float32)
    assert gemm.dense_top(torch.randn(8), weight, bias, 1e-6, None, rows, 2) is None  # int8 rows need scales
    assert gemm.dense_top(torch.randn(8), weight, bias, 1e-6, scales, rows.astype(np.int16), 2) is None
    assert gemm.dense_top(torch.randn(8), weight, bias, 1e-6, scales, np.zeros((3, 8), np.int8)[:, ::2], 2) is None  # strided
    assert gemm.dense_top(torch.randn(7), weight, bias, 1e-6, scales, rows, 2) is None  # hidden size
    assert gemm.dense_top(torch.randn(8).double(), weight, bias, 1e-6, scales, rows, 2) is None
    assert gemm.dense_top(torch.randn(8), weight, bias, 1e-6, scales, rows, gemm.DENSE_MAX_K + 1) is None
    idx, scores, _ = gemm.dense_top(torch.full((8,), float("nan")), weight, bias, 1e-6, scales, rows, 2)
    assert idx.size == 0 and scores.size == 0
    idx, scores, _ = gemm.dense_top(torch.zeros(8), torch.zeros(8, 4), torch.zeros(4), 1e-6, scales, rows, 5)
    assert idx.tolist() == [0, 1, 2] and scores.tolist() == [0.0, 0.0, 0.0]  # a zero query: all tie, k > n


@needs_dense
@pytest.mark.parametrize("kind", ["int8", "float32"])
def test_dense_rerank_is_the_numpy_rerank_of_an_approximate_index(kind):
    """gemm.dense_rerank (dense.py's approximate path: its candidates reranked exactly) keeps the
    k best of the candidate rows in dense._top's order: ties to the lower offset, candidates
    outside the block, -1 and repeats dropped. Integer rows and query: every sum is exact."""
    rng = np.random.default_rng(4)
    dim = 24
    for _ in range(200):
        n = int(rng.integers(0, 400))
        rows = rng.integers(-3, 4, size=(n, dim)).astype(np.int8 if kind == "int8" else np.float32)
        scales = np.ones(dim, dtype=np.float32) if kind == "int8" else None
        query = rng.integers(-2, 3, size=dim).astype(np.float32)
        ids = rng.integers(-1, n + 5, size=int(rng.integers(0, 60))).astype(np.int64)  # -1, repeats, past the block
        k = int(rng.integers(0, 12))
        found = gemm.dense_rerank(query, scales, rows, ids, k)
        assert found is not None
        keep = np.unique(ids[(ids >= 0) & (ids < n)])
        scores = rows[keep].astype(np.float64) @ query.astype(np.float64)
        order = np.lexsort((keep, -scores))[:k]
        assert found[0].tolist() == keep[order].tolist()
        assert found[1].tolist() == scores[order].tolist()
    rows = np.zeros((3, 4), dtype=np.int8)
    ids = np.array([0, 2], dtype=np.int64)
    assert gemm.dense_rerank(np.zeros(4, np.float32), None, rows, ids, 1) is None  # int8 rows need scales
    assert gemm.dense_rerank(np.zeros(4, np.float64), np.ones(4, np.float32), rows, ids, 1) is None
    assert gemm.dense_rerank(np.zeros(4, np.float32), np.ones(4, np.float32), rows, ids.astype(np.int32), 1) is None
    assert gemm.dense_rerank(np.zeros(4, np.float32), np.ones(4, np.float32), rows, ids, gemm.DENSE_MAX_K + 1) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_is_torchs_first_maximum_and_leaves_nan_to_torch(dtype):
    """gemm.argmax (greedy acceptance's argmax of a row in one call: bf16 where the CPU has
    AVX-512, float32 wherever the kernel loads) equals torch's argmax: the first of tied maxima,
    at any length (tails past 8 and 16 lanes), -inf and +inf entries; None for NaN (torch takes
    NaN as the largest) and for what it does not take."""
    if not (gemm.has_elementwise() if dtype == torch.bfloat16 else getattr(gemm.library(), "argmax_f32", False)):
        pytest.skip(f"the kernel has no {dtype} argmax here")
    rng = np.random.default_rng(2)
    for n in (1, 5, 7, 8, 9, 16, 17, 49152, 49159):
        for _ in range(20):
            x = torch.from_numpy(rng.normal(size=n).astype(np.float32)).to(dtype)
            if n > 3:  # ties: bf16 rounding makes some; force the maximum twice, far apart
                top = x.max()
                x[int(rng.integers(0, n))] = top
                x[int(rng.integers(0, n))] = top
                x[int(rng.integers(0, n))] = float("-inf")
            assert gemm.argmax(x) == int(x.argmax())
    assert gemm.argmax(torch.full((40,), float("-inf")).to(dtype)) == 0
    x = torch.zeros(41).to(dtype)
    x[[5, 30]] = float("inf")
    assert gemm.argmax(x) == 5
    for at in (7, 40):  # in the vector part and in the tail
        x = torch.zeros(41).to(dtype)
        x[at] = float("nan")
        assert gemm.argmax(x) is None
    assert gemm.argmax(torch.zeros(33).to(dtype)[-1:0]) is None
    assert gemm.argmax(torch.zeros(2, 40).to(dtype)[:, 0]) is None  # not contiguous
    assert gemm.argmax(torch.zeros(40).double()) is None  # float64: torch's own


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_rows_moves_as_index_select_and_refuses_what_it_cannot_take(dtype):
    g = torch.Generator().manual_seed(7)
    buffers = [torch.randn(1, 3, 32, 16, generator=g).to(dtype) for _ in range(4)]
    want = [b.clone() for b in buffers]
    start, rows = 10, [1, 4, 5, 9]
    for b in want:
        b[..., start : start + len(rows), :] = b.index_select(-2, torch.tensor([start + r for r in rows]))
    assert gemm.move_rows(buffers, start, rows)
    assert all(torch.equal(a, b) for a, b in zip(buffers, want, strict=True))
    before = [b.clone() for b in buffers]
    refused = [
        (buffers, start, [2, 1]),  # not increasing
        (buffers, start, [0, 0]),
        (buffers, 30, [0, 5]),  # past the capacity
        ([*buffers, torch.zeros(1, 3, 16, 16, dtype=dtype)], start, [1]),  # shapes differ
        ([*buffers, torch.zeros(1, 3, 32, 16, dtype=torch.float16)], start, [1]),  # dtypes differ
        ([*buffers, torch.zeros(1, 3, 16, 32, dtype=dtype).transpose(-1, -2)], start, [1]),  # not contiguous
    ]
    for bufs, at, r in refused:
        assert not gemm.move_rows(bufs, at, r)
    assert all(torch.equal(a, b) for a, b in zip(buffers, before, strict=True))
