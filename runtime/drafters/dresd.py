"""DReSD drafter: retrieval by dense nearest neighbours of the target's own hidden state.

Owns the DReSD algorithm: the query is ``state.last_hidden`` (the target's last hidden layer at
the last token it processed, ``tokens[-2]``) through the datastore's own normaliser; the ``k``
nearest datastore positions whose stored next token equals the pending token ``tokens[-1]`` (the
paper drops neighbours whose first token disagrees with the model's choice); their remaining
continuations, best neighbour first, merged into one trie capped at ``max_nodes``. Does not own
the search (dense.py) or the normaliser (normaliser.py): query and datastore rows go through the
same transform, which is what makes the vectors comparable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specstore.runtime.dense import DenseIndex
from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.normaliser import Normaliser
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import VerifyResult
from specstore.schemas.tables import PAD_TOKEN


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
        if len(index) != len(continuations):
            raise ValueError(f"index has {len(index)} rows but continuations {len(continuations)}")
        self.normaliser = normaliser
        self.index = index
        self.continuations = continuations
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
        length = min(cfg.draft_length, state.budget, self.continuations.shape[1] - 1)
        self.last_num_neighbours = 0
        if state.last_hidden is None or length <= 0 or cfg.k <= 0 or cfg.max_nodes <= 0 or not state.tokens:
            return DraftTree.empty()
        pending = int(state.tokens[-1])
        if self.index.block_size(pending) == 0:
            return DraftTree.empty()
        query = self.normaliser.apply_torch(state.last_hidden.reshape(-1))
        found = self.index.search(query, cfg.k, next_token=pending)
        self.last_num_neighbours = len(found)
        rows = self.continuations[found.rows, 1 : 1 + length]
        paths = [row[: _real_len(row)] for row in rows]
        tree = DraftTree.from_paths((p for p in paths if len(p)), max_nodes=cfg.max_nodes)
        tree.meta["num_neighbours"] = len(found)
        return tree

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        """DReSD keeps no feedback."""


def _real_len(row: np.ndarray) -> int:
    pad = np.flatnonzero(row == PAD_TOKEN)
    return int(pad[0]) if pad.size else int(row.shape[0])


def create(datastore=None, **options) -> DresdDrafter:
    """Registry factory: ``options`` are DresdConfig fields (k, max_nodes, draft_length)."""
    if datastore is None:
        raise SpecstoreError("method 'dresd' needs a datastore (--datastore NAME[@VERSION|@TAG])")
    return DresdDrafter.from_datastore(datastore, **options)
