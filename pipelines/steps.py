"""Beam DoFns and CombineFns of the build: thin adapters over the pure functions.

Owns per-worker resources (a tokenizer and a model shared across the DoFn instances of one
worker process through ``apache_beam.utils.shared.Shared``), progress bars, and the single-writer
steps (token stream + suffix array, normaliser, rejected records). The graph that wires them is
in transforms.py.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import apache_beam as beam
import numpy as np
from apache_beam.utils import shared

from specstore.pipelines.commit import link_or_copy
from specstore.pipelines.embed import (
    StagedBatch,
    embed_documents,
    generate_responses,
    load_staged,
    save_staged,
)
from specstore.pipelines.normalise import NormStats, fit_normaliser, sample_rows
from specstore.pipelines.plan import REJECTED_FILE, BuildPlan
from specstore.pipelines.render import Document, Rejection, prepare
from specstore.pipelines.rows import rows_table
from specstore.runtime.normaliser import NORMALISER_FILE, Normaliser
from specstore.runtime.sharded_suffix import shard_dir
from specstore.runtime.suffix_array import (
    SA_FILE,
    STREAM_FILE,
    build_suffix_array,
    join_documents,
    save_suffix_index,
)
from specstore.schemas.tables import tokens_schema

# one handle per kind of resource and process: a handle holds one object, and acquiring it with
# another tag replaces that object (so a tokenizer and a model sharing one handle took turns
# evicting each other, and the model was loaded again)
_SHARED_TOKENIZER = shared.Shared()
_SHARED_MODEL = shared.Shared()
_BARS: dict[str, object] = {}
_BARS_LOCK = threading.Lock()


def _libc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


_MALLOC_TRIM = _libc_trim()


def release_memory() -> None:
    """Give the heap's free pages back to the OS after a batch (glibc ``malloc_trim``).

    Each batch allocates and frees hundreds of MB of differently shaped arrays; glibc keeps the
    freed pages, so a worker's resident memory grew with the corpus (in-process loop, 600 chat
    documents, 198k tokens: 690 -> 1,350 MiB over 50 batches; with a trim after each batch
    690 -> 876 MiB, at the same speed). A no-op where the C library is not glibc.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _progress(desc: str, amount: int, enabled: bool, total: int | None = None, unit: str = "tok") -> None:
    """Advance this process' progress bar ``desc`` (tqdm, created on first use) by ``amount``;
    ``total`` (the stage's whole amount, from a side input) gives the bar its end and an ETA."""
    if not enabled:
        return
    from tqdm import tqdm

    with _BARS_LOCK:
        bar = _BARS.get(desc)
        if bar is None:
            bar = _BARS[desc] = tqdm(desc=desc, total=total, unit=unit, unit_scale=True, dynamic_ncols=True)
        bar.update(amount)
        if bar.total is not None and bar.n >= bar.total:
            bar.close()  # the stage is done: its rate and time stay as they were at its end


def close_progress() -> None:
    """Close this process' bars (the in-process DirectRunner shares them with the driver)."""
    with _BARS_LOCK:
        for bar in _BARS.values():
            bar.close()
        _BARS.clear()


class _Holder:
    """Weak-referenceable box for a shared resource (Shared keeps weak references)."""

    def __init__(self, value):
        self.value = value


def _tokenizer(plan: BuildPlan):
    def load():
        from transformers import AutoTokenizer

        return _Holder(AutoTokenizer.from_pretrained(plan.model_path))

    return _SHARED_TOKENIZER.acquire(load, tag=("tokenizer", plan.model_path)).value


def shared_model(plan: BuildPlan):
    """The model the build's workers in this process use (loaded on first use, then shared)."""
    def load():
        from specstore.runtime.models import load_model

        return load_model(plan.model_path, dtype=plan.dtype)

    return _SHARED_MODEL.acquire(load, tag=("model", plan.model_path, plan.dtype))


class PrepareFn(beam.DoFn):
    """Raw record -> documents (main), prompts (``prompts``) or a rejection (``rejected``)."""

    def __init__(self, plan: BuildPlan):
        self.plan = plan

    def setup(self):
        self.tokenizer = _tokenizer(self.plan)

    def process(self, record, total: int | None = None):
        _progress("prepare", 1, self.plan.progress, total, unit="doc")
        fmt = self.plan.source_format(record.source_index)
        for item in prepare(record, fmt, self.tokenizer, max_doc_tokens=self.plan.max_doc_tokens, regenerate=self.plan.regenerate):
            if isinstance(item, Rejection):
                yield beam.pvalue.TaggedOutput("rejected", item)
            elif isinstance(item, Document):
                yield item
            else:
                yield beam.pvalue.TaggedOutput("prompts", item)


