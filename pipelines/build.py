"""``specstore build``: decide what to build, run the Beam pipeline, commit one new version.

Owns the driver: validating inputs up front (one clear SpecstoreError line for a missing path,
an unknown format, an unwritable store, an unusable model), deciding with lineage.py whether the
build is a no-op (same corpus content, settings and model as the newest version), a full build,
an append or a refit, running the pipeline of transforms.py (or injecting a TestPipeline), and
handing the result to commit.py, whose ``Store.commit`` is the only step that makes it visible.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from specstore.pipelines.commit import PIPELINE_VERSION, BuildResult, finalise, plan_settings
from specstore.pipelines.corpus import resolve_sources, source_sha256
from specstore.pipelines.lineage import (
    MODES,
    BaseVersion,
    fingerprint,
    new_sources,
    parent_settings,
    refit_paths,
)
from specstore.pipelines.plan import REJECTED_FILE, BuildPlan
from specstore.runtime.errors import ManifestMismatchError, SpecstoreError
from specstore.runtime.normaliser import NORMALISER_FILE
from specstore.runtime.store import Store, file_sha256, validate_name, validate_tag

__all__ = ["BuildResult", "build", "make_plan", "run_pipeline", "run_from_args"]


def make_plan(store: Store, name: str, corpus: list[str], *, fmt: str = "auto", model: str | None = None, **settings) -> BuildPlan:
    """Validate the inputs and fix every location of a new build (nothing is written yet)."""
    from specstore.runtime.models import resolve_model_path

    validate_name(name)
    sources = resolve_sources([str(c) for c in corpus], fmt)
    for key in ("max_doc_tokens", "max_new_tokens", "pca_dims", "continuation_length", "batch_tokens", "sa_shard_tokens"):
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
    from specstore.pipelines.steps import close_progress

    try:
        with pipeline as p:
            expand_build(p, plan)
    finally:
        close_progress()


def build(
    store: Store | str | Path, name: str, corpus: list[str], *, fmt: str = "auto", model: str | None = None,
    regenerate: bool = False, max_docs: int | None = None, max_doc_tokens: int = 2048, max_new_tokens: int = 256,
    pca_dims: int = 64, continuation_length: int = 10, batch_tokens: int = 4096, dtype: str = "float32",
    tag: str | None = None, runner: str = "DirectRunner", beam_args: list[str] | None = None, progress: bool = True,
    test_pipeline=None, mode: str = "full", force: bool = False, normaliser: str | Path | None = None,
    sa_shard_tokens: int | None = None,
) -> BuildResult:
    """Build one new version of datastore ``name`` from ``corpus`` and commit it (see module doc).

    ``mode``: ``full`` (the corpus as given), ``append`` (only the sources whose content the newest
    version lacks, on top of its rows, stream and normaliser; its settings override the ones
    given here) or ``refit`` (the newest version's corpus plus ``corpus``, all recomputed).
    Without ``force``, a build that would reproduce the newest version commits nothing and returns
    it with ``unchanged=True`` (``tag``, if given, is then set on it). ``normaliser``: a
    normaliser.npz to reuse instead of fitting one.
    """
    from specstore.pipelines.steps import shared_model
    from specstore.runtime.models import load_model, model_id_of

    started = time.monotonic()
    store = store if isinstance(store, Store) else Store(store, create=True)
    if tag is not None:
        validate_tag(tag)
    if mode not in MODES:
        raise SpecstoreError(f"unknown build mode {mode!r}: choose one of {', '.join(MODES)}")
    versions = store.versions(validate_name(name))
    parent = versions[-1] if versions else None
    if mode != "full" and parent is None:
        raise SpecstoreError(f"--{mode} needs an existing version of '{name}' in {store.root}")
    settings = dict(
        regenerate=regenerate, max_doc_tokens=max_doc_tokens, max_new_tokens=max_new_tokens, pca_dims=pca_dims,
        continuation_length=continuation_length, batch_tokens=batch_tokens, dtype=dtype,
    )
    normaliser_from = None
    if mode == "append":
        kept = parent.manifest.settings.get("sa_shard_tokens")
        if sa_shard_tokens is not None and sa_shard_tokens != kept:
            have = f"shards of {kept} tokens" if kept else "one suffix array"
            raise SpecstoreError(f"--append keeps the parent's suffix-array layout ({have}); change --sa-shard-tokens with --refit")
        settings |= parent_settings(parent.manifest)
        sa_shard_tokens = settings.pop("sa_shard_tokens", None)
        normaliser = store.files_dir(name, parent.build_id) / NORMALISER_FILE
        normaliser_from = parent.build_id
    elif mode == "refit":
        corpus = refit_paths(parent.manifest, list(corpus))
    elif normaliser is not None:
        normaliser_from = file_sha256(Path(normaliser))
    in_process = test_pipeline is not None or _single_process(runner, beam_args)
    plan = make_plan(
        store, name, corpus, fmt=fmt, model=model, max_docs=max_docs, progress=progress,
        progress_totals=in_process, sa_shard_tokens=sa_shard_tokens, **settings,
    )
    # load the model here: it fails early and cleanly, and fingerprints the model as the runtime
    # does. Where the workers run in this process they reuse this very model (held until the
    # pipeline ends) instead of loading a second copy
    held = shared_model(plan) if in_process else load_model(model, dtype=plan.dtype)
    info = held.info.model_copy(update={"model_id": model_id_of(model, held.path)})
    if not in_process:
        held = None  # workers in other processes load their own
    if plan.pca_dims > info.hidden_size:
        raise SpecstoreError(f"pca-dims {plan.pca_dims} exceeds the model's hidden size {info.hidden_size}")
    hashes = [source_sha256(s) for s in plan.sources]
    base_sources = []
    if mode == "append":
        for field in ("tokenizer_hash", "vocab_size", "hidden_size", "revision"):
            if getattr(parent.manifest.model, field) != getattr(info, field):
                raise ManifestMismatchError(field, getattr(parent.manifest.model, field), getattr(info, field))
        sources, hashes = new_sources(parent.manifest, list(plan.sources), hashes)
        if not sources:
            return _unchanged(store, parent, tag, started)
        plan = replace(plan, sources=tuple(sources), base=BaseVersion.of(store, parent), normaliser_path=str(normaliser))
        base_sources = list(parent.manifest.sources)
    else:
        if normaliser is not None:
            plan = replace(plan, normaliser_path=str(normaliser))
        wanted = fingerprint(
            plan_settings(plan, normaliser_from), sources=[(s.format, h) for s, h in zip(plan.sources, hashes, strict=True)],
            model=info, pipeline_version=PIPELINE_VERSION, pca_dims=plan.pca_dims,
            continuation_length=plan.continuation_length, regenerated=plan.regenerate,
        )
        if parent is not None and not force and fingerprint(parent.manifest) == wanted:
            return _unchanged(store, parent, tag, started)
    run_pipeline(plan, runner=runner, beam_args=beam_args, test_pipeline=test_pipeline)
    del held  # the workers are done with it
    return finalise(
        store, plan, model_info=info, hashes=hashes, mode=mode, base_sources=base_sources,
        normaliser_from=normaliser_from, tag=tag, started=started,
    )


def _single_process(runner: str, beam_args: list[str] | None) -> bool:
    """Whether every step runs in this process (the DirectRunner's default in-memory mode with
    one worker), so that one progress bar per stage sees the whole stage."""
    from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions

    if runner not in ("DirectRunner", "direct"):
        return False
    opts = PipelineOptions(beam_args or []).view_as(DirectOptions)
    return opts.direct_running_mode == "in_memory" and (opts.direct_num_workers or 1) <= 1


def _unchanged(store: Store, parent, tag: str | None, started: float) -> BuildResult:
    if tag is not None:
        store.set_tag(f"{parent.name}@{parent.version}", tag)
    files = store.files_dir(parent.name, parent.build_id)
    return BuildResult(parent.manifest, parent.manifest.num_rejected, files / REJECTED_FILE, time.monotonic() - started, unchanged=True)


def run_from_args(args: argparse.Namespace, extra_beam_args: list[str]) -> int:
    """The CLI handler of ``specstore build``."""
    try:
        store = Store(args.store, create=True)
    except SpecstoreError:
        raise
    except OSError as exc:
        raise SpecstoreError(f"store {args.store} is not usable: {exc}") from None
    mode = "append" if getattr(args, "append", False) else "refit" if getattr(args, "refit", False) else "full"
    result = build(
        store, args.name, args.corpus, fmt=args.format, model=args.model, regenerate=args.regenerate,
        max_docs=args.max_docs, max_doc_tokens=args.max_doc_tokens, max_new_tokens=args.max_new_tokens,
        pca_dims=args.pca_dims, continuation_length=args.continuation_length, batch_tokens=args.batch_tokens,
        dtype=args.dtype, tag=args.tag, runner=args.runner, beam_args=extra_beam_args, progress=sys.stderr.isatty(),
        mode=mode, force=getattr(args, "force", False), sa_shard_tokens=getattr(args, "sa_shard_tokens", None),
    )
    m = result.manifest
    tag = f" (tag {args.tag})" if args.tag else ""
    if result.unchanged:
        print(f"{m.name}@{m.version}{tag}: unchanged (same corpus content, settings and model); no new version")
        return 0
    added = f", {m.lineage.added_documents} added by {mode}" if mode != "full" and m.lineage else ""
    print(
        f"{m.name}@{m.version}{tag}: {m.num_documents} documents{added}, {m.num_tokens} tokens, {m.num_rejected} rejected "
        f"(see {result.rejected_path}) in {result.seconds:.1f} s"
    )
    return 0
