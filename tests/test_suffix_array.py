"""Suffix array construction and search against brute force."""

import numpy as np
import pytest

from specstore.runtime.suffix_array import (
    SEPARATOR,
    SuffixIndex,
    build_suffix_array,
    join_documents,
    save_suffix_index,
)


def brute_sa(stream: np.ndarray) -> np.ndarray:
    return np.array(sorted(range(len(stream)), key=lambda i: stream[i:].tolist()), dtype=np.int64)


def brute_positions(stream: np.ndarray, pattern: list[int]) -> list[int]:
    k = len(pattern)
    return [i for i in range(len(stream) - k + 1) if stream[i : i + k].tolist() == pattern]


@pytest.mark.parametrize("seed", range(6))
def test_suffix_array_equals_brute_force_sort(seed):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 1 + seed * 3, size=rng.integers(0, 60)) for _ in range(rng.integers(1, 8))]
    stream, starts = join_documents(docs)
    sa = build_suffix_array(stream)
    assert sa.dtype == np.int32
    np.testing.assert_array_equal(sa, brute_sa(stream))
    assert len(starts) == len(docs)
    for d, doc in zip(starts, docs, strict=True):
        np.testing.assert_array_equal(stream[d : d + len(doc)], doc)
        assert stream[d + len(doc)] == SEPARATOR


def test_every_ngram_lookup_matches_brute_force_scan(tmp_path):
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 5, size=n) for n in (30, 1, 0, 45, 12)]
    stream, _ = join_documents(docs)
    save_suffix_index(tmp_path, stream, build_suffix_array(stream))
    index = SuffixIndex.load(tmp_path)  # memory-mapped
    assert isinstance(index.sa, np.memmap)
    checked = 0
    for doc in docs:
        for n in range(1, 6):
            for i in range(len(doc) - n + 1):
                pattern = doc[i : i + n].tolist()
                assert index.positions(pattern).tolist() == brute_positions(stream, pattern)
                checked += 1
    assert checked > 300
    # patterns that do not occur, incl. one that only exists across a document boundary
    assert index.positions([99]).size == 0
    cross = docs[0][-2:].tolist() + docs[1][:1].tolist()
    assert index.positions(cross).tolist() == brute_positions(stream, cross)
    for pos in index.positions(cross):
        assert SEPARATOR not in stream[pos : pos + len(cross)]


def test_longest_suffix_match_and_continuations_stop_at_document_end():
    docs = [[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7], [3, 4]]
    stream, _ = join_documents(docs)
    index = SuffixIndex(stream, build_suffix_array(stream))
    m = index.longest_suffix_match([8, 8, 2, 3, 4], max_len=16, min_len=2)
    assert m.length == 3 and m.count == 2
    conts = index.continuations(m, 3)
    assert sorted(map(tuple, conts.tolist())) == [(5, 6, SEPARATOR), (7, SEPARATOR, SEPARATOR)]
    assert index.longest_suffix_match([8, 8], min_len=2) is None
    assert index.longest_suffix_match([4], min_len=2) is None  # shorter than min_len
    m = index.longest_suffix_match([3, 4])
    assert m.count == 3
    # continuation of the occurrence at a document's very end is all padding
    assert (SEPARATOR, SEPARATOR) in set(map(tuple, index.continuations(m, 2).tolist()))
    assert index.continuations(m, 2, max_matches=1).shape == (1, 2)


def test_longest_match_is_the_longest_on_random_streams():
    rng = np.random.default_rng(3)
    stream, _ = join_documents([rng.integers(0, 3, size=200) for _ in range(3)])
    index = SuffixIndex(stream, build_suffix_array(stream))
    for _ in range(50):
        ctx = rng.integers(0, 3, size=20).tolist()
        m = index.longest_suffix_match(ctx, max_len=12, min_len=2)
        best = max((k for k in range(2, 13) if brute_positions(stream, ctx[-k:])), default=None)
        assert (m.length if m else None) == best
        if m:
            assert sorted(index.sa[m.lo : m.hi].tolist()) == brute_positions(stream, ctx[-m.length :])


def test_empty_and_invalid_inputs():
    stream, starts = join_documents([])
    assert stream.size == 0 and starts.size == 0
    assert build_suffix_array(stream).size == 0
    with pytest.raises(ValueError):
        join_documents([[1, -3]])
    with pytest.raises(ValueError):
        SuffixIndex(np.zeros(3, np.int32), np.zeros(2, np.int32))


@pytest.mark.parametrize(("gather_max", "samples"), [(2, 3), (4, 4), (7, 16), (2048, 256)])
def test_sampled_bisection_finds_every_interval_exactly(gather_max, samples):
    """Large intervals are narrowed by sampled bisection, small ones by one gather of the rest
    of the pattern: with tiny thresholds every level of a random stream takes the sampled path,
    and every n-gram's interval must still equal the brute-force occurrences."""
    rng = np.random.default_rng(gather_max + samples)
    docs = [rng.integers(0, 3, size=n) for n in (300, 120, 1, 0, 80)]
    stream, _ = join_documents(docs)
    index = SuffixIndex(stream, build_suffix_array(stream))
    index.gather_max, index.samples = gather_max, samples
    for n in (1, 2, 3, 5, 8):
        for _ in range(40):
            doc = docs[int(rng.integers(0, 2))]
            i = int(rng.integers(0, len(doc) - n))
            pattern = doc[i : i + n].tolist()
            found = index.find(pattern)
            assert found.length == n
            assert sorted(index.sa[found.lo : found.hi].tolist()) == brute_positions(stream, pattern)
        absent = [3] + rng.integers(0, 3, size=n - 1).tolist()  # 3 never occurs
        assert index.find(absent).count == 0
    ctx = docs[0][-20:].tolist()
    m = index.longest_suffix_match(ctx, max_len=12, min_len=2)
    best = max(k for k in range(2, 13) if brute_positions(stream, ctx[-k:]))
    assert m.length == best


