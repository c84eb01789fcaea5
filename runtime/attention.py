"""Tree attention for grouped-query models without copying the cache.

transformers' SDPA path gives a multi-token forward with a custom mask (every tree verification)
to ``scaled_dot_product_attention`` only after ``repeat_kv``: on a CPU, and on CUDA whenever a
mask is given, each layer copies its whole cached keys and values once per query head of a
group (SmolLM2-135M: 9 query heads over 3 key/value heads, so 3x the cache, 30 layers, every
step). A 1-token step has no such copy (transformers hands it to SDPA's ``enable_gqa``, which
has its own slow path on the CPU, below). So a verification cost more than its extra tree rows:
a fixed copy that grows with the context.

Owns ``PACKED_SDPA``, an attention implementation registered with transformers' attention and
mask interfaces: for a forward of several queries under a 4D mask shared by all heads it packs
the ``n_rep`` query heads of each key/value head into one head of ``n_rep x q`` rows (row
``r * q + i`` is head ``r``'s query ``i``) and repeats the mask's rows to match, so attention
reads each key/value head as it is cached; the rows' results are the same as with the copy (each
row's softmax is its own). A 1-token step without a mask (plain decoding) is packed the same
way on the CPU in bf16/fp16, where transformers' ``enable_gqa`` call is several times slower
(``_packable_step``). In bf16/fp16 on the CPU, packed attention over a long cache is two matmuls
and a softmax rather than SDPA's fused kernel, which grows about twice as fast with the cached
length there (``_matmul_attention``; float32 and CUDA keep SDPA). Everything else (prefill,
float32 and CUDA 1-token steps, position biases, soft-capping) is transformers' own SDPA function.
Before all of these, bf16 and float32 steps and trees on the CPU go to specstore's kernel where it
has them (``gemm.attention``: float32 wherever the kernel loads, bf16 with AVX-512 BF16), whose
rows are the bits of plain decoding's step. ``use_packed_attention(model)``
switches a model whose implementation is ``"sdpa"`` to it (the verifier does; the model's
weights and math are as before).
"""

from __future__ import annotations

import os

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specstore.runtime import gemm

PACKED_SDPA = "specstore_packed_sdpa"
# bf16 and float32 steps and trees on the CPU through specstore's kernel (gemm.attention) where it has one;
# SPECSTORE_CPU_ATTENTION=0 keeps them on the paths below
_KERNEL_ATTENTION = os.environ.get("SPECSTORE_CPU_ATTENTION", "1") != "0"


def _plain(module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict) -> bool:
    """Plain attention (no dropout, position bias, soft-capping or returned weights), the query
    heads grouped over the key/value heads as the module says."""
    n_rep = int(getattr(module, "num_key_value_groups", 1) or 1)
    return (
        key.shape[1] * n_rep == query.shape[1]
        and dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )


def _grouped(module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict) -> bool:
    """Several query heads per key/value head, plain attention (what packing needs)."""
    return int(getattr(module, "num_key_value_groups", 1) or 1) > 1 and _plain(module, query, key, dropout, kwargs)


def _packable(module, query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, kwargs: dict) -> bool:
    """Several queries under one 4D mask shared by all heads (a tree verification)."""
    return (
        query.shape[2] > 1
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and _grouped(module, query, key, dropout, kwargs)
    )


def _packable_step(module, query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, kwargs: dict) -> bool:
    """A 1-token step (plain decoding) that transformers would hand to SDPA's ``enable_gqa``: on
    the CPU in a reduced-precision dtype that runs several times slower than the same attention
    over packed query heads (bf16, 9 query over 3 key/value heads: 69 vs 22 us at 128 cached
    tokens, 538 vs 135 us at 1,024; float32 is as fast either way and keeps transformers' path)."""
    return (
        query.shape[2] == 1
        and query.device.type == "cpu"
        and query.dtype in (torch.bfloat16, torch.float16)
        and attention_mask is None
        and _grouped(module, query, key, dropout, kwargs)
    )


