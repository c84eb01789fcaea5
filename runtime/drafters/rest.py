"""REST drafter: retrieval by exact suffix match in a datastore's suffix array.

Owns the REST algorithm over retrieval.py's suffix-array source: the longest suffix of the
context (pending token included, spans from ``max_span`` down to ``min_span``) that occurs in
the datastore, what follows a capped, evenly spread sample of its occurrences; every
continuation prefix is counted and the most frequent prefixes become one token tree of at most
``max_nodes`` nodes. Deterministic. Per node it records the cost-aware signal (share of the
occurrences that agree, and their number: ``add_signals``). Works on a plain or a sharded
suffix index alike. Given the engine's served overlay (overlay.py), it searches the datastore
and the overlay together (retrieval.py's ``pooled_sample``) and marks the nodes the overlay
drafted (``node_data["overlay"]``, tallied in ``overlay_use``). Does not own the search
(suffix_array.py, sharded_suffix.py, overlay.py) or verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.overlay import OverlayUse, overlay_flags
from specstore.runtime.retrieval import SuffixSearch, pooled_sample, suffix_sample
from specstore.runtime.suffix_array import SEPARATOR
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import VerifyResult


@dataclass(frozen=True, slots=True)
class RestConfig:
    max_nodes: int = 64  # draft tree size cap (a 64-token verify costs ~2.4x a 1-token step on CPU)
    max_span: int = 16  # longest context suffix tried
    min_span: int = 2  # shortest context suffix accepted as a match
    draft_length: int = 10  # deepest draft (tokens after the pending one)
    max_matches: int = 1000  # occurrences read per step, spread evenly over all of them
    min_count: int = 1  # a prefix must follow at least this many occurrences to be drafted


def prefix_tree(continuations: np.ndarray, max_nodes: int, min_count: int = 1) -> DraftTree:
    """The ``max_nodes`` most frequent prefixes of the rows of ``continuations`` (int [M, D],
    SEPARATOR-padded) as a trie. Ties go to the shorter prefix, then the lexicographically
    smaller, so the kept set is closed under prefixes (a prefix is at least as frequent as any
    of its extensions) and the result does not depend on row order.
    ``node_data['counts']``: occurrences per node."""
    rows = np.asarray(continuations)
    if rows.size == 0 or max_nodes <= 0:
        return _empty()
    rows = rows[_lexicographic_order(rows)]  # equal prefixes become runs
    num, depth = rows.shape
    # brk[r, d]: row r starts a new run of equal depth-(d+1) prefixes (a fixed number of array
    # operations for the whole trie, not a loop of them per depth: this runs every decode step)
    brk = np.empty((num, depth), dtype=bool)
    brk[0] = True
    np.not_equal(rows[1:], rows[:-1], out=brk[1:])
    np.logical_or.accumulate(brk, axis=1, out=brk)
    level, start = np.nonzero(brk.T)  # every run, depth-major, in sorted order within a depth
    same_level_next = np.append(level[1:] == level[:-1], False)
    count = np.where(same_level_next, np.append(start[1:], num), num) - start
    token = rows[start, level]
    # a row's first separator ends its prefixes: a prefix is at least as frequent as its
    # extensions and a separator ends every extension, so the kept set is closed under prefixes
    is_sep = rows == SEPARATOR
    first_sep = np.where(is_sep.any(axis=1), is_sep.argmax(axis=1), depth)
    keep = (level < first_sep[start]) & (count >= min_count)
    if not keep.any():
        return _empty()
    kept = np.flatnonzero(keep)
    # most frequent first; ties to the shorter prefix, then the lexicographically smaller (run order)
    order = kept[np.argsort(-count[kept], kind="stable")][:max_nodes]
    chosen = np.sort(order)  # depth-major: parents before children
    # a run's parent is the run one depth up that holds its first row: the last run of that
    # depth starting at or before it, found by one search over (depth, start) keys
    key = level * num + start
    lv = level[chosen]
    parent = np.searchsorted(key, key[chosen] - num, side="right") - 1  # index among all runs
    parents = np.where(lv > 0, np.searchsorted(chosen, np.maximum(parent, 0)), -1)
    return DraftTree(token[chosen].astype(np.int64), parents.astype(np.int64),
                     node_data={"counts": count[chosen].astype(np.int64)})


def _lexicographic_order(rows: np.ndarray) -> np.ndarray:
    """The order that sorts ``rows`` lexicographically. Ids from -1 (SEPARATOR) to 65534 become
    big-endian 16-bit codes, so each row is one byte string and the sort compares strings
    (~5x a column-wise sort); larger ids fall back to sorting over all columns."""
    if rows.min() >= -1 and rows.max() < 0xFFFF:
        codes = np.ascontiguousarray((rows + 1).astype(">u2"))
        return np.argsort(codes.view(f"S{2 * rows.shape[1]}").ravel(), kind="stable")
    return np.lexsort(rows.T[::-1])


SHARE_EDGES = (0.2, 0.4, 0.6, 0.8, 0.99)  # share of the parent's occurrences that agree
SUPPORT_EDGES = (2, 4, 16)  # occurrences behind the node


def add_signals(tree: DraftTree, num_rows: int) -> None:
    """The cost-aware signal (drafters/cost_aware.py): ``bucket`` from the share of the parent's
    occurrences that continue with this node's token and from their number; ``prior`` the share."""
    from specstore.runtime.drafters.cost_aware import bucketize

    counts = tree.node_data["counts"].astype(float)
    parent_counts = np.where(tree.parents < 0, float(max(num_rows, 1)), counts[np.maximum(tree.parents, 0)])
    share = np.clip(counts / np.maximum(parent_counts, 1.0), 0.0, 1.0)
    tree.node_data["bucket"] = bucketize(share, SHARE_EDGES) * (len(SUPPORT_EDGES) + 1) + bucketize(counts, SUPPORT_EDGES)
    tree.node_data["prior"] = share