class GenerateFn(beam.DoFn):
    """A batch of prompts -> documents written by the model itself (batched greedy generation)."""

    def __init__(self, plan: BuildPlan):
        self.plan = plan

    def setup(self):
        self.loaded = shared_model(self.plan)

    def process(self, prompts, total: int | None = None):
        tok = self.loaded.tokenizer
        eos = {t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int) and t >= 0}
        pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
        docs = generate_responses(self.loaded.model, [p.tokens for p in prompts], max_new_tokens=self.plan.max_new_tokens, pad_id=pad, eos_ids=eos)
        _progress("generate", len(prompts), self.plan.progress, total, unit="doc")
        release_memory()
        for p, d in zip(prompts, docs, strict=True):
            yield Document(p.doc_id, d[: self.plan.max_doc_tokens])


class EmbedFn(beam.DoFn):
    """A batch of documents -> a staging file of raw hidden states (main) and their
    normaliser statistics (``stats``). Hidden states never travel through Beam.

    Statistics are summed over the bundle and emitted once, in ``finish_bundle``: an H x H
    float64 matrix per batch (2.6 MB for the default model) would otherwise pile up in the
    runner's buffers until the normaliser's combine runs (peak memory growing with the corpus).
    """

    def __init__(self, plan: BuildPlan):
        self.plan = plan

    def setup(self):
        self.loaded = shared_model(self.plan)

    def start_bundle(self):
        self.stats = None

    def finish_bundle(self):
        if self.stats is not None:
            from apache_beam.transforms.window import GlobalWindow
            from apache_beam.utils.timestamp import MIN_TIMESTAMP
            from apache_beam.utils.windowed_value import WindowedValue

            yield beam.pvalue.TaggedOutput("stats", WindowedValue(self.stats, MIN_TIMESTAMP, [GlobalWindow()]))
            self.stats = None

    def process(self, docs: list[Document], total: int | None = None):
        docs = sorted(docs, key=lambda d: d.doc_id)
        hidden = embed_documents(self.loaded.model, [d.tokens for d in docs])
        staged = save_staged(
            self.plan.staging_dir, f"embed-{docs[0].doc_id}-{uuid.uuid4().hex[:8]}",
            [d.doc_id for d in docs], [d.tokens for d in docs], hidden, self.plan.spill_dtype,
        )
        _progress("embed", staged.num_tokens, self.plan.progress, total)
        stats = NormStats.of(sample_rows(np.concatenate(hidden), self.plan.fit_rows_per_batch))
        self.stats = stats if self.stats is None else self.stats.merge(stats)
        del hidden
        release_memory()
        yield staged


class NormStatsCombineFn(beam.CombineFn):
    """Sums NormStats from all workers (None when there were no vectors)."""

    def create_accumulator(self):
        return None

    def add_input(self, acc, stats: NormStats):
        return stats if acc is None else acc.merge(stats)

    def merge_accumulators(self, accs):
        total = None
        for acc in accs:
            if acc is not None:
                total = acc if total is None else total.merge(acc)
        return total

    def extract_output(self, acc):
        return acc


def fit_and_save(stats: NormStats | None, plan: BuildPlan) -> Normaliser | None:
    """Fit the normaliser and write normaliser.npz (None when there is nothing to fit)."""
    if stats is None or stats.n < 2:
        return None
    normaliser = fit_normaliser(stats, plan.pca_dims)
    Path(plan.files_dir).mkdir(parents=True, exist_ok=True)
    normaliser.save(Path(plan.files_dir) / NORMALISER_FILE)
    return normaliser


def reuse_normaliser(_, plan: BuildPlan) -> Normaliser:
    """Copy the normaliser an append (or a fixed-normaliser build) reuses into this build's files."""
    normaliser = Normaliser.load(Path(plan.normaliser_path))
    Path(plan.files_dir).mkdir(parents=True, exist_ok=True)
    normaliser.save(Path(plan.files_dir) / NORMALISER_FILE)
    return normaliser


def write_stream(docs: list[tuple[int, np.ndarray]], plan: BuildPlan) -> dict:
    """Join all documents in doc_id order (after the parent's stream, for an append), build and
    save the suffix array; return the layout: each new document's stream start and the totals."""
    docs = sorted(docs, key=lambda d: d[0])
    stream, starts = join_documents([tokens for _, tokens in docs])
    base = plan.base
    if base is not None:
        base_stream = np.load(Path(base.files_dir) / STREAM_FILE)
        stream, starts = np.concatenate([base_stream, stream]), starts + len(base_stream)
    save_suffix_index(Path(plan.files_dir), stream, build_suffix_array(stream))
    num_new = int(sum(len(t) for _, t in docs))
    return {
        "starts": {doc: int(start) for (doc, _), start in zip(docs, starts, strict=True)},
        "num_new_documents": len(docs),
        "num_new_tokens": num_new,
        "num_documents": len(docs) + (base.num_documents if base else 0),
        "num_tokens": num_new + (base.num_tokens if base else 0),
    }


