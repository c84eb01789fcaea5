"""Pure numeric steps of the build: the streaming normaliser fit (against sklearn's PCA, with
statistics combined from parts), continuation padding, row tables and length batching."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.decomposition import PCA

from specstore.pipelines.embed import padded_width, plan_batches
from specstore.pipelines.normalise import NormStats, fit_normaliser, sample_rows
from specstore.pipelines.rows import continuations, rows_table
from specstore.schemas.tables import PAD_TOKEN, tokens_schema


def _data(seed=0, n=600, h=12):
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(h, h))
    return rng.normal(size=(n, h)) @ mixing * rng.uniform(0.1, 10, size=h) + rng.normal(size=h) * 5


def test_fit_matches_sklearn_pca_of_zscored_data():
    x = _data()
    norm = fit_normaliser(NormStats.of(x), dims=5)
    z = (x - x.mean(0)) / x.std(0)
    pca = PCA(n_components=5).fit(z)
    np.testing.assert_allclose(norm.mean, x.mean(0), rtol=1e-10)
    np.testing.assert_allclose(norm.std, x.std(0), rtol=1e-10)
    # same axes up to sign
    np.testing.assert_allclose(np.abs(norm.components @ pca.components_.T), np.eye(5), atol=1e-8)
    projected = pca.transform(z) * np.sign(np.diag(norm.components @ pca.components_.T))
    expected = projected / np.linalg.norm(projected, axis=1, keepdims=True)
    np.testing.assert_allclose(norm.apply(x), expected, atol=1e-5)


def test_combined_partial_statistics_equal_the_whole():
    x = _data(seed=1)
    parts = [NormStats.of(p) for p in np.array_split(x, 7)]
    total = NormStats.empty(x.shape[1])
    for p in reversed(parts):  # order does not matter
        total = total.merge(p)
    whole = NormStats.of(x)
    assert total.n == whole.n
    np.testing.assert_allclose(total.outer, whole.outer, rtol=1e-12)
    a, b = fit_normaliser(total, 4), fit_normaliser(whole, 4)
    np.testing.assert_allclose(a.components, b.components, atol=1e-9)  # deterministic sign too


def test_fit_rejects_bad_sizes():
    with pytest.raises(ValueError, match="at least 2"):
        fit_normaliser(NormStats.of(np.ones((1, 4))), 2)
    with pytest.raises(ValueError, match="pca_dims"):
        fit_normaliser(NormStats.of(_data(h=4)), 5)


def test_constant_dimension_does_not_blow_up():
    x = _data(h=6)
    x[:, 2] = 3.0
    out = fit_normaliser(NormStats.of(x), 3).apply(x)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-5)


def test_sample_rows_is_even_and_deterministic():
    x = np.arange(100)[:, None]
    assert sample_rows(x, 5)[:, 0].tolist() == [0, 25, 50, 74, 99]
    assert sample_rows(x, None) is x


def test_continuations_pad_at_document_end():
    cont, num = continuations(np.array([5, 6, 7, 8]), 3)
    assert cont.tolist() == [[6, 7, 8], [7, 8, PAD_TOKEN], [8, PAD_TOKEN, PAD_TOKEN], [PAD_TOKEN] * 3]
    assert num.tolist() == [3, 2, 1, 0]
    cont, num = continuations(np.array([1]), 2)
    assert cont.tolist() == [[PAD_TOKEN, PAD_TOKEN]] and num.tolist() == [0]


def test_rows_table_offsets_and_schema():
    docs = [np.array([1, 2, 3], np.int32), np.array([4, 5], np.int32)]
    emb = np.arange(10, dtype=np.float32).reshape(5, 2)
    table = rows_table([7, 9], docs, [0, 4], emb, 2)
    assert table.schema == tokens_schema(2, 2)
    d = table.to_pydict()
    assert d["doc_id"] == [7, 7, 7, 9, 9]
    assert d["position"] == [0, 1, 2, 0, 1]
    assert d["offset"] == [0, 1, 2, 4, 5]
    assert d["continuation"] == [[2, 3], [3, -1], [-1, -1], [5, -1], [-1, -1]]
    assert d["embedding"][4] == [8.0, 9.0]
    with pytest.raises(ValueError):
        rows_table([7], docs[:1], [0], emb, 2)


def test_padded_widths_are_few_and_tight():
    widths = [padded_width(n) for n in range(1, 2049)]
    assert all(w >= n for n, w in enumerate(widths, start=1))
    assert all(w <= n + 15 if n <= 64 else w < 1.125 * n for n, w in enumerate(widths, start=1))
    assert widths == sorted(widths)  # never shorter for a longer document
    assert sorted(set(widths))[:7] == [16, 32, 48, 64, 72, 80, 88] and len(set(widths)) == 44
    assert padded_width(128) == 128 and padded_width(129) == 144 and padded_width(2048) == 2048
    assert padded_width(3) == padded_width(16) != padded_width(17)


def test_plan_batches_one_width_per_batch_and_full_batches():
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(1, 700, size=300)] + [5000]
    budget = 1024
    batches = plan_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert batches[0] == [300]  # the longest first, alone past the budget
    by_width: dict[int, list[list[int]]] = {}
    for b in batches:
        widths = {padded_width(lengths[i]) for i in b}
        assert len(widths) == 1  # one padded shape per batch
        width = widths.pop()
        assert len(b) == 1 or len(b) * width <= budget
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
        by_width.setdefault(width, []).append(b)
    for width, group in by_width.items():  # every batch of a width but its last is full
        assert all(len(b) == max(1, budget // width) for b in group[:-1])
        assert 0 < len(group[-1]) <= max(1, budget // width)
    # so the shapes a build meets are bounded: at most two per width
    shapes = {(len(b), padded_width(max(lengths[i] for i in b))) for b in batches}
    assert len(shapes) <= 2 * len(by_width)
