"""Domain routing: pick, per request, which of several opened datastores to draft from.

Owns the choice only: the prompt's last-layer hidden states (without the positions it shares
with the chat template, when the caller passes it: every chat datastore holds the template too,
so only the content tells domains apart) are put through each datastore's own normaliser (a
datastore's vectors live in its own reduced space), averaged, and compared by cosine similarity
with that datastore's ``manifest.domain_centroid`` (the mean of its rows, written by the build);
the closest wins. When any of the datastores is sparse (no normaliser, no centroid: built with
``--index sparse``), all are scored lexically instead, by the share of the content's token
4-grams their suffix index holds (one scale for all, no model forward). How well it routes:
``benchmarks/routing_eval.py``. Does not own opening datastores or decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specstore.runtime.errors import SpecstoreError
from specstore.runtime.forward import hidden_states

LEXICAL_NGRAM = 4  # token n-grams a lexical route looks up


@dataclass(frozen=True, slots=True)
class Route:
    """The chosen datastore's index and every candidate's score (cosine similarity), by ref."""

    index: int
    scores: dict[str, float]


class Router:
    def __init__(self, datastores: list):
        if not datastores:
            raise SpecstoreError("routing needs at least one datastore")
        self.lexical = any(ds.manifest.index == "sparse" for ds in datastores)
        for ds in datastores:
            if not self.lexical and ds.manifest.domain_centroid is None:
                raise SpecstoreError(f"datastore {ds.ref} has no domain centroid (built before routing existed): rebuild it")
        self.datastores = datastores
        self._centroids = [] if self.lexical else [np.asarray(ds.manifest.domain_centroid, dtype=np.float64) for ds in datastores]

    def route(self, model, prompt_ids: list[int], template_ids: list[int] | None = None) -> Route:
        """Score the prompt (token ids, as the model sees it) against every datastore.

        ``template_ids``: the chat template around an empty message (``api.prompt_ids(tok, "")``);
        the positions the prompt shares with it at its start and end (system prompt, role
        markers) are left out of the average, so that short prompts are judged by their content
        and not by the template every datastore of chat data also holds."""
        if self.lexical:
            start, end = content_span(prompt_ids, template_ids)
            scores = {ds.ref: ngram_coverage(ds.suffix, prompt_ids[start:end]) for ds in self.datastores}
            best = max(range(len(self.datastores)), key=lambda i: scores[self.datastores[i].ref])
            return Route(best, scores)
        device = next(model.parameters()).device
        with torch.inference_mode():
            hidden = hidden_states(model, torch.tensor([prompt_ids], device=device))[0].cpu().numpy()
        start, end = content_span(prompt_ids, template_ids)
        hidden = hidden[start:end]
        scores = {}
        for ds, centroid in zip(self.datastores, self._centroids, strict=True):
            mean = ds.normaliser.apply(hidden).astype(np.float64).mean(axis=0)
            scores[ds.ref] = float(mean @ centroid / max(np.linalg.norm(mean) * np.linalg.norm(centroid), 1e-12))
        best = max(range(len(self.datastores)), key=lambda i: scores[self.datastores[i].ref])
        return Route(best, scores)

    def pick(self, model, prompt_ids: list[int], template_ids: list[int] | None = None):
        return self.datastores[self.route(model, prompt_ids, template_ids).index]


def ngram_coverage(suffix, ids: list[int], n: int = LEXICAL_NGRAM) -> float:
    """The share of the ``n``-grams of ``ids`` (all of ``ids`` when shorter) found in ``suffix``."""
    ids = [int(t) for t in ids]
    grams = [ids[i : i + n] for i in range(max(len(ids) - n + 1, 1))] if ids else []
    if not grams:
        return 0.0
    return sum(suffix.find(g).count > 0 for g in grams) / len(grams)


def content_span(prompt_ids: list[int], template_ids: list[int] | None) -> tuple[int, int]:
    """``[start, end)`` of the prompt without the prefix and suffix it shares with the template
    (the whole prompt when there is no template or nothing would be left)."""
    n = len(prompt_ids)
    if not template_ids:
        return 0, n
    start = 0
    while start < min(n, len(template_ids)) and prompt_ids[start] == template_ids[start]:
        start += 1
    tail = 0
    while tail < min(n - start, len(template_ids) - start) and prompt_ids[n - 1 - tail] == template_ids[-1 - tail]:
        tail += 1
    return (start, n - tail) if n - tail > start else (0, n)
