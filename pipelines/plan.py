"""Planning a build: every decision, setting and location fixed before the pipeline runs.

Owns ``plan_build``, the one function that decides what a build does: it validates the inputs
(one clear SpecstoreError line for a bad setting, a missing path, an unknown format, an unusable
model), resolves the mode against the newest version (lineage.py; an append's parent and kept
settings from append.py), loads the model to check and fingerprint it, and says whether the
build would reproduce the newest version. Its result, ``BuildPlan``, is one frozen, picklable
record that the driver and every Beam step receive (no globals), with the staging locations
inside the version's not yet visible file folder. A sparse plan (``index="sparse"``: stream and
suffix array only) fingerprints the model from its folder (config, tokenizer and the weights'
file hash) and never loads the weights. Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from specstore.pipelines import append
from specstore.pipelines import resume as resumer
from specstore.pipelines.append import BaseVersion
from specstore.pipelines.corpus import Chunk, Source, plan_chunks, resolve_sources, source_sha256
from specstore.pipelines.lineage import MODES, PIPELINE_VERSION, fingerprint, refit_paths
from specstore.runtime.dense_files import ANN_THRESHOLD
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.normaliser import NORMALISER_FILE
from specstore.runtime.storage import Location, is_remote
from specstore.runtime.store import REJECTED_FILE, Store, VersionRecord, file_sha256, validate_name
from specstore.schemas.manifest import INDEX_KINDS, ModelInfo
from specstore.schemas.tables import TABLE_FORMAT, tokens_schema

STAGING_DIR = "_staging"
SUMMARY_FILE = "summary.json"
# the plan's settings a manifest records (with model_path and normaliser_from); the unchanged check compares them
SETTINGS_KEPT = ("dtype", "max_docs", "max_doc_tokens", "max_new_tokens", "batch_tokens", "generate_batch", "fit_rows_per_batch", "spill_dtype",
                 "sa_shard_tokens", "ann_threshold")
_POSITIVE = ("max_doc_tokens", "max_new_tokens", "pca_dims", "continuation_length", "batch_tokens", "sa_shard_tokens", "ann_threshold")


@dataclass(frozen=True)
class BuildPlan:
    name: str
    build_id: str
    store_root: str  # a local directory or an object-store URI
    table_uri: str
    files_dir: str  # the version's files folder: a local path, or a URI in a remote store
    sources: tuple[Source, ...]  # what this build reads (an append: only the sources its parent lacks)
    model_path: str
    chunks: tuple[Chunk, ...] = ()  # the sources' parts that workers read on their own (corpus.plan_chunks)
    source_hashes: tuple[str, ...] = ()  # content hash of each source, in the same order
    model_info: ModelInfo | None = None  # the model's fingerprint (set once it is loaded), recorded in the manifest
    mode: str = "full"  # full | append | refit (lineage.MODES)
    index: str = "dense"  # dense: embed every token (tokens table, normaliser); sparse: stream and suffix array only
    dtype: str = "float32"
    regenerate: bool = False
    max_docs: int | None = None
    max_doc_tokens: int = 2048
    max_new_tokens: int = 256
    pca_dims: int = 64
    continuation_length: int = 10
    batch_tokens: int = 4096
    generate_batch: int = 16
    fit_rows_per_batch: int | None = 1024
    spill_dtype: str = "float32"
    progress: bool | str = True  # True: tqdm bars; "lines": a plain line per stage now and then (workers.LineProgress); False: none
    in_process: bool = True  # every step runs in the driver's process: bars know their totals, steps reuse its model
    base: BaseVersion | None = None  # append: the parent version whose rows and stream come first
    normaliser_path: str | None = None  # a normaliser to reuse instead of fitting one
    normaliser_from: str | None = None  # recorded: the parent's build_id (append) or the reused file's hash
    sa_shard_tokens: int | None = None  # build the suffix array in shards of at most this many tokens
    compact: bool = True  # dense: int8 table and dense/ files (runtime/dense_files.py); False: the old form (an append to an old version)
    ann_threshold: int = ANN_THRESHOLD  # dense: blocks of at least this many rows get an approximate index
    table_format: int = TABLE_FORMAT  # compact: the tokens table's layout (schemas/tables.py); an append keeps its parent's
    unchanged: VersionRecord | None = None  # the newest version, which this build would reproduce: nothing to run
    storage_options: tuple[tuple[str, str], ...] = ()  # a remote store's options as given (workers add their environment's)
    resumed_from: tuple[str, ...] = ()  # --resume: the unfinished builds whose staged batches this one reuses (resume.py)
    resumed: tuple = ()  # its complete staging files (resume.ResumedBatch), moved into this build's staging, not embedded again

    staging_name = STAGING_DIR
    summary_name = SUMMARY_FILE

    @property
    def location(self) -> Location:
        return Location.of(self.store_root, dict(self.storage_options))

    @property
    def remote(self) -> bool:
        return is_remote(self.store_root)

    @property
    def files_rel(self) -> str:
        return Store.files_rel(self.name, self.build_id)

    @property
    def staging_dir(self) -> Path:
        return Path(self.files_dir) / STAGING_DIR

    @property
    def summary_path(self) -> Path:
        return self.staging_dir / SUMMARY_FILE

    @property
    def rejected_path(self) -> Path | str:
        return self.location.child(f"{self.files_rel}/{REJECTED_FILE}") if self.remote else Path(self.files_dir) / REJECTED_FILE

    @property
    def sparse(self) -> bool:
        return self.index == "sparse"

    @property
    def vocab_size(self) -> int | None:
        """The compact table's vocabulary (its token type), None for the old form."""
        return self.model_info.vocab_size if self.compact and self.model_info is not None else None

    @property
    def table_schema(self):
        """The tokens table's Arrow schema (with Lance's encoding metadata) this build writes."""
        return tokens_schema(self.pca_dims, self.continuation_length, self.vocab_size, self.table_format)

    def source(self, index: int) -> Source:
        """The source numbered ``index`` (an append numbers its sources after the parent's)."""
        for s in self.sources:
            if s.index == index:
                return s
        raise KeyError(index)

    def source_path(self, index: int) -> str:
        return self.source(index).path

    def source_format(self, index: int) -> str:
        return self.source(index).format

    def recorded_settings(self) -> dict:
        """The settings the manifest records."""
        return {k: getattr(self, k) for k in SETTINGS_KEPT} | {"model_path": self.model_path, "normaliser_from": self.normaliser_from}

    def fingerprint(self) -> tuple:
        """What a version built by this plan would have to equal to be reproduced (lineage.fingerprint)."""
        return fingerprint(
            self.recorded_settings(), sources=[(s.format, h) for s, h in zip(self.sources, self.source_hashes, strict=True)],
            model=self.model_info, pipeline_version=PIPELINE_VERSION, pca_dims=self.pca_dims,
            continuation_length=self.continuation_length, regenerated=self.regenerate, index=self.index,
        )


