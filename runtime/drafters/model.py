"""ModelDrafter: a small causal LM with the target's tokenizer drafts a greedy chain.

Owns the draft model's own KV cache for one request (kept across steps, cropped back to the
longest prefix it shares with the new context, so each step runs only the new tokens plus the
draft). Pluggable as ReSpec's fallback (``ReSpecDrafter(fallback=ModelDrafter(model))``) or on
its own. Its drafts are model-made: ReSpec always verifies them strictly.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.kv_cache import growing_cache
from specstore.runtime.linear import use_packed_linears
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import VerifyResult


class ModelDrafter:
    """Greedy drafts of ``num_draft_tokens`` from ``model`` (any Hugging Face causal LM whose
    tokenizer is the target's: ids are passed through unchanged)."""

    name = "model"
    lossless = True
    source = "model"  # ReSpec verifies drafts of this source strictly

    def __init__(self, model, num_draft_tokens: int = 4):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.model = model
        use_packed_linears(model)  # its 1-token steps on weights packed once, as the verifier's (linear.py)
        self.num_draft_tokens = num_draft_tokens
        self.device = next(model.parameters()).device
        self._cache: DynamicCache | None = None
        self._cached: list[int] = []  # the tokens whose keys/values the cache holds

    def reset(self, prompt_ids: list[int]) -> None:
        self._cache, self._cached = growing_cache(self.model.config), []

    def _rewind(self, tokens: list[int]) -> None:
        """Crop the cache to the longest prefix it shares with ``tokens`` (and leave one token to run)."""
        common = 0
        limit = min(len(self._cached), len(tokens) - 1)
        while common < limit and self._cached[common] == tokens[common]:
            common += 1
        if common < len(self._cached):
            self._cache.crop(-(len(self._cached) - common))  # transformers 5.x: negative = tokens to remove
            self._cached = self._cached[:common]

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        limit = min(self.num_draft_tokens, state.budget)
        if limit <= 0 or not state.tokens:
            return DraftTree.empty()
        if self._cache is None:
            self.reset(state.tokens[: state.num_prompt])
        self._rewind(state.tokens)
        feed = state.tokens[len(self._cached) :]
        draft: list[int] = []
        for _ in range(limit):
            ids = torch.tensor([feed], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids, cache=self._cache, use_cache=True).logits
            self._cached += feed
            nxt = int(logits[0, -1].argmax())
            draft.append(nxt)
            feed = [nxt]
        # the cache holds the context and all but the last draft token; the next step rewinds it
        return DraftTree.chain(draft)

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        """No feedback: the next ``propose`` rewinds the cache to the committed tokens."""


def create(datastore=None, model=None, **options) -> ModelDrafter:
    """Registry-style factory: ``model`` is a loaded causal LM (a path is loaded in float32 on the CPU)."""
    if model is None:
        raise ValueError("ModelDrafter needs a draft model (a loaded causal LM or a model folder)")
    if isinstance(model, str):
        from specstore.runtime.models import load_model

        model = load_model(model, dtype="float32", device="cpu").model
    return ModelDrafter(model, **options)
