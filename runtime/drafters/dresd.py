"""DReSD drafter: retrieval by dense nearest neighbours of the target's own hidden state.

Owns the DReSD algorithm over retrieval.py's dense source: the query is ``state.last_hidden``
(the target's last hidden layer at the last token it processed, ``tokens[-2]``) through the
datastore's own normaliser; the ``k`` nearest datastore positions whose stored next token equals
the pending token ``tokens[-1]`` (the paper drops neighbours whose first token disagrees with the
model's choice); their remaining continuations, best neighbour first, merged into one trie
capped at ``max_nodes``. Does not own the search (dense.py) or the normaliser (normaliser.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specstore.runtime.dense import DenseIndex
from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.normaliser import Normaliser
from specstore.runtime.retrieval import DenseSource
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import VerifyResult


@dataclass(frozen=True, slots=True)
class DresdConfig:
    k: int = 10  # neighbours per step (after the next-token filter)
    max_nodes: int = 64  # trie size cap
    draft_length: int = 9  # tokens drafted per neighbour after the pending one (continuation L - 1)


class DresdDrafter:
    """DReSD over one datastore: ``normaliser`` and ``index`` must come from the same version;
    ``continuations``: int [N, L] rows aligned with the index (``continuations[:, 0]`` is each
    position's stored next token, the filter key)."""

    name = "dresd"
    lossless = True

    def __init__(self, normaliser: Normaliser, index: DenseIndex, continuations: np.ndarray, config: DresdConfig | None = None):
        self.source = DenseSource(normaliser, index, continuations)
        self.config = config or DresdConfig()
        self.last_num_neighbours = 0

    @classmethod
    def from_datastore(cls, datastore, **options) -> DresdDrafter:
        index = datastore.load_dense()
        return cls(datastore.normaliser, index, datastore.continuations, DresdConfig(**options))

    def reset(self, prompt_ids: list[int]) -> None:
        self.last_num_neighbours = 0

    def propose(self, state: DecodeState) -> DraftTree:
        cfg = self.config
        length = min(cfg.draft_length, state.budget, self.source.max_length)
        self.last_num_neighbours = 0
        if state.last_hidden is None or length <= 0 or cfg.max_nodes <= 0 or not state.tokens:
            return DraftTree.empty()
        found = self.source.search(state.last_hidden, int(state.tokens[-1]), cfg.k)
        self.last_num_neighbours = len(found)
        drafts = self.source.drafts(found, length)
        tree = DraftTree.from_paths((d.tokens for d in drafts), max_nodes=cfg.max_nodes)
        tree.meta["num_neighbours"] = len(found)
        return tree

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        """DReSD keeps no feedback."""


def create(datastore=None, **options) -> DresdDrafter:
    """Registry factory: ``options`` are DresdConfig fields (k, max_nodes, draft_length)."""
    if datastore is None:
        raise SpecstoreError("method 'dresd' needs a datastore (--datastore NAME[@VERSION|@TAG])")
    return DresdDrafter.from_datastore(datastore, **options)
