"""Datastore: one committed version of a datastore, loaded for decoding.

Owns opening a version by reference (``NAME``, ``NAME@VERSION``, ``NAME@TAG``) through the
store's commit point, checking its files against the manifest in constant time (every file
present with its recorded size, the suffix index's ``.npy`` headers consistent with the
manifest's counts; full checksums only on request, as ``specstore verify`` does), refusing a
version built for another model or tokenizer (the error names the field), and holding what the
drafters read: the normaliser, the memory-mapped suffix array, the rows' continuations and the
dense index. A compact dense version (``manifest.dense``) has its vectors in memory-mapped int8
files (dense_files.py): loading its dense index maps them and reads only their headers and the
block table, and its continuations come from the token stream. An old-form version's tokens
table is read whole (float32 embeddings and int32 continuations) and sorted at load. A sparse
version (``manifest.index == "sparse"``) has only the suffix index: no
normaliser, no tokens table; asking it for its dense index is a SpecstoreError. Does not own the
store catalogue (store.py), building versions (pipelines/) or drafting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from specstore.runtime.dense import DenseIndex
from specstore.runtime.dense_files import StreamContinuations, ann_file, open_compact
from specstore.runtime.errors import ChecksumError, ManifestMismatchError, SpecstoreError
from specstore.runtime.normaliser import NORMALISER_FILE, Normaliser
from specstore.runtime.sharded_suffix import ShardedSuffixIndex, load_suffix_index
from specstore.runtime.store import REJECTED_FILE, Ref, Store, VersionRecord, verify_files
from specstore.runtime.suffix_array import SuffixIndex
from specstore.schemas.manifest import Manifest, ModelInfo
from specstore.schemas.tables import tokens_schema

# checked in this order: the most telling difference is named first
CHECKED_MODEL_FIELDS = ("tokenizer_hash", "vocab_size", "hidden_size", "revision")


def check_model(manifest: Manifest, info: ModelInfo) -> None:
    """Raise ManifestMismatchError naming the first field where ``info`` differs from the manifest."""
    for name in CHECKED_MODEL_FIELDS:
        expected, actual = getattr(manifest.model, name), getattr(info, name)
        if expected != actual:
            raise ManifestMismatchError(name, expected, actual)


@dataclass
class Datastore:
    """One opened version. ``continuations``: what the dense index's row ids index: for an
    old-form version int32 [N, L] (-1 padded, with ``continuation_lens`` int [N]), one row per
    datastore position in table order; for a compact one a ``StreamContinuations`` over the
    token stream (row ids are stream positions). ``normaliser`` is None for a sparse version."""

    store: Store
    record: VersionRecord
    normaliser: Normaliser | None
    suffix: SuffixIndex | ShardedSuffixIndex
    continuations: np.ndarray | StreamContinuations | None = None
    continuation_lens: np.ndarray | None = None
    dense: DenseIndex | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    prefetching: list = field(default_factory=list)  # open(prefetch=True)'s background threads

    @property
    def manifest(self) -> Manifest:
        return self.record.manifest

    @property
    def ref(self) -> str:
        return f"{self.record.name}@{self.record.version}"

    @property
    def has_dense(self) -> bool:
        """Whether the version has a dense index (tokens table and normaliser): not when sparse."""
        return self.manifest.index == "dense"

    @classmethod
    def open(
        cls,
        store: Store | str | os.PathLike,
        ref: str | Ref,
        model_info: ModelInfo | None = None,
        verify: bool = False,
        *,
        dense: bool = True,
        device: str | torch.device = "cpu",
        prefetch: bool = False,
    ) -> Datastore:
        """Open the version ``ref`` resolves to.

        ``model_info``: the model that will decode with it (``load_model(...).info``); ``None``
        skips the check. ``verify``: also check every file's SHA-256 (reads the whole version;
        ``specstore verify`` does the same). Without it, opening reads only what its size does not
        grow with: each file's size, the suffix index's ``.npy`` headers (memory maps) and the
        normaliser.
        ``dense``: load the tokens table and build the dense index (DReSD needs it, REST does
        not), when the version has one (a sparse version opens without it). ``device``: where the
        dense index searches. ``prefetch``: map the suffix index's pages in a background thread
        after the open (a long-lived server: its first searches then pay no page faults), and a
        compact dense index's pages and approximate indexes (``DenseIndex.prefetch``); the
        threads are ``prefetching``; the open itself still reads only headers.
        """
        store = store if isinstance(store, Store) else Store(store)
        record = store.resolve(ref)
        manifest = record.manifest
        if model_info is not None:
            check_model(manifest, model_info)
        verify_files(store.location, manifest.files, full=verify)
        files = _local_files(store, manifest)
        normaliser = None
        if manifest.index == "dense":
            normaliser = _load(files / NORMALISER_FILE, Normaliser.load)
            _check_normaliser(manifest, normaliser)
        # one suffix array, or shards searched together; drafts end at any id outside the vocabulary
        suffix = _load(files, lambda folder: load_suffix_index(folder, manifest.model.vocab_size))
        _check_suffix(manifest, suffix, files)
        ds = cls(store, record, normaliser, suffix, device=torch.device(device))
        if dense and ds.has_dense:
            ds.load_dense()
        if prefetch:
            ds.prefetching = suffix.prefetch()
            if ds.dense is not None and ds.manifest.dense is not None:  # a compact version's mapped rows and indexes
                ds.prefetching.append(ds.dense.prefetch())
        return ds

    def load_dense(self) -> DenseIndex:
        """The dense index (SpecstoreError for a sparse version, which has none): a compact
        version's files mapped, or an old-form version's tokens table read and sorted."""
        if self.dense is not None:
            return self.dense
        m = self.manifest
        if not self.has_dense:
            raise SpecstoreError(f"datastore {self.ref} is sparse: it has no dense index (tokens table); rebuild it with --index dense")
        if m.dense is not None:
            return self._map_dense()
        try:
            table = self.store.open_table(m.tokens_table)
        except Exception as exc:  # lancedb raises several types for a missing or unreadable table
            raise SpecstoreError(f"cannot open tokens table {m.tokens_table} of {self.ref}: {exc}") from None
        _check_schema(self.ref, m, table.schema)
        try:
            data = table.to_lance().to_table(columns=["embedding", "continuation", "continuation_len"])
        except Exception as exc:
            raise ChecksumError(f"tokens table {m.tokens_table} of {self.ref} is unreadable: {exc}") from None
        embeddings = _fixed_list(data.column("embedding"), m.pca_dims, np.float32)
        self.continuations = _fixed_list(data.column("continuation"), m.continuation_length, np.int32)
        self.continuation_lens = data.column("continuation_len").to_numpy().astype(np.int32)
        self.dense = DenseIndex(embeddings, self.continuations[:, 0] if len(embeddings) else np.zeros(0), self.device)
        return self.dense


    def _map_dense(self) -> DenseIndex:
        m = self.manifest
        store, prefix = self.store, Store.files_rel(m.name, m.build_id)
        fetch = None
        if store.location.remote:  # an approximate index is fetched into the file cache on its block's first search
            from specstore.runtime.file_cache import FileCache

            def fetch(rel: str) -> Path:
                return FileCache().fetch(store.location, f"{prefix}/{rel}", m.files[f"{prefix}/{rel}"])

        files = _local_files(store, m)
        compact = open_compact(files, m.dense, m.pca_dims, m.model.vocab_size, m.files, prefix, fetch)
        self.continuations = StreamContinuations(self.suffix, m.model.vocab_size)
        self.dense = DenseIndex.from_blocks(compact.codes, np.asarray(m.dense.scales, np.float32), compact.positions,
                                            compact.blocks, compact.ann)
        return self.dense


def _local_files(store: Store, manifest: Manifest) -> Path:
    """The version's files folder: in place for a local store; for a remote one, a folder of
    the host's file cache holding what is mapped (not the rejected records, nor the approximate
    indexes, fetched when first used)."""
    if not store.location.remote:
        return store.files_dir(manifest.name, manifest.build_id)
    from specstore.runtime.file_cache import FileCache

    ann = tuple(ann_file(t) for t in manifest.dense.ann_blocks) if manifest.dense is not None else ()
    return FileCache().version_dir(store.location, Store.files_rel(manifest.name, manifest.build_id), manifest.files,
                                   skip=(REJECTED_FILE, *ann))


def _load(path: Path, loader):
    try:
        return loader(path)
    except (OSError, ValueError, KeyError, EOFError) as exc:
        raise ChecksumError(f"datastore file {path} is unreadable: {exc}") from None


def _check_normaliser(manifest: Manifest, normaliser: Normaliser) -> None:
    if normaliser.hidden_size != manifest.model.hidden_size:
        raise ManifestMismatchError("hidden_size", manifest.model.hidden_size, normaliser.hidden_size)
    if normaliser.dims != manifest.pca_dims:
        raise ManifestMismatchError("pca_dims", manifest.pca_dims, normaliser.dims)


def _check_suffix(manifest: Manifest, suffix: SuffixIndex | ShardedSuffixIndex, files: Path) -> None:
    """The mapped arrays' headers against the manifest: 1-D int32 stream, int32/int64 suffix
    array, and one stream entry per token plus one separator per document."""
    for index in getattr(suffix, "shards", None) or [suffix]:
        for what, arr, allowed in (("stream", index.stream, (np.int32,)), ("suffix array", index.sa, (np.int32, np.int64))):
            if arr.ndim != 1 or arr.dtype not in [np.dtype(a) for a in allowed]:
                raise ChecksumError(f"datastore {what} in {files} has dtype {arr.dtype} and shape {arr.shape}, "
                                    f"expected 1-D {' or '.join(np.dtype(a).name for a in allowed)}")
    expected = manifest.num_tokens + manifest.num_documents
    if len(suffix) != expected:
        raise ChecksumError(f"datastore stream in {files} has {len(suffix)} entries, manifest implies {expected} "
                            f"({manifest.num_tokens} tokens + {manifest.num_documents} separators)")


def _check_schema(ref: str, manifest: Manifest, schema: pa.Schema) -> None:
    """The tokens table's columns against the manifest: the compact form when it has ``dense``
    (int8 embeddings, tokens in the vocabulary's narrowest type), else the old form."""
    vocab = manifest.model.vocab_size if manifest.dense is not None else None
    layout = manifest.dense.table_format if manifest.dense is not None else 1
    expected = tokens_schema(manifest.pca_dims, manifest.continuation_length, vocab, layout)
    for f in expected:
        if schema.get_field_index(f.name) < 0:
            raise SpecstoreError(f"tokens table of {ref} has no column '{f.name}'")
        if schema.field(f.name).type != f.type:
            raise SpecstoreError(
                f"tokens table of {ref}: column '{f.name}' is {schema.field(f.name).type}, manifest implies {f.type}"
            )


def _fixed_list(column: pa.ChunkedArray, width: int, dtype) -> np.ndarray:
    """A fixed-size-list column as a [rows, width] array (no per-row Python work)."""
    column = column.combine_chunks()
    if len(column) == 0:
        return np.zeros((0, width), dtype=dtype)
    flat = column.flatten()  # respects a slice offset, unlike .values
    return np.asarray(flat.to_numpy(zero_copy_only=False), dtype=dtype).reshape(len(column), width)
