"""Prompt lookup decoding: draft by matching the context's own last tokens earlier in it.

Tries the last ``max_ngram`` tokens first, then shorter n-grams down to ``min_ngram``; the most
recent earlier occurrence with a full continuation wins and the tokens that followed it (at most ``num_draft_tokens``,
and never more than the decode budget) become one chain. Deterministic, model-free, no state
between steps.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import VerifyResult


def lookup(tokens: np.ndarray, max_ngram: int, min_ngram: int, num_draft_tokens: int) -> list[int]:
    """Continuation of the most recent earlier match of the longest matching suffix n-gram."""
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        # windows starting at 0..size-n-1: each has at least one following token, and the
        # suffix itself (starting at size-n) is excluded
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
        if len(hits):
            # the most recent match that still has a full continuation, else the earliest
            # (longest continuation): in a repetitive stream the most recent match is the
            # previous token and would draft only one token
            full = hits[hits + n + num_draft_tokens <= size]
            start = int(full[-1] if len(full) else hits[0]) + n
            return tokens[start : start + num_draft_tokens].tolist()
    return []


class PromptLookupDrafter:
    name = "pld"
    lossless = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_draft_tokens: int = 10):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.max_ngram, self.min_ngram, self.num_draft_tokens = max_ngram, min_ngram, num_draft_tokens

    def reset(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, state: DecodeState) -> DraftTree:
        limit = min(self.num_draft_tokens, state.budget)
        if limit <= 0:
            return DraftTree.empty()
        tokens = np.asarray(state.tokens, dtype=np.int64)
        return DraftTree.chain(lookup(tokens, self.max_ngram, self.min_ngram, limit))

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        pass


def create(datastore=None, **options) -> PromptLookupDrafter:
    return PromptLookupDrafter(**options)
