"""Retrieval sources: what may follow the context, for every drafter that retrieves.

Owns three sources, each answering with continuations (draft tokens after the pending token)
and the offset in its source where each one starts:

- context (prompt lookup): earlier occurrences, in the context itself, of its longest suffix
  n-gram (``context_matches``, ``context_continuations``);
- suffix array (REST): the longest context suffix found in a datastore's suffix index, plain
  (suffix_array.py) or sharded (sharded_suffix.py) behind one interface (``SuffixSearch``), read
  for a capped, evenly spread sample of its occurrences (``suffix_sample``) and, for a few
  candidates, reduced to the distinct drafts most occurrences share (``ranked_drafts``);
- dense (DReSD): the datastore positions nearest to the target's hidden state whose stored next
  token is the pending token, and their stored continuations (``DenseSource``);
- served overlay: what the engine has served (overlay.py), searched through the same calls as
  a suffix index; ``pooled_sample`` searches a datastore and the overlay together for REST
  (the longer match wins; equal matches pool their rows, each source weighing the same).

pld, rest and dresd are thin drafters over one source each (pld and rest also consult the
overlay when given one); ReSpec's pool combines all four. Does not own the search structures
(suffix_array.py, sharded_suffix.py, dense.py, overlay.py), trees (drafters) or scores (ReSpec).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from specstore.runtime import gemm
from specstore.runtime.dense import DenseIndex, Neighbours
from specstore.runtime.normaliser import Normaliser
from specstore.runtime.suffix_array import SEPARATOR
from specstore.schemas.tables import DEFAULT_CONTINUATION_LENGTH, PAD_TOKEN


@dataclass(slots=True)
class Continuation:
    """Draft tokens and where they start in their source: a context position, a stream offset
    of the suffix index, or a datastore row + 1 (the row's own next token is the pending one)."""

    offset: int
    tokens: list[int]
    match: int = 0  # context: the length of the context suffix it continues (0 where not recorded)


# --- context -------------------------------------------------------------------------------


def context_matches(tokens: np.ndarray, max_ngram: int, min_ngram: int = 1) -> tuple[int, np.ndarray]:
    """``(n, starts)``: the longest ``n`` in ``[min_ngram, max_ngram]`` whose last ``n`` tokens
    occur earlier in ``tokens`` with at least one token after them, and the offsets just after
    each such occurrence, ascending. ``(0, [])`` when none does. ``tokens``: int [T]. In one
    kernel call where it is loaded (gemm.context_matches; int64 tokens), else
    ``numpy_context_matches``."""
    tokens = np.asarray(tokens)
    found = gemm.context_matches(tokens, max_ngram, max(int(min_ngram), 1)) if tokens.dtype == np.int64 else None
    if found is not None:
        return found[0], found[1]
    return numpy_context_matches(tokens, max_ngram, min_ngram)


def numpy_context_matches(tokens: np.ndarray, max_ngram: int, min_ngram: int = 1) -> tuple[int, np.ndarray]:
    """``context_matches`` in numpy (the kernel's reference).

    One comparison over the context finds where the last token occurs earlier (each such place
    ends a candidate occurrence and has a token after it); only those are extended backwards,
    one token at a time, so a step costs one pass over the context, not one per n."""
    tokens, min_ngram = np.asarray(tokens), max(int(min_ngram), 1)  # an n-gram has a token at least
    size = len(tokens)
    longest = min(max_ngram, size - 1)
    if longest < min_ngram:
        return 0, np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(tokens[: size - 1] == tokens[-1])  # occurrence ends, the suffix itself excluded
    matched = np.ones(ends.size, dtype=np.int64)  # how many tokens back each occurrence matches
    alive = np.arange(ends.size)
    for k in range(1, longest):
        alive = alive[ends[alive] >= k]
        alive = alive[tokens[ends[alive] - k] == tokens[size - 1 - k]]
        if not alive.size:
            break
        matched[alive] += 1
    n = int(matched.max()) if ends.size else 0
    if n < min_ngram:
        return 0, np.zeros(0, dtype=np.int64)
    return n, (ends[matched == n] + 1).astype(np.int64)


def matched_back(tokens: np.ndarray, start: int, cap: int) -> int:
    """How many tokens before offset ``start`` equal the context's last ones (``tokens[start - 1]``
    against ``tokens[-1]``, and so on back), at most ``cap``."""
    k = min(int(cap), int(start))
    if k <= 0:
        return 0
    same = tokens[start - k : start][::-1] == tokens[len(tokens) - k :][::-1]
    return k if bool(same.all()) else int(np.argmin(same))


def context_continuations(tokens: np.ndarray, length: int, num: int, max_ngram: int, min_ngram: int = 1, *,
                          full_first: bool = True, match_cap: int = 0) -> list[Continuation]:
    """Up to ``num`` distinct continuations (at most ``length`` tokens) of the longest matching
    suffix n-gram: those with a full ``length`` tokens first, the most recent first, then the
    ones cut by the context's end, longest first. Prompt lookup's rule (drafters/pld.py): in a
    repetitive stream the most recent occurrence ends just before the end of the context and
    would draft one token, where an earlier one drafts the whole run. ``full_first=False``: the
    most recent first, whatever their length (the order before 2026-12-01).

    Each continuation's ``match`` is the n-gram's length; with ``match_cap`` above it, how far
    back its occurrence matches the context's end, up to ``match_cap`` tokens: a copy of a long
    span of the context shows as a long match, where the n-gram stops at ``max_ngram``."""
    tokens = np.asarray(tokens)
    found = gemm.context_matches(tokens, max_ngram, max(int(min_ngram), 1), match_cap) if tokens.dtype == np.int64 else None
    if found is not None:  # the kernel measured every occurrence's match too
        n, starts, back = found
        matched = dict(zip(starts.tolist(), back.tolist(), strict=True))
    else:
        n, starts = numpy_context_matches(tokens, max_ngram, min_ngram)
        matched = None
    size = len(tokens)
    if full_first:
        order = sorted(starts.tolist(), key=lambda s: (-min(size - s, length), -s))
    else:
        order = starts[::-1].tolist()
    out, seen = [], set()
    for start in order:
        draft = tokens[start : start + length].tolist()
        if tuple(draft) in seen:
            continue
        seen.add(tuple(draft))
        if matched is not None:
            match = matched[start]
        else:
            match = matched_back(tokens, start, match_cap) if match_cap > n else n
        out.append(Continuation(start, draft, match))
        if len(out) >= num:
            break
    return out


# --- suffix array --------------------------------------------------------------------------


class SuffixSearch(Protocol):
    """What SuffixIndex and ShardedSuffixIndex both answer; matches have ``length`` and ``count``."""

    def __len__(self) -> int: ...

    def longest_suffix_match(self, context: Sequence[int], max_len: int = 16, min_len: int = 2): ...

    def continuations(self, match, length: int, max_matches: int | None = None, *, spread: bool = False,
                      return_offsets: bool = False): ...


@dataclass(slots=True)
class SuffixSample:
    """What follows a sample of the occurrences of the longest matching context suffix.
    ``rows``: int32 [M, length], SEPARATOR from a document's end on; ``offsets``: int64 [M],
    the stream offset where each row starts."""

    match_length: int
    num_matches: int  # all occurrences, before sampling
    rows: np.ndarray
    offsets: np.ndarray


def suffix_sample(index: SuffixSearch, context: Sequence[int], length: int, *, max_span: int, min_span: int,
                  max_matches: int) -> SuffixSample | None:
    """The longest suffix of ``context`` (``max_span`` down to ``min_span`` tokens) found in
    ``index`` and ``length`` tokens after each of at most ``max_matches`` of its occurrences,
    spread evenly over all of them; None when no suffix is found."""
    match = index.longest_suffix_match(context, max_span, min_span)
    if match is None or match.count == 0:
        return None
    rows, offsets = index.continuations(match, length, max_matches, spread=True, return_offsets=True)
    return SuffixSample(match.length, match.count, rows, offsets)


def pooled_sample(found: SuffixSample | None, served: SuffixSample | None) -> tuple[SuffixSample | None, np.ndarray | None]:
    """A datastore's sample and the served overlay's, searched for the same context, as one:
    the longer match wins; on equal lengths the rows are pooled, the overlay's repeated so that
    both sources weigh about the same in prefix counts (its rows are the target's own outputs
    but usually far fewer). Returns ``(sample, overlay rows in it or None)``; a pooled sample's
    offsets mix both sources' offset spaces (REST reads rows only)."""
    if served is None or (found is not None and found.match_length > served.match_length):
        return found, None
    if found is None or served.match_length > found.match_length:
        return served, served.rows
    repeat = max(1, round(len(found.rows) / max(len(served.rows), 1)))
    rows = np.concatenate([found.rows, np.repeat(served.rows, repeat, axis=0)])
    offsets = np.concatenate([found.offsets, np.repeat(served.offsets, repeat)])
    return SuffixSample(found.match_length, found.num_matches + served.num_matches, rows, offsets), served.rows


def ranked_drafts(sample: SuffixSample, num: int) -> list[Continuation]:
    """The ``num`` distinct drafts of a sample, ranked by how many occurrences share their first
    1, 2, 3 tokens (ties: the smaller token ids), each at its earliest offset."""
    drafts = [tuple(r[r != SEPARATOR].tolist()) for r in sample.rows]
    prefix = [Counter(d[:j] for d in drafts if len(d) >= j) for j in (1, 2, 3)]
    first_start: dict[tuple, int] = {}
    for d, s in zip(drafts, sample.offsets.tolist(), strict=True):
        if d and (d not in first_start or s < first_start[d]):
            first_start[d] = s
    order = sorted(first_start, key=lambda d: (*(-c[d[:j]] for j, c in zip((1, 2, 3), prefix, strict=True)), d))
    return [Continuation(first_start[d], list(d)) for d in order[:num]]


# --- dense ---------------------------------------------------------------------------------


class DenseSource:
    """Dense neighbours of one datastore version: ``normaliser`` and ``index`` from the same
    version (a query and the rows go through the same transform, which is what makes them
    comparable); ``continuations``: what the index's row ids index: int [N, L] rows aligned with
    the index (an old-form version: ``[:, 0]`` each position's stored next token, the filter
    key, PAD_TOKEN after a document's end), or a ``StreamContinuations`` (a compact version: row
    ids are stream positions, continuations the stream after them)."""

    def __init__(self, normaliser: Normaliser, index: DenseIndex, continuations, max_length: int | None = None):
        self.normaliser = normaliser
        self.index = index
        self.continuations = continuations
        if isinstance(continuations, np.ndarray):
            if len(index) != len(continuations):
                raise ValueError(f"index has {len(index)} rows but continuations {len(continuations)}")
            self.max_length = int(continuations.shape[1]) - 1  # tokens stored after the pending one
        else:
            self.max_length = int(max_length if max_length is not None else DEFAULT_CONTINUATION_LENGTH - 1)

    @classmethod
    def from_datastore(cls, datastore) -> DenseSource:
        """The datastore's dense source (loads its dense index when not loaded yet)."""
        index = datastore.load_dense()
        return cls(datastore.normaliser, index, datastore.continuations, datastore.manifest.continuation_length - 1)

    def search(self, hidden: torch.Tensor, pending: int, k: int) -> Neighbours:
        """The ``k`` nearest positions to ``hidden`` [H] (the target's state at the token before
        ``pending``) among those whose stored next token is ``pending``, best first."""
        if k <= 0 or self.index.block_size(pending) == 0:
            return Neighbours(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
        return self.index.search_hidden(self.normaliser, hidden, k, pending)

    def drafts(self, found: Neighbours, length: int) -> list[Continuation]:
        """Each neighbour's stored continuation after the pending token (at most ``length``
        tokens, cut at the document's end), best neighbour first; empty ones left out."""
        length = min(length, self.max_length)
        out = []
        if not isinstance(self.continuations, np.ndarray):
            pending = found.next_token
            if pending is None or length <= 0:
                return out
            for row, draft in zip(found.rows.tolist(), self.continuations.drafts(found.rows, pending, length), strict=True):
                if draft:
                    out.append(Continuation(row + 2, draft))  # the stream offset where the draft starts
            return out
        for row, cont in zip(found.rows.tolist(), self.continuations[found.rows, 1 : 1 + length], strict=True):
            pad = np.flatnonzero(cont == PAD_TOKEN)
            draft = cont[: int(pad[0]) if pad.size else len(cont)].tolist()
            if draft:
                out.append(Continuation(row + 1, draft))
        return out
