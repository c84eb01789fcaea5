"""Where a new build stands relative to the newest committed version of its datastore.

Owns three decisions the driver (build.py) acts on, all made before any pipeline work:

- *unchanged*: the corpus content (the sources' content hashes, in order), the settings and the
  model equal the parent's, so the build would reproduce it: no new version;
- *append*: only sources whose content the parent lacks are read and embedded; the parent's
  rows, token stream and normaliser are reused (``BaseVersion`` carries what the steps need);
- *refit*: the parent's corpus plus the new paths, everything recomputed.

Pure functions over manifests; nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specstore.pipelines.corpus import Source
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.sharded_suffix import shard_files
from specstore.runtime.store import Store, VersionRecord
from specstore.schemas.manifest import Manifest, ModelInfo

MODES = ("full", "append", "refit")
# settings that change what a build produces (model_path is compared through the model's hash instead)
_IGNORED_SETTINGS = ("model_path",)


@dataclass(frozen=True)
class BaseVersion:
    """The committed version an append extends: its files and the sizes its rows start after."""

    version: int
    build_id: str
    files_dir: str
    table_uri: str
    num_documents: int
    num_tokens: int
    num_sources: int
    embedding_sum: tuple[float, ...]  # domain_centroid x num_tokens, to combine with the new rows
    shards: tuple[tuple[int, int], ...] = ()  # (stream offset, stream length) of each suffix-array shard; () if one array

    @classmethod
    def of(cls, store: Store, record: VersionRecord) -> BaseVersion:
        m = record.manifest
        centroid = m.domain_centroid or []
        files = store.files_dir(m.name, m.build_id)
        shards, offset = [], 0
        for stream in shard_files(files)[::2]:  # (stream, suffix array) per shard, in shard order
            length = int(np.load(stream, mmap_mode="r").shape[0])
            shards.append((offset, length))
            offset += length
        return cls(
            version=record.version, build_id=m.build_id, files_dir=str(files),
            table_uri=store.table_uri(m.tokens_table), num_documents=m.num_documents, num_tokens=m.num_tokens,
            num_sources=len(m.sources), embedding_sum=tuple(float(c) * m.num_tokens for c in centroid),
            shards=tuple(shards),
        )


def fingerprint(manifest_or_settings: Manifest | dict, *, sources: list[tuple[str, str]] | None = None,
                model: ModelInfo | None = None, **shape) -> tuple:
    """What must be equal for two builds to produce the same version."""
    if isinstance(manifest_or_settings, Manifest):
        m = manifest_or_settings
        return fingerprint(
            dict(m.settings), sources=[(s.format, s.sha256) for s in m.sources], model=m.model,
            pipeline_version=m.pipeline_version, pca_dims=m.pca_dims, continuation_length=m.continuation_length,
            regenerated=m.regenerated,
        )
    settings = {k: v for k, v in manifest_or_settings.items() if k not in _IGNORED_SETTINGS}
    return (tuple(sources or ()), model.revision, model.tokenizer_hash, tuple(sorted(shape.items())), tuple(sorted(settings.items())))


def new_sources(parent: Manifest, sources: list[Source], hashes: list[str]) -> tuple[list[Source], list[str]]:
    """The sources (re-indexed after the parent's) whose content the parent does not hold yet."""
    held = {(s.format, s.sha256) for s in parent.sources}
    kept = [(s, h) for s, h in zip(sources, hashes, strict=True) if (s.format, h) not in held]
    offset = len(parent.sources)
    return [Source(offset + i, s.path, s.format) for i, (s, _) in enumerate(kept)], [h for _, h in kept]


def refit_paths(parent: Manifest, paths: list[str]) -> list[str]:
    """The parent's corpus paths (which must still exist) followed by the given ones not among them."""
    missing = [s.path for s in parent.sources if not Path(s.path).exists()]
    if missing:
        raise SpecstoreError(f"cannot refit {parent.name}@{parent.version}: its corpus path {missing[0]} no longer exists")
    known = {s.path for s in parent.sources}
    return [s.path for s in parent.sources] + [p for p in paths if str(Path(p).expanduser().resolve()) not in known]


def parent_settings(parent: Manifest) -> dict:
    """The settings an append must keep so its rows match the parent's."""
    s = parent.settings
    keep = {k: s[k] for k in ("max_doc_tokens", "max_new_tokens", "batch_tokens", "dtype", "sa_shard_tokens") if s.get(k) is not None}
    return keep | {"pca_dims": parent.pca_dims, "continuation_length": parent.continuation_length, "regenerate": parent.regenerated}
