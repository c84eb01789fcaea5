"""The build's pure contracts: the stream layout and its shard maths, and the build summary
(its sums over fragments and its JSON form, which is how it crosses from pipeline to driver)."""

from __future__ import annotations

import numpy as np
import pytest

from specstore.pipelines.append import BaseVersion
from specstore.pipelines.layout import Shard, assign_shards, stream_layout
from specstore.pipelines.summary import BuildSummary, SourceCounts, WrittenFragment, summarise
from specstore.runtime.suffix_array import join_documents


def _base(lengths: list[int], shard_tokens: int | None, centroid=(1.0, 2.0)) -> BaseVersion:
    """A parent version of documents with ``lengths`` (and its shards, as a sharded build made them)."""
    shards = ()
    if shard_tokens is not None:
        shards = tuple((s.offset, s.length) for s in assign_shards(list(enumerate(lengths)), shard_tokens).shards)
    return BaseVersion(
        version=1, build_id="parent", files_dir="", table_uri="", num_documents=len(lengths), num_tokens=sum(lengths),
        sources=(), embedding_sum=tuple(c * sum(lengths) for c in centroid), shards=shards,
    )


def test_stream_layout_matches_the_joined_stream():
    docs = {7: [1, 2, 3], 2: [4], 5: [], 9: [5, 6]}
    layout = stream_layout([(d, len(t)) for d, t in docs.items()])
    _, starts = join_documents([docs[d] for d in sorted(docs)])
    assert layout.starts == dict(zip(sorted(docs), starts.tolist(), strict=True))
    assert (layout.num_documents, layout.num_tokens, layout.num_entries) == (4, 6, 10)
    assert (layout.num_new_documents, layout.num_new_tokens) == (4, 6) and layout.shards == ()


def test_stream_layout_of_an_append_starts_after_the_parent():
    base = _base([3, 4], None)
    layout = stream_layout([(10, 2), (11, 5)], base)
    assert layout.starts == {10: 9, 11: 12}  # the parent's 7 tokens and 2 separators come first
    assert (layout.num_documents, layout.num_tokens, layout.num_new_documents, layout.num_new_tokens) == (4, 14, 2, 7)


def test_shards_fill_in_doc_id_order_and_a_long_document_gets_its_own():
    layout = assign_shards([(3, 2), (1, 4), (2, 3), (4, 20)], max_tokens=10)
    # entries: doc1 5, doc2 4 (9 <= 10), doc3 3 (12 > 10: new shard), doc4 21 (alone)
    assert layout.shards == (Shard(0, 9), Shard(9, 3), Shard(12, 21))
    assert layout.shard_of == {1: 0, 2: 0, 3: 1, 4: 2}
    assert layout.starts == {1: 0, 2: 5, 3: 9, 4: 12}
    assert sum(s.length for s in layout.shards) == layout.num_entries


def test_an_append_fills_the_parent_last_shard_as_a_full_build_would():
    parent, new = [4, 3, 2], [1, 6, 2]
    full = assign_shards(list(enumerate(parent + new)), max_tokens=10)
    base = _base(parent, 10)
    appended = assign_shards([(len(parent) + i, n) for i, n in enumerate(new)], 10, base)
    assert [(s.offset, s.length) for s in appended.shards] == [(s.offset, s.length) for s in full.shards]
    assert [s.base_length for s in appended.shards] == [n for _, n in base.shards] + [0] * (len(full.shards) - len(base.shards))
    assert [s.takes_new_documents for s in appended.shards[: len(base.shards)]] == [False, True]
    assert {d: full.starts[d] for d in appended.starts} == appended.starts
    assert (appended.num_documents, appended.num_tokens, appended.num_new_tokens) == (6, 18, 9)


def test_parent_shards_that_disagree_with_its_manifest_are_an_internal_error():
    base = _base([4, 3], 10)
    broken = BaseVersion(**{**base.__dict__, "num_tokens": base.num_tokens + 1})
    with pytest.raises(RuntimeError, match="parent's shards hold"):
        assign_shards([(5, 1)], 10, broken)


def test_summary_orders_fragments_by_stream_and_adds_the_parent():
    layout = stream_layout([(3, 2), (4, 1)], _base([3], None))
    written = [
        WrittenFragment(first_offset=7, fragments=("b",), num_rows=1, embedding_sum=(1.0, 1.0)),
        WrittenFragment(first_offset=4, fragments=("a1", "a2"), num_rows=2, embedding_sum=(2.0, 0.0)),
    ]
    summary = summarise(written, layout, _base([3], None, centroid=(0.0, 1.0)), num_rejected=1, source_indices=[2, 3],
                        read_counts={2: 3}, rejected_counts={2: 1})
    assert summary.fragments == ("a1", "a2", "b")
    assert summary.num_rows == 6 == summary.num_tokens  # 3 new rows and the parent's 3
    np.testing.assert_allclose(summary.domain_centroid, [3.0 / 6, 4.0 / 6])
    assert summary.sources == {2: SourceCounts(3, 1), 3: SourceCounts(0, 0)}


def test_summary_json_round_trip(tmp_path):
    summary = BuildSummary(
        num_documents=2, num_tokens=5, num_new_documents=2, num_new_tokens=5, num_rows=5, num_rejected=0,
        fragments=('{"id": 0}',), domain_centroid=(0.1, 1 / 3), sources={0: SourceCounts(2, 0), 11: SourceCounts(1, 1)},
    )
    summary.write(tmp_path / "staging" / "summary.json")
    assert BuildSummary.read(tmp_path / "staging" / "summary.json") == summary
    empty = BuildSummary(0, 0, 0, 0, 0, 3, (), None, {0: SourceCounts(3, 3)})
    assert BuildSummary.from_json(empty.to_json()) == empty
