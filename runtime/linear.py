"""The target's linear layers with oneDNN-packed weights on the CPU.

A decoding step multiplies every projection of every layer (SmolLM2-135M: 7 x 30 plus the
output head) at 1 to ~20 rows, where ``torch.nn.functional.linear`` on a CPU, which takes the
weight as it is stored, runs well below the same oneDNN product on a weight reordered into
oneDNN's blocked layout once. Packing each weight once (``torch.ops.mkldnn._reorder_linear_weight``) and multiplying with
``torch.ops.mkldnn._linear_pointwise`` measured on this project's CPU (2 cores, AVX-512 bf16):
a whole bf16 step 57.5 -> 41.1 ms at 1 row, 75.2 -> 54.3 ms at 13 rows; the output head alone at
1 row 5.4 -> 3.0 ms in bf16, 13.1 -> 5.7 ms in float32. In bf16 the results are bit-identical to
``F.linear`` on a CPU with native bf16 (where bf16 is emulated, a whole model's logits were seen
within 1e-3); float32 rounds differently (~1e-4) but the same way for plain decoding and every
verification, as both run through it.

specstore's own kernel (gemm.py) comes first where it runs: a weight whose dtype it takes
(``_kernel_takes``: float32, and bf16 on CPUs without native bf16) is packed into its panels
instead, products of up to ``gemm.MAX_ROWS`` rows go to it and larger ones to ``F.linear``;
everything below is then not used for that weight.

``use_packed_linears(model)`` switches every ``nn.Linear`` of a CPU model to ``PackedLinear``
(a subclass: same parameters and state dict) holding a packed copy of its weight, so
hashes, tied embeddings, saving and copying are as before, at the price of a second copy of the
linear weights (default model: ~0.2 GB in bf16; a model whose copy would take more than a
quarter of the free memory is left as it is). A weight changed in place or moved is packed
again on its next call; an input on another device or in another dtype, or one that needs
gradients, goes to ``F.linear``. The verifier calls it, so plain decoding and every drafter's
verification share it. ``SPECSTORE_PACKED_LINEARS=0`` turns it off.

Small products (``small_rows_plain``): on some CPUs oneDNN's packed product has a fixed cost that
``F.linear`` (MKL there) does not, and at 1-3 rows ``F.linear`` is the faster one: float32 on a
2-core Xeon without native bf16, 576 x 576 at 1 row 24 against 42 us, 576 x 1536 82 against 113,
while from 5 rows on the packed product wins (576 x 1536 at 9 rows 246 against 198 us, the output
head at 17 rows 26.7 against 9.3 ms; BENCHMARKS.md, "Decoding dtype"). So the first time a
weight shape and dtype is packed, both products are timed at 1 and ``SMALL_ROWS`` rows, and where
``F.linear`` is faster at both by ``SMALL_MARGIN`` it takes inputs of up to ``SMALL_ROWS`` rows
(plain decoding's steps, the smallest trees); the decision is kept for the process, one per
shape. ``SPECSTORE_LINEAR_SMALL_ROWS=packed`` (or ``plain``) fixes it instead of measuring.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from specstore.runtime import gemm
from specstore.runtime.device import cpu_flags, native_bf16_cpu

_ATTR = "_specstore_packed"
SMALL_ROWS = 3  # rows up to which F.linear may take a product (module doc, small products)
SMALL_MARGIN = 0.8  # ... where it took at most this share of the packed product's time, at 1 and SMALL_ROWS rows
_small: dict[tuple, bool] = {}  # (dtype, in, out, bias) -> F.linear for small inputs, decided once per process


def _available() -> bool:
    return (os.environ.get("SPECSTORE_PACKED_LINEARS", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _free_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _state(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What a packed copy is valid for: the weight's storage, in-place version, dtype, device and
    shape, and the bias's storage."""
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor keeps no version counter
        version = None
    return (weight.data_ptr(), version, weight.dtype, weight.device, weight.shape,
            None if bias is None else bias.data_ptr())


