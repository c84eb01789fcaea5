"""Suffix array over a datastore's token stream: build (native, pydivsufsort) and search.

Owns the stream layout (documents joined by a separator so that no match crosses a document
boundary), construction, persistence by memory map, n-gram lookup and REST's longest-suffix
match. The pipelines call ``build_suffix_array``; the runtime searches. Does not own how
continuations become draft trees (drafters/rest.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specstore.schemas.tables import PAD_TOKEN

SEPARATOR = PAD_TOKEN  # never a real token id, so no pattern of real tokens can match across it
STREAM_FILE = "stream.npy"
SA_FILE = "suffix_array.npy"
_GATHER_MAX = 4096  # intervals up to this size are narrowed by one vectorised gather
_BLOCK = 1 << 22  # suffix-array entries gathered at once when the per-rank tokens are first built


def join_documents(documents: Iterable[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents, each followed by SEPARATOR.

    Returns ``(stream int32 [num_tokens + num_docs], starts int64 [num_docs])`` where
    ``starts[d]`` is the stream offset of document d's first token.
    """
    parts, starts, offset = [], [], 0
    for doc in documents:
        arr = np.asarray(doc, dtype=np.int32)
        if arr.size and arr.min() < 0:
            raise ValueError("token ids must be non-negative")
        starts.append(offset)
        parts.append(arr)
        parts.append(np.array([SEPARATOR], dtype=np.int32))
        offset += arr.size + 1
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return stream, np.asarray(starts, dtype=np.int64)


def build_suffix_array(stream: np.ndarray) -> np.ndarray:
    """Suffix array of ``stream`` (ids >= -1), int32 when it fits, else int64.

    Sorted order equals lexicographic order of the suffixes as integer sequences, a shorter
    suffix before a longer one that it prefixes. Built by divsufsort (C) on ids shifted by one.
    """
    import pydivsufsort

    stream = np.asarray(stream)
    if stream.size == 0:
        return np.zeros(0, dtype=np.int32)
    shifted = (stream.astype(np.int64) + 1).astype(np.uint32)
    sa = pydivsufsort.divsufsort(shifted)
    dtype = np.int32 if stream.size < 2**31 - 1 else np.int64
    return np.asarray(sa, dtype=dtype)


def save_suffix_index(folder: Path, stream: np.ndarray, sa: np.ndarray) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / STREAM_FILE, np.asarray(stream, dtype=np.int32))
    np.save(folder / SA_FILE, sa)
    return [STREAM_FILE, SA_FILE]


def _bounds(block: np.ndarray, offset: int, token: int) -> tuple[int, int]:
    """``offset +`` the range of ``token`` in the sorted ``block`` (key cast to its dtype)."""
    key = block.dtype.type(token)
    return offset + int(np.searchsorted(block, key, "left")), offset + int(np.searchsorted(block, key, "right"))


@dataclass(slots=True)
class Match:
    """An SA interval ``[lo, hi)`` whose suffixes all start with the ``length`` matched tokens."""

    length: int
    lo: int
    hi: int

    @property
    def count(self) -> int:
        return self.hi - self.lo


