"""Acceptance rules: which draft tokens the target keeps, and which token it adds (the bonus).

Owns the temperature/top-p warp, greedy acceptance of the longest matching path, and lossless
multi-draft speculative sampling over a DraftTree. Does not own forward passes, masks or the
KV cache (verify.py).

Sampling treats every draft node as a *deterministic* proposal (its draft distribution is a
point mass), which is what retrieval and lookup drafters produce. At each node the children are
tried in order with recursive rejection sampling: child token ``x`` is accepted with probability
``r(x)``, where ``r`` starts as the target distribution ``p`` and, after each rejection, has the
rejected token removed and is renormalised; if every child is rejected the bonus is drawn from
the final ``r``. The probability of emitting token ``x`` is then exactly ``p(x)`` (accepting
``x_k`` has probability ``prod_{j<k}(1 - r_j(x_j)) * r_k(x_k) = p(x_k)``), so the output
distribution equals plain sampling whatever the drafter proposes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstore.runtime import gemm
from specstore.runtime.tree import DraftTree


@dataclass(slots=True)
class Sampling:
    """``temperature <= 0`` means greedy. ``generator`` (CPU) makes sampling reproducible."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def seeded(cls, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> Sampling:
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        return cls(temperature, top_p, gen)


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[V] logits -> [V] float64 CPU probabilities after temperature and top-p (nucleus) filtering.

    float64 on the CPU so that the residual renormalisations below lose nothing and sampling
    does not depend on the device the model runs on.
    """
    probs = torch.softmax(logits.detach().double().cpu() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        drop = order[mass_before >= sampling.top_p]
        probs[drop] = 0.0
        probs /= probs.sum()
    return probs


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=generator).item())


def children_lists(tree: DraftTree) -> list[list[int]]:
    """``out[0]``: nodes under the root (the pending token); ``out[i + 1]``: children of node i."""
    out: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for node, parent in enumerate(tree.parents.tolist()):
        out[parent + 1].append(node)
    return out


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dimension, computed in float32: the conversion is exact (same values,
    so the same first maximum), and on the CPU torch's bf16 argmax over a vocabulary is ~2x slower
    than the conversion and a float32 argmax together (0.73 against 0.31 ms for [7, 49152])."""
    return logits.float().argmax(dim=-1)


def accept(logits: torch.Tensor, tree: DraftTree, sampling: Sampling) -> tuple[list[int], int]:
    """Walk the tree from the root; return (accepted node indices, bonus token).

    ``logits``: [1 + n, V]; row 0 belongs to the pending token, row ``i + 1`` to node i.
    """
    children = children_lists(tree)
    tokens = tree.tokens.tolist()
    accepted: list[int] = []
    row = 0
    if sampling.greedy:
        # an argmax only for the rows the walk reaches (the accepted path and the row after it):
        # a tree's other rows are never read, and each row's conversion and argmax cost as much
        # as a whole row's share of one batched argmax
        while True:
            choice = gemm.argmax(logits[row])  # bf16 or float32 on the CPU: one kernel call
            if choice is None:
                choice = int(greedy_choice(logits[row]))
            nxt = next((c for c in children[row] if tokens[c] == choice), None)
            if nxt is None:
                return accepted, choice
            accepted.append(nxt)
            row = nxt + 1
    while True:
        residual = target_probs(logits[row], sampling)
        nxt = None
        for child in children[row]:
            tok = tokens[child]
            if _uniform(sampling.generator) < residual[tok].item():
                nxt = child
                break
            residual[tok] = 0.0
            total = residual.sum()
            if total <= 0:  # every token with mass was drafted and rejected: cannot happen with u < 1
                break
            residual /= total
        if nxt is None:
            return accepted, _draw(residual, sampling.generator)
        accepted.append(nxt)
        row = nxt + 1


def pick(logits: torch.Tensor, sampling: Sampling) -> int:
    """The next token from [V] logits with no draft: argmax, or a draw from the warped distribution."""
    if sampling.greedy:
        choice = gemm.argmax(logits)  # bf16 or float32 on the CPU: one kernel call, as greedy acceptance
        return int(greedy_choice(logits)) if choice is None else choice
    return _draw(target_probs(logits, sampling), sampling.generator)

