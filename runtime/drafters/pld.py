"""Prompt lookup decoding: draft by matching the context's own last tokens earlier in it.

A thin drafter over retrieval.py's context source: the longest suffix n-gram (``max_ngram``
down to ``min_ngram`` tokens) found earlier in the context; the most recent occurrence with a
full continuation wins (else the earliest, whose continuation is the longest: in a repetitive
stream the most recent occurrence is the previous token and would draft only one), and the
tokens that followed it (at most ``num_draft_tokens``, and never more than the decode budget)
become one chain. Deterministic, model-free, no state between steps. Each node's cost-aware
signal (``node_data["bucket"]``) is the matched n-gram's length.
"""

from __future__ import annotations

import numpy as np

from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.retrieval import context_matches
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import VerifyResult


def lookup(tokens: np.ndarray, max_ngram: int, min_ngram: int, num_draft_tokens: int) -> list[int]:
    """Continuation of the most recent earlier match (with a full continuation) of the longest
    matching suffix n-gram."""
    return lookup_match(tokens, max_ngram, min_ngram, num_draft_tokens)[1]


def lookup_match(tokens: np.ndarray, max_ngram: int, min_ngram: int, num_draft_tokens: int) -> tuple[int, list[int]]:
    """``lookup`` and the matched n-gram's length (0 when nothing matched)."""
    n, starts = context_matches(tokens, max_ngram, min_ngram)
    if not len(starts):
        return 0, []
    full = starts[starts + num_draft_tokens <= len(tokens)]
    start = int(full[-1] if len(full) else starts[0])
    return n, tokens[start : start + num_draft_tokens].tolist()


def match_tree(match_len: int, draft: list[int]) -> DraftTree:
    """A chain with the cost-aware signal (drafters/cost_aware.py): bucket = matched n-gram length."""
    tree = DraftTree.chain(draft)
    tree.node_data["bucket"] = np.full(len(tree), min(match_len, 8), dtype=np.int64)
    return tree


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
        return match_tree(*lookup_match(tokens, self.max_ngram, self.min_ngram, limit))

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        pass


def create(datastore=None, **options) -> PromptLookupDrafter:
    return PromptLookupDrafter(**options)
