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
does after each tree) sets the filled length only. The values, and so every product and logit,
are the ones ``torch.cat`` would give; only the copies go. Where something replaces a layer's
tensors (``batch_repeat_interleave`` and ``batch_select_indices``, as on the verifier's batch
fallback's deep copy), the next ``update`` starts a new buffer from what it holds then.

``compact(cache, start, rows, length)`` is the verifier's step end on such a cache: the accepted
rows move up in every layer's buffers in one kernel call (gemm.move_rows) and the layers' lengths
are set, instead of two torch ops per layer and tensor for the move and a slice of each for the
cut.

``growing_cache(config)`` is a ``DynamicCache`` for ``config`` with each plain ``DynamicLayer``
(not sliding-window or other kinds, which keep their own rules) swapped for a ``GrowingLayer``.
``SPECSTORE_GROWING_CACHE=0`` keeps transformers' layers (for comparisons).
"""

from __future__ import annotations

import os

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specstore.runtime import gemm

MIN_CAPACITY = 256  # rows a buffer holds at least


def _view(buffer: str, held: str) -> property:
    """A ``GrowingLayer``'s ``keys`` or ``values``: a view of ``buffer``'s first ``_length`` rows,
    made when read, while the layer owns its buffers; else the tensor kept in ``held``."""

    def get(self) -> torch.Tensor | None:
        d = self.__dict__
        return d[buffer].narrow(-2, 0, d["_length"]) if d.get("_own") else d.get(held)

    def put(self, value: torch.Tensor | None) -> None:
        self._disown()
        self.__dict__[held] = value

    return property(get, put)


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with in-place appends (module doc). While the layer owns its buffers,
    ``keys`` and ``values`` are views of their first ``_length`` rows, made when read, so a crop
    or a compaction changes one number instead of slicing 2 tensors per layer; a tensor that
    something else assigns (transformers' batch and beam operations) is kept as given until the
    next ``update`` copies it in. A deep copy copies the buffers and owns them."""

    keys = _view("_key_buffer", "_keys")
    values = _view("_value_buffer", "_values")

    def _disown(self) -> None:
        """Hand both views out as tensors before one of them is replaced from outside."""
        d = self.__dict__
        if d.get("_own"):
            d["_keys"], d["_values"] = self.keys, self.values
            d["_own"] = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def _fits(self, states: tuple[torch.Tensor, torch.Tensor], old: int, new: int) -> bool:
        """Whether the buffers take ``new`` rows of ``states``' kind, the ``old`` cached ones
        being their leading rows (not tensors something else put in place of the views)."""
        own = self.__dict__.get("_own")  # owned views sit at their buffers' start by construction
        for name, buf, state in (("keys", self._key_buffer, states[0]), ("values", self._value_buffer, states[1])):
            if (buf is None or new > buf.shape[-2] or buf.shape[:-2] != state.shape[:-2] or buf.shape[-1] != state.shape[-1]
                    or buf.dtype != state.dtype or buf.device != state.device):
                return False
            if old and not own:
                view = getattr(self, name)
                if view.data_ptr() != buf.data_ptr() or view.stride() != buf.stride() or view.shape[:-2] != buf.shape[:-2]:
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
        d = self.__dict__
        d["_length"], d["_own"], d["_keys"], d["_values"] = new, True, None, None
        return self.keys, self.values

    def reserve(self, rows: int) -> bool:
        """Make room for ``rows`` more rows after the cached ones, written by someone else (the
        kernel forward, kernel_forward.py) before ``advance``; True where the layer owns its
        buffers and they now hold them (False: nothing done, ``update`` is the way in)."""
        d = self.__dict__
        if not d.get("_own"):
            return False
        old = d["_length"]
        if old + rows > self._key_buffer.shape[-2]:
            self._grow(self._key_buffer, self._value_buffer, old, old + rows)  # the filled rows go along
        return True

    def advance(self, rows: int) -> None:
        """Count ``rows`` rows written after the cached ones into the reserved room as cached."""
        self.__dict__["_length"] += rows

    def get_seq_length(self) -> int:
        d = self.__dict__
        return d["_length"] if d.get("_own") else super().get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        d = self.__dict__
        if d.get("_own") and tokens_to_remove < 0:  # the views shorten: one number
            d["_length"] = max(d["_length"] + tokens_to_remove, 0)
            return
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        self.__dict__["_own"] = False  # the views go with the buffers
        self._key_buffer = self._value_buffer = None
        super().reset()


def compact(cache: DynamicCache, start: int, rows: list[int], length: int) -> bool:
    """Move cached rows ``start + rows[i]`` to ``start + i`` in every layer (``rows``: an
    accepted path's node rows, increasing) and keep the first ``length`` rows. True when done
    here; False, with the cache untouched, where a layer is not a ``GrowingLayer`` owning its
    buffers or the kernel cannot move the rows (the caller does it with torch)."""
    layers, buffers = [], []
    for layer in cache.layers:
        d = layer.__dict__
        if type(layer) is not GrowingLayer or not d.get("_own") or length > d["_length"]:
            return False
        layers.append(d)
        buffers += (d["_key_buffer"], d["_value_buffer"])
    if rows != list(range(len(rows))) and not gemm.move_rows(buffers, start, rows):
        return False
    for d in layers:
        d["_length"] = length
    return True


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
