"""The commit sequence of a build whose pipeline has finished.

Owns turning the staging summary into one visible version: the tokens table's single Lance
commit (for an append, the parent's fragments, hard-linked into the new table, come first),
removal of the staging files, checksums, the manifest with its lineage, ``Store.commit`` (the
only step that makes the version visible) and the tag. Does not own the pipeline (transforms.py)
or deciding what to build (build.py, lineage.py).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from specstore.pipelines.lineage import BaseVersion
from specstore.pipelines.plan import REJECTED_FILE, BuildPlan
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.normaliser import NORMALISER_FILE
from specstore.runtime.sharded_suffix import shard_files
from specstore.runtime.store import Store, checksum_files
from specstore.runtime.suffix_array import SA_FILE, STREAM_FILE
from specstore.schemas.manifest import Lineage, Manifest, SourceInfo
from specstore.schemas.tables import tokens_schema

PIPELINE_VERSION = "build-1"
SETTINGS_KEPT = ("dtype", "max_docs", "max_doc_tokens", "max_new_tokens", "batch_tokens", "generate_batch", "fit_rows_per_batch", "spill_dtype",
                 "sa_shard_tokens")


@dataclass(frozen=True)
class BuildResult:
    manifest: Manifest
    num_rejected: int
    rejected_path: Path
    seconds: float
    unchanged: bool = False  # True: nothing to build; ``manifest`` is the existing newest version


def plan_settings(plan: BuildPlan, normaliser_from: str | None) -> dict:
    return {k: getattr(plan, k) for k in SETTINGS_KEPT} | {"model_path": plan.model_path, "normaliser_from": normaliser_from}


def link_base_fragments(base: BaseVersion, table_uri: str) -> list:
    """The parent's fragments, their data files hard-linked (copied across devices) into the new
    table, so the new version never depends on the parent's files and gc may remove either."""
    import lance

    dataset = lance.dataset(base.table_uri)
    data_dir = Path(table_uri) / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    metadata = []
    for fragment in dataset.get_fragments():
        meta = fragment.metadata
        if meta.deletion_file is not None:
            raise SpecstoreError(f"tokens table {base.table_uri} has deleted rows; append needs a complete parent")
        for data_file in fragment.data_files():
            link_or_copy(Path(base.table_uri) / "data" / data_file.path, data_dir / data_file.path)
        metadata.append(meta)
    return metadata


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` becomes a hard link to ``src`` (a copy across devices): no bytes copied, and gc of
    the version that owns ``src`` leaves ``dst`` intact. Replaces what a crashed run left at ``dst``."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def finalise(
    store: Store, plan: BuildPlan, *, model_info, hashes: list[str], mode: str = "full", base_sources: list[SourceInfo] = (),
    normaliser_from: str | None = None, tag: str | None = None, started: float | None = None,
) -> BuildResult:
    """Commit a build whose pipeline has finished: Lance commit, checksums, manifest, catalogue."""
    import lance
    from lance.fragment import FragmentMetadata

    if not plan.summary_path.is_file():
        raise SpecstoreError(f"build {plan.build_id} did not finish: no summary in {plan.staging_dir}")
    summary = json.loads(plan.summary_path.read_text())
    files_dir = Path(plan.files_dir)
    if summary["num_new_documents"] == 0 or summary["num_rows"] == 0:
        rejected = sum(s["num_records"] for s in summary["sources"].values())
        raise SpecstoreError(
            f"no usable documents: {rejected} records read, {summary['num_rejected']} rejected (reasons in {files_dir / REJECTED_FILE})"
        )
    fragments = [FragmentMetadata.from_json(f) for f in summary["fragments"]]
    if plan.base is not None:
        fragments = link_base_fragments(plan.base, plan.table_uri) + fragments
    schema = tokens_schema(plan.pca_dims, plan.continuation_length)
    dataset = lance.LanceDataset.commit(plan.table_uri, lance.LanceOperation.Overwrite(schema, fragments))
    if dataset.count_rows() != summary["num_tokens"] or summary["num_rows"] != summary["num_tokens"]:
        raise SpecstoreError(f"internal: {dataset.count_rows()} table rows for {summary['num_tokens']} stream tokens")
    shutil.rmtree(plan.staging_dir, ignore_errors=True)

    root = Path(plan.store_root)
    table_dir = Path(plan.table_uri)
    data_files = sorted(table_dir / "data" / f.path for frag in dataset.get_fragments() for f in frag.data_files())
    index_files = shard_files(files_dir) or [files_dir / STREAM_FILE, files_dir / SA_FILE]
    version_files = index_files + [files_dir / n for n in (NORMALISER_FILE, REJECTED_FILE)] + data_files
    files = checksum_files(root, [p.relative_to(root).as_posix() for p in version_files])
    sources = list(base_sources) + [
        SourceInfo(path=s.path, format=s.format, sha256=h, **summary["sources"][str(s.index)])
        for s, h in zip(plan.sources, hashes, strict=True)
    ]
    newest = store.versions(plan.name)
    lineage = Lineage(
        mode=mode, added_sources=[s.path for s in plan.sources], added_documents=summary["num_new_documents"],
        added_tokens=summary["num_new_tokens"], normaliser_from=normaliser_from,
    )
    manifest = Manifest(
        name=plan.name, build_id=plan.build_id, created_at=datetime.now(UTC), pipeline_version=PIPELINE_VERSION,
        model=model_info, pca_dims=plan.pca_dims, continuation_length=plan.continuation_length,
        num_documents=summary["num_documents"], num_tokens=summary["num_tokens"],
        num_rejected=summary["num_rejected"] + sum(s.num_rejected for s in base_sources),
        regenerated=plan.regenerate, sources=sources, tokens_table=table_dir.stem, files=files,
        settings=plan_settings(plan, normaliser_from), lineage=lineage,
        parent_version=plan.base.version if plan.base else (newest[-1].version if newest else None),
        domain_centroid=summary["domain_centroid"],
    )
    committed = store.commit(manifest)
    if tag is not None:
        store.set_tag(f"{plan.name}@{committed.version}", tag)
    return BuildResult(committed, summary["num_rejected"], files_dir / REJECTED_FILE, time.monotonic() - (started or time.monotonic()))
