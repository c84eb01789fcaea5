"""Retrieval sources (runtime/retrieval.py) and ReSpec's pool over them: the context source,
the suffix-array source on a plain and a sharded index (one interface, the same answers), the
dense source, and the pool's keys, all on hand-made data checked against brute force."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specstore.runtime.dense import DenseIndex
from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.drafters.respec_pool import CandidatePool, PoolConfig
from specstore.runtime.normaliser import Normaliser
from specstore.runtime.retrieval import (
    DenseSource,
    SuffixSample,
    context_continuations,
    context_matches,
    ranked_drafts,
    suffix_sample,
)
from specstore.runtime.sharded_suffix import ShardedSuffixIndex
from specstore.runtime.suffix_array import SEPARATOR, SuffixIndex, build_suffix_array, join_documents
from specstore.schemas.tables import PAD_TOKEN


def _index(docs) -> SuffixIndex:
    stream, _ = join_documents([np.asarray(d, dtype=np.int32) for d in docs])
    return SuffixIndex(stream, build_suffix_array(stream))


def _sharded(docs, cuts) -> ShardedSuffixIndex:
    return ShardedSuffixIndex([_index(docs[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)])


# --- context -------------------------------------------------------------------------------


def test_context_matches_finds_the_longest_suffix_ngram_earlier():
    tokens = np.array([1, 2, 3, 9, 2, 3, 4, 1, 2, 3])
    n, starts = context_matches(tokens, max_ngram=4)
    assert n == 3 and starts.tolist() == [3]  # "1 2 3" occurs at 0; its continuation starts at 3
    n, starts = context_matches(tokens, max_ngram=2)
    assert n == 2 and starts.tolist() == [3, 6]  # "2 3" at 1 and 4, ascending
    assert context_matches(np.array([5, 6, 7]), 3)[0] == 0  # nothing earlier
    assert context_matches(np.array([5, 6, 5]), 3, min_ngram=2)[0] == 0  # only a 1-gram would match
    n, starts = context_matches(np.array([7, 7, 7, 7]), 2)
    assert n == 2 and starts.tolist() == [2, 3]  # overlapping occurrences, each with a following token


def _context_matches_by_windows(tokens: np.ndarray, max_ngram: int, min_ngram: int = 1):
    """The definition, one window scan per n (the implementation before 2026-12-01)."""
    from numpy.lib.stride_tricks import sliding_window_view

    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
        if len(hits):
            return n, hits + n
    return 0, np.zeros(0, dtype=np.int64)


@pytest.mark.parametrize("path", ["kernel", "numpy"])
def test_context_matches_equals_the_window_scan_on_random_contexts(path, monkeypatch):
    from specstore.runtime import gemm

    if path == "numpy":
        monkeypatch.setattr(gemm, "context_matches", lambda *a, **k: None)
    elif not gemm.available():
        pytest.skip(f"no CPU kernel here: {gemm.unavailable_reason()}")
    rng = np.random.default_rng(7)
    for trial in range(3000):
        size = int(rng.integers(1, 60))
        vocab = int(rng.choice([2, 3, 5, 20]))  # small vocabularies: long and overlapping repeats
        tokens = rng.integers(0, vocab, size)
        max_ngram, min_ngram = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        got = context_matches(tokens, max_ngram, min_ngram)
        want = _context_matches_by_windows(tokens, max_ngram, min_ngram)
        assert got[0] == want[0] and got[1].tolist() == want[1].tolist(), (trial, tokens.tolist(), max_ngram, min_ngram)


def test_context_continuations_full_length_most_recent_first_and_distinct():
    tokens = np.array([4, 5, 6, 4, 5, 6, 4, 7, 8, 4])
    found = context_continuations(tokens, length=2, num=5, max_ngram=1)
    assert [(c.offset, c.tokens) for c in found] == [(7, [7, 8]), (4, [5, 6])]  # offset 1 repeats [5, 6]
    assert [c.tokens for c in context_continuations(tokens, length=2, num=1, max_ngram=1)] == [[7, 8]]
    # the recent occurrences are cut by the context's end (3 and 6 tokens): the full one comes first
    found = context_continuations(tokens, length=9, num=3, max_ngram=1)
    assert [c.tokens for c in found] == [[5, 6, 4, 5, 6, 4, 7, 8, 4], [5, 6, 4, 7, 8, 4], [7, 8, 4]]
    recent = context_continuations(tokens, length=9, num=3, max_ngram=1, full_first=False)
    assert [c.tokens for c in recent] == [[7, 8, 4], [5, 6, 4, 7, 8, 4], [5, 6, 4, 5, 6, 4, 7, 8, 4]]
    # a repetitive stream: the latest occurrence drafts one token, the run's start all of them
    run = np.array([9, 7, 7, 7, 7, 7, 7, 7])
    assert context_continuations(run, length=4, num=1, max_ngram=2)[0].tokens == [7, 7, 7, 7]
    assert context_continuations(np.array([1, 2, 3]), 4, 2, 3) == []


def test_context_continuations_are_the_same_from_the_kernel_and_from_numpy(monkeypatch):
    """Occurrences, order, drafts and each one's match back (up to match_cap) agree between the
    kernel's one call (gemm.context_matches) and the numpy search with matched_back."""
    from specstore.runtime import gemm

    if not gemm.available():
        pytest.skip(f"no CPU kernel here: {gemm.unavailable_reason()}")
    rng = np.random.default_rng(8)
    real = gemm.context_matches
    for trial in range(1500):
        tokens = rng.integers(0, int(rng.choice([2, 3, 6])), int(rng.integers(2, 80)))
        args = (int(rng.integers(1, 12)), int(rng.integers(1, 4)), int(rng.integers(1, 5)), int(rng.integers(1, 4)))
        cap = int(rng.choice([0, 2, 16]))
        monkeypatch.setattr(gemm, "context_matches", real)
        got = context_continuations(tokens, *args, match_cap=cap)
        monkeypatch.setattr(gemm, "context_matches", lambda *a, **k: None)
        want = context_continuations(tokens, *args, match_cap=cap)
        assert [(c.offset, c.tokens, c.match) for c in got] == [(c.offset, c.tokens, c.match) for c in want], trial


