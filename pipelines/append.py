"""Append: a new version made of the newest one plus the sources it lacks.

Owns everything an append does that a full build does not: what the steps need to know of the
parent (``BaseVersion``), which of the parent's settings it keeps and which sources are new
(both used by planning, plan.py), and reusing the parent's files without copying bytes: its
token stream ahead of the new documents, its suffix-array shards that take no new documents and
its table fragments, hard-linked into the new version. Where new documents go in the stream is
the layout's (layout.py); the parent's normaliser is reused like any given one (writers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specstore.pipelines.corpus import Source
from specstore.pipelines.files import local_copy
from specstore.runtime.errors import ManifestMismatchError, SpecstoreError
from specstore.runtime.sharded_suffix import SHARDS_DIR, shard_dir
from specstore.runtime.storage import Location
from specstore.runtime.store import Store, VersionRecord
from specstore.runtime.suffix_array import INDEX_FILES, STREAM_FILE
from specstore.schemas.manifest import DenseFiles, Manifest, ModelInfo, SourceInfo

if TYPE_CHECKING:
    from specstore.pipelines.layout import StreamLayout
    from specstore.pipelines.plan import BuildPlan

# what must match between the parent's model and the one given for the new rows to fit its own
MODEL_FIELDS = ("tokenizer_hash", "vocab_size", "hidden_size", "revision")


@dataclass(frozen=True)
class BaseVersion:
    """The committed version an append extends: its files and the sizes its rows start after."""

    version: int
    build_id: str
    files_dir: str  # a local path, or a URI in a remote store
    table_uri: str
    num_documents: int
    num_tokens: int
    sources: tuple[SourceInfo, ...]  # the parent's, listed before the new ones in the manifest
    embedding_sum: tuple[float, ...]  # domain_centroid x num_tokens, to combine with the new rows
    shards: tuple[tuple[int, int], ...] = ()  # (stream offset, stream length) of each suffix-array shard; () if one array
    index: str = "dense"  # a sparse parent has no table rows
    files_rel: str = ""  # the files folder relative to the store's root
    dense: DenseFiles | None = None  # a compact parent's dense files

    @property
    def num_rows(self) -> int:
        """Rows of the parent's tokens table: one per token, none when sparse."""
        return self.num_tokens if self.index == "dense" else 0

    @property
    def num_entries(self) -> int:
        """Length of the parent's stream: its tokens and one separator per document."""
        return self.num_tokens + self.num_documents

    @property
    def num_rejected(self) -> int:
        return sum(s.num_rejected for s in self.sources)

    @classmethod
    def of(cls, store: Store, record: VersionRecord) -> BaseVersion:
        m = record.manifest
        centroid = m.domain_centroid or []
        rel = Store.files_rel(m.name, m.build_id)
        shards, offset = [], 0
        prefix = f"{rel}/{SHARDS_DIR}/"
        for stream in sorted(f for f in m.files if f.startswith(prefix) and f.endswith("/" + STREAM_FILE)):  # shard order
            length = _npy_length(store.location, stream)
            shards.append((offset, length))
            offset += length
        return cls(
            version=record.version, build_id=m.build_id, files_dir=store.location.child(rel), files_rel=rel,
            table_uri=store.table_uri(m.tokens_table) if m.tokens_table else "", num_documents=m.num_documents, num_tokens=m.num_tokens,
            sources=tuple(m.sources), embedding_sum=tuple(float(c) * m.num_tokens for c in centroid),
            shards=tuple(shards), index=m.index, dense=m.dense,
        )


def kept_settings(parent: Manifest, sa_shard_tokens: int | None) -> dict:
    """The settings an append takes from its parent, so that its rows match the parent's
    (``sa_shard_tokens``, the one given, must be None or the parent's own)."""
    s = parent.settings
    kept = s.get("sa_shard_tokens")
    if sa_shard_tokens is not None and sa_shard_tokens != kept:
        have = f"shards of {kept} tokens" if kept else "one suffix array"
        raise SpecstoreError(f"--append keeps the parent's suffix-array layout ({have}); change --sa-shard-tokens with --refit")
    keep = {k: s[k] for k in ("max_doc_tokens", "max_new_tokens", "batch_tokens", "dtype", "ann_threshold") if s.get(k) is not None}
    return keep | {
        "pca_dims": parent.pca_dims, "continuation_length": parent.continuation_length, "regenerate": parent.regenerated,
        "sa_shard_tokens": kept,
    }


