"""The dense index over a datastore version's reduced embeddings (DReSD's retriever).

Owns nearest-neighbour search by inner product over the L2-normalised PCA embeddings of one
version (inner product = cosine), optionally restricted to the positions whose stored next token
equals a given token (DReSD's filter). Does not own the query transform (normaliser.py), loading
the rows (datastore.py) or turning neighbours into drafts (drafters/dresd.py).

Layout: rows are sorted once by their stored next token, so the positions sharing a next token
are one contiguous block. A filtered search is then an *exact* matrix-vector product over that
block only, on the CPU (numpy) or on a GPU (torch, everything resident on the device). The blocks
are small (a datastore's most frequent token is a few percent of it), which is why this beats an
approximate index here: the filter shrinks the search to one block at no loss of recall, while
an ANN index answers the unfiltered question, whose neighbours the filter then mostly drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NO_NEXT_TOKEN = -1  # stored next token of a document's last position (nothing follows it)


@dataclass(slots=True)
class Neighbours:
    """``rows``: int64 [k] row indices into the arrays the index was built from, best first;
    ``scores``: float32 [k] inner products."""

    rows: np.ndarray
    scores: np.ndarray

    def __len__(self) -> int:
        return int(self.rows.shape[0])


class DenseIndex:
    """Exact inner-product search, whole or restricted to one next-token block.

    ``embeddings``: float32 [N, D] (unit rows); ``next_tokens``: int [N], ``-1`` where no token
    follows. ``device``: where vectors live and products run (``cpu`` or a CUDA device).
    """

    def __init__(self, embeddings: np.ndarray, next_tokens: np.ndarray, device: str | torch.device = "cpu"):
        embeddings = np.asarray(embeddings, dtype=np.float32)
        next_tokens = np.asarray(next_tokens, dtype=np.int64)
        if embeddings.ndim != 2 or embeddings.shape[0] != next_tokens.shape[0]:
            raise ValueError(f"embeddings {embeddings.shape} and next_tokens {next_tokens.shape} do not line up")
        self.device = torch.device(device)
        self.dims = int(embeddings.shape[1])
        order = np.argsort(next_tokens, kind="stable")
        self.rows = order.astype(np.int64)  # block-sorted position -> original row
        sorted_tokens = next_tokens[order]
        tokens, starts, counts = np.unique(sorted_tokens, return_index=True, return_counts=True)
        self._blocks = {int(t): (int(s), int(s + c)) for t, s, c in zip(tokens, starts, counts, strict=True)}
        vectors = np.ascontiguousarray(embeddings[order])
        if self.device.type == "cpu":
            self._vectors = vectors
            self._torch_vectors = None
        else:
            self._vectors = None
            self._torch_vectors = torch.from_numpy(vectors).to(self.device)
            self._torch_rows = torch.from_numpy(self.rows).to(self.device)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def block_size(self, next_token: int) -> int:
        start, end = self._blocks.get(int(next_token), (0, 0))
        return end - start

    def search(self, query: torch.Tensor | np.ndarray, k: int, next_token: int | None = None) -> Neighbours:
        """The ``k`` rows with the largest inner product with ``query`` [D], best first; with
        ``next_token``, only among rows whose stored next token equals it (fewer if the block is
        smaller; none if it is empty)."""
        if next_token is None:
            start, end = 0, len(self)
        else:
            start, end = self._blocks.get(int(next_token), (0, 0))
        k = min(int(k), end - start)
        if k <= 0:
            return Neighbours(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
        if self._torch_vectors is not None:
            return self._search_torch(query, k, start, end)
        q = query.detach().float().cpu() if isinstance(query, torch.Tensor) else torch.from_numpy(np.asarray(query, np.float32))
        # the product runs in torch (zero-copy views), not numpy: numpy's BLAS threads keep
        # spinning after a call and then slow the target's next forward ~3x on a 2-core CPU
        scores = (torch.from_numpy(self._vectors[start:end]) @ q.reshape(-1)).numpy()
        if k < scores.shape[0]:
            part = np.argpartition(-scores, k - 1)[:k]
        else:
            part = np.arange(scores.shape[0])
        best = part[np.lexsort((part, -scores[part]))]  # by score, ties by position: deterministic
        return Neighbours(self.rows[start + best], scores[best].astype(np.float32))

    def _search_torch(self, query, k: int, start: int, end: int) -> Neighbours:
        q = torch.as_tensor(query).to(self.device, torch.float32).reshape(-1)
        scores = self._torch_vectors[start:end] @ q
        top = torch.topk(scores, k, sorted=True)
        rows = self._torch_rows[start:end][top.indices]
        # one transfer: the drafter builds its tree on the host
        both = torch.stack([rows.to(torch.float64), top.values.to(torch.float64)]).cpu().numpy()
        return Neighbours(both[0].astype(np.int64), both[1].astype(np.float32))
