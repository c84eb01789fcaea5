"""The served overlay: what an engine has served, held in memory and searched like a suffix array.

Owns the store and its search (issue 15, point 3): each served request's response (and its
prompt, with ``prompts=True``) is one document of a token stream, documents end with SEPARATOR
so that no match crosses them, and the whole is bounded by ``max_tokens`` tokens (separators not
counted): adding a request that would exceed it first evicts the oldest requests, whole, until
it fits (a request larger than the bound alone keeps its response's first ``max_tokens``
tokens, its prompt dropped).

Search answers what SuffixIndex answers (``longest_suffix_match`` and ``continuations`` with
``max_matches``, ``spread`` and ``return_offsets``), so retrieval.py's ``suffix_sample`` and
``ranked_drafts`` take it as they take a datastore's index. Occurrences are found through a hash
of each position's preceding two tokens (``(a, b) -> positions after them``, appended to as
documents arrive) and extended backwards against the context in numpy, one comparison over the
surviving occurrences per extra token; so a match is at least 2 tokens long (a shorter
``min_len`` is taken as 2) and only occurrences with at least one token after them count.
Adding costs one dict append per token; eviction moves a start offset and the arrays are
compacted when the dead prefix outgrows the live part (amortised O(1) per token).

Offsets are global and only grow: a position keeps its offset while it is held, which is what
ReSpec's candidate keys (respec_pool.py) need. Every public method takes the overlay's own lock,
so one overlay may be read and fed from several threads; the engine additionally feeds it only
between requests (engine.py), so a request drafts from one unchanging overlay.

Does not own how continuations become drafts (drafters/, retrieval.py) or when requests are
added (engine.py).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specstore.runtime.suffix_array import SEPARATOR

DEFAULT_MAX_TOKENS = 65536
_MIN_COMPACT = 4096  # dead tokens tolerated before compaction is considered


def _key(a: int, b: int) -> int:
    return (int(a) << 32) | int(b)


@dataclass(slots=True)
class OverlayMatch:
    """The longest matched context suffix (``length`` tokens) and the global offsets just after
    each of its occurrences, ascending (oldest first)."""

    length: int
    positions: np.ndarray  # int64 [count]

    @property
    def count(self) -> int:
        return int(self.positions.size)


@dataclass(slots=True)
class _Request:
    id: int
    end: int  # global offset one past its last separator
    num_tokens: int


@dataclass(slots=True)
class OverlayUse:
    """A drafter's tally of the overlay's part in one request: steps whose tree held overlay
    nodes, overlay nodes drafted, and overlay nodes the target accepted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def record(self, flags: np.ndarray | None, accepted_nodes: Sequence[int]) -> None:
        """``flags``: bool [n], which nodes of the verified tree came from the overlay."""
        if flags is None or not flags.any():
            return
        self.steps += 1
        self.drafted += int(flags.sum())
        self.accepted += sum(1 for n in accepted_nodes if flags[n])

    def to_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted}


