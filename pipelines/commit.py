"""The commit sequence of a build whose pipeline has finished, and the result of every build.

Owns turning the staging summary (summary.py) into one visible version: the tokens table's
single Lance commit (for an append, the parent's fragments, hard-linked into the new table by
append.py, come first; none for a sparse version, whose files are its stream and suffix array),
removal of the staging files, checksums, the manifest with its lineage and index kind,
``Store.commit`` (the only step that makes the version visible) and the tag; and, for a build
that would reproduce the newest version, tagging that one instead. Does not own the pipeline
(transforms.py) or deciding what to build (plan.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from specstore.pipelines import files
from specstore.pipelines.append import link_parent_fragments
from specstore.pipelines.lineage import PIPELINE_VERSION
from specstore.pipelines.plan import REJECTED_FILE, BuildPlan
from specstore.pipelines.resume import remove_resumed
from specstore.pipelines.summary import BuildSummary
from specstore.runtime import dense_files as df
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.normaliser import NORMALISER_FILE
from specstore.runtime.sharded_suffix import SHARDS_DIR, shard_files
from specstore.runtime.store import Store, checksum_files, location_sha256
from specstore.runtime.suffix_array import INDEX_FILES
from specstore.schemas.manifest import DenseFiles, FileInfo, Lineage, Manifest, SourceInfo


@dataclass(frozen=True)
class BuildResult:
    manifest: Manifest
    num_rejected: int
    rejected_path: Path | str  # a URI in a remote store
    seconds: float
    unchanged: bool = False  # True: nothing to build; ``manifest`` is the existing newest version
    resumed_tokens: int = 0  # --resume: tokens whose embeddings came from the killed build's staging


def finalise(store: Store, plan: BuildPlan, *, tag: str | None = None, started: float | None = None) -> BuildResult:
    """Commit a build whose pipeline has finished: Lance commit (dense), checksums, manifest, catalogue."""
    summary = files.read_summary(plan)
    if summary is None:
        raise SpecstoreError(f"build {plan.build_id} did not finish: no summary in {files.version_rel(plan, plan.staging_name)}")
    if summary.num_new_documents == 0 or (summary.num_rows == 0 and not plan.sparse):
        read = sum(s.num_records for s in summary.sources.values())
        raise SpecstoreError(
            f"no usable documents: {read} records read, {summary.num_rejected} rejected (reasons in {plan.rejected_path})"
        )
    data_files = [] if plan.sparse else _commit_table(plan, summary)
    files.remove_staging(plan)
    dense = None if summary.dense is None else DenseFiles(**summary.dense)
    if plan.compact and not plan.sparse and dense is None:
        raise SpecstoreError(f"internal: build {plan.build_id} wrote no dense files")

    table_name = Store.table_name(plan.name, plan.build_id)
    own_files = (REJECTED_FILE,) if plan.sparse else (NORMALISER_FILE, REJECTED_FILE)
    version_files = _index_files(plan) + [files.version_rel(plan, n) for n in own_files + _dense_files(dense)] + data_files
    checksums = _checksums(plan, version_files)
    base_sources = list(plan.base.sources) if plan.base else []
    sources = base_sources + [
        SourceInfo(path=s.path, format=s.format, sha256=h, num_records=summary.sources[s.index].num_records,
                   num_rejected=summary.sources[s.index].num_rejected)
        for s, h in zip(plan.sources, plan.source_hashes, strict=True)
    ]
    newest = store.versions(plan.name)
    lineage = Lineage(
        mode=plan.mode, added_sources=[s.path for s in plan.sources], added_documents=summary.num_new_documents,
        added_tokens=summary.num_new_tokens, normaliser_from=plan.normaliser_from,
    )
    manifest = Manifest(
        name=plan.name, build_id=plan.build_id, created_at=datetime.now(UTC), pipeline_version=PIPELINE_VERSION,
        model=plan.model_info, pca_dims=plan.pca_dims, continuation_length=plan.continuation_length,
        num_documents=summary.num_documents, num_tokens=summary.num_tokens,
        num_rejected=summary.num_rejected + (plan.base.num_rejected if plan.base else 0),
        regenerated=plan.regenerate, sources=sources, index=plan.index, tokens_table="" if plan.sparse else table_name, files=checksums,
        settings=plan.recorded_settings(), lineage=lineage,
        parent_version=plan.base.version if plan.base else (newest[-1].version if newest else None),
        domain_centroid=None if summary.domain_centroid is None else list(summary.domain_centroid), dense=dense,
    )
    committed = store.commit(manifest)
    if tag is not None:
        store.set_tag(f"{plan.name}@{committed.version}", tag)
    remove_resumed(plan)  # what is left of a resumed build (its batches were moved into this one's staging)
    return BuildResult(committed, summary.num_rejected, plan.rejected_path, time.monotonic() - (started or time.monotonic()),
                       resumed_tokens=sum(b.num_tokens for b in plan.resumed))


def _dense_files(dense: DenseFiles | None) -> tuple[str, ...]:
    """A compact version's dense files (runtime/dense_files.py), relative to its files folder."""
    if dense is None:
        return ()
    return (df.VECTORS_FILE, df.POSITIONS_FILE, df.BLOCKS_FILE) + tuple(df.ann_file(t) for t in dense.ann_blocks)