def _pack(module: torch.nn.Linear) -> tuple:
    """Pack ``module``'s weight for the products decoding runs; holds and returns ``(oneDNN
    packed weight, _state, detached bias, small inputs to F.linear, kernel panels)``. Where
    specstore's own kernel takes the dtype here (``_kernel_takes``) it gets panels (gemm.pack)
    and no oneDNN copy is made: larger products go to ``F.linear``. Otherwise the oneDNN copy,
    checked against ``F.linear``, None (remembered until the weight changes) where this torch
    build or CPU cannot pack it (e.g. fp16 without AVX-512 fp16)."""
    weight = module.weight.detach()
    bias = None if module.bias is None else module.bias.detach().contiguous()
    if weight.device.type == "cpu" and weight.dim() == 2 and _kernel_takes(weight.dtype):
        held = module.__dict__[_ATTR] = (None, _state(module.weight, module.bias), bias, False, gemm.pack(weight))
        return held
    packed = None
    if weight.device.type == "cpu":
        try:
            with torch.no_grad():
                candidate = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)  # not the global RNG
                got = torch.ops.mkldnn._linear_pointwise(probe, candidate, bias, "none", [], "")
                want = torch.nn.functional.linear(probe, weight, bias)
            tol = 1e-2 if weight.dtype in (torch.bfloat16, torch.float16) else 1e-4
            if got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=tol,
                                                          atol=tol * max(want.abs().max().item(), 1.0)):
                packed = candidate
        except RuntimeError:
            packed = None
    small = packed is not None and small_rows_plain(weight, packed, bias)
    held = module.__dict__[_ATTR] = (packed, _state(module.weight, module.bias), bias, small, None)
    return held


def _kernel_takes(dtype: torch.dtype) -> bool:
    """Whether specstore's kernel (gemm.py) takes this dtype's few-row products here: float32
    wherever it runs; bf16 on CPUs without native bf16 (widened to float32), and on CPUs with
    AVX-512 BF16 but no AMX through its dot products (there a plain bf16 step of the default
    model took 19-20 ms against oneDNN's 27.5, BENCHMARKS.md); with AMX, oneDNN's products
    (not measured against the kernel there)."""
    if dtype == torch.float32:
        return gemm.available()
    if dtype == torch.bfloat16:
        if not gemm.available():
            return False
        if not native_bf16_cpu()[0]:
            return True
        return gemm.dot_bf16() and "amx_bf16" not in cpu_flags()
    return False


def _seconds(fn, x: torch.Tensor, reps: int) -> float:
    """Median over 5 rounds of ``reps`` calls, after 2 warm-up calls: seconds per call."""
    for _ in range(2):
        fn(x)
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn(x)
        rounds.append((time.perf_counter() - start) / reps)
    return statistics.median(rounds)


