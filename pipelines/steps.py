"""Beam DoFns and CombineFns of the build: thin adapters over the pure functions.

Owns the per-element steps that need worker state: rendering and tokenising records (with the
process' shared tokenizer), regenerating responses and embedding batches (with its shared
model), combining normaliser statistics, and the progress and heap trimming around the fragment
writer. The resources themselves are in workers.py, the functions they adapt in render.py,
embed.py, normalise.py and writers.py; the graph that wires the steps is in transforms.py.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import replace
from pathlib import Path

import apache_beam as beam
import numpy as np

from specstore.pipelines import files, workers, writers
from specstore.pipelines.embed import StagedBatch, embed_documents, generate_responses, save_staged
from specstore.pipelines.layout import StreamLayout
from specstore.pipelines.normalise import NormStats, sample_rows
from specstore.pipelines.plan import BuildPlan
from specstore.pipelines.render import Document, Rejection, TokenRef, prepare_batch
from specstore.runtime.normaliser import Normaliser


class PrepareFn(beam.DoFn):
    """A batch of raw records -> documents (main), prompts (``prompts``) or rejections
    (``rejected``); the batch's texts are tokenised in one call (render.prepare_batch)."""

    def __init__(self, plan: BuildPlan):
        self.plan = plan

    def setup(self):
        self.tokenizer = workers.shared_tokenizer(self.plan.model_path)

    def process(self, records, total: int | None = None):
        workers.advance("prepare", len(records), self.plan.progress, total, unit="doc")
        items = prepare_batch(records, self.plan.source_format, self.tokenizer, max_doc_tokens=self.plan.max_doc_tokens,
                              regenerate=self.plan.regenerate)
        for item in items:
            if isinstance(item, Rejection):
                yield beam.pvalue.TaggedOutput("rejected", item)
            elif isinstance(item, Document):
                yield item
            else:
                yield beam.pvalue.TaggedOutput("prompts", item)


SPILL_TOKENS = 4 << 20  # tokens per spill file (16 MiB of int32)


class SpillTokensFn(beam.DoFn):
    """Documents -> TokenRefs: each bundle's tokens go to staging files of about SPILL_TOKENS
    tokens, read back by the worker that builds the suffix array (or its shard). Keeps the
    corpus's tokens out of every collection the runner holds between stages."""

    def __init__(self, plan: BuildPlan):
        self.plan = plan

    def start_bundle(self):
        self._docs: list[Document] = []
        self._tokens = 0

    def process(self, doc: Document):
        self._docs.append(doc)
        self._tokens += len(doc.tokens)
        if self._tokens >= SPILL_TOKENS:
            yield from self._flush()

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindows

        for ref in self._flush():
            yield GlobalWindows.windowed_value(ref)

    def _flush(self) -> list[TokenRef]:
        docs, self._docs, self._tokens = self._docs, [], 0
        return writers.spill_tokens([(d.doc_id, d.tokens) for d in docs], self.plan)


class GenerateFn(beam.DoFn):
    """A batch of prompts -> documents written by the model itself (batched greedy generation)."""

    def __init__(self, plan: BuildPlan):
        self.plan = plan

    def setup(self):
        self.loaded = workers.shared_model(self.plan.model_path, self.plan.dtype)

    def process(self, prompts, total: int | None = None):
        tok = self.loaded.tokenizer
        eos = {t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int) and t >= 0}
        pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
        docs = generate_responses(self.loaded.model, [p.tokens for p in prompts], max_new_tokens=self.plan.max_new_tokens, pad_id=pad, eos_ids=eos)
        workers.advance("generate", len(prompts), self.plan.progress, total, unit="doc")
        workers.release_memory()
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
        self.loaded = workers.shared_model(self.plan.model_path, self.plan.dtype)

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
        name = f"embed-{docs[0].doc_id}-{uuid.uuid4().hex[:8]}"
        rel = f"{self.plan.staging_name}/{name}.npz"
        with files.output(self.plan, rel) as path:  # a remote store: written here, uploaded on leaving
            staged = save_staged(path.parent, name, [d.doc_id for d in docs], [d.tokens for d in docs], hidden, self.plan.spill_dtype)
        if self.plan.remote:
            staged = replace(staged, path=self.plan.location.child(files.version_rel(self.plan, rel)))
        workers.advance("embed", staged.num_tokens, self.plan.progress, total)
        stats = NormStats.of(sample_rows(np.concatenate(hidden), self.plan.fit_rows_per_batch))
        self.stats = stats if self.stats is None else self.stats.merge(stats)
        del hidden
        workers.release_memory()
        yield staged


class ResumeFn(EmbedFn):
    """A staging file of the build being resumed (resume.ResumedBatch) -> the same file, moved
    into this build's staging (main), and its normaliser statistics (``stats``), as EmbedFn
    would have computed them from the same batch. No model."""

    def setup(self):
        pass

    def process(self, batch, total: int | None = None):
        from specstore.pipelines.embed import load_staged

        name = batch.rel.rsplit("/", 1)[-1]
        rel = files.version_rel(self.plan, f"{self.plan.staging_name}/{name}")
        location = self.plan.location
        if location.remote:  # a server-side copy, then the old object goes
            location.copy(batch.rel, rel)
            location.delete_file(batch.rel)
            path = location.child(rel)
        else:  # a rename: the old build's folder keeps nothing this one needs
            path = str(location.local_root / rel)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            os.replace(location.local_root / batch.rel, path)
        with files.local_copy(path, dict(self.plan.storage_options)) as local:
            _, _, hidden = load_staged(str(local))
        workers.advance("resume", batch.num_tokens, self.plan.progress, total)
        stats = NormStats.of(sample_rows(hidden, self.plan.fit_rows_per_batch))
        self.stats = stats if self.stats is None else self.stats.merge(stats)
        del hidden
        workers.release_memory()
        yield StagedBatch(path, batch.doc_ids, batch.num_tokens)


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


def write_fragment(staged: StagedBatch, normaliser: Normaliser | None, layout: StreamLayout, plan: BuildPlan):
    """writers.write_fragment for one staging file (nothing without a normaliser: no vectors)."""
    if normaliser is None:
        return
    written = writers.write_fragment(staged, normaliser, layout, plan)
    workers.release_memory()
    workers.advance("write", written.num_rows, plan.progress, layout.num_new_tokens if plan.in_process else None)
    yield written
