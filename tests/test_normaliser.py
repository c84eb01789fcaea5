"""The normaliser's apply: numpy and torch paths agree, unit norm, persistence round trip."""

import numpy as np
import pytest
import torch

from specstore.runtime.normaliser import Normaliser


def random_normaliser(h=12, d=4, seed=0) -> Normaliser:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(h, h)))
    return Normaliser(mean=rng.normal(size=h), std=rng.uniform(0.5, 2, size=h), components=q[:d], pca_mean=rng.normal(size=h) * 0.1)


def test_apply_is_zscore_pca_l2(tmp_path):
    norm = random_normaliser()
    x = np.random.default_rng(1).normal(size=(5, 12))
    expected = ((x - norm.mean) / norm.std - norm.pca_mean) @ norm.components.T
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    out = norm.apply(x)
    assert out.dtype == np.float32 and out.shape == (5, 4)
    np.testing.assert_allclose(out, expected, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(norm.apply_torch(torch.tensor(x, dtype=torch.float32)).numpy(), out, atol=1e-5)
    norm.save(tmp_path / "n.npz")
    again = Normaliser.load(tmp_path / "n.npz")
    np.testing.assert_allclose(again.apply(x), out, atol=1e-7)


def test_wrong_hidden_size_is_an_error():
    with pytest.raises(ValueError, match="hidden size"):
        random_normaliser().apply(np.zeros((2, 7)))
