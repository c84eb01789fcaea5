"""A float32 decoding step of a Llama-style model in one kernel call, on the CPU.

A decoding step through transformers' modules runs each of the default model's 30 layers as a
dozen module calls and several dozen small torch ops (norms, rotary embedding, cache appends,
residual adds, views), each a few microseconds of Python and dispatch: on a 2-core Zen 3 in
float32 a plain step of SmolLM2-135M after 300 cached tokens took ~47 ms, of which the products
(the weights read from memory) ~21-24 ms (BENCHMARKS.md, thirty-fifth session). The kernel
(csrc/small_gemm.c, ``specstore_decoder_f32``) runs the whole layer stack of a step or a tree
verification in one call: the same products (``specstore_linear_f32``) and attention
(``specstore_attention_f32``) as the module path, with the RMS norms, rotary embedding, cache
writes and SiLU gate between them in C.

Owns ``KernelForward``: built once per model from its weights (``KernelForward.of(model)``, kept
for the model's life and rebuilt when a weight changes), called by the verifier (verify.py) for every
forward of up to ``MAX_ROWS`` tokens on a cache whose layers grow in place (kv_cache.py), and for
a prompt's prefill (``prefill``: calls of up to ``MAX_ROWS`` tokens, each causal within itself and
after the earlier ones, the output head over the last token only; through the modules a prefill
ran every module and torch op of the 30 layers and the output head over all its rows);
everything the kernel does not take goes through the modules as before. It
takes a model where ``reason(model)`` is None: float32 on the CPU, the kernel built, a Llama,
Mistral or Qwen2 decoder of full-attention layers with a SiLU-gated MLP, RMS norms, rotary
positions over the whole head and logits that are the output head's product, every linear on
the kernel's panels (linear.py). The query, key and value projections run as one product, and
the gate and up projections as another: their panels are stacked (``linear.stacked_panel``), and
the modules' own packed copies become views of the stack, so no weight is held twice.

Numbers: every row's result depends only on that row and the cache (as in the module path), so
plain decoding and every verification still agree bit for bit. The norms, SiLU and rotary
embedding round as float32 arithmetic does, not always as torch's ops do: logits agree with
the module path's to rounding (tests/test_kernel_forward.py); a prompt's prefill through the
modules (where the kernel does not take the cache) and the steps after it through the kernel
fill one cache all the same. ``SPECSTORE_KERNEL_FORWARD=0``
keeps every forward on the modules (for comparisons).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import weakref

import torch

from specstore.runtime import gemm
from specstore.runtime.kv_cache import GrowingLayer
from specstore.runtime.linear import kernel_panel, stacked_panel, weight_state

MAX_ROWS = gemm.MAX_ROWS  # tokens of a forward it takes (a plain step, a tree and its padding); longer go to the modules
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its KernelForward (not on the model: copies and pickles stay plain)


def enabled() -> bool:
    """Whether the kernel forward may run at all here (``SPECSTORE_KERNEL_FORWARD``, the kernel built with it)."""
    if os.environ.get("SPECSTORE_KERNEL_FORWARD", "1") == "0":
        return False
    lib = gemm.library()
    return bool(lib is not None and getattr(lib, "decoder_f32", False))


def _named(obj, names: tuple[str, ...]) -> bool:
    return any(base.__name__ in names for base in type(obj).__mro__)


def reason(model) -> str | None:
    """Why ``KernelForward`` does not take ``model`` (None: it does)."""
    if not enabled():
        return "off (SPECSTORE_KERNEL_FORWARD=0, or the kernel did not build: gemm.unavailable_reason())"
    if not _named(model, ARCHITECTURES):
        return f"{type(model).__name__} is not one of {', '.join(ARCHITECTURES)}"
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or first.dtype != torch.float32:
        return "not a float32 model on the CPU"
    cfg = model.config
    if any(getattr(cfg, a, None) for a in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return "its logits are not the output head's product"
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "mlp_bias", False):
        return "its MLP is not a bias-free SiLU gate"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])) or (
            getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)):
        return "it has sliding-window layers"
    if float(getattr(cfg, "partial_rotary_factor", None) or 1.0) != 1.0:
        return "its rotary embedding covers part of each head"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "its base model is not laid out as Llama's"
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        return "its output head is not a linear layer"
    for layer in base.layers:
        if not _named(layer, _LAYERS):
            return f"layer {type(layer).__name__} is not a known decoder layer"
        attn = layer.self_attn
        if getattr(attn, "sliding_window", None) or getattr(attn, "attention_dropout", 0.0) and model.training:
            return "an attention layer slides or drops out"
        if attn.o_proj.bias is not None:
            return "its attention output projection has a bias"
        linears = [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(kernel_panel(m) is None for m in linears):
            return "its linears are not on the kernel's panels (linear.use_packed_linears)"
        if layer.mlp.gate_proj.out_features != base.layers[0].mlp.gate_proj.out_features or layer.mlp.down_proj.bias is not None:
            return "its MLPs differ between layers or have a bias"
    if kernel_panel(model.get_output_embeddings()) is None:
        return "its output head is not on the kernel's panels"
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads or cfg.num_attention_heads)
    dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if dim % 8 or dim > 256 or heads % kv_heads:
        return f"head dim {dim} (the kernel's attention takes multiples of 8 up to 256) or heads {heads} over {kv_heads}"
    for layer in base.layers:
        attn = layer.self_attn
        if (attn.q_proj.out_features != heads * dim or attn.k_proj.out_features != kv_heads * dim
                or attn.v_proj.out_features != kv_heads * dim or abs(float(attn.scaling) - dim ** -0.5) > 1e-12 * dim):
            return "its attention's shapes or scaling are not the config's"
    return None


def _pointers(tensors) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


class KernelForward:
    """The layer stack of one model as the kernel's call (module doc); ``KernelForward.of(model)``."""

    def __init__(self, model):
        why = reason(model)
        if why is not None:
            raise ValueError(f"the kernel forward does not take this model: {why}")
        cfg, base = model.config, model.model
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads or self.heads)
        self.dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.hidden = int(cfg.hidden_size)
        self.eps = float(base.layers[0].input_layernorm.variance_epsilon)
        self.scale = float(base.layers[0].self_attn.scaling)
        self.embed = base.get_input_embeddings().weight
        self.rotary = base.rotary_emb
        head = model.get_output_embeddings()
        self.vocab = head.out_features
        self.head_panel = kernel_panel(head)
        self.head_bias = None if head.bias is None else head.bias.detach().contiguous()
        self.final_norm = base.norm.weight.detach().contiguous()
        layers = base.layers
        self.inter = int(layers[0].mlp.gate_proj.out_features)
        # panels and biases kept here as well as through the pointer arrays (they must outlive the calls)
        self._keep: list[torch.Tensor] = []
        qkv, qkv_bias, gate_up, gate_up_bias, out, down, norm_in, norm_post = [], [], [], [], [], [], [], []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            panel, bias = stacked_panel([attn.q_proj, attn.k_proj, attn.v_proj])
            qkv.append(panel)
            qkv_bias.append(bias)
            panel, bias = stacked_panel([mlp.gate_proj, mlp.up_proj])
            gate_up.append(panel)
            gate_up_bias.append(bias)
            out.append(kernel_panel(attn.o_proj))
            down.append(kernel_panel(mlp.down_proj))
            norm_in.append(layer.input_layernorm.weight.detach().contiguous())
            norm_post.append(layer.post_attention_layernorm.weight.detach().contiguous())
        self.layers = len(layers)
        self._keep += qkv + gate_up + out + down + norm_in + norm_post + [b for b in qkv_bias + gate_up_bias if b is not None]
        self._qkv, self._out, self._gate_up, self._down = (_pointers(t) for t in (qkv, out, gate_up, down))
        self._qkv_bias = _pointers(qkv_bias) if any(b is not None for b in qkv_bias) else None
        self._gate_up_bias = _pointers(gate_up_bias) if any(b is not None for b in gate_up_bias) else None
        self._norm_in, self._norm_post = _pointers(norm_in), _pointers(norm_post)
        # what the panels were made from: a weight changed in place or replaced makes them stale
        self._sources = [m for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                                           layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                                                           layer.mlp.down_proj)] + [head]
        self._states = [weight_state(m) for m in self._sources]
        self._norms = [(w, w.data_ptr(), getattr(w, "_version", None)) for w in
                       [layer.input_layernorm.weight for layer in layers] + [layer.post_attention_layernorm.weight for layer in layers]
                       + [base.norm.weight]]

    @classmethod
    def of(cls, model) -> KernelForward | None:
        """``model``'s kernel forward (made on first use, kept while the model lives, made again where a
        weight changed since), or None where ``reason(model)`` says it does not take it."""
        held = _MADE.get(model)
        if held is not None and held.fresh():
            return held
        if reason(model) is not None:
            _MADE.pop(model, None)
            return None
        made = _MADE[model] = cls(model)
        return made

    def fresh(self) -> bool:
        """Whether every weight is as when the panels were made."""
        if not enabled() or any(weight_state(m) != s for m, s in zip(self._sources, self._states, strict=True)):
            return False
        return all(w.data_ptr() == p and getattr(w, "_version", None) == v for w, p, v in self._norms)

    @staticmethod
    def takes(cache, rows: int) -> bool:
        """Whether a forward of ``rows`` tokens on ``cache`` can run here: up to ``MAX_ROWS``, every
        layer a ``GrowingLayer`` owning its buffers (after a prefill, ``prefill`` or the modules')."""
        if rows < 1 or rows > MAX_ROWS:
            return False
        return all(type(layer) is GrowingLayer and layer.__dict__.get("_own") for layer in cache.layers)

    def start(self, cache, rows: int) -> bool:
        """Give an empty cache's layers buffers of room for ``rows`` that the kernel writes (a
        prompt's prefill in kernel calls, ``prefill``): True where every layer is a ``GrowingLayer``
        holding nothing yet and now owning them; False, with the cache untouched, otherwise."""
        layers = cache.layers
        if len(layers) != self.layers or any(type(layer) is not GrowingLayer or layer.get_seq_length() for layer in layers):
            return False
        empty = torch.empty((1, self.kv_heads, 0, self.dim), dtype=torch.float32)
        for layer in layers:
            layer.update(empty, empty)  # owned buffers of the layer's shape, nothing cached
            layer.reserve(rows)
        return True

    def prefill(self, tokens: list[int], cache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A prompt's forward on an empty cache in kernel calls of up to ``MAX_ROWS`` tokens each,
        of as equal sizes as that allows (causal within each, after every earlier row): the last
        token's logits [V] and last hidden state [H]; None, with the cache untouched, where the cache
        is not an empty one of ``GrowingLayer``s (the modules' way then)."""
        if not tokens or not self.start(cache, len(tokens)):
            return None
        logits = hidden = None
        calls = -(-len(tokens) // MAX_ROWS)  # of as equal sizes as that allows: 73 tokens as 37 + 36, not 72 + 1
        bounds = [len(tokens) * i // calls for i in range(calls + 1)]
        for at, end in itertools.pairwise(bounds):
            chunk = tokens[at:end]
            rows = len(chunk)
            positions = torch.arange(at, at + rows, dtype=torch.long).unsqueeze(0)
            mask = torch.zeros((1, 1, rows, at + rows), dtype=torch.float32)
            mask[0, 0, :, at:].masked_fill_(torch.ones(rows, rows, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
            logits, hidden = self(chunk, cache, positions, mask, last=1)
        return logits[0], hidden[-1]

    def __call__(self, tokens: list[int], cache, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [rows, V] and last hidden states [rows, H] of ``tokens`` after ``cache``'s rows,
        which grows by them (``takes`` must hold). ``positions`` [1, rows] and ``mask`` [1, 1, rows,
        cached + rows] (additive, float32) as verify.tree_attention_inputs gives them; None for a
        plain step's one token (the next position, every key). ``last``: logits of the last
        ``last`` rows only (a prompt's prefill needs its last token's), [last, V]."""
        rows = len(tokens)
        layers = cache.layers
        cached = layers[0].__dict__["_length"]
        keys, values = [], []
        for layer in layers:  # one pass a step: room for the rows, and the buffers the kernel writes
            if layer.__dict__["_length"] != cached or not layer.reserve(rows):
                raise ValueError("the cache's layers do not hold the same rows")
            keys.append(layer._key_buffer)
            values.append(layer._value_buffer)
        stride = keys[0].stride(1)
        if any(b.stride(1) != stride or not b.is_contiguous() for b in keys + values):
            raise ValueError("the cache's layers have buffers of different capacities")
        ids = torch.tensor(tokens, dtype=torch.long)
        x = self.embed.index_select(0, ids)
        if positions is None:
            if rows != 1 or mask is not None:
                raise ValueError("several tokens need their positions and mask")
            positions = torch.tensor([[cached]], dtype=torch.long)
        cos, sin = self.rotary(x.unsqueeze(0), positions)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        if cos.dtype != torch.float32 or cos.shape != (rows, self.dim):
            raise ValueError(f"rotary tables of {tuple(cos.shape)} {cos.dtype}, not ({rows}, {self.dim}) float32")
        m_ptr, m_stride = None, 0
        if mask is not None:
            if mask.dtype != torch.float32 or tuple(mask.shape[-2:]) != (rows, cached + rows) or mask.stride(-1) != 1:
                raise ValueError("the mask is not [.., rows, cached + rows] float32 with contiguous rows")
            m_ptr, m_stride = mask.data_ptr(), mask.stride(-2)
        hidden = torch.empty((rows, self.hidden), dtype=torch.float32)
        code = gemm.library().specstore_decoder_f32(
            self.layers, rows, self.hidden, self.heads, self.kv_heads, self.dim, self.inter, self.eps, self.scale,
            x.data_ptr(), self._norm_in, self._norm_post, self._qkv, self._qkv_bias, self._out, None, self._gate_up,
            self._gate_up_bias, self._down, None, _pointers(keys), _pointers(values), stride, cached,
            cos.data_ptr(), sin.data_ptr(), m_ptr, m_stride, self.final_norm.data_ptr(), hidden.data_ptr(),
            torch.get_num_threads())
        if code == -2:
            raise MemoryError("small_gemm: no memory for the decoder's scratch")
        if code != 0:
            raise ValueError(f"small_gemm: the decoder refused its shapes ({code})")
        for layer in layers:
            layer.advance(rows)
        logits = gemm.linear(hidden if last is None else hidden[rows - last:], self.head_panel, self.head_bias, self.vocab)
        return logits, hidden
