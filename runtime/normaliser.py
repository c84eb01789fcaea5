"""The normaliser: hidden state -> per-dimension z-score -> PCA projection -> L2 unit vector.

Owns *applying* the transform (identically to datastore rows and to live queries) and its
persistence. Fitting it from corpus statistics is the pipelines' job (pipelines/normalise.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

NORMALISER_FILE = "normaliser.npz"
_EPS = 1e-6


@dataclass(frozen=True)
class Normaliser:
    """``mean``, ``std``: [H]; ``components``: [D, H] (rows are principal axes); ``pca_mean``: [H];
    ``variances``: [D] the variance along each axis (the PCA eigenvalues; None in a file written
    before they were kept), from which a compact version's int8 scales come (``code_scales``)."""

    mean: np.ndarray
    std: np.ndarray
    components: np.ndarray
    pca_mean: np.ndarray
    variances: np.ndarray | None = None

    @property
    def hidden_size(self) -> int:
        return int(self.mean.shape[0])

    @property
    def dims(self) -> int:
        return int(self.components.shape[0])

    def apply(self, hidden: np.ndarray) -> np.ndarray:
        """[..., H] float -> [..., D] float32, unit L2 norm (computed in float64 for stability)."""
        h = np.asarray(hidden, dtype=np.float64)
        if h.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden size {h.shape[-1]} does not match normaliser's {self.hidden_size}")
        # in torch, not numpy: numpy's OpenBLAS threads spin after a product and slow whatever
        # runs next on a small CPU (the build's next embedding forward, the runtime's next step)
        return self._transform(torch.from_numpy(h)).to(torch.float32).numpy()

    def apply_torch(self, hidden: torch.Tensor) -> torch.Tensor:
        """Same transform on a torch tensor on any device: [..., H] -> [..., D] float32."""
        return self._transform(hidden.float())

    def _transform(self, hidden: torch.Tensor) -> torch.Tensor:
        """z-score, PCA projection and L2 norm in ``hidden``'s dtype and on its device, as one
        affine map: ``((h - mean) / std - pca_mean) @ C.T`` = ``h @ (C / std).T - offset`` (the
        folded parameters are computed in float64, then converted once per device and dtype; one
        product instead of three passes over the hidden state)."""
        weight, bias = self.folded(hidden.device, hidden.dtype)
        p = torch.addmm(bias, hidden.reshape(-1, hidden.shape[-1]), weight).reshape(*hidden.shape[:-1], -1)
        return p / p.norm(dim=-1, keepdim=True).clamp_min(_EPS)

    def folded(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The transform's affine part as ``(weight [H, D], bias [D])``, contiguous, in ``dtype`` on
        ``device``: ``(h - mean) / std - pca_mean`` projected is ``h @ weight + bias`` (computed in
        float64 once, converted once per device and dtype). The L2 norm follows it (``_transform``;
        runtime/dense.py's one-call search runs both in the kernel)."""
        key = (torch.device(device), dtype)
        params = self._tensors.get(key)
        if params is None:
            scaled = np.asarray(self.components, dtype=np.float64) / np.maximum(self.std, _EPS)  # [D, H]
            offset = (np.asarray(self.mean, dtype=np.float64) + np.maximum(self.std, _EPS) * self.pca_mean) @ scaled.T
            params = self._tensors[key] = (torch.as_tensor(np.ascontiguousarray(scaled.T), dtype=dtype, device=device),
                                           torch.as_tensor(-offset, dtype=dtype, device=device).contiguous())
        return params

    @property
    def eps(self) -> float:
        """The floor of the projected vector's norm before the L2 division."""
        return _EPS

    def __post_init__(self) -> None:
        object.__setattr__(self, "_tensors", {})

    def code_scales(self) -> np.ndarray:
        """Per-dimension int8 scales of this transform's unit vectors (dense_files.quantise):
        from the axes' variances, or one scale over [-1, 1] when they are unknown."""
        from specstore.runtime.dense_files import CODE_MAX, scales_from_variances

        if self.variances is None:
            return np.full(self.dims, CODE_MAX, dtype=np.float32)
        return scales_from_variances(self.variances)

    def save(self, path: Path) -> None:
        extra = {} if self.variances is None else {"variances": self.variances}
        np.savez(path, mean=self.mean, std=self.std, components=self.components, pca_mean=self.pca_mean, **extra)

    @classmethod
    def load(cls, path: Path) -> Normaliser:
        with np.load(path) as data:
            return cls(
                mean=data["mean"].astype(np.float64),
                std=data["std"].astype(np.float64),
                components=data["components"].astype(np.float64),
                pca_mean=data["pca_mean"].astype(np.float64),
                variances=data["variances"].astype(np.float64) if "variances" in data.files else None,
            )
