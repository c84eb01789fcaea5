"""ReSpec's hybrid candidate pool: candidates from retrieval.py's three sources, each with a key
that identifies its *match thread*.

Owns combining the sources and keying their continuations (no retrieval of its own, no scoring,
no trees): ``CandidatePool.gather(state, length)`` returns ``Candidate``s from

- ``context``: several distinct continuations of the context's longest suffix n-gram found
  earlier in it, full-length ones first, most recent first (prompt lookup's rule, so that a
  long copy from the context is drafted whole);
- ``overlay``: the distinct continuations most occurrences share, of the longest context suffix
  found in what the engine has served (overlay.py; when the engine gives the drafter one);
- ``suffix``: the distinct continuations most occurrences share, of the longest context suffix
  found in the datastore's suffix index (plain or sharded), in steps without the dense source
  (a sparse datastore; ``PoolConfig.suffix_beside_dense`` for both);
- ``dense``: the nearest datastore positions to ``state.last_hidden`` whose stored next token is
  the pending token (when the datastore was opened with its dense index).

A candidate's key is ``(source, offset - len(tokens))``: the offset in its source where its
draft starts minus the context length. When a match keeps holding (the target accepts what
the source says next), the next step finds it again at a later offset with a longer context,
so the key stays the same; that is what ReSpec's per-candidate EMA scores attach to.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.retrieval import (
    Continuation,
    DenseSource,
    context_continuations,
    ranked_drafts,
    suffix_sample,
)

SOURCES = ("context", "overlay", "suffix", "dense")
POOL_SWITCHES = ("context_full_first", "suffix_beside_dense")  # PoolConfig's on/off fields


@dataclass(slots=True)
class Candidate:
    key: tuple[str, int]
    tokens: list[int]  # draft tokens after the pending token
    # the length of the context suffix they continue (pending token included): context candidates
    # how far back their occurrence matches (at most max_span; at least the n-gram), suffix-array
    # and overlay ones the longest suffix found (at most max_span); dense ones 0
    match: int = 0

    @property
    def source(self) -> str:
        return self.key[0]


@dataclass(frozen=True, slots=True)
class PoolConfig:
    num_context: int = 4  # context occurrences per step (2 before 2026-12-05: BENCHMARKS.md)
    num_suffix: int = 3  # distinct suffix-array continuations per step (a sparse datastore's, below)
    num_dense: int = 3  # dense neighbours per step (after the next-token filter)
    num_overlay: int = 3  # distinct served-overlay continuations per step
    max_ngram: int = 4  # longest context n-gram tried (pending token included)
    min_ngram: int = 1
    max_span: int = 16  # longest suffix tried in the datastore (REST); also how far back a context match is measured
    min_span: int = 2
    max_matches: int = 64  # datastore occurrences read per step, spread evenly
    context_full_first: bool = True  # context continuations of full length first (False: most recent first)
    # the suffix array's continuations also where the datastore has a dense index. Beside the
    # dense neighbours and the context they added nothing: replayed on the tune splits of all
    # four bench sets, with and without a draft head, MAT moved -0.8% to +0.4% without them,
    # and their lookup cost 0.15-0.2 ms a step (BENCHMARKS.md, twenty-fifth session). Steps
    # without the dense source (a sparse datastore: no dense index) keep them: there they are
    # the datastore's only source.
    suffix_beside_dense: bool = False

    def __post_init__(self) -> None:
        for name in POOL_SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


def _keyed(source: str, found: list[Continuation], size: int, match: int | None = None) -> list[Candidate]:
    """``match``: the length of the context suffix they continue, for all of them (suffix sources)."""
    return [Candidate((source, c.offset - size), c.tokens, c.match if match is None else match) for c in found]


class CandidatePool:
    """The sources of one datastore (``None``: the context only) and of the served overlay."""

    def __init__(self, datastore=None, config: PoolConfig | None = None, overlay=None):
        self.config = config or PoolConfig()
        self.overlay = overlay
        self.suffix = datastore.suffix if datastore is not None else None
        has_dense = datastore is not None and datastore.dense is not None
        self.dense = None
        if has_dense:  # a compact version's continuations come from its stream, as long as its manifest says
            conts = datastore.continuations
            length = None if isinstance(conts, np.ndarray) else datastore.manifest.continuation_length - 1
            self.dense = DenseSource(datastore.normaliser, datastore.dense, conts, length)

    def gather(self, state: DecodeState, length: int) -> list[Candidate]:
        """All candidates for this step, interleaved by rank across sources in ``SOURCES`` order
        (each source's best first, then each one's second, ...) so that ties in score keep the
        pool diverse."""
        cfg, size = self.config, len(state.tokens)
        if length <= 0 or size < 2:
            return []
        per_source = []
        if cfg.num_context > 0:
            tokens = np.asarray(state.tokens, dtype=np.int64)
            found = context_continuations(tokens, length, cfg.num_context, cfg.max_ngram, cfg.min_ngram,
                                          full_first=cfg.context_full_first, match_cap=cfg.max_span)
            per_source.append(_keyed("context", found, size))
        if self.overlay is not None and cfg.num_overlay > 0:
            sample = suffix_sample(self.overlay, state.tokens, length, max_span=cfg.max_span, min_span=cfg.min_span,
                                   max_matches=cfg.max_matches)
            per_source.append(_keyed("overlay", ranked_drafts(sample, cfg.num_overlay), size, sample.match_length) if sample else [])
        dense = self.dense is not None and state.last_hidden is not None and cfg.num_dense > 0
        if self.suffix is not None and cfg.num_suffix > 0 and (not dense or cfg.suffix_beside_dense):
            sample = suffix_sample(self.suffix, state.tokens, length, max_span=cfg.max_span, min_span=cfg.min_span,
                                   max_matches=cfg.max_matches)
            per_source.append(_keyed("suffix", ranked_drafts(sample, cfg.num_suffix), size, sample.match_length) if sample else [])
        if dense:
            found = self.dense.search(state.last_hidden, int(state.tokens[-1]), cfg.num_dense)
            per_source.append(_keyed("dense", self.dense.drafts(found, length), size))
        return [c for rank in itertools.zip_longest(*per_source) for c in rank if c is not None]