def _empty() -> DraftTree:
    tree = DraftTree.empty()
    tree.node_data["counts"] = np.zeros(0, dtype=np.int64)
    return tree


class RestDrafter:
    """REST over one datastore's suffix array. ``propose`` matches ``state.tokens`` (context and
    pending token); the tree's tokens follow the pending token."""

    name = "rest"
    lossless = True

    def __init__(self, index: SuffixSearch, config: RestConfig | None = None, overlay: SuffixSearch | None = None):
        self.index = index
        self.config = config or RestConfig()
        self.overlay = overlay  # the engine's served overlay, searched with the datastore
        self.overlay_use = OverlayUse()
        self.last_match_len = 0  # for stats and debugging: span of the last match (0 = none)

    @classmethod
    def from_datastore(cls, datastore, overlay: SuffixSearch | None = None, **options) -> RestDrafter:
        return cls(datastore.suffix, RestConfig(**options), overlay)

    def reset(self, prompt_ids: list[int]) -> None:
        self.last_match_len = 0
        self.overlay_use = OverlayUse()

    def overlay_stats(self) -> dict | None:
        """This request's overlay tally (None without an overlay)."""
        return self.overlay_use.to_dict() if self.overlay is not None else None

    def propose(self, state: DecodeState) -> DraftTree:
        cfg = self.config
        length = min(cfg.draft_length, state.budget)
        self.last_match_len = 0
        if length <= 0 or cfg.max_nodes <= 0:
            return DraftTree.empty()
        search = dict(max_span=cfg.max_span, min_span=cfg.min_span, max_matches=cfg.max_matches)
        sample = suffix_sample(self.index, state.tokens, length, **search)
        served = None
        if self.overlay is not None:
            sample, served = pooled_sample(sample, suffix_sample(self.overlay, state.tokens, length, **search))
        if sample is None:
            return DraftTree.empty()
        self.last_match_len = sample.match_length
        tree = prefix_tree(sample.rows, cfg.max_nodes, cfg.min_count)
        tree.meta["match_len"] = sample.match_length
        tree.meta["num_matches"] = sample.num_matches
        add_signals(tree, len(sample.rows))
        if served is not None:
            tree.node_data["overlay"] = overlay_flags(tree.tokens, tree.parents, served)
        return tree

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        """REST keeps no feedback; with an overlay, it counts the overlay's accepted nodes."""
        self.overlay_use.record(tree.node_data.get("overlay"), result.accepted_nodes)


def create(datastore=None, overlay=None, **options) -> RestDrafter:
    """Registry factory: ``options`` are RestConfig fields (max_nodes, max_span, ...);
    ``overlay``: a served overlay searched with the datastore."""
    if datastore is None:
        raise SpecstoreError("method 'rest' needs a datastore (--datastore NAME[@VERSION|@TAG])")
    return RestDrafter.from_datastore(datastore, overlay, **options)