class ServedOverlay:
    """``ServedOverlay(max_tokens=65536, prompts=False)``; ``add(response, prompt)`` after each
    request; search like a SuffixIndex."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, prompts: bool = False):
        if int(max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens, self.prompts = int(max_tokens), bool(prompts)
        self._lock = threading.RLock()
        self._buf = np.full(1024, SEPARATOR, dtype=np.int32)  # global offsets [base, end)
        self._base = self._start = self._end = 0  # buffer origin, first live offset, end
        self._keys: dict[int, list[int]] = {}  # (a, b) -> global offsets just after each a, b
        self._arrays: dict[int, tuple[int, np.ndarray]] = {}  # key -> (list length, its positions)
        self._requests: deque[_Request] = deque()
        self.num_tokens = 0  # tokens held, separators not counted
        self.num_added = self.num_evicted = 0  # requests
        self._next_id = 0

    # ---- feeding ---------------------------------------------------------------------------
    def add(self, response: Sequence[int], prompt: Sequence[int] = ()) -> int | None:
        """Hold one served request (the prompt only with ``prompts=True``); returns its id, or
        None when there was nothing to hold. Evicts the oldest requests while it does not fit."""
        docs = [list(map(int, prompt))] if self.prompts and len(prompt) else []
        docs.append(list(map(int, response)))
        if sum(len(d) for d in docs) > self.max_tokens:
            docs = [docs[-1][: self.max_tokens]]  # too large alone: the response's head
        docs = [d for d in docs if d]
        if not docs:
            return None
        size = sum(len(d) for d in docs)
        with self._lock:
            while self._requests and self.num_tokens + size > self.max_tokens:
                old = self._requests.popleft()
                self._start, self.num_tokens = old.end, self.num_tokens - old.num_tokens
                self.num_evicted += 1
            if self._start == self._end and self._start > self._base:  # all evicted
                self._compact()
            for doc in docs:
                self._append(doc)
            self._next_id += 1
            self._requests.append(_Request(self._next_id, self._end, size))
            self.num_tokens += size
            self.num_added += 1
            if self._start - self._base > max(_MIN_COMPACT, self._end - self._start):
                self._compact()
            return self._next_id

    def _append(self, doc: list[int]) -> None:
        n = len(doc)
        need = self._end + n + 1 - self._base
        if need > len(self._buf):
            grown = np.full(max(need, 2 * len(self._buf)), SEPARATOR, dtype=np.int32)
            grown[: self._end - self._base] = self._buf[: self._end - self._base]
            self._buf = grown
        at = self._end - self._base
        self._buf[at : at + n] = doc
        self._buf[at + n] = SEPARATOR
        keys = self._keys
        for i in range(2, n):  # offsets with a token after them (the document's last is left out)
            keys.setdefault(_key(doc[i - 2], doc[i - 1]), []).append(self._end + i)
        self._end += n + 1

    def _compact(self) -> None:
        """Drop the evicted prefix: a fresh buffer from the first live offset, keys filtered."""
        live = self._buf[self._start - self._base : self._end - self._base]
        self._buf = np.full(max(1024, 2 * len(live)), SEPARATOR, dtype=np.int32)
        self._buf[: len(live)] = live
        self._base = self._start
        kept = {}
        for key, found in self._keys.items():
            i = bisect_left(found, self._start)
            if i < len(found):
                kept[key] = found[i:]
        self._keys, self._arrays = kept, {}

    def clear(self) -> None:
        with self._lock:
            self.__init__(self.max_tokens, self.prompts)

    # ---- reading ---------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[int]:
        """Ids of the requests held, oldest first."""
        with self._lock:
            return [r.id for r in self._requests]

    def documents(self) -> list[list[int]]:
        """The documents held, oldest first (a request's prompt before its response)."""
        with self._lock:
            live = self._buf[self._start - self._base : self._end - self._base]
            ends = np.flatnonzero(live == SEPARATOR)
            starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
            return [live[a:b].tolist() for a, b in zip(starts, ends, strict=True)]

    def stats(self) -> dict:
        with self._lock:
            return {"tokens": self.num_tokens, "max_tokens": self.max_tokens, "requests": self.num_requests,
                    "added": self.num_added, "evicted": self.num_evicted, "prompts": self.prompts}

    def __len__(self) -> int:
        """Stream length held (tokens and separators), as ``len`` of a SuffixIndex."""
        return self._end - self._start

    def _positions(self, key: int) -> np.ndarray:
        found = self._keys.get(key)
        if not found:
            return np.zeros(0, dtype=np.int64)
        cached = self._arrays.get(key)
        if cached is None or cached[0] != len(found):
            cached = (len(found), np.asarray(found, dtype=np.int64))
            self._arrays[key] = cached
        arr = cached[1]
        return arr[int(np.searchsorted(arr, self._start)) :]

    def longest_suffix_match(self, context: Sequence[int], max_len: int = 16, min_len: int = 2) -> OverlayMatch | None:
        """The longest suffix of ``context`` (``min_len`` .. ``max_len`` tokens, at least 2) held
        with a token after it; None when there is none."""
        max_len, min_len = min(max_len, len(context)), max(min_len, 2)
        if max_len < min_len:
            return None
        with self._lock:
            alive = self._positions(_key(context[-2], context[-1]))
            length = 2
            while alive.size and length < max_len:
                back = alive - (length + 1)  # where the next context token back must be
                tokens = self._buf[np.maximum(back - self._base, 0)]
                same = (back >= self._start) & (tokens == int(context[-(length + 1)]))
                if not same.any():
                    break
                alive, length = alive[same], length + 1
            if not alive.size or length < min_len:
                return None
            return OverlayMatch(length, alive)

    def continuations(self, match: OverlayMatch, length: int, max_matches: int | None = None, *, spread: bool = False,
                      return_offsets: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Tokens after each occurrence: int32 ``[M, length]``, SEPARATOR from a document's end
        on, rows sorted. With ``max_matches``: evenly spread over all occurrences (``spread``) or
        the most recent ones. With ``return_offsets``: also each row's global offset."""
        starts = match.positions
        if max_matches is not None and starts.size > max_matches:
            if spread:
                starts = starts[(np.arange(max_matches, dtype=np.int64) * starts.size) // max_matches]
            else:
                starts = starts[-max_matches:]
        length = max(int(length), 0)
        with self._lock:
            idx = starts[:, None] + np.arange(length)[None, :]
            inside = (idx >= self._start) & (idx < self._end)
            rows = self._buf[np.clip(idx - self._base, 0, len(self._buf) - 1)].astype(np.int32)
        rows[~inside] = SEPARATOR
        rows[np.cumsum(rows == SEPARATOR, axis=1) > 0] = SEPARATOR
        if length and rows.shape[0] > 1:
            order = np.lexsort(rows.T[::-1])
            rows, starts = rows[order], starts[order]
        return (rows, starts) if return_offsets else rows


def overlay_flags(tree_tokens: np.ndarray, parents: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """bool [n]: which nodes of a tree (tokens, parents) spell a prefix of one of ``rows`` (int
    [M, L], SEPARATOR-padded): the nodes a source of those rows drafted."""
    prefixes = set()
    for row in np.unique(np.asarray(rows), axis=0) if len(rows) else ():
        row = row[row != SEPARATOR].tolist()
        prefixes.update(tuple(row[: j + 1]) for j in range(len(row)))
    paths: list[tuple] = []
    flags = np.zeros(len(tree_tokens), dtype=bool)
    for i, (tok, parent) in enumerate(zip(tree_tokens.tolist(), parents.tolist(), strict=True)):
        path = (paths[parent] if parent >= 0 else ()) + (tok,)
        paths.append(path)
        flags[i] = path in prefixes
    return flags