def plan_build(
    store: Store, name: str, corpus: list[str], *, mode: str = "full", fmt: str = "auto", model: str | None = None,
    force: bool = False, normaliser: str | Path | None = None, in_process: bool = True, progress: bool | str = True,
    max_docs: int | None = None, sa_shard_tokens: int | None = None, index: str | None = None, resume: bool = False,
    **settings,
) -> BuildPlan:
    """Decide one build of datastore ``name`` (see module doc); nothing is written.

    ``mode``: ``full`` (the corpus as given), ``append`` (only the sources whose content the newest
    version lacks, on top of its rows, stream and normaliser; its settings override the ones
    given) or ``refit`` (the newest version's corpus plus ``corpus``, all recomputed). Without
    ``force``, a plan that would reproduce the newest version has it as ``unchanged``.
    ``normaliser``: a normaliser.npz to reuse instead of fitting one. ``in_process``: every step
    runs in this process (the model loaded here to check it is the one they use). ``settings``:
    the remaining BuildPlan fields (``regenerate``, ``pca_dims``, ``dtype``, ...); None means
    the default. ``index``: ``dense`` or ``sparse`` (None: dense, or an append's parent's kind;
    an append given the other kind is refused). ``resume``: reuse the staged batches of the newest
    unfinished build with the same resume record (resume.py; a SpecstoreError when there is none).
    """
    from specstore.runtime.models import resolve_model_path

    if mode not in MODES:
        raise SpecstoreError(f"unknown build mode {mode!r}: choose one of {', '.join(MODES)}")
    versions = store.versions(validate_name(name))
    parent = versions[-1] if versions else None
    if mode != "full" and parent is None:
        raise SpecstoreError(f"--{mode} needs an existing version of '{name}' in {store.root}")
    if index is not None and index not in INDEX_KINDS:
        raise SpecstoreError(f"unknown index kind {index!r}: choose one of {', '.join(INDEX_KINDS)}")
    settings = {k: v for k, v in settings.items() if v is not None} | {"sa_shard_tokens": sa_shard_tokens}
    normaliser_from = None
    if mode == "append":
        index = append.kept_index(parent.manifest, index)
        settings |= append.kept_settings(parent.manifest, sa_shard_tokens)
        settings["compact"] = parent.manifest.dense is not None  # one table holds one form: an old parent's append stays old
        if parent.manifest.dense is not None:  # and one layout: the parent's fragments are linked into the new table
            settings["table_format"] = parent.manifest.dense.table_format
        if index == "dense":
            normaliser = store.location.child(f"{Store.files_rel(name, parent.build_id)}/{NORMALISER_FILE}")
            normaliser_from = parent.build_id
    elif mode == "refit":
        index = index or parent.manifest.index
        corpus = refit_paths(parent.manifest, list(corpus))
    index = index or "dense"
    if index == "sparse" and settings.get("regenerate"):
        raise SpecstoreError("--regenerate needs the model to write responses: build it with --index dense")
    if index == "sparse" and normaliser is not None:
        raise SpecstoreError("a sparse build fits no normaliser, so it reuses none: drop --normaliser or build --index dense")
    if normaliser is not None and normaliser_from is None:
        normaliser_from = file_sha256(Path(normaliser))
    sources = resolve_sources([str(c) for c in corpus], fmt)
    _check_settings(settings, max_docs)
    build_id = Store.new_build_id()
    plan = BuildPlan(
        name=name, build_id=build_id, store_root=str(store.root), table_uri=store.table_uri(Store.table_name(name, build_id)),
        files_dir=store.location.child(Store.files_rel(name, build_id)), sources=tuple(sources), model_path=str(resolve_model_path(model)),
        mode=mode, index=index, progress=progress, in_process=in_process, normaliser_path=None if normaliser is None else str(normaliser),
        normaliser_from=normaliser_from, max_docs=max_docs, storage_options=tuple(sorted(store.location.storage_options.items())),
        **settings,
    )
    info = _folder_model(model) if plan.sparse else _checked_model(model, plan)
    if not plan.sparse and plan.pca_dims > info.hidden_size:
        raise SpecstoreError(f"pca-dims {plan.pca_dims} exceeds the model's hidden size {info.hidden_size}")
    hashes = [source_sha256(s) for s in plan.sources]
    if mode == "append":
        append.check_model(parent.manifest, info)
        sources, hashes = append.new_sources(parent.manifest, list(plan.sources), hashes)
        plan = replace(plan, sources=tuple(sources), base=BaseVersion.of(store, parent))
    plan = replace(plan, source_hashes=tuple(hashes), model_info=info)
    if mode == "append":
        unchanged = not plan.sources
    else:
        unchanged = parent is not None and not force and fingerprint(parent.manifest) == plan.fingerprint()
    if unchanged:
        return replace(plan, unchanged=parent)
    if resume:
        if plan.sparse:
            raise SpecstoreError("--resume reuses embedded batches, and a sparse build embeds none: rebuild it without --resume")
        resumed_from, batches = resumer.find(store, plan)
        plan = replace(plan, resumed_from=resumed_from, resumed=batches)
    return replace(plan, chunks=tuple(c for s in plan.sources for c in plan_chunks(s)))


