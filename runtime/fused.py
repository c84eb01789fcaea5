"""A decoding step's elementwise parts in one kernel call each, for bf16 models on the CPU.

In a bf16 forward on the CPU each RMS norm is eight small torch ops (widen, square, mean, add,
rsqrt, multiply, narrow, weight) and a gated MLP's middle two (silu, multiply), each a few
microseconds of dispatch plus a pass over cold memory; torch's bf16 elementwise kernels also
cost about 1 ns a value here, so every tree row adds to them (BENCHMARKS.md, sixteenth session:
with the kernel's calls a plain bf16 step went from 18.1 to 16.1 ms, a 6-node tree from 20.4 to
18.1). The kernel
(csrc/small_gemm.c, ``gemm.rmsnorm`` / ``gemm.silu_mul``) does each in one call, rounding to
bf16 where transformers' modules round, and a row's result depends only on that row (so a tree
verification still gives plain decoding's logits bit for bit).

The rotary position embedding likewise: transformers' ``apply_rotary_pos_emb`` is six bf16 ops
and a concatenation per query and key, ~1.1 ms of a ~17 ms plain step here across 30 layers;
``gemm.rotary`` computes each in one call with torch's bits (each product and the sum rounded to
bf16 as torch's ops round), and hands the attention a contiguous query (no copy before the
kernel's attention). Plain bf16 step 16.9 -> 16.0 ms, 6 nodes 18.5 -> 17.5 (BENCHMARKS.md,
eighteenth session).

Owns ``use_fused_elementwise(model)``: switches the RMS norms and gated MLPs of known
architectures (``NORMS``, ``MLPS``: Llama and the families that copy its modules) to subclasses
whose forward takes the kernel's call when it applies (bf16 on the CPU, no gradient wanted,
the kernel built with AVX-512 BF16) and the module's own forward otherwise; and the
``apply_rotary_pos_emb`` of the modeling module of each known attention class (``ATTENTIONS``)
to a function that takes the kernel's call when it applies (one sequence, cos/sin broadcast over
heads as well) and transformers' own function otherwise; a module-level function, so every model
of that module in the process takes it, with the same results. Weights, state dict and results
in every other case are unchanged. ``SPECSTORE_CPU_FUSED=0`` leaves the modules as they are. The
verifier switches its model (verify.py), as it does its linears (linear.py).
"""

from __future__ import annotations

import os
import sys

import torch

from specstore.runtime import gemm

NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")  # weight * (x / rms(x)), bf16 rounded between
MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP")  # down(act(gate(x)) * up(x))
_SWITCHED = "_specstore_fused"


def _wants_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not _wants_grad(hidden_states, self.weight):
        out = gemm.rmsnorm(hidden_states, self.weight, self.variance_epsilon)
        if out is not None:
            return out
    return super(type(self), self).forward(hidden_states)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not _wants_grad(gate, up):
        middle = gemm.silu_mul(gate, up)
        if middle is not None:
            return self.down_proj(middle)
    return self.down_proj(self.act_fn(gate) * up)


def _fused_class(base: type, forward) -> type:
    """``base`` with ``forward`` replaced, made once and kept in this module (a pickle finds it)."""
    name = f"Fused{base.__name__}"
    cls = globals().get(name)
    if cls is None or cls.__bases__ != (base,):
        cls = type(name, (base,), {"forward": forward, "__module__": __name__, _SWITCHED: True})
        globals()[name] = cls
    return cls


def _silu(module: torch.nn.Module) -> bool:
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    return act == "silu" and all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj"))


ATTENTIONS = ("LlamaAttention", "MistralAttention", "Qwen2Attention")  # call their module's apply_rotary_pos_emb
_ROTARY = "_specstore_rotary"


def _rotary_function(original):
    """``original`` (a modeling module's ``apply_rotary_pos_emb``) taking the kernel's call where it
    applies: bf16 on the CPU, one sequence, cos/sin broadcast over heads, no gradient wanted."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        if unsqueeze == 1 and len(args) <= 1 and set(kwargs) <= {"unsqueeze_dim"} and not _wants_grad(q, k, cos, sin):
            out = gemm.rotary(q, k, cos, sin)
            if out is not None:
                return out
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__wrapped__ = original
    setattr(apply_rotary_pos_emb, _ROTARY, True)
    return apply_rotary_pos_emb


def _use_kernel_rotary(model: torch.nn.Module) -> int:
    """Give the modeling modules of ``model``'s known attention classes the kernel's rotary
    embedding (``_rotary_function``; its bits are torch's). A module-level function, so every
    model of that module in the process takes it: the same results, sooner. Returns how many
    modules now have it."""
    if not gemm.has_rotary():
        return 0
    done = set()
    for m in model.modules():
        cls = type(m)
        for base in cls.__mro__:
            if base.__name__ in ATTENTIONS:
                module = sys.modules.get(base.__module__)
                fn = getattr(module, "apply_rotary_pos_emb", None)
                if callable(fn):
                    if not getattr(fn, _ROTARY, False):
                        module.apply_rotary_pos_emb = _rotary_function(fn)
                    done.add(module.__name__)
                break
    return len(done)


def use_fused_elementwise(model: torch.nn.Module) -> int:
    """Switch ``model``'s RMS norms and silu-gated MLPs of the known classes (module doc);
    idempotent. Returns how many modules run switched (0 where the kernel has no such calls or
    ``SPECSTORE_CPU_FUSED=0``)."""
    if os.environ.get("SPECSTORE_CPU_FUSED", "1") == "0" or not gemm.has_elementwise():
        return 0
    count = _use_kernel_rotary(model)
    for m in model.modules():
        cls = type(m)
        if getattr(cls, _SWITCHED, False):
            count += 1
        elif cls.__name__ in NORMS and hasattr(m, "variance_epsilon") and isinstance(getattr(m, "weight", None), torch.Tensor):
            m.__class__ = _fused_class(cls, _norm_forward)
            count += 1
        elif cls.__name__ in MLPS and _silu(m):
            m.__class__ = _fused_class(cls, _mlp_forward)
            count += 1
    return count