class SuffixIndex:
    """Search over one stream and its suffix array (arrays may be memory maps).

    Every read is bounds-checked, so a damaged file costs matches, never a crash or a wrong
    draft id: a suffix-array entry outside ``[0, len(stream))`` is skipped (its rank has no
    tokens), and a continuation ends at its first token outside ``[0, vocab_size)`` (any
    negative id when ``vocab_size`` is None). Nothing is read at construction but the arrays'
    lengths; the per-rank first and second tokens are gathered on the first search."""

    def __init__(self, stream: np.ndarray, sa: np.ndarray, vocab_size: int | None = None):
        if len(stream) != len(sa):
            raise ValueError(f"stream has {len(stream)} entries but suffix array {len(sa)}")
        self.stream = stream
        self.sa = sa
        self.vocab_size = vocab_size
        self._n = len(stream)
        self._first_tokens: np.ndarray | None = None
        self._second_tokens: np.ndarray | None = None
        self._sa_in_range: bool | None = None  # every SA entry in [0, n): set with the first tokens

    def _gather(self, raw: np.ndarray, depth: int) -> np.ndarray:
        """The token ``depth`` places after each suffix start in ``raw`` (SA entries), int32;
        -2 (sorts first) past the end or where the entry is out of range."""
        starts = np.asarray(raw, dtype=np.int64)
        if self._sa_in_range:  # the usual case, known since the first search: no per-entry check
            pos = starts + depth
            return np.where(pos < self._n, np.asarray(self.stream)[np.minimum(pos, self._n - 1)], -2)
        # one unsigned compare: 0 <= start < n - depth (a negative start wraps to a huge value)
        inside = starts.view(np.uint64) < max(self._n - depth, 0)
        tokens = np.asarray(self.stream)[np.where(inside, starts + depth, 0)]
        return np.where(inside, tokens, -2)  # int32 (the stream's dtype, checked on open)

    def _gather_all(self, depth: int) -> np.ndarray:
        """``_gather`` over the whole suffix array, in blocks (bounded temporaries at any size)."""
        out = np.empty(self._n, dtype=np.int32)
        in_range = True
        for lo in range(0, self._n, _BLOCK):
            block = np.asarray(self.sa[lo : lo + _BLOCK])
            in_range = in_range and bool(block.min() >= 0 and block.max() < self._n)
            out[lo : lo + _BLOCK] = self._gather(block, depth)
        self._sa_in_range = in_range
        return out

    @property
    def _first(self) -> np.ndarray:
        """First token of every suffix, in SA order: lets the first step be one vectorised searchsorted."""
        if self._first_tokens is None:
            self._first_tokens = self._gather_all(0)
        return self._first_tokens

    @property
    def _second(self) -> np.ndarray:
        """Second token of every suffix, in SA order (-2 past the end): within a first-token
        interval it is sorted, so depth 1 is one searchsorted in C, not a Python bisection over
        memory-mapped entries (milliseconds per step at millions of tokens)."""
        if self._second_tokens is None:
            self._second_tokens = self._gather_all(1)
        return self._second_tokens

    @classmethod
    def load(cls, folder: Path, *, mmap: bool = True, vocab_size: int | None = None) -> SuffixIndex:
        mode = "r" if mmap else None
        return cls(np.load(folder / STREAM_FILE, mmap_mode=mode), np.load(folder / SA_FILE, mmap_mode=mode), vocab_size)

    def __len__(self) -> int:
        return self._n

    def _token_at(self, rank: int, depth: int) -> int:
        start = int(self.sa[rank])
        pos = start + depth
        return int(self.stream[pos]) if 0 <= start and pos < self._n else -2  # past the end sorts first

    def _narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """Within [lo, hi) (suffixes sharing ``depth`` tokens), the sub-interval whose next token is ``token``."""
        if depth == 1:
            return _bounds(self._second[lo:hi], lo, token)
        if hi - lo <= _GATHER_MAX:  # small interval: gather its tokens at ``depth`` at once
            return _bounds(self._gather(self.sa[lo:hi], depth), lo, token)
        a, b = lo, hi
        while a < b:  # first rank with token_at >= token
            mid = (a + b) // 2
            if self._token_at(mid, depth) < token:
                a = mid + 1
            else:
                b = mid
        start, b = a, hi
        while a < b:  # first rank with token_at > token
            mid = (a + b) // 2
            if self._token_at(mid, depth) <= token:
                a = mid + 1
            else:
                b = mid
        return start, a

    def find(self, pattern: Sequence[int]) -> Match:
        """The SA interval of suffixes starting with ``pattern`` (empty interval if absent)."""
        pattern = [int(t) for t in pattern]
        if not pattern or self._n == 0:
            return Match(0, 0, self._n)
        first = self._first.dtype.type(pattern[0])  # a Python int key would cast the whole array
        lo = int(np.searchsorted(self._first, first, side="left"))
        hi = int(np.searchsorted(self._first, first, side="right"))
        for depth in range(1, len(pattern)):
            if lo >= hi:
                break
            lo, hi = self._narrow(lo, hi, depth, pattern[depth])
        return Match(len(pattern), lo, hi)

    def positions(self, pattern: Sequence[int]) -> np.ndarray:
        """Sorted stream offsets where ``pattern`` occurs."""
        m = self.find(pattern)
        found = np.asarray(self.sa[m.lo : m.hi], dtype=np.int64)
        return np.sort(found[(found >= 0) & (found < self._n)])

    def longest_suffix_match(self, context: Sequence[int], max_len: int = 16, min_len: int = 2) -> Match | None:
        """The longest suffix of ``context`` (between min_len and max_len tokens) found in the stream.

        Occurrence is monotone in length (a longer suffix occurs only where a shorter one does),
        so the longest length is found by binary search over lengths.
        """
        max_len = min(max_len, len(context))
        if max_len < min_len:
            return None
        best = None
        lo_len, hi_len = min_len, max_len
        while lo_len <= hi_len:
            mid = (lo_len + hi_len) // 2
            m = self.find(context[-mid:])
            if m.count > 0:
                best, lo_len = m, mid + 1
            else:
                hi_len = mid - 1
        return best

    def continuations(
        self, match: Match, length: int, max_matches: int | None = None, *, spread: bool = False,
        return_offsets: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Tokens following each occurrence of a match: int32 ``[num_matches, length]``, padded with
        SEPARATOR from the end of the occurrence's document on. Occurrences are taken in SA order,
        so the rows come out sorted. With ``max_matches``, the first ones, or with ``spread`` ones
        evenly spaced over the whole interval (a deterministic sample that keeps frequencies).
        With ``return_offsets``, also the stream offset where each row starts (int64 [num_matches])."""
        if max_matches is not None and spread and match.count > max_matches:
            ranks = match.lo + (np.arange(max_matches, dtype=np.int64) * match.count) // max_matches
            starts = np.asarray(self.sa[ranks], dtype=np.int64) + match.length
        else:
            hi = match.hi if max_matches is None else min(match.hi, match.lo + max_matches)
            starts = np.asarray(self.sa[match.lo : hi], dtype=np.int64) + match.length
        if starts.size == 0 or length <= 0:
            out = np.zeros((starts.size, max(length, 0)), dtype=np.int32)
            return (out, starts) if return_offsets else out
        if not self._sa_in_range:  # a damaged suffix array: a row whose entry is out of range reads nothing
            starts_checked = np.where((starts - match.length).view(np.uint64) < np.uint64(self._n), starts, self._n)
        else:
            starts_checked = starts
        idx = starts_checked[:, None] + np.arange(length)[None, :]
        inside = idx < self._n
        out = np.asarray(self.stream)[np.minimum(idx, self._n - 1)].astype(np.int32)
        out[~inside] = SEPARATOR
        # a separator, a negative id or one past the vocabulary (a damaged stream) ends the row:
        # negative int32 ids are huge as uint32, so one unsigned compare finds them all
        limit = np.uint32(self.vocab_size if self.vocab_size is not None else 2**31 - 1)
        ended = np.cumsum(out.view(np.uint32) >= limit, axis=1) > 0
        out[ended] = SEPARATOR
        return (out, starts) if return_offsets else out