# --- suffix array --------------------------------------------------------------------------

DOCS = [[1, 2, 3, 4, 5], [9, 2, 3, 4, 7, 8], [2, 3, 4, 5, 0], [6, 2, 3], [2, 3, 4, 7, 1]]


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_suffix_sample_rows_are_what_follows_each_occurrence(kind):
    index = _index(DOCS) if kind == "plain" else _sharded(DOCS, [0, 1, 3, 5])
    stream, _ = join_documents([np.asarray(d, dtype=np.int32) for d in DOCS])  # global offsets
    sample = suffix_sample(index, [0, 0, 2, 3, 4], 3, max_span=8, min_span=2, max_matches=100)
    assert isinstance(sample, SuffixSample) and (sample.match_length, sample.num_matches) == (3, 4)
    assert sorted(sample.offsets.tolist()) == [4, 10, 16, 26]  # just after each "2 3 4" (documents at 0, 6, 13, 19, 23)
    for row, offset in zip(sample.rows.tolist(), sample.offsets.tolist(), strict=True):
        want = stream[offset : offset + 3].tolist()
        want = want[: want.index(SEPARATOR)] if SEPARATOR in want else want
        assert [t for t in row if t != SEPARATOR] == want and row[: len(want)] == want  # padded after a document's end
    assert suffix_sample(index, [8, 8, 8], 3, max_span=8, min_span=2, max_matches=100) is None
    capped = suffix_sample(index, [2, 3], 3, max_span=8, min_span=2, max_matches=2)
    assert capped.num_matches == 5 and len(capped.rows) == len(capped.offsets) == 2