def assign_shards(lengths: list[tuple[int, int]], plan: BuildPlan) -> dict:
    """The layout of a sharded build from document lengths alone (no tokens pass through here):
    documents in doc_id order fill shards of at most ``sa_shard_tokens`` stream entries.

    For an append, the parent's shards come first, as they are; new documents go on filling its
    last shard (which is then rebuilt with them) and new shards after it, exactly as a full build
    of the parent's corpus plus the new one would place them.
    """
    lengths = sorted(lengths)
    base = plan.base
    shards = [{"offset": o, "length": n, "base_length": n} for o, n in (base.shards if base else ())]
    offset = sum(s["length"] for s in shards)
    if base is not None and offset != base.num_tokens + base.num_documents:
        raise RuntimeError(f"internal: the parent's shards hold {offset} stream entries, its manifest says {base.num_tokens + base.num_documents}")
    starts, shard_of = {}, {}
    for doc, n in lengths:
        if not shards or (shards[-1]["length"] and shards[-1]["length"] + n + 1 > plan.sa_shard_tokens):
            shards.append({"offset": offset, "length": 0, "base_length": 0})
        starts[doc], shard_of[doc] = offset, len(shards) - 1
        shards[-1]["length"] += n + 1  # the document and its separator
        offset += n + 1
    num_new = int(sum(n for _, n in lengths))
    return {
        "starts": starts, "shard_of": shard_of, "shards": shards,
        "num_documents": len(lengths) + (base.num_documents if base else 0),
        "num_tokens": num_new + (base.num_tokens if base else 0),
        "num_new_documents": len(lengths), "num_new_tokens": num_new,
    }


def write_shard(keyed: tuple[int, list], plan: BuildPlan, layout: dict) -> int:
    """One shard's stream and suffix array (built on the worker that holds only this shard); a
    parent's shard that takes new documents is rebuilt from its stream followed by theirs."""
    index, docs = keyed
    docs = sorted(docs, key=lambda d: d[0])
    stream, _ = join_documents([tokens for _, tokens in docs])
    expected = layout["shards"][index]
    if expected["base_length"]:
        base_stream = np.load(shard_dir(Path(plan.base.files_dir), index) / STREAM_FILE)
        stream = np.concatenate([base_stream, stream])
    first = expected["offset"] + expected["base_length"]
    if len(stream) != expected["length"] or layout["starts"][docs[0][0]] != first:
        raise RuntimeError(f"internal: shard {index} has {len(stream)} entries, layout says {expected}")
    save_suffix_index(shard_dir(Path(plan.files_dir), index), stream, build_suffix_array(stream))
    return index


def reuse_shard(index: int, plan: BuildPlan, layout: dict):
    """A parent's shard that takes no new documents: linked (or copied) into the new version."""
    shard = layout["shards"][index]
    if shard["length"] != shard["base_length"]:
        return []  # rebuilt by write_shard
    source, target = shard_dir(Path(plan.base.files_dir), index), shard_dir(Path(plan.files_dir), index)
    target.mkdir(parents=True, exist_ok=True)
    for name in (STREAM_FILE, SA_FILE):
        link_or_copy(source / name, target / name)
    return [index]


def write_fragment(staged: StagedBatch, normaliser: Normaliser | None, layout: dict, plan: BuildPlan):
    """Rows of one staging file -> one Lance fragment (not yet committed to the table)."""
    from lance.fragment import write_fragments

    if normaliser is None:
        return
    doc_ids, docs, hidden = load_staged(staged.path)
    embeddings = normaliser.apply(hidden)
    table = rows_table(doc_ids, docs, [layout["starts"][d] for d in doc_ids], embeddings, plan.continuation_length)
    fragments = write_fragments(table, plan.table_uri, schema=tokens_schema(plan.pca_dims, plan.continuation_length))
    embedding_sum = embeddings.astype(np.float64).sum(axis=0).tolist()
    del hidden, embeddings
    release_memory()
    _progress("write", table.num_rows, plan.progress, layout["num_new_tokens"] if plan.progress_totals else None)
    yield {
        "first_offset": int(min(layout["starts"][d] for d in doc_ids)),
        "fragments": [json.dumps(f.to_json()) for f in fragments],
        "num_rows": table.num_rows,
        "embedding_sum": embedding_sum,
    }


def write_rejected(rejections: list[Rejection], plan: BuildPlan) -> int:
    """All rejected records, in source and record order, one JSON object per line."""
    Path(plan.files_dir).mkdir(parents=True, exist_ok=True)
    rejections = sorted(rejections, key=lambda r: (r.source_index, r.record_index))
    with open(Path(plan.files_dir) / REJECTED_FILE, "w", encoding="utf-8") as out:
        for r in rejections:
            out.write(json.dumps(r.to_json(plan.source_path(r.source_index)), ensure_ascii=False) + "\n")
    return len(rejections)
