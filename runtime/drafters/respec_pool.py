"""ReSpec's hybrid candidate pool: draft candidates from the context, the suffix array and the
dense index, each with a key that identifies its *match thread*.

Owns candidate generation only (no scoring, no trees): ``gather(state, length)`` returns
``Candidate``s from three sources:

- ``context``: the longest suffix n-gram of prompt + generated text found earlier in it (prompt
  lookup / SuffixDecoding's per-request tree), several occurrences, most recent first;
- ``suffix``: the longest context suffix found in the datastore's suffix array (REST's match),
  distinct continuations of an evenly spread sample of its occurrences, most frequent first;
- ``dense``: the nearest datastore positions to ``state.last_hidden`` through the datastore's
  normaliser whose stored next token is the pending token (DReSD's query and filter).

A candidate's key is ``(source, offset - len(tokens))``: the offset in its source where its
draft starts minus the context length. When a match keeps holding (the target accepts what
the source says next), the next step finds it again at a later offset with a longer context,
so the key stays the same; that is what ReSpec's per-candidate EMA scores attach to.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.suffix_array import SEPARATOR
from specstore.schemas.tables import PAD_TOKEN

SOURCES = ("context", "suffix", "dense")


@dataclass(slots=True)
class Candidate:
    key: tuple[str, int]
    tokens: list[int]  # draft tokens after the pending token

    @property
    def source(self) -> str:
        return self.key[0]


@dataclass(frozen=True, slots=True)
class PoolConfig:
    num_context: int = 2  # context occurrences per step
    num_suffix: int = 3  # distinct suffix-array continuations per step
    num_dense: int = 3  # dense neighbours per step (after the next-token filter)
    max_ngram: int = 4  # longest context n-gram tried (pending token included)
    min_ngram: int = 1
    max_span: int = 16  # longest suffix tried in the datastore (REST)
    min_span: int = 2
    max_matches: int = 64  # datastore occurrences read per step, spread evenly


def context_candidates(tokens: np.ndarray, length: int, cfg: PoolConfig) -> list[Candidate]:
    size = len(tokens)
    for n in range(min(cfg.max_ngram, size - 1), cfg.min_ngram - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # every window has a following token
        hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
        if not len(hits):
            continue
        out, seen = [], set()
        for start in (hits[::-1] + n).tolist():  # most recent first
            draft = tokens[start : start + length].tolist()
            if tuple(draft) in seen:
                continue
            seen.add(tuple(draft))
            out.append(Candidate(("context", start - size), draft))
            if len(out) >= cfg.num_context:
                break
        return out
    return []


def suffix_candidates(index, tokens: list[int], length: int, cfg: PoolConfig) -> list[Candidate]:
    match = index.longest_suffix_match(tokens, cfg.max_span, cfg.min_span)
    if match is None or match.count == 0:
        return []
    count = match.count
    if count > cfg.max_matches:
        ranks = match.lo + (np.arange(cfg.max_matches, dtype=np.int64) * count) // cfg.max_matches
    else:
        ranks = np.arange(match.lo, match.hi, dtype=np.int64)
    starts = np.asarray(index.sa[ranks], dtype=np.int64) + match.length
    n = len(index)
    idx = starts[:, None] + np.arange(length)[None, :]
    rows = np.asarray(index.stream)[np.minimum(idx, n - 1)].astype(np.int64)
    rows[idx >= n] = SEPARATOR
    rows[np.cumsum(rows == SEPARATOR, axis=1) > 0] = SEPARATOR
    drafts = [tuple(r[r != SEPARATOR].tolist()) for r in rows]
    # rank distinct drafts by how many occurrences share their first 1, 2, 3 tokens
    prefix = [Counter(d[:j] for d in drafts if len(d) >= j) for j in (1, 2, 3)]
    first_start: dict[tuple, int] = {}
    for d, s in zip(drafts, starts.tolist(), strict=True):
        if d and (d not in first_start or s < first_start[d]):
            first_start[d] = s
    order = sorted(first_start, key=lambda d: (*(-c[d[:j]] for j, c in zip((1, 2, 3), prefix, strict=True)), d))
    size = len(tokens)
    return [Candidate(("suffix", first_start[d] - size), list(d)) for d in order[: cfg.num_suffix]]


def dense_candidates(datastore, state: DecodeState, length: int, cfg: PoolConfig) -> list[Candidate]:
    index = datastore.dense
    if index is None or state.last_hidden is None or cfg.num_dense <= 0:
        return []
    pending = int(state.tokens[-1])
    if index.block_size(pending) == 0:
        return []
    query = datastore.normaliser.apply_torch(state.last_hidden.reshape(-1))
    found = index.search(query, cfg.num_dense, next_token=pending)
    length = min(length, datastore.continuations.shape[1] - 1)
    out, size = [], len(state.tokens)
    for row in found.rows.tolist():
        cont = datastore.continuations[row, 1 : 1 + length]
        pad = np.flatnonzero(cont == PAD_TOKEN)
        draft = cont[: int(pad[0]) if pad.size else len(cont)].tolist()
        if draft:
            out.append(Candidate(("dense", row + 1 - size), draft))
    return out


def gather(datastore, state: DecodeState, length: int, cfg: PoolConfig) -> list[Candidate]:
    """All candidates for this step, interleaved by rank across sources (each source's best
    first, then each one's second, ...) so that ties in score keep the pool diverse.
    ``datastore`` may be None: context only."""
    if length <= 0 or len(state.tokens) < 2:
        return []
    per_source = [context_candidates(np.asarray(state.tokens, dtype=np.int64), length, cfg) if cfg.num_context > 0 else []]
    if datastore is not None:
        per_source.append(suffix_candidates(datastore.suffix, state.tokens, length, cfg) if cfg.num_suffix > 0 else [])
        per_source.append(dense_candidates(datastore, state, length, cfg))
    return [c for rank in itertools.zip_longest(*per_source) for c in rank if c is not None]