def single_process(runner: str, beam_args: list[str] | None) -> bool:
    """Whether every step runs in this process (the DirectRunner's default in-memory mode with
    one worker), so that one progress bar per stage sees the whole stage."""
    from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions

    if runner not in ("DirectRunner", "direct"):
        return False
    opts = PipelineOptions(beam_args or []).view_as(DirectOptions)
    return opts.direct_running_mode == "in_memory" and (opts.direct_num_workers or 1) <= 1


def _check_settings(settings: dict, max_docs: int | None) -> None:
    for key in _POSITIVE:
        if settings.get(key) is not None and settings[key] <= 0:
            raise SpecstoreError(f"{key.replace('_', '-')} must be positive, got {settings[key]}")
    if max_docs is not None and max_docs < 0:
        raise SpecstoreError(f"max-docs must be >= 0, got {max_docs}")


def _folder_model(model: str | None) -> ModelInfo:
    """A sparse build's model fingerprint, from the folder: tokenizer and config, never the weights."""
    from specstore.runtime.models import folder_model_info

    try:
        return folder_model_info(model)[1]
    except (OSError, ValueError) as exc:
        raise SpecstoreError(f"model {model or 'default'} is not usable: {exc}") from None


def _checked_model(model: str | None, plan: BuildPlan) -> ModelInfo:
    """Load the model (failing early and cleanly) and fingerprint it as the runtime does. In
    process, it is the shared model the steps will use (one load per build)."""
    from specstore.pipelines import workers  # Beam's Shared: imported only where a model is loaded
    from specstore.runtime.models import load_model, model_id_of

    loaded = workers.shared_model(plan.model_path, plan.dtype) if plan.in_process else load_model(model, dtype=plan.dtype)
    return loaded.info.model_copy(update={"model_id": model_id_of(model, loaded.path)})