def _index_files(plan: BuildPlan) -> list[str]:
    """The stream and suffix array files of the version (every shard's, when sharded), relative to the store."""
    if not plan.remote:
        folder, root = Path(plan.files_dir), Path(plan.store_root)
        listed = shard_files(folder) or [folder / n for n in INDEX_FILES]
        return [p.relative_to(root).as_posix() for p in listed]
    shards = files.version_rel(plan, SHARDS_DIR)
    found = sorted(rel for rel, is_file, _, _ in plan.location.walk(shards) if is_file and rel.rsplit("/", 1)[-1] in INDEX_FILES)
    return found or [files.version_rel(plan, n) for n in INDEX_FILES]


def _checksums(plan: BuildPlan, rels: list[str]) -> dict[str, FileInfo]:
    if not plan.remote:
        return checksum_files(Path(plan.store_root), rels)
    location = plan.location
    return {rel: FileInfo(sha256=location_sha256(location, rel), num_bytes=location.size(rel)) for rel in rels}


def _commit_table(plan: BuildPlan, summary: BuildSummary) -> list[str]:
    """The tokens table's single Lance commit (an append's parent fragments first); its data
    files, relative to the store."""
    import lance
    from lance.fragment import FragmentMetadata

    options = plan.location.options or None
    fragments = [FragmentMetadata.from_json(f) for f in summary.fragments]
    if plan.base is not None:
        fragments = link_parent_fragments(plan.base, plan.table_uri, plan.location) + fragments
    schema = plan.table_schema
    dataset = lance.LanceDataset.commit(plan.table_uri, lance.LanceOperation.Overwrite(schema, fragments), storage_options=options)
    if dataset.count_rows() != summary.num_tokens or summary.num_rows != summary.num_tokens:
        raise SpecstoreError(f"internal: {dataset.count_rows()} table rows for {summary.num_tokens} stream tokens")
    table = f"{Store.table_name(plan.name, plan.build_id)}.lance"
    return sorted(f"{table}/data/{f.path}" for frag in dataset.get_fragments() for f in frag.data_files())


def keep_unchanged(store: Store, plan: BuildPlan, *, tag: str | None = None, started: float | None = None) -> BuildResult:
    """The result of a build that would reproduce the newest version: that version (tagged ``tag``)."""
    newest = plan.unchanged
    if tag is not None:
        store.set_tag(f"{newest.name}@{newest.version}", tag)
    rejected = store.location.child(f"{Store.files_rel(newest.name, newest.build_id)}/{REJECTED_FILE}")
    seconds = time.monotonic() - (started or time.monotonic())
    return BuildResult(newest.manifest, newest.manifest.num_rejected, rejected if store.location.remote else Path(rejected),
                       seconds, unchanged=True)