# Reduced-precision attention on the CPU through two matmuls and a softmax (``_matmul_attention``)
# instead of SDPA's fused kernel, where the kernel scales worse with the cached length. On the
# seventh session's CPU (bf16, 3 key/value heads of 64 dims) 27 packed rows (an 8-node tree) over
# 1,024 cached tokens took 229 against 113 us a layer, 3 rows (a 1-token step) over 2,048 145
# against 80 us, and the switch came at 8k row-key products or 1,024 keys. On the fifteenth
# session's Zen 4 with the cache growing in place, whole bf16 steps interleaved in one process
# found SDPA as fast or faster at every size decoding meets (0-16 nodes over 300-2,000 cached
# tokens: a plain step at 1,100 tokens 22.1 against 26.7 ms, 8 nodes 32.8 against 36.2; only 16
# nodes over 2,000 tokens 51.0 against 49.2, BENCHMARKS.md), so the switch now waits for far
# larger products: 48 packed rows (a 16-node tree) over 2,048 tokens.
MATMUL_MIN_WORK = 98304  # packed query rows x keys at which the matmul path is taken
MATMUL_MIN_KEYS = 8192  # ... or cached keys, whatever the rows (the default model's context)
MATMUL_MAX_QUERIES = 128  # query tokens of a forward (trees and steps; a prompt's prefill keeps SDPA)


def _matmul_worth_it(query: torch.Tensor, rows: int, keys: int) -> bool:
    return (query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)
            and query.shape[2] <= MATMUL_MAX_QUERIES and (rows * keys >= MATMUL_MIN_WORK or keys >= MATMUL_MIN_KEYS))


def _matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None) -> torch.Tensor:
    """softmax(q k^T x scale + mask) v for [B, H, R, D] queries over [B, H, K, D] keys and values,
    ``mask`` additive (float) or allowed (bool), broadcast over heads; what SDPA computes, in
    three ops whose cost grows with the keys as a matmul's does."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(-1, -2))
    if mask is None:
        scores.mul_(scale)
    elif mask.dtype == torch.bool:
        scores.mul_(scale).masked_fill_(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = torch.add(mask.to(scores.dtype), scores, alpha=scale)
    return torch.matmul(scores.softmax(-1), value)


_last_repeat: tuple = (None, 0, None)  # (mask, n_rep, repeated mask) of the last call: one tuple, swapped whole


def _repeated_mask(mask: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``mask`` [B, 1, q, k] with its rows repeated ``n_rep`` times (row ``r * q + i`` is row
    ``i``), made once per forward: every layer is handed the same mask tensor (the verifier makes
    a new one each step and never edits one in place), and repeating it in each of 30 layers cost
    a tree step ~0.3 ms on this project's CPU. Threads that verify at once only replace each
    other's entry (the identity check keeps each result its own mask's)."""
    global _last_repeat
    last, reps, repeated = _last_repeat
    if last is not mask or reps != n_rep:
        repeated = mask.repeat(1, 1, n_rep, 1)
        _last_repeat = (mask, n_rep, repeated)
    return repeated


def _kernel_takes(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                  dropout: float, kwargs: dict) -> bool:
    """A bf16 or float32 CPU step or tree that specstore's attention kernel computes (module doc)."""
    return (_KERNEL_ATTENTION and query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float32)
            and _plain(module, query, key, dropout, kwargs) and gemm.attention_takes(query, key, value, attention_mask))


def packed_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                        dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, H_kv, k, D]
    -> ([B, q, H, D_v], None)."""
    if _kernel_takes(module, query, key, value, attention_mask, dropout, kwargs):
        return gemm.attention(query, key, value, attention_mask, scaling), None
    if _packable_step(module, query, key, attention_mask, dropout, kwargs):
        b, h, _, d = query.shape
        packed = query.reshape(b, key.shape[1], h // key.shape[1], d)  # one query attends to all: no mask
        if _matmul_worth_it(query, packed.shape[2], key.shape[2]):
            out = _matmul_attention(packed, key, value, None, scaling)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, scale=scaling)
        return out.reshape(b, h, 1, value.shape[-1]).transpose(1, 2).contiguous(), None
    if not _packable(module, query, key, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, h, q, d = query.shape
    n_rep = h // key.shape[1]
    packed = query.reshape(b, key.shape[1], n_rep * q, d)
    mask = _repeated_mask(attention_mask, n_rep)
    if _matmul_worth_it(query, n_rep * q, key.shape[2]):
        out = _matmul_attention(packed, key, value, mask, scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, q, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


def use_packed_attention(model) -> bool:
    """Switch ``model`` from transformers' ``"sdpa"`` to ``PACKED_SDPA`` (True when it now uses it)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == PACKED_SDPA:
        return True
    if impl != "sdpa":
        return False
    try:
        model.set_attn_implementation(PACKED_SDPA)
    except (AttributeError, ValueError, KeyError):
        return False
    return getattr(model.config, "_attn_implementation", None) == PACKED_SDPA
