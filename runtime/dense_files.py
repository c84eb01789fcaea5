"""A dense version's compact files: int8 codes block-sorted by next token, mapped, not read.

Owns the format the build writes and the runtime maps (``manifest.dense``, schemas/manifest.py
``DenseFiles``): the file names under the version's ``dense/`` folder, quantisation (``quantise``,
the one rule the build's table rows, its block files and a query's dequantisation share),
opening them (``open_compact``: memory maps with their headers checked against the manifest, the
small block table read and checked, approximate indexes of large blocks loaded only when their
block is first searched, and only after their checksum matches) and reading continuations from
the token stream (``StreamContinuations``: position p's continuation is the stream after p, cut
at the document's separator). Every id read from a file is checked before it is used: a
damaged file may cost speed, never a crash or a changed output (drafts are verified). Does not
own the search (dense.py) or writing the files (pipelines/writers.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specstore.runtime.errors import ChecksumError
from specstore.runtime.hashing import file_sha256
from specstore.schemas.manifest import DenseFiles, FileInfo

DENSE_DIR = "dense"
VECTORS_FILE = f"{DENSE_DIR}/vectors.npy"
POSITIONS_FILE = f"{DENSE_DIR}/positions.npy"
BLOCKS_FILE = f"{DENSE_DIR}/blocks.npy"
ANN_DIR = f"{DENSE_DIR}/ann"
CODE_MAX = 127  # int8 codes are in [-127, 127]: symmetric, so a code and its negation both exist
ANN_THRESHOLD = 20_000  # default: blocks of at least this many rows get an approximate index (docs/SCALING.md)
SCALE_SIGMAS = 4.0  # a dimension's codes span +-4 of its standard deviations (clipped beyond)

log = logging.getLogger(__name__)


def ann_file(token: int) -> str:
    return f"{ANN_DIR}/{int(token)}.faiss"


def positions_dtype(num_entries: int) -> str:
    """The narrowest stored type for stream positions below ``num_entries``."""
    return "uint32" if num_entries < 2**32 else "int64"


def quantise(vectors: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float [N, D] -> int8 codes [N, D]: ``clip(round(x * scale), -127, 127)`` per dimension."""
    x = np.asarray(vectors, dtype=np.float32) * np.asarray(scales, dtype=np.float32)
    return np.clip(np.rint(x), -CODE_MAX, CODE_MAX).astype(np.int8)


def scales_from_variances(variances: np.ndarray) -> np.ndarray:
    """Per-dimension scales for unit vectors whose unnormalised components have ``variances``
    (the PCA eigenvalues): component j of a unit vector has a standard deviation of about
    ``sqrt(var_j / sum(var))``; codes span ``SCALE_SIGMAS`` of them (at most [-1, 1])."""
    var = np.clip(np.asarray(variances, dtype=np.float64), 0.0, None)
    sigma = np.sqrt(var / max(float(var.sum()), 1e-30))
    span = np.clip(SCALE_SIGMAS * sigma, 1.0 / CODE_MAX, 1.0)
    return (CODE_MAX / span).astype(np.float32)


