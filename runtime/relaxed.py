"""Source-aware acceptance: ReSpec's relaxed rule for retrieved drafts, strict for the rest.

Owns one acceptance rule (verify.AcceptanceRule): ``rule(logits, tree, sampling) -> (accepted
nodes, bonus, relaxed flags)``. ReSpec exposes it as its drafter's ``acceptance`` and the
decode loop hands it to the verifier's ``step``. It does not own forward passes or the cache,
and it never changes the lossless paths: under sampling, or for a node that no retrieved
candidate produced, it accepts exactly as ``sampling.accept`` does.

The rule (greedy only). At each row, a child equal to the target's argmax is accepted strictly.
Otherwise a *retrieved* child ``c`` (``tree.node_data["retrieved"][c]`` True) may be accepted
relaxed when all hold:

- ``c``'s token is among the target's ``top_k`` tokens at that row;
- ``p(c) >= ratio * p(argmax)`` (softmax of the row's logits, temperature 1);
- look-ahead tolerance: some child of ``c`` is then accepted strictly (equals the argmax of
  ``c``'s own row). A relaxed token is never the last one kept, and two relaxed tokens are never
  adjacent.

Relaxed acceptance changes the output: a drafter that enables it must report ``lossless=False``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstore.runtime.sampling import Sampling, accept, children_lists, greedy_choice
from specstore.runtime.tree import DraftTree


@dataclass(frozen=True, slots=True)
class RelaxedRule:
    """``top_k``: the relaxed token must rank among the target's top k; ``ratio``: and have at
    least ``ratio`` times the top token's probability."""

    top_k: int = 3
    ratio: float = 0.3

    def __post_init__(self) -> None:
        if self.top_k < 2:
            raise ValueError(f"relaxed top_k must be >= 2 (1 is strict acceptance), got {self.top_k}")
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"relaxed ratio must be in (0, 1], got {self.ratio}")

    def allows(self, row_logits: torch.Tensor, token: int) -> bool:
        """True when ``token`` is in the row's top-k and ``p(token) >= ratio * p_top``."""
        top = torch.topk(row_logits.float(), self.top_k)
        if token not in top.indices.tolist():
            return False
        # p(token) / p_top = exp(logit(token) - logit_top): no softmax over the vocabulary needed
        return float(row_logits[token].float() - top.values[0]) >= float(torch.log(torch.tensor(self.ratio)))

    def __call__(self, logits: torch.Tensor, tree: DraftTree, sampling: Sampling) -> tuple[list[int], int, list[bool]]:
        """Accept over ``tree`` from ``logits`` [1 + n, V] (row 0 = pending token)."""
        if not sampling.greedy:
            accepted, bonus = accept(logits, tree, sampling)
            return accepted, bonus, [False] * len(accepted)
        retrieved = tree.node_data.get("retrieved")
        retrieved = [False] * len(tree) if retrieved is None else retrieved.tolist()
        return accept_relaxed(logits, tree, self, retrieved)


def accept_relaxed(
    logits: torch.Tensor, tree: DraftTree, rule: RelaxedRule, retrieved: list[bool]
) -> tuple[list[int], int, list[bool]]:
    """Greedy walk with the relaxed rule for retrieved nodes (module docstring)."""
    children = children_lists(tree)
    tokens = tree.tokens.tolist()
    choice = greedy_choice(logits).tolist()
    accepted: list[int] = []
    flags: list[bool] = []
    row = 0
    while True:
        strict = next((c for c in children[row] if tokens[c] == choice[row]), None)
        if strict is not None:
            accepted.append(strict)
            flags.append(False)
            row = strict + 1
            continue
        relaxed = None
        for c in children[row]:
            if not retrieved[c] or not rule.allows(logits[row], tokens[c]):
                continue
            after = next((g for g in children[c + 1] if tokens[g] == choice[c + 1]), None)
            if after is not None:  # look-ahead: the next draft token is accepted strictly
                relaxed = (c, after)
                break
        if relaxed is None:
            return accepted, int(choice[row]), flags
        c, after = relaxed
        accepted += [c, after]
        flags += [True, False]
        row = after + 1