def small_rows_plain(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``F.linear`` takes this weight's products of up to ``SMALL_ROWS`` rows (module doc):
    ``SPECSTORE_LINEAR_SMALL_ROWS`` ``packed`` / ``plain`` fixes it; otherwise timed once per
    (dtype, shape, bias) in this process."""
    mode = os.environ.get("SPECSTORE_LINEAR_SMALL_ROWS", "auto")
    if mode in ("packed", "plain"):
        return mode == "plain"
    key = (weight.dtype, weight.shape[1], weight.shape[0], bias is None)
    if key not in _small:
        reps = max(2, min(50, int(4e6 // max(weight.numel(), 1))))
        faster = True
        with torch.no_grad():
            for rows in (1, SMALL_ROWS):
                x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(weight.dtype)
                plain = _seconds(lambda v: torch.nn.functional.linear(v, weight, bias), x, reps)
                oned = _seconds(lambda v: torch.ops.mkldnn._linear_pointwise(v, packed, bias, "none", [], ""), x, reps)
                faster = faster and plain <= SMALL_MARGIN * oned
        _small[key] = faster
    return _small[key]


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` (same parameters and state dict) that multiplies on the CPU with
    its weight packed once; ``use_packed_linears`` switches a module's class to it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # every projection of every step comes here: parameters read from ``_parameters``
        # directly (not through Module.__getattr__), the bias detached once at packing
        params = self._parameters
        weight = params["weight"]
        held = self.__dict__.get(_ATTR)
        if held is None or held[1] != _state(weight, params["bias"]):
            held = _pack(self)
        if (not x.is_cpu or x.dtype != weight.dtype
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return torch.nn.functional.linear(x, weight, params["bias"])
        if held[4] is not None and x.numel() <= gemm.MAX_ROWS * x.shape[-1]:
            return gemm.linear(x, held[4], held[2], weight.shape[0])
        if held[0] is None or (held[3] and x.numel() <= SMALL_ROWS * x.shape[-1]):
            return torch.nn.functional.linear(x, weight, params["bias"])
        return torch.ops.mkldnn._linear_pointwise(x, held[0], held[2], "none", [], "")

    def __getstate__(self):
        state = super().__getstate__().copy()
        state.pop(_ATTR, None)  # a copy or a pickle packs its own weight on first use
        return state


def backend(dtype: torch.dtype) -> str:
    """Which product a CPU model's linears of ``dtype`` run on at decoding's row counts:
    ``"specstore"`` (gemm.py's kernel), ``"onednn"`` (packed weights, F.linear for small
    products where that measured faster) or ``"torch"`` (F.linear: switched off)."""
    if not _available():
        return "torch"
    return "specstore" if _kernel_takes(dtype) else "onednn"


def is_packed(module: torch.nn.Module) -> bool:
    """True when ``module`` runs on a packed weight (packed at its last call or when switched)."""
    held = getattr(module, "__dict__", {}).get(_ATTR)
    return isinstance(module, PackedLinear) and held is not None and (held[0] is not None or held[4] is not None)


def kernel_panel(module: torch.nn.Module) -> torch.Tensor | None:
    """``module``'s weight as specstore's kernel's panels (gemm.pack), where it runs on them."""
    if not isinstance(module, PackedLinear) or _stale(module):
        return None
    return module.__dict__[_ATTR][4]


def weight_state(module: torch.nn.Linear) -> tuple:
    """What a packed copy of ``module``'s weight is valid for (``_state``)."""
    return _state(module._parameters["weight"], module._parameters["bias"])


def stacked_panel(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One panel for the products of ``modules`` (kernel-packed, one input size) side by side: their
    outputs in order, as if their weights were stacked, and the stacked bias (zeros for a module
    without one; None where none has one). Where each module's outputs fill whole panels
    (``gemm.NB``), each module's own packed copy becomes a view of its part of the stack, so the
    weights are not held twice; otherwise the stack is a copy of its own."""
    weights = [m.weight.detach() for m in modules]
    panel = gemm.pack(torch.cat(weights))
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights, strict=True)]).contiguous()
    if panel.dim() == 3 and all(w.shape[0] % gemm.NB == 0 for w in weights):
        start = 0
        for m, w in zip(modules, weights, strict=True):
            held = m.__dict__.get(_ATTR)
            blocks = w.shape[0] // gemm.NB
            if held is not None and held[4] is not None and held[4].shape == (blocks, *panel.shape[1:]):
                m.__dict__[_ATTR] = (*held[:4], panel[start:start + blocks])
            start += blocks
    return panel, bias


def _stale(module: PackedLinear) -> bool:
    held = module.__dict__.get(_ATTR)
    return held is None or held[1] != weight_state(module)


def use_packed_linears(model: torch.nn.Module) -> int:
    """Switch every CPU ``nn.Linear`` of ``model`` to ``PackedLinear`` and pack its weight, and
    pack again a weight changed since (idempotent); returns how many run packed."""
    if not _available():
        return 0
    todo = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.device.type == "cpu" and (
        type(m) is torch.nn.Linear or isinstance(m, PackedLinear) and _stale(m))]
    if todo:  # the verifier calls this per request: memory is read only when there is work
        free = _free_bytes()
        if free is not None and sum(m.weight.numel() * m.weight.element_size() for m in todo) > free // 4:
            todo = []
    for m in todo:
        m.__class__ = PackedLinear
        _pack(m)
    return sum(is_packed(m) for m in model.modules())
