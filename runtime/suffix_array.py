"""Suffix array over a datastore's token stream: build (native, pydivsufsort) and search.

Owns the stream layout (documents joined by a separator so that no match crosses a document
boundary), construction, persistence by memory map, n-gram lookup and REST's longest-suffix
match. The pipelines call ``build_suffix_array``; the runtime searches. Does not own how
continuations become draft trees (drafters/rest.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specstore.runtime import gemm
from specstore.schemas.tables import PAD_TOKEN

SEPARATOR = PAD_TOKEN  # never a real token id, so no pattern of real tokens can match across it
STREAM_FILE = "stream.npy"
SA_FILE = "suffix_array.npy"
FIRST_FILE = "first_token_ranks.npy"  # where each first token's ranks start (vocabulary-sized)
INDEX_FILES = (STREAM_FILE, SA_FILE, FIRST_FILE)  # a suffix index's files (versions before 2026-12 lack FIRST_FILE)
_GATHER_MAX = 2048  # intervals up to this size are narrowed by one vectorised gather
_SAMPLES = 256  # ranks sampled per round when bisecting a larger interval
_MATCH_MAX = 64  # intervals up to this size compare the rest of a pattern in one gather
_CACHE_MAX = 1 << 16  # narrowed intervals remembered (~16 MB at most)


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


def first_token_ranks(stream: np.ndarray) -> np.ndarray:
    """int64 ``[max id + 3]``: the suffixes starting with token ``t`` (``t >= -1``, SEPARATOR
    included) are the SA ranks ``[ranks[t + 1], ranks[t + 2])``; the last entry is the stream's
    length. What the first level of every search would otherwise bisect for."""
    stream = np.asarray(stream)
    counts = np.bincount(stream.astype(np.int64) + 1) if stream.size else np.zeros(1, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def save_suffix_index(folder: Path, stream: np.ndarray, sa: np.ndarray) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / STREAM_FILE, np.asarray(stream, dtype=np.int32))
    np.save(folder / SA_FILE, sa)
    np.save(folder / FIRST_FILE, first_token_ranks(stream))
    return list(INDEX_FILES)


def _bounds(block: np.ndarray, offset: int, token: int) -> tuple[int, int]:
    """``offset +`` the range of ``token`` in the sorted ``block`` (key cast to its dtype)."""
    key = block.dtype.type(token)
    return offset + int(np.searchsorted(block, key, "left")), offset + int(np.searchsorted(block, key, "right"))


def touch_pages(*arrays: np.ndarray, block: int = 1 << 26) -> None:
    """Read one element per 4 KiB page of each (C-contiguous, e.g. memory-mapped) array, so that
    its pages are mapped into the process (a prefetch thread's work; numpy's loop drops the GIL)."""
    for arr in arrays:
        arr = arr.reshape(-1)  # a view: rows of several elements are pages like any other bytes
        step = max(1, 4096 // max(arr.itemsize, 1))
        for lo in range(0, len(arr), block):
            int(arr[lo : lo + block : step].sum())  # one element per 4 KiB page


def _usable_ranks(ranks: np.ndarray | None, n: int) -> np.ndarray | None:
    """``first_token_ranks`` when it fits a stream of ``n`` entries (1-D, from 0 to ``n``, never
    falling), else None: a damaged or missing table costs the shortcut, never a wrong range."""
    if ranks is None:
        return None
    ranks = np.asarray(ranks)
    if ranks.ndim != 1 or ranks.size < 2 or ranks.dtype.kind not in "iu" or ranks[0] != 0 or ranks[-1] != n:
        return None
    return ranks.astype(np.int64) if bool(np.all(ranks[1:] >= ranks[:-1])) else None


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
    lengths, and nothing is gathered or cached per rank: a search reads O(log n) sampled
    entries, so the first search is as fast as any and memory beyond the page cache stays flat.

    Narrowing an interval to the suffixes with a given token at a given depth reads the tokens
    at that depth of ``samples`` evenly spaced ranks at once (two vectorised gathers), keeps the
    segment between the samples that brackets each bound, and repeats until a segment holds at
    most ``gather_max`` ranks, which are gathered whole; once the interval itself is that small,
    the rest of the pattern is compared in one gather of all its remaining depths."""

    def __init__(self, stream: np.ndarray, sa: np.ndarray, vocab_size: int | None = None,
                 first_ranks: np.ndarray | None = None):
        if len(stream) != len(sa):
            raise ValueError(f"stream has {len(stream)} entries but suffix array {len(sa)}")
        self.stream = stream
        self.sa = sa
        self.vocab_size = vocab_size
        self._n = len(stream)
        self._stream, self._sa = np.asarray(stream), np.asarray(sa)  # plain views: no memmap overhead per call
        self.first_ranks = _usable_ranks(first_ranks, self._n)
        self.gather_max = _GATHER_MAX
        self.samples = _SAMPLES
        self.match_max = _MATCH_MAX
        # longest_suffix_match in the kernel's one call where it loads (SPECSTORE_CPU_KERNEL=0:
        # never); False: the numpy search, the reference the kernel's is tested against
        self.native = True
        # (lo, hi, depth, token) -> narrowed interval, for intervals wider than ``match_max``
        # (see _narrow); at most _CACHE_MAX entries
        self._cache: dict[tuple[int, int, int, int], tuple[int, int]] = {}

    def _gather(self, raw: np.ndarray, depth: int | np.ndarray) -> np.ndarray:
        """The token ``depth`` places after each suffix start in ``raw`` (SA entries); ``depth``
        may be an array that broadcasts against ``raw`` (one gather of several depths).

        No per-entry check: in an intact array every suffix of an interval being narrowed has
        its next ``depth`` tokens before the stream's final separator (they equal pattern
        tokens, never a separator), so positions are in range; on a damaged one, ``clip`` keeps
        every read inside the stream and a wrong token only costs the match."""
        return self._stream.take(raw + depth, mode="clip")

    @classmethod
    def load(cls, folder: Path, *, mmap: bool = True, vocab_size: int | None = None) -> SuffixIndex:
        mode = "r" if mmap else None
        first = np.load(folder / FIRST_FILE) if (folder / FIRST_FILE).is_file() else None  # vocabulary-sized
        return cls(np.load(folder / STREAM_FILE, mmap_mode=mode), np.load(folder / SA_FILE, mmap_mode=mode), vocab_size, first)

    def __len__(self) -> int:
        return self._n

    def prefetch(self) -> list[threading.Thread]:
        """Map every page of the stream and the suffix array into this process in a background
        thread (one read per page, numpy's loop without the GIL) and return it. The first
        searches after an open otherwise pay a page fault for each page they touch first (p99
        of a REST step 2.4 ms against 0.84 ms at 103M tokens); a long-lived server calls this
        once. Pages come from the page cache (or the disk): no memory beyond it. Returns the
        thread in a list, as ``ShardedSuffixIndex.prefetch`` returns one per shard."""
        thread = threading.Thread(target=touch_pages, args=(self._stream, self._sa), name="specstore-prefetch", daemon=True)
        thread.start()
        return [thread]

    def _bound(self, lo: int, hi: int, depth: int, token: int, side: str) -> int:
        """The first rank in [lo, hi) whose token at ``depth`` is >= ``token`` (side "left") or
        > ``token`` (side "right"); the ranks are sorted by that token."""
        while hi - lo > self.gather_max:
            lo, hi = self._bracket(lo, hi, depth, token, (side,))[0]
        tokens = self._gather(self._sa[lo:hi], depth)
        return lo + int(np.searchsorted(tokens, tokens.dtype.type(token), side))

    def _bracket(self, lo: int, hi: int, depth: int, token: int, sides: tuple[str, ...]) -> list[tuple[int, int]]:
        """One round of sampled bisection: for each side, the segment of [lo, hi] that holds
        that bound, between the last sample below it and the first that is not."""
        ranks = lo + (np.arange(1, self.samples, dtype=np.int64) * (hi - lo)) // self.samples
        tokens = self._gather(self._sa.take(ranks), depth)
        out = []
        for side in sides:
            i = int(np.searchsorted(tokens, tokens.dtype.type(token), side))
            out.append((int(ranks[i - 1]) + 1 if i > 0 else lo, int(ranks[i]) if i < ranks.size else hi))
        return out

    def _narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """Within [lo, hi) (suffixes sharing ``depth`` tokens), the sub-interval whose next token
        is ``token``: both bounds from one gather when the interval is small, else from one
        shared round of samples and then each bound in its own segment. Intervals wider than
        ``match_max`` are remembered (bounded): common prefixes recur, and a decode re-asks its
        own at every step."""
        remember = hi - lo > self.match_max
        if remember and (found := self._cache.get((lo, hi, depth, token))) is not None:
            return found
        if hi - lo <= self.gather_max:
            tokens = self._gather(self._sa[lo:hi], depth)
            key = tokens.dtype.type(token)
            found = lo + int(np.searchsorted(tokens, key, "left")), lo + int(np.searchsorted(tokens, key, "right"))
        else:
            left, right = self._bracket(lo, hi, depth, token, ("left", "right"))
            found = self._bound(*left, depth, token, "left"), self._bound(*right, depth, token, "right")
        if remember:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()  # bounded; refilled by the next searches
            self._cache[(lo, hi, depth, token)] = found
        return found

    def _match_rest(self, lo: int, hi: int, depth: int, rest: list[int]) -> tuple[int, int]:
        """Within a small [lo, hi) sharing ``depth`` tokens, the ranks whose next tokens are
        ``rest``: one gather of all remaining depths, then the run of equal rows (sorted ranks
        make it contiguous; on a damaged array the first and last equal rows bound it)."""
        window = self._gather(self._sa[lo:hi, None], depth + np.arange(len(rest))[None, :])
        equal = np.flatnonzero((window == np.asarray(rest, dtype=window.dtype)).all(axis=1))
        if equal.size == 0:
            at = lo + int(np.searchsorted(window[:, 0], window.dtype.type(rest[0]), "left"))
            return at, at
        return lo + int(equal[0]), lo + int(equal[-1]) + 1

    def find(self, pattern: Sequence[int]) -> Match:
        """The SA interval of suffixes starting with ``pattern`` (empty interval if absent)."""
        pattern = [int(t) for t in pattern]
        if not pattern or self._n == 0:
            return Match(0, 0, self._n)
        lo, hi, first = 0, self._n, 0
        if self.first_ranks is not None:
            at = pattern[0] + 1
            lo, hi = (int(self.first_ranks[at]), int(self.first_ranks[at + 1])) if 0 <= at < len(self.first_ranks) - 1 else (0, 0)
            first = 1
        for depth in range(first, len(pattern)):
            if lo >= hi:
                break
            if hi - lo <= self.match_max and len(pattern) - depth > 1:
                lo, hi = self._match_rest(lo, hi, depth, pattern[depth:])
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
        if self.native:  # the same search in one kernel call (gemm.sa_longest)
            found = gemm.sa_longest(self._stream, self._sa, self.first_ranks, context, max_len, min_len)
            if found is not None:
                return Match(*found) if found[0] > 0 else None
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
            starts = self._sa.take(ranks).astype(np.int64) + match.length
        else:
            hi = match.hi if max_matches is None else min(match.hi, match.lo + max_matches)
            starts = self._sa[match.lo : hi].astype(np.int64) + match.length
        if starts.size == 0 or length <= 0:
            out = np.zeros((starts.size, max(length, 0)), dtype=np.int32)
            return (out, starts) if return_offsets else out
        # a damaged suffix array: a row whose entry is out of range reads nothing
        starts_checked = np.where((starts - match.length).view(np.uint64) < np.uint64(self._n), starts, self._n)
        idx = starts_checked[:, None] + np.arange(length)[None, :]
        out = self._stream.take(idx, mode="clip").astype(np.int32, copy=False)
        out[idx >= self._n] = SEPARATOR
        # a separator, a negative id or one past the vocabulary (a damaged stream) ends the row:
        # negative int32 ids are huge as uint32, so one unsigned compare finds them all
        limit = np.uint32(self.vocab_size if self.vocab_size is not None else 2**31 - 1)
        out[np.logical_or.accumulate(out.view(np.uint32) >= limit, axis=1)] = SEPARATOR
        return (out, starts) if return_offsets else out
