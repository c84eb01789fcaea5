"""A KV cache that grows in place instead of being copied whole on every forward.

transformers' ``DynamicLayer`` appends a forward's keys and values with ``torch.cat``: every
decoding step (one token, or a draft tree) copies the layer's whole cache into a new tensor, 30
layers x 2 on the default model, and the fresh allocation of a large tensor page-faults in as
well: a cost that plain decoding pays per token and a drafting method per step. On this
project's 2-core CPU, float32, whole steps side by side (``benchmarks/kv_cache_ab.py``,
BENCHMARKS.md, thirteenth session) gained about 5% at 1,000-2,000 cached tokens and 0-2% at 300.

Owns ``GrowingLayer``, a ``DynamicLayer`` whose keys and values live in a buffer with spare
capacity (doubled when full, so a request of n tokens copies O(n) in all): ``update`` writes the
new rows after the cached ones and returns views of the filled part; ``crop`` (what the verifier
does after each tree) shortens the views only. The values, and so every product and logit, are
the ones ``torch.cat`` would give; only the copies go. Where something replaces a layer's tensors
(``batch_repeat_interleave`` and ``batch_select_indices``, a deep copy), the next ``update`` finds
that its views no longer sit at the start of its buffer and starts a new buffer from them.

``growing_cache(config)`` is a ``DynamicCache`` for ``config`` with each plain ``DynamicLayer``
(not sliding-window or other kinds, which keep their own rules) swapped for a ``GrowingLayer``.
``SPECSTORE_GROWING_CACHE=0`` keeps transformers' layers (for comparisons).
"""

from __future__ import annotations

import os

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256  # rows a buffer holds at least


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with in-place appends (module doc)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def _fits(self, states: tuple[torch.Tensor, torch.Tensor], old: int, new: int) -> bool:
        """Whether the buffers take ``new`` rows of ``states``' kind, the ``old`` cached ones
        being their leading rows (not tensors something else put in place of the views)."""
        for view, buf, state in ((self.keys, self._key_buffer, states[0]), (self.values, self._value_buffer, states[1])):
            if (buf is None or new > buf.shape[-2] or buf.shape[:-2] != state.shape[:-2] or buf.shape[-1] != state.shape[-1]
                    or buf.dtype != state.dtype or buf.device != state.device):
                return False
            if old and (view.data_ptr() != buf.data_ptr() or view.stride() != buf.stride() or view.shape[:-2] != buf.shape[:-2]):
                return False
        return True

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, old: int, needed: int) -> None:
        capacity = max(2 * needed, MIN_CAPACITY)
        keys = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if old:
            keys[..., :old, :] = self.keys
            values[..., :old, :] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.get_seq_length()
        new = old + key_states.shape[-2]
        if not self._fits((key_states, value_states), old, new):
            self._grow(key_states, value_states, old, new)
        self._key_buffer[..., old:new, :] = key_states
        self._value_buffer[..., old:new, :] = value_states
        self.keys = self._key_buffer[..., :new, :]
        self.values = self._value_buffer[..., :new, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


def growing_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose plain layers grow in place (module doc)."""
    cache = DynamicCache(config=config)
    if os.environ.get("SPECSTORE_GROWING_CACHE", "1") == "0":
        return cache
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = GrowingLayer()
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
    return cache