def block_table(tokens: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64 [B, 3] rows (token, start, end) of blocks of ``counts`` rows in ``tokens`` order."""
    ends = np.cumsum(np.asarray(counts, dtype=np.int64))
    return np.stack([np.asarray(tokens, dtype=np.int64), ends - counts, ends], axis=1) if len(ends) else np.zeros((0, 3), np.int64)


@dataclass
class CompactFiles:
    """A compact version's mapped arrays: ``codes`` int8 [M, D], ``positions`` [M] and the
    checked block table ``blocks`` (token -> (start, end))."""

    codes: np.ndarray
    positions: np.ndarray
    blocks: dict[int, tuple[int, int]]
    ann: Callable[[int], object | None]


def open_compact(folder: Path, dense: DenseFiles, pca_dims: int, vocab_size: int, files: dict[str, FileInfo],
                 files_prefix: str, fetch: Callable[[str], Path] | None = None) -> CompactFiles:
    """Map a version's dense files (``folder``: its files folder). Reads the ``.npy`` headers
    and the block table (its size grows with the vocabulary, not the datastore); a header that
    disagrees with the manifest is a ChecksumError naming the file. A block-table row outside
    the vocabulary or the rows is dropped (that block is then searched as empty).
    ``files``/``files_prefix``: the manifest's checksums, for an index file's check on first
    use; ``fetch``: how to get an index file of a remote store (None: it is in ``folder``)."""
    codes = _mapped(folder / VECTORS_FILE, np.int8, (dense.num_rows, pca_dims))
    positions = _mapped(folder / POSITIONS_FILE, np.dtype(dense.positions_dtype), (dense.num_rows,))
    try:
        table = np.load(folder / BLOCKS_FILE)
    except (OSError, ValueError, EOFError) as exc:
        raise ChecksumError(f"datastore file {folder / BLOCKS_FILE} is unreadable: {exc}") from None
    if table.ndim != 2 or table.shape[1] != 3 or table.dtype != np.int64:
        raise ChecksumError(f"datastore file {folder / BLOCKS_FILE} has dtype {table.dtype} and shape {table.shape}, expected int64 [B, 3]")
    ok = (table[:, 0] >= 0) & (table[:, 0] < vocab_size) & (table[:, 1] >= 0) & (table[:, 1] <= table[:, 2]) & (table[:, 2] <= dense.num_rows)
    blocks = {int(t): (int(s), int(e)) for t, s, e in table[ok]}
    ann = AnnIndexes(folder, dense, files, files_prefix, fetch)
    return CompactFiles(codes, positions, blocks, ann)


def _mapped(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:
        raise ChecksumError(f"datastore file {path} is unreadable: {exc}") from None
    if arr.dtype != np.dtype(dtype) or arr.shape != shape:
        raise ChecksumError(f"datastore file {path} has dtype {arr.dtype} and shape {arr.shape}, manifest implies {np.dtype(dtype)} {shape}")
    return arr


class AnnIndexes:
    """The approximate indexes of a version's large blocks, each read into memory on its
    block's first search (about 30 B per row of the block) after the file's SHA-256 matches the
    manifest: faiss does not check what it reads, so a damaged file is never handed to it (that
    block is then scanned exactly, and a warning says which file)."""

    def __init__(self, folder: Path, dense: DenseFiles, files: dict[str, FileInfo], prefix: str, fetch):
        self.folder, self.files, self.prefix, self.fetch = folder, files, prefix.rstrip("/"), fetch
        self.tokens = set(dense.ann_blocks)
        self.nprobe, self.rerank = dense.ann_nprobe, dense.ann_rerank
        self.loaded: dict[int, object | None] = {}
        self._lock = threading.Lock()

    def load_all(self) -> int:
        """Read every block's index now instead of on its first search (``Datastore.open``'s
        ``prefetch``: a long-lived server's searches then never wait for one); returns how many
        are usable. Resident memory grows by the indexes' bytes (about 17 B per indexed row)."""
        return sum(self(t) is not None for t in sorted(self.tokens))

    def __call__(self, token: int):
        if token not in self.tokens:
            return None
        if token in self.loaded:
            return self.loaded[token]
        with self._lock:
            if token not in self.loaded:
                self.loaded[token] = self._load(token)
        return self.loaded[token]

    def _load(self, token: int):
        rel = ann_file(token)
        info = self.files.get(f"{self.prefix}/{rel}")
        try:
            path = self.fetch(rel) if self.fetch is not None else self.folder / rel
            if info is None or file_sha256(path) != info.sha256:
                raise ChecksumError("checksum mismatch")
            import faiss

            # read whole: faiss's memory-mapped inverted lists (IO_FLAG_MMAP) searched 30-80x
            # slower here (p50 1.4-3.6 ms against 0.045 ms on a 52k-row block)
            index = faiss.read_index(str(path))
            faiss.extract_index_ivf(index).nprobe = self.nprobe
            return ApproximateBlock(index, self.rerank)
        except Exception as exc:  # any failure: the block is scanned exactly instead
            log.warning("approximate index %s unusable (%s): block %d is searched exactly", rel, exc, token)
            return None


@dataclass
class ApproximateBlock:
    """One block's faiss index and how many candidates per wanted neighbour it proposes
    (``DenseIndex`` reranks them exactly on the block's int8 rows)."""

    index: object
    rerank: int

    def candidates(self, query: np.ndarray, count: int) -> np.ndarray:
        """Up to ``count`` row offsets in the block (-1 where it has fewer), best first."""
        _, ids = self.index.search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), int(count))
        return ids[0]


