"""DReSD drafter: retrieval by dense nearest neighbours of the target's own hidden state.

Owns the DReSD algorithm over retrieval.py's dense source: the query is ``state.last_hidden``
(the target's last hidden layer at the last token it processed, ``tokens[-2]``) through the
datastore's own normaliser; the ``k`` nearest datastore positions whose stored next token equals
the pending token ``tokens[-1]`` (the paper drops neighbours whose first token disagrees with the
model's choice); their remaining continuations, best neighbour first, merged into one trie
capped at ``max_nodes``; per node the cost-aware signal (neighbour agreement). Does not own the search (dense.py) or the normaliser (normaliser.py).
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


SHARE_EDGES = (0.2, 0.4, 0.6, 0.8, 0.99)  # share of the drafts through a node
RANK_EDGES = (1, 3)  # rank of the nearest neighbour whose draft passes through it


def add_signals(tree: DraftTree) -> None:
    """The cost-aware signal (drafters/cost_aware.py) from neighbour agreement: ``bucket`` from
    the share of the drafts (neighbours) passing through a node and the best rank among them;
    ``prior`` that share."""
    from specstore.runtime.drafters.cost_aware import bucketize

    n = len(tree)
    through, best = np.zeros(n), np.full(n, np.inf)
    for rank, path in enumerate(tree.paths):
        for node in path:
            through[node] += 1
            best[node] = min(best[node], rank)
    share = through / max(len(tree.paths), 1)
    best = np.where(np.isfinite(best), best, len(tree.paths))
    tree.node_data["bucket"] = bucketize(share, SHARE_EDGES) * (len(RANK_EDGES) + 1) + bucketize(best, RANK_EDGES)
    tree.node_data["prior"] = share


class DresdDrafter:
    """DReSD over one datastore: ``normaliser`` and ``index`` must come from the same version;
    ``continuations``: what the index's row ids index (retrieval.DenseSource: int [N, L] rows of
    an old-form version, or a compact version's stream continuations)."""

    name = "dresd"
    lossless = True

    def __init__(self, normaliser: Normaliser, index: DenseIndex, continuations, config: DresdConfig | None = None,
                 max_length: int | None = None):
        self.source = DenseSource(normaliser, index, continuations, max_length)
        self.config = config or DresdConfig()
        self.last_num_neighbours = 0

    @classmethod
    def from_datastore(cls, datastore, **options) -> DresdDrafter:
        index = datastore.load_dense()
        return cls(datastore.normaliser, index, datastore.continuations, DresdConfig(**options),
                   datastore.manifest.continuation_length - 1)

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
        add_signals(tree)
        return tree

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        """DReSD keeps no feedback."""


def create(datastore=None, **options) -> DresdDrafter:
    """Registry factory: ``options`` are DresdConfig fields (k, max_nodes, draft_length)."""
    if datastore is None:
        raise SpecstoreError("method 'dresd' needs a datastore (--datastore NAME[@VERSION|@TAG])")
    return DresdDrafter.from_datastore(datastore, **options)
