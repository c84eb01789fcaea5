"""Plain autoregressive decoding as a drafter: it never drafts, so every step is one token."""

from __future__ import annotations

from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import VerifyResult


class AutoregressiveDrafter:
    name = "ar"
    lossless = True

    def reset(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, state: DecodeState) -> DraftTree:
        return DraftTree.empty()

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        pass


def create(datastore=None, **options) -> AutoregressiveDrafter:
    if options:
        raise TypeError(f"the ar drafter takes no options, got {sorted(options)}")
    return AutoregressiveDrafter()
