"""The drafter contract: ``propose(state) -> DraftTree`` and ``observe(state, tree, result)``.

An empty tree means "decode one token normally". Drafters see the decode state read-only and
never touch the model's cache, masks or positions. A drafter whose drafts are accepted by its
own rule (ReSpec's relaxed mode) exposes it as ``acceptance`` (verify.AcceptanceRule); the
decode loop reads it once per request and passes it to the verifier. Without the attribute, or
with None, the sampling rule decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from specstore.runtime.tree import DraftTree

if TYPE_CHECKING:
    import torch

    from specstore.runtime.verify import VerifyResult


@dataclass(slots=True)
class DecodeState:
    """What a drafter may look at.

    ``tokens``: prompt + generated ids; ``tokens[-1]`` is the pending token (committed, but not
    yet run through the target). ``last_hidden``: the target's last hidden layer [H] at
    ``tokens[-2]``, the last token it processed (the DReSD query). ``last_logits``: [V], the
    target's logits at that same position (they chose ``tokens[-1]`` under greedy decoding).
    ``budget``: how many draft tokens along one path can still be used (new-token limit and
    context limit both applied). ``verify_s``: in ``observe``, the seconds the step's
    verification took (None where it was not timed: the simulator's replay).
    """

    tokens: list[int]
    num_prompt: int
    last_hidden: torch.Tensor | None = None
    last_logits: torch.Tensor | None = None
    budget: int = 0
    step: int = 0
    verify_s: float | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt :]


@runtime_checkable
class Drafter(Protocol):
    name: str
    lossless: bool

    def reset(self, prompt_ids: list[int]) -> None:
        """Start a new request."""

    def propose(self, state: DecodeState) -> DraftTree:
        """Draft tokens to follow ``state.tokens[-1]``; an empty tree for plain decoding."""

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        """Feedback after verification (state already includes the newly committed tokens)."""
