"""DraftTree: the one encoding every drafter hands the verifier.

A tree of draft tokens that follow the *pending* token (the last committed token, whose
logits the target has not computed yet; it is the implicit root). ``parents[i]`` is the index
of node i's parent, ``-1`` for a child of the root, and always ``< i`` (topological order).
A linear draft is a chain; several drafts are merged into a trie with the shared root.
Drafters never build attention masks or position ids: the verifier derives them from this.

Besides tokens and parents a tree carries what its drafter needs back in ``observe``, in three
typed places that every subset (``subset``, ``clip_depth``) keeps consistent:

- ``node_data``: per-node arrays (``[n]`` each, e.g. REST's ``counts``, ReSpec's ``retrieved``);
  a subset keeps the rows of the nodes it keeps;
- ``paths``: for a trie made by ``from_paths``, the node indices of each input path, in input
  order; a subset keeps every path (so per-path values stay aligned) but drops removed nodes;
- ``meta``: per-tree values (a match length, per-path keys aligned with ``paths``), copied as is.

The verifier reads tokens and parents only; the acceptance rule it is given may read
``node_data`` (ReSpec's relaxed rule reads ``retrieved``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class DraftTree:
    tokens: np.ndarray  # int64 [n]
    parents: np.ndarray  # int64 [n], -1 = child of the root
    node_data: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [n]
    paths: list[list[int]] = field(default_factory=list)  # node indices of each input path
    meta: dict = field(default_factory=dict)  # per-tree values

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        self.parents = np.asarray(self.parents, dtype=np.int64).reshape(-1)
        n = self.tokens.shape[0]
        if self.parents.shape[0] != n:
            raise ValueError("tokens and parents must have the same length")
        if n and np.any(self.parents >= np.arange(n)):
            raise ValueError("every parent index must be smaller than its node's index")
        if n and np.any(self.parents < -1):
            raise ValueError("parent indices must be >= -1")
        for name, values in self.node_data.items():
            if not isinstance(values, np.ndarray):
                self.node_data[name] = values = np.asarray(values)
            if values.shape[:1] != (n,):
                raise ValueError(f"node_data[{name!r}] has {len(values)} entries for {n} nodes")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def _built(cls, tokens: np.ndarray, parents: np.ndarray, node_data: dict[str, np.ndarray], paths: list[list[int]],
               meta: dict) -> DraftTree:
        """A tree from parts that are valid by construction (``from_paths``, ``subset``: int64
        [n] tokens and parents with parents before children, node_data arrays of n rows),
        without ``__post_init__``'s checks: a few numpy calls that each cost microseconds on
        the cold caches after a forward, every step."""
        tree = object.__new__(cls)
        tree.tokens, tree.parents, tree.node_data, tree.paths, tree.meta = tokens, parents, node_data, paths, meta
        return tree

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
        at ``max_nodes``. ``paths[k]`` lists the node indices of input path k (cut where the cap
        stopped it; empty when none of it fit)."""
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
        return cls._built(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64), {}, path_nodes, {})

    def depths(self) -> np.ndarray:
        """Depth of each node: 1 for children of the root."""
        return np.asarray(self.depth_list(), dtype=np.int64)

    def depth_list(self) -> list[int]:
        """``depths`` as Python ints (for loops over a few dozen nodes)."""
        depth: list[int] = []
        for p in self.parents.tolist():  # parents come first; Python ints, not numpy scalars
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def take(self, nodes: Sequence[int]) -> DraftTree:
        """The subtree of ``nodes`` (indices that hold each one's parent too), re-indexed in
        their tree order with every per-node field, in Python lists and one fancy index per field
        (a proposal's few dozen nodes: the cost-aware pruner's every step). Unchecked: the pruner
        keeps parents first by construction; ``subset`` checks a mask, then takes it."""
        kept = sorted(nodes)
        index = {node: i for i, node in enumerate(kept)}
        parents = self.parents.tolist()
        tokens = self.tokens.tolist()
        rows = np.array(kept, dtype=np.int64)
        return DraftTree._built(
            np.array([tokens[i] for i in kept], dtype=np.int64),
            np.array([-1 if parents[i] < 0 else index[parents[i]] for i in kept], dtype=np.int64),
            {name: values[rows] for name, values in self.node_data.items()},
            [[index[i] for i in path if i in index] for path in self.paths],
            dict(self.meta),
        )

    def subset(self, keep: np.ndarray) -> DraftTree:
        """The nodes where ``keep`` (bool [n]) is True, re-indexed with every per-node field.
        ``keep`` must hold each kept node's parent too (a tree, not a forest)."""
        keep = np.asarray(keep, dtype=bool)
        kept_parents = self.parents[keep]
        if np.any(kept_parents >= 0) and not keep[kept_parents[kept_parents >= 0]].all():
            raise ValueError("a subset must keep the parent of every node it keeps")
        return self.take(np.flatnonzero(keep).tolist())


def clip_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """The subtree of nodes at depth <= ``max_depth`` (``tree`` itself when nothing is deeper)."""
    if len(tree) <= max_depth:  # no node is deeper than the tree has nodes: nothing to measure
        return tree
    keep = tree.depths() <= max_depth
    if keep.all():
        return tree
    return tree.subset(keep)


def within_vocab(tree: DraftTree, vocab_size: int | None) -> DraftTree:
    """The subtree without nodes whose token is outside ``[0, vocab_size)`` and without their
    descendants (a draft ends where it holds an id the target cannot take, e.g. from a damaged
    datastore file); ``tree`` itself when every id is valid (one vectorised check)."""
    if vocab_size is None or len(tree) == 0:
        return tree
    bad = (tree.tokens < 0) | (tree.tokens >= vocab_size)
    if not bad.any():
        return tree
    for node, parent in enumerate(tree.parents.tolist()):  # parents come first: one pass marks descendants
        if parent >= 0 and bad[parent]:
            bad[node] = True
    return tree.subset(~bad)
