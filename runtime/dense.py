"""The dense index over a datastore version's reduced embeddings (DReSD's retriever).

Owns nearest-neighbour search by inner product over the L2-normalised PCA embeddings of one
version (inner product = cosine), optionally restricted to the positions whose stored next token
equals a given token (DReSD's filter). Does not own the query transform (normaliser.py), loading
the rows (datastore.py) or turning neighbours into drafts (drafters/dresd.py).

Layout: rows are sorted by their stored next token, so the positions sharing a next token are
one contiguous block. A filtered search is then a matrix-vector product over that block only:
the filter shrinks the search to one block at no loss of recall, while an unfiltered ANN index
answers the unfiltered question, whose neighbours the filter then mostly drops.

Two ways to get there, one search. An old-form version's float32 rows are sorted here, at load
(``DenseIndex(embeddings, next_tokens)``; on the CPU, or everything resident on a GPU). A
compact version's build wrote them sorted (dense_files.py): ``DenseIndex.from_blocks`` takes its
memory-mapped int8 codes, their per-dimension scales, the row ids and the block table as they
are, and reads a block's codes only when a search asks for it. A block with an approximate index
(faiss, built for blocks above the build's threshold) is searched through it: its candidates are
reranked exactly on the int8 rows; a block without one is scanned exactly. Every row id and
block bound read from a file is checked: a damaged file may cost recall, never a crash.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from specstore.runtime import gemm

NO_NEXT_TOKEN = -1  # stored next token of a document's last position (nothing follows it)


@dataclass(slots=True)
class Neighbours:
    """``rows``: int64 [k] row indices into the arrays the index was built from, best first;
    ``scores``: float32 [k] inner products; ``next_token``: the block searched (None: all)."""

    rows: np.ndarray
    scores: np.ndarray
    next_token: int | None = None

    def __len__(self) -> int:
        return int(self.rows.shape[0])


SCAN_CHUNK = 1 << 14  # rows of a mapped block converted and scored at once (bounded temporary memory)
# blocks above this many rows find their top k with torch.topk first; smaller ones in numpy at once
# (np.partition over a few thousand scores costs less than the four more torch ops, each of which
# runs on cold caches right after a forward)
TOPK_FROM = 4096
# int8 (or read-only mapped) rows converted to float32 are kept for the next search of the same
# block, least recently used dropped first, up to this many bytes an index: a decode searches the
# blocks of common tokens again and again, and converting a block costs more than scoring it
CONVERTED_CACHE_BYTES = 64 << 20


class DenseIndex:
    """Inner-product search, whole or restricted to one next-token block.

    ``embeddings``: float32 [N, D] (unit rows); ``next_tokens``: int [N], ``-1`` where no token
    follows. ``device``: where vectors live and products run (``cpu`` or a CUDA device).
    ``from_blocks`` makes one over already block-sorted (mapped) arrays instead.
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
        self._scales = None
        self._ann = None
        vectors = np.ascontiguousarray(embeddings[order])
        self._init_converted()
        if self.device.type == "cpu":
            self._vectors = vectors
            self._torch_vectors = None
        else:
            self._vectors = None
            self._torch_vectors = torch.from_numpy(vectors).to(self.device)
            self._torch_rows = torch.from_numpy(self.rows).to(self.device)

    @classmethod
    def from_blocks(cls, codes: np.ndarray, scales: np.ndarray | None, rows: np.ndarray, blocks: dict[int, tuple[int, int]],
                    ann=None) -> DenseIndex:
        """An index over rows already sorted into blocks, used as they are (memory maps stay
        maps; nothing is copied or sorted). ``codes``: [M, D], float32 vectors or int8 codes with
        per-dimension ``scales`` (vector = code / scale); ``rows``: [M] the id each sorted row
        answers with; ``blocks``: next token -> (start, end) into them, each within [0, M];
        ``ann``: None, or a callable token -> that block's approximate index or None (an object
        with ``rerank`` and ``candidates(query, count)`` -> row offsets in the block, as
        dense_files.ApproximateBlock). Searches run on the CPU."""
        self = cls.__new__(cls)
        self.device = torch.device("cpu")
        self.dims = int(codes.shape[1])
        self.rows = rows
        self._blocks = blocks
        self._scales = None if scales is None else np.asarray(scales, dtype=np.float32)
        self._ann = ann
        self._vectors = codes
        self._torch_vectors = None
        self._init_converted()
        return self

    def _init_converted(self) -> None:
        self._converted: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._converted_bytes = 0
        self._converted_lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def prefetch(self) -> threading.Thread:
        """Map every page of the mapped rows and row ids, then read every approximate index,
        in a background thread (started and returned): a long-lived server's first searches then
        pay neither page faults nor an index's read. Changes no result."""
        thread = threading.Thread(target=self._warm, name="specstore-dense-prefetch", daemon=True)
        thread.start()
        return thread

    def _warm(self) -> None:
        from specstore.runtime.suffix_array import touch_pages

        touch_pages(*(a for a in (self._vectors, self.rows) if isinstance(a, np.ndarray)))
        load_all = getattr(self._ann, "load_all", None)
        if load_all is not None:
            load_all()

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
        q = q.reshape(-1)
        if self._scales is not None:  # code . (q / scale) = (code / scale) . q: the dequantised product
            q = q / torch.from_numpy(self._scales)
        index = self._ann(int(next_token)) if self._ann is not None and next_token is not None else None
        if index is not None:
            best, scores = self._search_ann(index, query, q, k, start, end)
        else:
            best, scores = self._scan(q, k, start, end)
        return Neighbours(np.asarray(self.rows[start + best], dtype=np.int64), scores.astype(np.float32), next_token)

    def search_hidden(self, normaliser, hidden: torch.Tensor, k: int, next_token: int) -> Neighbours:
        """``search(normaliser.apply_torch(hidden), k, next_token)``: the ``k`` rows of the
        ``next_token`` block nearest to the target's state ``hidden`` [H] under the version's
        transform. On the CPU with the kernel (gemm.dense_top) the transform, the block's exact
        scan and its top k are one call (an approximate block: the transform, then its index and
        rerank as ``search``), the results those of ``search`` up to float32 rounding (sums in
        another order: a near tie may order differently); elsewhere ``search`` itself."""
        if self._torch_vectors is None and gemm.has_dense():
            found = self._search_kernel(normaliser, hidden, k, next_token)
            if found is not None:
                return found
        return self.search(normaliser.apply_torch(hidden.reshape(-1)), k, next_token=next_token)

    def _search_kernel(self, normaliser, hidden: torch.Tensor, k: int, next_token: int) -> Neighbours | None:
        start, end = self._blocks.get(int(next_token), (0, 0))
        k = min(int(k), end - start)
        if k <= 0:
            return Neighbours(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
        weight, bias = normaliser.folded(torch.device("cpu"), torch.float32)
        index = self._ann(int(next_token)) if self._ann is not None else None
        if index is not None:  # the query from the kernel, the block through its approximate index
            got = gemm.dense_top(hidden, weight, bias, normaliser.eps, None, None, 0, want_query=True)
            if got is None:
                return None
            query = got[2]
            ids = self._candidates(index, query, k, start, end)
            found = gemm.dense_rerank(query, self._scales, self._vectors[start:end], ids, k)
            if found is not None:
                best, scores = found
            else:
                q = torch.from_numpy(query / self._scales if self._scales is not None else query)
                best, scores = self._rerank(ids, q, k, start, end)
        else:
            got = gemm.dense_top(hidden, weight, bias, normaliser.eps, self._scales, self._vectors[start:end], k)
            if got is None:
                return None
            best, scores = got[0], got[1]
        return Neighbours(np.asarray(self.rows[start + best], dtype=np.int64), scores.astype(np.float32), next_token)

    def _scan(self, q: torch.Tensor, k: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top ``k`` of the block: (offsets into it, scores), best first."""
        # the product runs in torch (zero-copy views), not numpy: numpy's BLAS threads keep
        # spinning after a call and then slow the target's next forward ~3x on a 2-core CPU;
        # rows are converted SCAN_CHUNK at a time (bounded temporary memory), scores kept whole
        parts = [self._block_tensor(lo, min(lo + SCAN_CHUNK, end)) @ q for lo in range(start, end, SCAN_CHUNK)]
        scores = parts[0] if len(parts) == 1 else torch.cat(parts)
        if TOPK_FROM < scores.shape[0] and k < scores.shape[0]:
            # torch.topk finds the cut (at 19k rows a sixth of numpy's 0.18 ms); _top orders what reaches it
            keep = torch.nonzero(scores >= torch.topk(scores, k, sorted=False).values.min()).flatten()
            return _top(scores[keep].numpy(), keep.numpy(), k)
        return _top(scores.numpy(), np.arange(scores.shape[0]), k)

    def _block_tensor(self, start: int, end: int) -> torch.Tensor:
        block = self._vectors[start:end]
        if block.dtype == np.float32 and block.flags.writeable:
            return torch.from_numpy(block)
        key = (start, end)  # int8 codes (or a read-only map): converted once, kept while there is room
        with self._converted_lock:
            hit = self._converted.get(key)
            if hit is not None:
                self._converted.move_to_end(key)
                return hit
        converted = torch.from_numpy(np.array(block, dtype=np.float32))
        size = converted.numel() * 4
        if size <= CONVERTED_CACHE_BYTES:
            with self._converted_lock:
                if key not in self._converted:
                    self._converted[key] = converted
                    self._converted_bytes += size
                while self._converted_bytes > CONVERTED_CACHE_BYTES:
                    _, old = self._converted.popitem(last=False)
                    self._converted_bytes -= old.numel() * 4
        return converted

    def _search_ann(self, index, query, q: torch.Tensor, k: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The block's approximate index proposes ``k * rerank`` candidates; the exact int8
        product over those rows ranks them. Ids outside the block (a damaged index) are dropped.
        (With the kernel, _search_kernel reranks them in one call: gemm.dense_rerank.)"""
        return self._rerank(self._candidates(index, query, k, start, end), q, k, start, end)

    @staticmethod
    def _candidates(index, query, k: int, start: int, end: int) -> np.ndarray:
        """The approximate index's ``k * rerank`` candidate offsets into the block (int64, as it
        gives them: -1 past its last, possibly repeated or outside the block when damaged)."""
        raw = query.detach().float().cpu().numpy() if isinstance(query, torch.Tensor) else np.asarray(query, np.float32)
        return np.ascontiguousarray(index.candidates(raw, min(end - start, k * index.rerank)), dtype=np.int64)

    def _rerank(self, ids: np.ndarray, q: torch.Tensor, k: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best of the candidate offsets ``ids`` by the exact product with ``q``."""
        ids = np.unique(ids[(ids >= 0) & (ids < end - start)])
        if ids.size == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        codes = np.asarray(self._vectors[start + ids], dtype=np.float32)
        scores = (torch.from_numpy(codes) @ q).numpy()
        return _top(scores, ids, min(k, ids.size))

    def _search_torch(self, query, k: int, start: int, end: int) -> Neighbours:
        q = torch.as_tensor(query).to(self.device, torch.float32).reshape(-1)
        scores = self._torch_vectors[start:end] @ q
        top = torch.topk(scores, k, sorted=True)
        rows = self._torch_rows[start:end][top.indices]
        # one transfer: the drafter builds its tree on the host
        both = torch.stack([rows.to(torch.float64), top.values.to(torch.float64)]).cpu().numpy()
        return Neighbours(both[0].astype(np.int64), both[1].astype(np.float32))


def _top(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best (ids, scores), by score, ties by id: deterministic (every entry tied with the
    k-th best competes for the last places by id)."""
    n = scores.shape[0]
    k = min(k, n)
    if k < n:
        part = np.flatnonzero(scores >= np.partition(scores, n - k)[n - k])
    else:
        part = np.arange(n)
    best = part[np.lexsort((ids[part], -scores[part]))][:k]
    return ids[best].astype(np.int64), scores[best]