def test_a_shuffled_suffix_array_costs_matches_not_a_crash():
    """Sampled bisection assumes sorted ranks; on a damaged (shuffled, out-of-range) array it
    must still return intervals inside the array and continuations of real tokens only."""
    rng = np.random.default_rng(5)
    stream, _ = join_documents([rng.integers(0, 4, size=500)])
    sa = build_suffix_array(stream)
    rng.shuffle(sa)
    sa[::7] = rng.integers(-10**6, 10**6, size=sa[::7].shape)
    index = SuffixIndex(stream, sa, vocab_size=4)
    index.gather_max, index.samples = 4, 5
    for _ in range(100):
        pattern = rng.integers(0, 4, size=int(rng.integers(1, 6))).tolist()
        m = index.find(pattern)
        assert 0 <= m.lo <= m.hi <= len(stream)
        rows = index.continuations(m, 4, max_matches=50, spread=True)
        assert rows.shape[1] == 4 and (((rows >= 0) & (rows < 4)) | (rows == SEPARATOR)).all()


def test_first_token_ranks_give_every_first_level_interval(tmp_path):
    rng = np.random.default_rng(11)
    docs = [rng.integers(0, 9, size=n) for n in (50, 0, 30, 7)]
    stream, _ = join_documents(docs)
    sa = build_suffix_array(stream)
    assert "first_token_ranks.npy" in save_suffix_index(tmp_path, stream, sa)
    with_table = SuffixIndex.load(tmp_path)
    without = SuffixIndex(stream, sa)
    assert with_table.first_ranks is not None and without.first_ranks is None
    for pattern in [[t] for t in range(-1, 12)] + [docs[0][i : i + 3].tolist() for i in range(40)] + [[8, 9], [99, 1]]:
        a, b = with_table.find(pattern), without.find(pattern)
        assert a.count == b.count == len(brute_positions(stream, pattern))
        if a.count:
            assert (a.lo, a.hi) == (b.lo, b.hi)
    # a damaged table (not from 0 to n, or falling) is not used: it costs the shortcut only
    bad = np.load(tmp_path / "first_token_ranks.npy")
    for damaged in (bad[::-1].copy(), np.where(np.arange(bad.size) == 3, 10**9, bad), bad[:-1]):
        assert SuffixIndex(stream, sa, first_ranks=damaged).first_ranks is None


def test_prefetch_maps_the_pages_in_the_background_and_changes_no_result(tmp_path):
    rng = np.random.default_rng(2)
    stream, _ = join_documents([rng.integers(0, 50, size=30_000)])
    save_suffix_index(tmp_path, stream, build_suffix_array(stream))
    index = SuffixIndex.load(tmp_path)
    before = [index.find(stream[i : i + 4].tolist()) for i in range(0, 3000, 97)]
    [thread] = index.prefetch()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert [index.find(stream[i : i + 4].tolist()) for i in range(0, 3000, 97)] == before


@pytest.mark.parametrize("sa_dtype", [np.int32, np.int64])
def test_the_kernels_longest_match_equals_the_numpy_search(tmp_path, sa_dtype):
    """SuffixIndex.longest_suffix_match in one kernel call (gemm.sa_longest) finds the length and
    interval the numpy search finds: on random streams, with and without the first-token ranks,
    memory-mapped; on a damaged (shuffled, out-of-range) array it stays inside the array."""
    from specstore.runtime import gemm

    if not gemm.available():
        pytest.skip(f"no CPU kernel here: {gemm.unavailable_reason()}")
    rng = np.random.default_rng(11)
    docs = [rng.integers(0, 4, size=n) for n in (400, 150, 1, 0, 90)]
    stream, _ = join_documents(docs)
    save_suffix_index(tmp_path, stream, build_suffix_array(stream))
    mapped = SuffixIndex.load(tmp_path)
    plain = SuffixIndex(stream, build_suffix_array(stream).astype(sa_dtype))
    calls = []
    real = gemm.sa_longest
    gemm_spy = lambda *a: calls.append(1) or real(*a)  # noqa: E731
    for index in (mapped, plain):
        assert index._sa.dtype in (np.int32, np.int64)
        reference = SuffixIndex(index.stream, index.sa, first_ranks=index.first_ranks)
        reference.native = False
        for _ in range(150):
            doc = docs[int(rng.integers(0, 2))]
            end = int(rng.integers(1, len(doc)))
            ctx = doc[max(0, end - 20) : end].tolist() + rng.integers(0, 5, size=int(rng.integers(0, 3))).tolist()
            max_len, min_len = int(rng.integers(1, 17)), int(rng.integers(1, 4))
            gemm.sa_longest, before = gemm_spy, len(calls)
            try:
                got = index.longest_suffix_match(ctx, max_len, min_len)
            finally:
                gemm.sa_longest = real
            want = reference.longest_suffix_match(ctx, max_len, min_len)
            assert (got is None) == (want is None)
            if got is not None:
                assert (got.length, got.lo, got.hi) == (want.length, want.lo, want.hi)
            assert len(calls) == before + (min(max_len, len(ctx)) >= min_len)
    assert mapped.first_ranks is not None
    sa = build_suffix_array(stream).astype(sa_dtype)
    rng.shuffle(sa)
    sa[::7] = rng.integers(-10**6, 10**6, size=sa[::7].shape)
    damaged = SuffixIndex(stream, sa, vocab_size=4)
    for _ in range(100):
        m = damaged.longest_suffix_match(rng.integers(0, 5, size=12).tolist(), 8, 1)
        assert m is None or 0 <= m.lo < m.hi <= len(stream)
