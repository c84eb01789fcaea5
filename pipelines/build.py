"""``specstore build``: plan a build, run the Beam pipeline, commit one new version.

Owns the driver: validating inputs up front (one clear SpecstoreError line for a missing path,
an unknown format, an unwritable store, an unusable model), running the pipeline of
transforms.py (or injecting a TestPipeline), then the commit sequence: the tokens table's single
Lance commit, removal of the staging files, checksums, the manifest, ``Store.commit`` (the only
step that makes the version visible) and the tag.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from specstore.pipelines.corpus import resolve_sources, source_sha256
from specstore.pipelines.plan import REJECTED_FILE, BuildPlan
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.normaliser import NORMALISER_FILE
from specstore.runtime.store import Store, checksum_files, validate_name, validate_tag
from specstore.runtime.suffix_array import SA_FILE, STREAM_FILE
from specstore.schemas.manifest import Manifest, SourceInfo
from specstore.schemas.tables import tokens_schema

PIPELINE_VERSION = "build-1"


@dataclass(frozen=True)
class BuildResult:
    manifest: Manifest
    num_rejected: int
    rejected_path: Path
    seconds: float


def make_plan(store: Store, name: str, corpus: list[str], *, fmt: str = "auto", model: str | None = None, **settings) -> BuildPlan:
    """Validate the inputs and fix every location of a new build (nothing is written yet)."""
    from specstore.runtime.models import resolve_model_path

    validate_name(name)
    sources = resolve_sources([str(c) for c in corpus], fmt)
    for key in ("max_doc_tokens", "max_new_tokens", "pca_dims", "continuation_length", "batch_tokens"):
        if settings.get(key) is not None and settings[key] <= 0:
            raise SpecstoreError(f"{key.replace('_', '-')} must be positive, got {settings[key]}")
    if settings.get("max_docs") is not None and settings["max_docs"] < 0:
        raise SpecstoreError(f"max-docs must be >= 0, got {settings['max_docs']}")
    build_id = Store.new_build_id()
    return BuildPlan(
        name=name, build_id=build_id, store_root=str(store.root), table_uri=store.table_uri(Store.table_name(name, build_id)),
        files_dir=str(store.files_dir(name, build_id)), sources=tuple(sources), model_path=str(resolve_model_path(model)),
        **{k: v for k, v in settings.items() if v is not None or k == "max_docs"},
    )


def run_pipeline(plan: BuildPlan, *, runner: str = "DirectRunner", beam_args: list[str] | None = None, test_pipeline=None) -> None:
    """Run the whole Beam build; its last step writes the staging summary."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions
    from specstore.pipelines.transforms import expand_build

    if test_pipeline is not None:
        pipeline = test_pipeline
    else:
        pipeline = beam.Pipeline(options=PipelineOptions([f"--runner={runner}", *(beam_args or [])]))
    with pipeline as p:
        expand_build(p, plan)


def finalise(store: Store, plan: BuildPlan, *, model_info, tag: str | None = None, started: float | None = None) -> BuildResult:
    """Commit a build whose pipeline has finished: Lance commit, checksums, manifest, catalogue."""
    import lance
    from lance.fragment import FragmentMetadata

    if not plan.summary_path.is_file():
        raise SpecstoreError(f"build {plan.build_id} did not finish: no summary in {plan.staging_dir}")
    summary = json.loads(plan.summary_path.read_text())
    files_dir = Path(plan.files_dir)
    if summary["num_documents"] == 0 or summary["num_rows"] == 0:
        rejected = sum(s["num_records"] for s in summary["sources"].values())
        raise SpecstoreError(
            f"no usable documents: {rejected} records read, {summary['num_rejected']} rejected (reasons in {files_dir / REJECTED_FILE})"
        )
    if summary["num_rows"] != summary["num_tokens"]:
        raise SpecstoreError(f"internal: {summary['num_rows']} table rows for {summary['num_tokens']} stream tokens")
    schema = tokens_schema(plan.pca_dims, plan.continuation_length)
    fragments = [FragmentMetadata.from_json(f) for f in summary["fragments"]]
    dataset = lance.LanceDataset.commit(plan.table_uri, lance.LanceOperation.Overwrite(schema, fragments))
    shutil.rmtree(plan.staging_dir, ignore_errors=True)

    root = Path(plan.store_root)
    table_dir = Path(plan.table_uri)
    data_files = sorted(table_dir / "data" / f.path for frag in dataset.get_fragments() for f in frag.data_files())
    version_files = [files_dir / n for n in (STREAM_FILE, SA_FILE, NORMALISER_FILE, REJECTED_FILE)] + data_files
    files = checksum_files(root, [p.relative_to(root).as_posix() for p in version_files])
    sources = [
        SourceInfo(path=s.path, format=s.format, sha256=source_sha256(s), **summary["sources"][str(s.index)])
        for s in plan.sources
    ]
    manifest = Manifest(
        name=plan.name, build_id=plan.build_id, created_at=datetime.now(UTC), pipeline_version=PIPELINE_VERSION,
        model=model_info, pca_dims=plan.pca_dims, continuation_length=plan.continuation_length,
        num_documents=summary["num_documents"], num_tokens=summary["num_tokens"], num_rejected=summary["num_rejected"],
        regenerated=plan.regenerate, sources=sources, tokens_table=Path(plan.table_uri).stem, files=files,
        settings=_settings(plan), parent_version=_newest(store, plan.name), domain_centroid=summary["domain_centroid"],
    )
    committed = store.commit(manifest)
    if tag is not None:
        store.set_tag(f"{plan.name}@{committed.version}", tag)
    return BuildResult(committed, summary["num_rejected"], files_dir / REJECTED_FILE, time.monotonic() - (started or time.monotonic()))


