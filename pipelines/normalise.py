"""Fitting the normaliser from sufficient statistics that combine across workers.

Owns the *fit* half of runtime/normaliser.py: per-batch statistics (count, sum, sum of outer
products, all float64), merging them in any order, and turning the total into a z-score plus
a PCA of the z-scored covariance (``eigh``), so no process ever holds the corpus' vectors.
Applying the transform is the runtime's (runtime/normaliser.py), so queries and rows match.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specstore.runtime.normaliser import _EPS, Normaliser


@dataclass(slots=True)
class NormStats:
    """Sufficient statistics of a set of hidden states: ``n``, ``total`` [H], ``outer`` [H, H]."""

    n: int
    total: np.ndarray
    outer: np.ndarray

    @classmethod
    def empty(cls, hidden_size: int) -> NormStats:
        return cls(0, np.zeros(hidden_size), np.zeros((hidden_size, hidden_size)))

    @classmethod
    def of(cls, x: np.ndarray) -> NormStats:
        """Statistics of rows ``x`` [N, H] (accumulated in float64).

        The product runs in torch, not numpy: numpy's OpenBLAS threads keep spinning after a
        call, and on a small CPU that slows the next embedding forward."""
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
        return cls(int(t.shape[0]), t.sum(dim=0).numpy(), (t.T @ t).numpy())

    def merge(self, other: NormStats) -> NormStats:
        """Sum of two statistics (in place on self, returned for chaining)."""
        if self.n == 0:
            return NormStats(other.n, other.total.copy(), other.outer.copy())
        if other.n:
            self.n += other.n
            self.total += other.total
            self.outer += other.outer
        return self


def sample_rows(x: np.ndarray, max_rows: int | None) -> np.ndarray:
    """An evenly strided, deterministic subset of at most ``max_rows`` rows (all when None)."""
    if max_rows is None or len(x) <= max_rows:
        return x
    return x[np.linspace(0, len(x) - 1, max_rows).round().astype(np.int64)]


def fit_normaliser(stats: NormStats, dims: int) -> Normaliser:
    """z-score with the population std, then the top ``dims`` principal axes of the z-scored data.

    Components are the eigenvectors of the z-scored covariance with the largest eigenvalues,
    each signed so that its largest-magnitude entry is positive (a deterministic choice).
    """
    hidden = stats.total.shape[0]
    if stats.n < 2:
        raise ValueError(f"need at least 2 vectors to fit the normaliser, got {stats.n}")
    if not 0 < dims <= hidden:
        raise ValueError(f"pca_dims must be in 1..{hidden} (the hidden size), got {dims}")
    mean = stats.total / stats.n
    cov = stats.outer / stats.n - np.outer(mean, mean)
    std = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    scale = np.maximum(std, _EPS)  # the same floor Normaliser.apply uses
    z_cov = cov / np.outer(scale, scale)
    eigvals, eigvecs = np.linalg.eigh((z_cov + z_cov.T) / 2)
    order = np.argsort(eigvals)[::-1][:dims]
    components = eigvecs[:, order].T
    signs = np.sign(components[np.arange(dims), np.abs(components).argmax(axis=1)])
    components *= np.where(signs == 0, 1.0, signs)[:, None]
    return Normaliser(mean=mean, std=std, components=components, pca_mean=np.zeros(hidden),
                      variances=np.clip(eigvals[order], 0.0, None))