def test_ranked_drafts_by_shared_prefixes_and_earliest_offset():
    rows = np.array([[5, 0, SEPARATOR], [7, 8, SEPARATOR], [5, 6, SEPARATOR], [7, 1, SEPARATOR], [5, 0, SEPARATOR]])
    sample = SuffixSample(3, 5, rows.astype(np.int32), np.array([40, 10, 4, 27, 15]))
    found = ranked_drafts(sample, 3)
    # first tokens: 5 three times, 7 twice; then "5 0" (twice) before "5 6"
    assert [(c.tokens, c.offset) for c in found] == [([5, 0], 15), ([5, 6], 4), ([7, 1], 27)]
    assert len(ranked_drafts(sample, 9)) == 4 and ranked_drafts(sample, 0) == []


def test_plain_and_sharded_indexes_give_the_same_drafts():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 5, rng.integers(2, 25)).tolist() for _ in range(40)]
    plain, sharded = _index(docs), _sharded(docs, [0, 9, 10, 31, 40])
    for _ in range(100):
        doc = docs[rng.integers(len(docs))]
        context = rng.integers(0, 5, 2).tolist() + doc[: int(rng.integers(1, len(doc) + 1))]
        a = suffix_sample(plain, context, 4, max_span=6, min_span=1, max_matches=10_000)
        b = suffix_sample(sharded, context, 4, max_span=6, min_span=1, max_matches=10_000)
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert (a.match_length, a.num_matches) == (b.match_length, b.num_matches)
        assert sorted(zip(a.offsets.tolist(), a.rows.tolist(), strict=True)) == sorted(zip(b.offsets.tolist(), b.rows.tolist(), strict=True))
        assert ranked_drafts(a, 3) == ranked_drafts(b, 3)


# --- dense ---------------------------------------------------------------------------------


def _dense_source(num: int = 30, dims: int = 4, length: int = 4):
    rng = np.random.default_rng(1)
    hidden = rng.normal(size=(num, dims))
    identity = Normaliser(np.zeros(dims), np.ones(dims), np.eye(dims), np.zeros(dims))
    vectors = identity.apply(hidden)
    continuations = rng.integers(3, 6, (num, length)).astype(np.int32)  # next tokens 3..5
    continuations[::4, 2:] = PAD_TOKEN  # some rows end their document early
    continuations[1, 1:] = PAD_TOKEN  # nothing after the pending token
    return DenseSource(identity, DenseIndex(vectors, continuations[:, 0]), continuations), hidden, continuations


def test_dense_source_finds_the_nearest_rows_with_the_pending_token():
    source, hidden, cont = _dense_source()
    for row in (0, 5, 13):
        pending = int(cont[row, 0])
        found = source.search(torch.tensor(hidden[row], dtype=torch.float32), pending, k=3)
        assert found.rows[0] == row  # a row's own state is its nearest neighbour
        assert all(cont[r, 0] == pending for r in found.rows.tolist())
        assert len(found) == min(3, int((cont[:, 0] == pending).sum()))
    assert len(source.search(torch.zeros(4), 7, k=3)) == 0  # no row is followed by token 7
    assert len(source.search(torch.zeros(4), 0, k=0)) == 0


def test_dense_source_drafts_stop_at_the_documents_end():
    source, hidden, cont = _dense_source()
    found = source.search(torch.tensor(hidden[0], dtype=torch.float32), int(cont[0, 0]), k=30)
    drafts = source.drafts(found, length=9)
    assert source.max_length == 3
    expected = []
    for r in found.rows.tolist():
        tail = cont[r, 1:].tolist()
        tail = tail[: tail.index(PAD_TOKEN)] if PAD_TOKEN in tail else tail
        if tail:
            expected.append((r + 1, tail))
    assert [(d.offset, d.tokens) for d in drafts] == expected
    assert all(len(d.tokens) <= 1 for d in source.drafts(found, length=1))
    with pytest.raises(ValueError, match="rows but continuations"):
        DenseSource(source.normaliser, source.index, cont[:-1])


