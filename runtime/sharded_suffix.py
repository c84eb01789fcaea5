"""A suffix array built in shards, searched as one (``specstore build --sa-shard-tokens N``).

Owns the shard layout of a version's files (``shards/NNNNN/{stream,suffix_array}.npy``, each a
run of whole documents, so no match crosses a shard) and ``ShardedSuffixIndex``, which answers
the same calls as ``SuffixIndex`` (``find``, ``positions``, ``longest_suffix_match``,
``continuations``, ``len``) by asking every shard and merging; ``load_suffix_index`` opens
either kind. Stream offsets are global: shard k's stream starts where shard k-1's ends.

Merging is exact for ``find``, ``positions``, ``longest_suffix_match`` and for ``continuations``
without a sample; a spread sample (``max_matches`` with ``spread``) takes each shard's share in
proportion to its count, so it keeps frequencies but may pick other occurrences than one array
over the whole stream would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specstore.runtime.suffix_array import INDEX_FILES, Match, SuffixIndex

SHARDS_DIR = "shards"


def shard_dir(folder: Path, index: int) -> Path:
    return folder / SHARDS_DIR / f"{index:05d}"


def shard_files(folder: Path) -> list[Path]:
    """Every shard file of a version folder, in shard order (empty when unsharded)."""
    root = folder / SHARDS_DIR
    if not root.is_dir():
        return []
    return [d / n for d in sorted(root.iterdir()) for n in INDEX_FILES if (d / n).is_file()]


@dataclass(slots=True)
class ShardedMatch:
    """One match length and the interval it has in every shard."""

    length: int
    parts: list[Match]

    @property
    def count(self) -> int:
        return sum(p.count for p in self.parts)


class ShardedSuffixIndex:
    def __init__(self, shards: list[SuffixIndex]):
        if not shards:
            raise ValueError("a sharded suffix index needs at least one shard")
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(s) for s in shards[:-1]]).astype(np.int64)

    @classmethod
    def load(cls, folder: Path, *, mmap: bool = True, vocab_size: int | None = None) -> ShardedSuffixIndex:
        dirs = sorted((folder / SHARDS_DIR).iterdir())
        return cls([SuffixIndex.load(d, mmap=mmap, vocab_size=vocab_size) for d in dirs])

    def __len__(self) -> int:
        return int(sum(len(s) for s in self.shards))

    def prefetch(self) -> list:
        """``SuffixIndex.prefetch`` for every shard (one thread each)."""
        return [thread for s in self.shards for thread in s.prefetch()]

    def find(self, pattern: Sequence[int]) -> ShardedMatch:
        parts = [s.find(pattern) for s in self.shards]
        return ShardedMatch(parts[0].length, parts)

    def positions(self, pattern: Sequence[int]) -> np.ndarray:
        found = [s.positions(pattern) + off for s, off in zip(self.shards, self.offsets, strict=True)]
        return np.sort(np.concatenate(found))

    def longest_suffix_match(self, context: Sequence[int], max_len: int = 16, min_len: int = 2) -> ShardedMatch | None:
        best = max((m.length for s in self.shards if (m := s.longest_suffix_match(context, max_len, min_len))), default=0)
        if best == 0:
            return None
        return self.find(list(context)[-best:])

    def continuations(
        self, match: ShardedMatch, length: int, max_matches: int | None = None, *, spread: bool = False,
        return_offsets: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Rows as ``SuffixIndex.continuations``, merged across shards in sorted order; with
        ``return_offsets`` also each row's global stream offset."""
        total = match.count
        quotas = [None] * len(self.shards)
        if max_matches is not None and spread and total > max_matches:
            # each shard's share of the sample, in proportion to its occurrences (sums to max_matches)
            cuts = np.zeros(len(match.parts) + 1, dtype=np.int64)
            cuts[1:] = np.cumsum([p.count for p in match.parts]) * max_matches // total
            quotas = np.diff(cuts).tolist()
        rows, offsets = [], []
        for shard, part, quota, base in zip(self.shards, match.parts, quotas, self.offsets, strict=True):
            if part.count == 0 or quota == 0:
                continue
            take = quota if quota is not None else max_matches
            shard_rows, shard_offsets = shard.continuations(part, length, take, spread=spread and quota is not None,
                                                            return_offsets=True)
            rows.append(shard_rows)
            offsets.append(shard_offsets + base)
        if not rows:
            merged, where = np.zeros((0, max(length, 0)), dtype=np.int32), np.zeros(0, dtype=np.int64)
        else:
            merged, where = np.concatenate(rows), np.concatenate(offsets)
        if merged.shape[1]:
            order = np.lexsort(merged.T[::-1])
            merged, where = merged[order], where[order]
        if max_matches is not None and not (spread and total > max_matches):
            merged, where = merged[:max_matches], where[:max_matches]
        return (merged, where) if return_offsets else merged


def load_suffix_index(folder: Path, vocab_size: int | None = None) -> SuffixIndex | ShardedSuffixIndex:
    """The suffix index of a version folder (memory maps; only the headers are read): sharded
    when it has a ``shards`` folder. ``vocab_size``: continuations end at any id outside it."""
    if (folder / SHARDS_DIR).is_dir():
        return ShardedSuffixIndex.load(folder, vocab_size=vocab_size)
    return SuffixIndex.load(folder, vocab_size=vocab_size)
