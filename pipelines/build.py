"""``specstore build``: plan, run the Beam pipeline, commit one new version.

Owns the driver: ``build`` reads plan (plan.py: inputs validated, mode, model check, whether
the newest version would be reproduced) -> unchanged? -> run the pipeline of transforms.py (or
an injected TestPipeline) -> finalise (commit.py, whose ``Store.commit`` is the only step that
makes the version visible); and the CLI handler of ``specstore build``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specstore.pipelines import resume as resumer
from specstore.pipelines import workers
from specstore.pipelines.commit import BuildResult, finalise, keep_unchanged
from specstore.pipelines.plan import BuildPlan, plan_build, single_process
from specstore.runtime.device import resolve_build_dtype
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.store import Store, validate_tag

__all__ = ["BuildResult", "build", "plan_build", "run_pipeline", "run_from_args"]


def build(
    store: Store | str | Path, name: str, corpus: list[str], *, fmt: str = "auto", model: str | None = None,
    regenerate: bool = False, max_docs: int | None = None, max_doc_tokens: int = 2048, max_new_tokens: int = 256,
    pca_dims: int = 64, continuation_length: int = 10, batch_tokens: int = 4096, dtype: str = "float32",
    tag: str | None = None, runner: str = "DirectRunner", beam_args: list[str] | None = None, progress: bool | str = True,
    test_pipeline=None, mode: str = "full", force: bool = False, normaliser: str | Path | None = None,
    sa_shard_tokens: int | None = None, index: str | None = None, ann_threshold: int | None = None, resume: bool = False,
) -> BuildResult:
    """Build one new version of datastore ``name`` from ``corpus`` and commit it (see module doc).

    ``mode``: ``full``, ``append`` or ``refit`` (plan.plan_build). Without ``force``, a build that
    would reproduce the newest version commits nothing and returns it with ``unchanged=True``
    (``tag``, if given, is then set on it). ``normaliser``: a normaliser.npz to reuse instead of
    fitting one. ``dtype``: float32, bfloat16, or auto (bfloat16 where the hardware runs it fast,
    runtime/device.py ``resolve_build_dtype``); the manifest records the resolved name.
    ``index``: ``dense`` (the default: every token embedded, a tokens table and a normaliser, for
    dresd and respec's dense source) or ``sparse`` (token stream and suffix array only, built with
    the tokenizer alone: rest, pld and respec's context and suffix sources); None: dense, or for
    ``append``/``refit`` the parent's kind (an append never mixes kinds). ``ann_threshold``: a
    dense version's next-token blocks of at least this many rows get an approximate index
    (None: runtime/dense_files.py ``ANN_THRESHOLD``, or an append's parent's). ``progress``:
    True for progress bars, ``"lines"`` for a plain line per stage every minute (a log file),
    False for none. ``resume``: reuse the embedded batches of the newest unfinished (killed) build
    of ``name`` made from the same corpus, settings and model (resume.py); only the rest is embedded.
    """
    started = time.monotonic()
    dtype = resolve_build_dtype(dtype)  # "auto": bf16 where it runs fast; the manifest records the resolved name
    store = store if isinstance(store, Store) else Store(store, create=True)
    if tag is not None:
        validate_tag(tag)
    plan = plan_build(
        store, name, corpus, mode=mode, fmt=fmt, model=model, force=force, normaliser=normaliser,
        in_process=test_pipeline is not None or single_process(runner, beam_args), progress=progress,
        max_docs=max_docs, sa_shard_tokens=sa_shard_tokens, regenerate=regenerate, max_doc_tokens=max_doc_tokens,
        max_new_tokens=max_new_tokens, pca_dims=pca_dims, continuation_length=continuation_length,
        batch_tokens=batch_tokens, dtype=dtype, index=index, ann_threshold=ann_threshold, resume=resume,
    )
    if plan.unchanged is not None:
        return keep_unchanged(store, plan, tag=tag, started=started)
    if not plan.sparse:
        resumer.write_record(plan)  # before any batch is staged: a killed build can be resumed
    if plan.resumed_from and progress:
        reused = sum(b.num_tokens for b in plan.resumed)
        print(f"resuming build {', '.join(plan.resumed_from)}: {len(plan.resumed)} staged batches ({reused:,} tokens) reused, "
              "the rest embedded", file=sys.stderr)
    run_pipeline(plan, runner=runner, beam_args=beam_args, test_pipeline=test_pipeline)
    return finalise(store, plan, tag=tag, started=started)


def run_pipeline(plan: BuildPlan, *, runner: str = "DirectRunner", beam_args: list[str] | None = None, test_pipeline=None) -> None:
    """Run the whole Beam build; its last step writes the staging summary. In process, the steps
    reuse the model the plan was checked with, held until the pipeline ends."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from specstore.pipelines.transforms import expand_build

    if test_pipeline is not None:
        pipeline = test_pipeline
    else:
        pipeline = beam.Pipeline(options=PipelineOptions([f"--runner={runner}", *(beam_args or [])]))
    try:
        with workers.model_held(plan.model_path, plan.dtype, plan.in_process and not plan.sparse), pipeline as p:
            expand_build(p, plan)
    finally:
        workers.close_progress()


def run_from_args(args: argparse.Namespace, extra_beam_args: list[str]) -> int:
    """The CLI handler of ``specstore build``."""
    try:
        store = Store.from_args(args, create=True)
    except SpecstoreError:
        raise
    except OSError as exc:
        raise SpecstoreError(f"store {args.store} is not usable: {exc}") from None
    mode = "append" if getattr(args, "append", False) else "refit" if getattr(args, "refit", False) else "full"
    progress = True if sys.stderr.isatty() else "lines"  # a log file (a scheduled rebuild) gets plain lines
    if progress == "lines":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its weight-loading bars would be carriage-returned noise in a log
    result = build(
        store, args.name, args.corpus, fmt=args.format, model=args.model, regenerate=args.regenerate,
        max_docs=args.max_docs, max_doc_tokens=args.max_doc_tokens, max_new_tokens=args.max_new_tokens,
        pca_dims=args.pca_dims, continuation_length=args.continuation_length, batch_tokens=args.batch_tokens,
        dtype=args.dtype, tag=args.tag, runner=args.runner, beam_args=extra_beam_args, progress=progress,
        mode=mode, force=getattr(args, "force", False), sa_shard_tokens=getattr(args, "sa_shard_tokens", None),
        index=getattr(args, "index", None), ann_threshold=getattr(args, "ann_threshold", None),
        resume=getattr(args, "resume", False),
    )
    m = result.manifest
    tag = f" (tag {args.tag})" if args.tag else ""
    if result.unchanged:
        print(f"{m.name}@{m.version}{tag}: unchanged (same corpus content, settings and model); no new version")
        return 0
    added = f", {m.lineage.added_documents} added by {mode}" if mode != "full" and m.lineage else ""
    rate = f", {m.lineage.added_tokens / result.seconds:,.0f} tokens/s" if m.lineage and result.seconds > 0 and not result.resumed_tokens else ""
    if result.resumed_tokens:
        rate = f", {result.resumed_tokens:,} tokens' embeddings reused from a killed build"
    print(
        f"{m.name}@{m.version}{tag}: {m.num_documents} documents{added}, {m.num_tokens} tokens ({m.index}), {m.num_rejected} rejected "
        f"(see {result.rejected_path}) in {result.seconds:.1f} s{rate}"
    )
    return 0
