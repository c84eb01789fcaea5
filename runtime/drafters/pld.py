"""Prompt lookup decoding: draft by matching the context's own last tokens earlier in it.

A thin drafter over retrieval.py's context source: the longest suffix n-gram (``max_ngram``
down to ``min_ngram`` tokens) found earlier in the context; the most recent occurrence with a
full continuation wins (else the earliest, whose continuation is the longest: in a repetitive
stream the most recent occurrence is the previous token and would draft only one), and the
tokens that followed it (at most ``num_draft_tokens``, and never more than the decode budget)
become one chain. Deterministic, model-free, no state between steps. Each node's cost-aware
signal (``node_data["bucket"]``) is the matched n-gram's length.

Given the engine's served overlay (overlay.py), a context suffix found there longer than the
context's own match (up to ``overlay_max_span`` tokens) drafts instead, by the same rule: the
most recent of its occurrences (among the last ``overlay_max_matches``) with a full
continuation, else the one with the longest; its nodes are marked ``node_data["overlay"]`` and
tallied in ``overlay_use``.
"""

from __future__ import annotations

import numpy as np

from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.overlay import OverlayUse
from specstore.runtime.retrieval import SuffixSearch, context_matches
from specstore.runtime.suffix_array import SEPARATOR
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

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_draft_tokens: int = 10,
                 overlay: SuffixSearch | None = None, overlay_max_span: int = 16, overlay_max_matches: int = 64):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.max_ngram, self.min_ngram, self.num_draft_tokens = max_ngram, min_ngram, num_draft_tokens
        self.overlay, self.overlay_max_span, self.overlay_max_matches = overlay, overlay_max_span, overlay_max_matches
        self.overlay_use = OverlayUse()

    def reset(self, prompt_ids: list[int]) -> None:
        self.overlay_use = OverlayUse()

    def overlay_stats(self) -> dict | None:
        """This request's overlay tally (None without an overlay)."""
        return self.overlay_use.to_dict() if self.overlay is not None else None

    def propose(self, state: DecodeState) -> DraftTree:
        limit = min(self.num_draft_tokens, state.budget)
        if limit <= 0:
            return DraftTree.empty()
        tokens = np.asarray(state.tokens, dtype=np.int64)
        n, draft = lookup_match(tokens, self.max_ngram, self.min_ngram, limit)
        if self.overlay is not None and n < self.overlay_max_span:
            span, served = self._served(state.tokens, n + 1, limit)
            if served:
                tree = match_tree(span, served)
                tree.node_data["overlay"] = np.ones(len(tree), dtype=bool)
                return tree
        return match_tree(n, draft)

    def _served(self, tokens: list[int], min_span: int, limit: int) -> tuple[int, list[int]]:
        """``(match length, draft)`` from the overlay; ``(0, [])`` when it holds no longer match."""
        match = self.overlay.longest_suffix_match(tokens, self.overlay_max_span, min_span)
        if match is None:
            return 0, []
        rows, offsets = self.overlay.continuations(match, limit, self.overlay_max_matches, return_offsets=True)
        lengths = (rows != SEPARATOR).sum(axis=1)  # rows end at their first separator
        full = np.flatnonzero(lengths == limit)
        pick = int(full[np.argmax(offsets[full])]) if full.size else int(np.lexsort((offsets, -lengths))[0])
        return match.length, rows[pick, : lengths[pick]].tolist()

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        self.overlay_use.record(tree.node_data.get("overlay"), result.accepted_nodes)


def create(datastore=None, **options) -> PromptLookupDrafter:
    return PromptLookupDrafter(**options)