def _settings(plan: BuildPlan) -> dict:
    keep = ("dtype", "max_docs", "max_doc_tokens", "max_new_tokens", "batch_tokens", "generate_batch", "fit_rows_per_batch", "spill_dtype")
    return {k: getattr(plan, k) for k in keep} | {"model_path": plan.model_path}


def _newest(store: Store, name: str) -> int | None:
    versions = store.versions(name)
    return versions[-1].version if versions else None


def build(
    store: Store | str | Path, name: str, corpus: list[str], *, fmt: str = "auto", model: str | None = None,
    regenerate: bool = False, max_docs: int | None = None, max_doc_tokens: int = 2048, max_new_tokens: int = 256,
    pca_dims: int = 64, continuation_length: int = 10, batch_tokens: int = 4096, dtype: str = "float32",
    tag: str | None = None, runner: str = "DirectRunner", beam_args: list[str] | None = None, progress: bool = True,
    test_pipeline=None,
) -> BuildResult:
    """Build one new version of datastore ``name`` from ``corpus`` and commit it (see module doc)."""
    from specstore.runtime.models import load_model

    started = time.monotonic()
    store = store if isinstance(store, Store) else Store(store, create=True)
    if tag is not None:
        validate_tag(tag)
    plan = make_plan(
        store, name, corpus, fmt=fmt, model=model, regenerate=regenerate, max_docs=max_docs, max_doc_tokens=max_doc_tokens,
        max_new_tokens=max_new_tokens, pca_dims=pca_dims, continuation_length=continuation_length,
        batch_tokens=batch_tokens, dtype=dtype, progress=progress,
    )
    info = load_model(model, dtype=dtype).info  # fails early and cleanly; fingerprints the model as the runtime does
    if pca_dims > info.hidden_size:
        raise SpecstoreError(f"pca-dims {pca_dims} exceeds the model's hidden size {info.hidden_size}")
    run_pipeline(plan, runner=runner, beam_args=beam_args, test_pipeline=test_pipeline)
    return finalise(store, plan, model_info=info, tag=tag, started=started)


def run_from_args(args: argparse.Namespace, extra_beam_args: list[str]) -> int:
    """The CLI handler of ``specstore build``."""
    try:
        store = Store(args.store, create=True)
    except SpecstoreError:
        raise
    except OSError as exc:
        raise SpecstoreError(f"store {args.store} is not usable: {exc}") from None
    result = build(
        store, args.name, args.corpus, fmt=args.format, model=args.model, regenerate=args.regenerate,
        max_docs=args.max_docs, max_doc_tokens=args.max_doc_tokens, max_new_tokens=args.max_new_tokens,
        pca_dims=args.pca_dims, continuation_length=args.continuation_length, batch_tokens=args.batch_tokens,
        dtype=args.dtype, tag=args.tag, runner=args.runner, beam_args=extra_beam_args, progress=sys.stderr.isatty(),
    )
    m = result.manifest
    tag = f" (tag {args.tag})" if args.tag else ""
    print(
        f"{m.name}@{m.version}{tag}: {m.num_documents} documents, {m.num_tokens} tokens, {m.num_rejected} rejected "
        f"(see {result.rejected_path}) in {result.seconds:.1f} s"
    )
    return 0