# --- the pool ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_pool_keys_each_source_by_offset_minus_context_length(kind):
    suffix = _index(DOCS) if kind == "plain" else _sharded(DOCS, [0, 2, 5])
    source, hidden, cont = _dense_source()
    datastore = SimpleNamespace(suffix=suffix, dense=source.index, normaliser=source.normaliser, continuations=cont)
    pool = CandidatePool(datastore, PoolConfig(num_context=1, num_suffix=2, num_dense=2, suffix_beside_dense=True))
    tokens = [2, 3, 4, 0, 6, 2, 3, 4]
    state = DecodeState(tokens=tokens, num_prompt=3, last_hidden=torch.tensor(hidden[5], dtype=torch.float32),
                        budget=8)
    found = pool.gather(state, 3)
    by_source = {s: [c for c in found if c.source == s] for s in ("context", "suffix", "dense")}
    assert [c.key for c in by_source["context"]] == [("context", 3 - len(tokens))]  # "2 3 4" at 0, draft from 3
    assert by_source["context"][0].tokens == [0, 6, 2]
    suffix_want = ranked_drafts(suffix_sample(suffix, tokens, 3, max_span=16, min_span=2, max_matches=64), 2)
    assert [(c.key, c.tokens) for c in by_source["suffix"]] == [(("suffix", d.offset - len(tokens)), d.tokens) for d in suffix_want]
    span = suffix_sample(suffix, tokens, 3, max_span=16, min_span=2, max_matches=64).match_length
    assert span >= 2 and all(c.match == span for c in by_source["suffix"])  # the suffix they continue (cost-aware signal)
    dense_want = source.drafts(source.search(state.last_hidden, tokens[-1], 2), 3)
    assert [(c.key, c.tokens) for c in by_source["dense"]] == [(("dense", d.offset - len(tokens)), d.tokens) for d in dense_want]
    assert all(c.match == 0 for c in by_source["dense"])
    assert all(by_source.values())  # every source found something
    assert [c.source for c in found[:3]] == ["context", "suffix", "dense"]  # interleaved by rank, each source's best first
    # without a datastore, the context alone; without a dense index, no dense candidates
    assert {c.source for c in CandidatePool(None).gather(state, 3)} == {"context"}
    no_dense = SimpleNamespace(suffix=suffix, dense=None, normaliser=None, continuations=None)
    assert "dense" not in {c.source for c in CandidatePool(no_dense).gather(state, 3)}
    assert CandidatePool(datastore).gather(state, 0) == []


def test_pool_drafts_from_the_suffix_array_only_in_steps_without_the_dense_source():
    source, hidden, cont = _dense_source()
    suffix = _index(DOCS)
    datastore = SimpleNamespace(suffix=suffix, dense=source.index, normaliser=source.normaliser, continuations=cont)
    tokens = [2, 3, 4, 0, 6, 2, 3, 4]
    with_hidden = DecodeState(tokens=tokens, num_prompt=3, last_hidden=torch.tensor(hidden[5], dtype=torch.float32), budget=8)
    without = DecodeState(tokens=tokens, num_prompt=3, last_hidden=None, budget=8)

    def sources(config, state):
        return {c.source for c in CandidatePool(datastore, config).gather(state, 3)}

    assert sources(PoolConfig(), with_hidden) == {"context", "dense"}  # the default: dense in the suffix's place
    assert sources(PoolConfig(suffix_beside_dense=True), with_hidden) == {"context", "suffix", "dense"}
    assert sources(PoolConfig(), without) == {"context", "suffix"}  # no hidden state: no dense search, the suffix array
    assert sources(PoolConfig(num_dense=0), with_hidden) == {"context", "suffix"}
    sparse = SimpleNamespace(suffix=suffix, dense=None, normaliser=None, continuations=None)
    assert {c.source for c in CandidatePool(sparse).gather(with_hidden, 3)} == {"context", "suffix"}
    with pytest.raises(ValueError, match="suffix_beside_dense must be True or False"):
        PoolConfig(suffix_beside_dense="yes")
