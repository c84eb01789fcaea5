"""DraftTree: the one encoding every drafter hands the verifier.

A tree of draft tokens that follow the *pending* token (the last committed token, whose
logits the target has not computed yet; it is the implicit root). ``parents[i]`` is the index
of node i's parent, ``-1`` for a child of the root, and always ``< i`` (topological order).
A linear draft is a chain; several drafts are merged into a trie with the shared root.
Drafters never build attention masks or position ids: the verifier derives them from this.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class DraftTree:
    tokens: np.ndarray  # int64 [n]
    parents: np.ndarray  # int64 [n], -1 = child of the root
    # free-form per-node bookkeeping a drafter may attach (e.g. which candidate made a node);
    # the verifier ignores it and hands it back through observe()
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        self.parents = np.asarray(self.parents, dtype=np.int64).reshape(-1)
        if self.tokens.shape != self.parents.shape:
            raise ValueError("tokens and parents must have the same length")
        if len(self.parents) and np.any(self.parents >= np.arange(len(self.parents))):
            raise ValueError("every parent index must be smaller than its node's index")
        if len(self.parents) and np.any(self.parents < -1):
            raise ValueError("parent indices must be >= -1")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def empty(cls) -> DraftTree:
        return cls(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        n = len(tokens)
        return cls(np.asarray(tokens, dtype=np.int64), np.arange(n, dtype=np.int64) - 1)

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]], max_nodes: int | None = None) -> DraftTree:
        """Merge drafts into a trie (shared prefixes once), in the order given; stop adding nodes
        at ``max_nodes``. ``meta['path_nodes'][k]`` lists the node indices of path k."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}
        path_nodes: list[list[int]] = []
        for path in paths:
            parent, nodes = -1, []
            for tok in path:
                key = (parent, int(tok))
                node = children.get(key)
                if node is None:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    node = len(tokens)
                    children[key] = node
                    tokens.append(int(tok))
                    parents.append(parent)
                nodes.append(node)
                parent = node
            path_nodes.append(nodes)
        return cls(np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64), {"path_nodes": path_nodes})

    def depths(self) -> np.ndarray:
        """Depth of each node: 1 for children of the root."""
        depth = np.zeros(len(self), dtype=np.int64)
        for i, p in enumerate(self.parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return depth

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]