def kept_index(parent: Manifest, index: str | None) -> str:
    """An append's index kind: the parent's (``index``, the one given, must be None or the
    parent's own: a version is all dense or all sparse)."""
    if index is not None and index != parent.index:
        raise SpecstoreError(
            f"--append keeps the parent's index kind: {parent.name}@{parent.version} is {parent.index}, "
            f"not {index} (build a new {index} version without --append, or use --refit --index {index})"
        )
    return parent.index


def check_model(parent: Manifest, info: ModelInfo) -> None:
    """The given model must be the parent's (ManifestMismatchError names the first field that differs)."""
    for name in MODEL_FIELDS:
        if getattr(parent.model, name) != getattr(info, name):
            raise ManifestMismatchError(name, getattr(parent.model, name), getattr(info, name))


def new_sources(parent: Manifest, sources: list[Source], hashes: list[str]) -> tuple[list[Source], list[str]]:
    """The sources (re-indexed after the parent's) whose content the parent does not hold yet."""
    held = {(s.format, s.sha256) for s in parent.sources}
    kept = [(s, h) for s, h in zip(sources, hashes, strict=True) if (s.format, h) not in held]
    offset = len(parent.sources)
    return [Source(offset + i, s.path, s.format) for i, (s, _) in enumerate(kept)], [h for _, h in kept]


def _npy_length(location: Location, rel: str) -> int:
    """The length of a 1-D ``.npy`` file of a store, from its header alone."""
    with location.open_input(rel) as handle:
        major, _ = np.lib.format.read_magic(handle)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _, _ = read(handle)
    return int(shape[0])


def parent_stream(base: BaseVersion, shard: int | None = None, storage_options: dict | None = None) -> np.ndarray:
    """The parent's token stream (or that of its shard ``shard``), to put ahead of new documents."""
    name = STREAM_FILE if shard is None else f"{shard_dir(Path(), shard).as_posix()}/{STREAM_FILE}"
    with local_copy(f"{base.files_dir}/{name}", storage_options) as path:
        return np.load(path)


@dataclass
class ParentDense:
    """A compact parent's dense files (runtime/dense_files.py), memory-mapped."""

    codes: np.ndarray
    positions: np.ndarray
    blocks: np.ndarray
    ann_blocks: tuple[int, ...]


def parent_dense(base: BaseVersion, storage_options: dict | None = None) -> ParentDense | None:
    """The parent's dense rows to put ahead of the new ones in every block (None: a sparse or
    old-form parent, whose appends keep the old form)."""
    if base.dense is None:
        return None
    from specstore.runtime import dense_files as df

    arrays = []
    for name in (df.VECTORS_FILE, df.POSITIONS_FILE, df.BLOCKS_FILE):
        with local_copy(f"{base.files_dir}/{name}", storage_options) as path:
            arrays.append(np.load(path, mmap_mode=None if base.files_dir.find("://") >= 0 else "r"))
    return ParentDense(*arrays, ann_blocks=tuple(base.dense.ann_blocks))


def link_untouched_shard(index: int, plan: BuildPlan, layout: StreamLayout) -> list[int]:
    """A parent's shard that takes no new documents, linked into the new version: ``[index]``;
    ``[]`` for one that does (writers.write_shard rebuilds it)."""
    if layout.shards[index].takes_new_documents:
        return []
    shard = shard_dir(Path(), index).as_posix()
    for name in INDEX_FILES:
        source = f"{plan.base.files_rel}/{shard}/{name}"
        if plan.location.exists(source):  # a parent built before the first-token table lacks it
            plan.location.copy(source, f"{plan.files_rel}/{shard}/{name}")
    return [index]


def link_parent_fragments(base: BaseVersion, table_uri: str, location: Location) -> list:
    """The parent's fragments, their data files hard-linked (copied across devices, or on an
    object store) into the new table, so the new version never depends on the parent's files
    and gc may remove either."""
    import lance

    dataset = lance.dataset(base.table_uri, storage_options=location.options or None)
    parent, table = base.table_uri.rstrip("/").rsplit("/", 1)[-1], table_uri.rstrip("/").rsplit("/", 1)[-1]
    metadata = []
    for fragment in dataset.get_fragments():
        meta = fragment.metadata
        if meta.deletion_file is not None:
            raise SpecstoreError(f"tokens table {base.table_uri} has deleted rows; append needs a complete parent")
        for data_file in fragment.data_files():
            location.copy(f"{parent}/data/{data_file.path}", f"{table}/data/{data_file.path}")
        metadata.append(meta)
    return metadata
