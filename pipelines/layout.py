"""Where each document sits in a version's token stream, and how the stream splits into shards.

Owns ``StreamLayout``: every new document's stream offset, the version's counts and, for a build
with ``--sa-shard-tokens``, which suffix-array shard each document goes to and each shard's
extent. The stream is every document in doc_id order, each followed by one separator; an
append's documents come after the parent's. Pure functions of document lengths (and of the
parent's shards): no tokens and no files pass through here. The writers (writers.py) check what
they write against the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specstore.pipelines.append import BaseVersion


@dataclass(frozen=True)
class Shard:
    """One suffix-array shard: stream entries ``offset .. offset + length`` (tokens and separators),
    of which the first ``base_length`` are the parent's shard as it was (append)."""

    offset: int
    length: int
    base_length: int = 0

    @property
    def takes_new_documents(self) -> bool:
        return self.length > self.base_length


@dataclass(frozen=True)
class StreamLayout:
    starts: dict[int, int]  # doc_id -> stream offset of the document's first token (new documents)
    num_documents: int  # the whole version's, an append's parent included
    num_tokens: int
    num_new_documents: int
    num_new_tokens: int
    shard_of: dict[int, int] = field(default_factory=dict)  # doc_id -> shard index; empty if one array
    shards: tuple[Shard, ...] = ()  # every shard of the version, the parent's first; () if one array

    @property
    def num_entries(self) -> int:
        """Length of the whole stream: every token and one separator per document."""
        return self.num_tokens + self.num_documents


def stream_layout(lengths: list[tuple[int, int]], base: BaseVersion | None = None) -> StreamLayout:
    """The layout of one suffix array over the whole stream, from ``(doc_id, num_tokens)`` pairs."""
    lengths = sorted(lengths)
    offset = base.num_entries if base else 0
    starts = {}
    for doc, n in lengths:
        starts[doc] = offset
        offset += n + 1  # the document and its separator
    return _layout(starts, lengths, base)


def assign_shards(lengths: list[tuple[int, int]], max_tokens: int, base: BaseVersion | None = None) -> StreamLayout:
    """The layout of a sharded build: documents in doc_id order fill shards of at most
    ``max_tokens`` stream entries (a longer document gets a shard of its own).

    For an append, the parent's shards come first, as they are; new documents go on filling its
    last shard (which is then rebuilt with them) and new shards after it, exactly as a full build
    of the parent's corpus plus the new one would place them.
    """
    lengths = sorted(lengths)
    offsets = [o for o, _ in base.shards] if base else []
    sizes = [n for _, n in base.shards] if base else []
    base_sizes = list(sizes)
    offset = sum(sizes)
    if base is not None and offset != base.num_entries:
        raise RuntimeError(f"internal: the parent's shards hold {offset} stream entries, its manifest says {base.num_entries}")
    starts, shard_of = {}, {}
    for doc, n in lengths:
        if not sizes or (sizes[-1] and sizes[-1] + n + 1 > max_tokens):
            offsets.append(offset)
            sizes.append(0)
            base_sizes.append(0)
        starts[doc], shard_of[doc] = offset, len(sizes) - 1
        sizes[-1] += n + 1  # the document and its separator
        offset += n + 1
    shards = tuple(Shard(o, n, b) for o, n, b in zip(offsets, sizes, base_sizes, strict=True))
    return _layout(starts, lengths, base, shard_of=shard_of, shards=shards)


def _layout(starts: dict[int, int], lengths: list[tuple[int, int]], base: BaseVersion | None, **shards) -> StreamLayout:
    num_new = int(sum(n for _, n in lengths))
    return StreamLayout(
        starts=starts, num_documents=len(lengths) + (base.num_documents if base else 0),
        num_tokens=num_new + (base.num_tokens if base else 0), num_new_documents=len(lengths), num_new_tokens=num_new,
        **shards,
    )