FEW_DRAFTS = 16  # StreamContinuations.drafts: up to this many positions in Python lists, more in one gather


class StreamContinuations:
    """Continuations read from a version's token stream (plain or sharded suffix index):
    ``draft(position, next_token, length)`` is the stream after ``position + 1`` (the pending
    token), at most ``length`` tokens, cut at the document's separator or any id outside the
    vocabulary; empty when ``position`` is outside the stream or the token after it is not
    ``next_token`` (a damaged positions file)."""

    def __init__(self, suffix, vocab_size: int):
        shards = getattr(suffix, "shards", None)
        self.streams = [s.stream for s in shards] if shards else [suffix.stream]
        self.offsets = np.cumsum([0] + [len(s) for s in self.streams]).astype(np.int64)
        self.vocab_size = int(vocab_size)

    def draft(self, position: int, next_token: int, length: int) -> list[int]:
        shard = int(np.searchsorted(self.offsets, position, side="right")) - 1
        if position < 0 or shard >= len(self.streams):
            return []
        stream, local = self.streams[shard], position - int(self.offsets[shard])
        window = np.asarray(stream[local + 1 : local + 2 + length], dtype=np.int64)
        if window.size == 0 or window[0] != next_token:
            return []
        bad = np.flatnonzero((window[1:] < 0) | (window[1:] >= self.vocab_size))
        return window[1 : 1 + (int(bad[0]) if bad.size else window.size - 1)].tolist()

    def _few_drafts(self, positions: list[int], next_token: int, length: int) -> list[list[int]]:
        """``drafts`` of a few positions in Python lists over a plain view of the one stream:
        slices of a few dozen tokens, where each numpy call after a forward costs more (the
        same drafts as the gather below)."""
        view = self.__dict__.get("_view")
        if view is None:
            view = self._view = np.asarray(self.streams[0])  # an ndarray over the map: no memmap per slice
        n, vocab, out = view.shape[0], self.vocab_size, []
        for p in positions:
            window = view[p + 1 : p + 2 + length].tolist() if 0 <= p < n else []
            if not window or window[0] != next_token:
                out.append([])
                continue
            draft = window[1:]
            for i, t in enumerate(draft):
                if t < 0 or t >= vocab:
                    draft = draft[:i]
                    break
            out.append(draft)
        return out

    def drafts(self, positions, next_token: int, length: int) -> list[list[int]]:
        """``draft`` for each of ``positions`` (a search's neighbours), in order: one gather of
        all their windows from an unsharded stream (one ``draft`` call each costs ~15 us of
        memory-map slicing, i.e. ~0.15 ms of a 10-neighbour propose); shards go one by one."""
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(self.streams) != 1 or length <= 0 or positions.size == 0:
            return [self.draft(int(p), next_token, length) for p in positions.tolist()]
        if positions.size <= FEW_DRAFTS:
            return self._few_drafts(positions.tolist(), next_token, length)
        stream = self.streams[0]
        n = len(stream)
        at = positions[:, None] + 1 + np.arange(length + 1, dtype=np.int64)  # window: stream[p + 1 : p + 2 + length]
        inside = (positions[:, None] >= 0) & (at < n)
        window = np.asarray(stream[np.clip(at, 0, max(n - 1, 0))], dtype=np.int64) if n else np.zeros(at.shape, np.int64)
        ok = inside[:, 0] & (window[:, 0] == next_token)
        bad = ~inside[:, 1:] | (window[:, 1:] < 0) | (window[:, 1:] >= self.vocab_size)
        cut = np.where(bad.any(axis=1), bad.argmax(axis=1), length)
        return [window[i, 1 : 1 + int(cut[i])].tolist() if ok[i] else [] for i in range(len(positions))]
