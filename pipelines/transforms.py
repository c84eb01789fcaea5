"""The build pipeline's graph: corpus -> documents -> embeddings -> normaliser -> fragments.

A sparse build (``plan.index == "sparse"``) is corpus -> documents -> stream and suffix array:
no Embed step, no normaliser, no tokens table, and no model (the tokenizer alone).

Owns how the steps are wired, labelled and batched: the DoFns of steps.py, the writers of
writers.py, the layout of layout.py, an append's reused shards (append.py) and the progress
bars' totals. ``expand_build(p, plan)`` adds the whole build to a pipeline (a TestPipeline in
tests) and returns its labelled PCollections; its last step writes the ``BuildSummary`` to
``_staging/summary.json``, which the driver (build.py, commit.py) turns into one committed
version. Nothing here makes a version visible.
"""

from __future__ import annotations

from dataclasses import dataclass

import apache_beam as beam
from apache_beam.pvalue import AsDict, AsList, AsSingleton, PCollection

from specstore.pipelines import append, files, steps, writers
from specstore.pipelines.corpus import Chunk, read_chunk
from specstore.pipelines.embed import padded_width, plan_batches
from specstore.pipelines.layout import StreamLayout, assign_shards
from specstore.pipelines.plan import BuildPlan
from specstore.pipelines.summary import BuildSummary, WrittenFragment, summarise

PREPARE_BATCH = 64  # records rendered and tokenised together (one batched call of the fast tokenizer)


@dataclass(frozen=True)
class BuildOutputs:
    records: PCollection  # RawRecord
    documents: PCollection  # Document (after regeneration, if any)
    rejected: PCollection  # Rejection
    staged: PCollection  # StagedBatch (empty when sparse)
    normaliser: PCollection  # one Normaliser (or None; empty when sparse)
    layout: PCollection  # one StreamLayout
    fragments: PCollection  # WrittenFragment
    summary: PCollection  # one BuildSummary, also written to plan.summary_path


def _first_n(record, counts: dict[int, int], n: int) -> bool:
    """Keep a record when its rank over all sources (in source order) is below n."""
    return sum(c for s, c in counts.items() if s < record.source_index) + record.record_index < n


def _not_resumed(document, resumed: frozenset) -> bool:
    return document.doc_id not in resumed


def _total(plan: BuildPlan, items: PCollection, label: str, size) -> object:
    """A stage's whole amount (sum of ``size`` over ``items``) as a side input for its progress
    bar; None (no total) when there are no bars or the steps run in several processes."""
    if not (plan.progress and plan.in_process):
        return None
    total = items | f"Size{label}" >> beam.Map(size) | f"Total{label}" >> beam.CombineGlobally(sum)
    return AsSingleton(total)


class _Batch(beam.PTransform):
    """Documents (or prompts) -> lists forming padded batches, grouped by padded width, spread out."""

    def __init__(self, tokens_per_batch: int, max_items: int | None = None):
        super().__init__()
        self.tokens_per_batch = tokens_per_batch
        self.max_items = max_items

    def expand(self, items):
        def cut(keyed):
            _, group = keyed
            group = list(group)
            for idx in plan_batches([len(d.tokens) for d in group], self.tokens_per_batch):
                for start in range(0, len(idx), self.max_items or len(idx)):
                    yield [group[i] for i in idx[start : start + (self.max_items or len(idx))]]

        return (
            items
            | "ByWidth" >> beam.Map(lambda d: (padded_width(len(d.tokens)), d))
            | "GroupByWidth" >> beam.GroupByKey()
            | "CutBatches" >> beam.FlatMap(cut)
            | "Spread" >> beam.Reshuffle()
        )


def expand_build(p: beam.Pipeline, plan: BuildPlan) -> BuildOutputs:
    # the sources' chunks, spread over workers, each read on its own: no stage holds the
    # corpus's text (a side input or a shuffle of records would)
    chunks = list(plan.chunks) or [Chunk(s) for s in plan.sources]
    records = (
        p
        | "Chunks" >> beam.Create(chunks)
        | "SpreadChunks" >> beam.Reshuffle()
        | "ReadRecords" >> beam.FlatMap(read_chunk, limit=plan.max_docs)
    )
    if plan.max_docs is not None:
        per_source = records | "CountForLimit" >> beam.Map(lambda r: (r.source_index, 1)) | beam.CombinePerKey(sum)
        records = records | "FirstN" >> beam.Filter(_first_n, counts=AsDict(per_source), n=plan.max_docs)
    if all(c.num_records is not None for c in chunks):  # counted by the plan: no side input over the records
        counted = sum(c.num_records for c in chunks)
        record_total = min(counted, plan.max_docs) if plan.max_docs is not None else counted
    else:
        record_total = _total(plan, records, "Records", lambda r: 1)
    if not (plan.progress and plan.in_process):
        record_total = None
    prepared = (
        records
        | "BatchRecords" >> beam.BatchElements(min_batch_size=PREPARE_BATCH, max_batch_size=PREPARE_BATCH)
        | "RenderTokenise" >> beam.ParDo(steps.PrepareFn(plan), total=record_total)
        .with_outputs("rejected", "prompts", main="documents")
    )
    documents = prepared.documents
    if plan.regenerate:
        generated = (
            prepared.prompts
            | "BatchPrompts" >> _Batch(plan.batch_tokens, plan.generate_batch)
            | "Regenerate" >> beam.ParDo(steps.GenerateFn(plan), total=_total(plan, prepared.prompts, "Prompts", lambda r: 1))
        )
        documents = (documents, generated) | "AllDocuments" >> beam.Flatten()

    if not plan.sparse:
        to_embed = documents
        if plan.resumed:  # --resume: the old build's staged batches come back as they are; only the rest is embedded
            to_embed = documents | "SkipResumed" >> beam.Filter(_not_resumed, resumed=frozenset(d for b in plan.resumed for d in b.doc_ids))
        embedded = (
            to_embed
            | "BatchDocuments" >> _Batch(plan.batch_tokens)
            | "Embed" >> beam.ParDo(steps.EmbedFn(plan), total=_total(plan, to_embed, "Tokens", lambda d: len(d.tokens)))
            .with_outputs("stats", main="staged")
        )
        staged, stats = embedded.staged, embedded.stats
        if plan.resumed:
            reused = (
                p
                | "ResumedBatches" >> beam.Create(list(plan.resumed))
                | "Resume" >> beam.ParDo(steps.ResumeFn(plan), total=sum(b.num_tokens for b in plan.resumed) if plan.progress and plan.in_process else None)
                .with_outputs("stats", main="staged")
            )
            staged = (staged, reused.staged) | "AllStaged" >> beam.Flatten()
            stats = (stats, reused.stats) | "AllStats" >> beam.Flatten()
        if plan.normaliser_path is not None:  # append: the parent's normaliser, so old rows stay valid
            normaliser = p | "NormaliserPath" >> beam.Create([plan.normaliser_path]) | "ReuseNormaliser" >> beam.Map(writers.reuse_normaliser, plan=plan)
        else:
            normaliser = (
                stats
                | "CombineStats" >> beam.CombineGlobally(steps.NormStatsCombineFn())
                | "FitNormaliser" >> beam.Map(writers.fit_and_save, plan=plan)
            )
    refs = documents | "SpillTokens" >> beam.ParDo(steps.SpillTokensFn(plan))  # tokens to staging files
    if plan.sa_shard_tokens is None:  # one suffix array: the whole token stream meets on one worker
        layout = (
            refs
            | "CollectStream" >> beam.combiners.ToList()
            | "SuffixArray" >> beam.Map(writers.write_stream, plan=plan)
        )
        shards_done = p | "NoShards" >> beam.Create([])
    else:  # only lengths meet on one worker; each shard's tokens meet on the worker that sorts them
        layout = (
            refs
            | "DocLengths" >> beam.Map(lambda r: (r.doc_id, r.length))
            | "CollectLengths" >> beam.combiners.ToList()
            | "AssignShards" >> beam.Map(assign_shards, max_tokens=plan.sa_shard_tokens, base=plan.base)
        )
        built = (
            refs
            | "KeyByShard" >> beam.Map(lambda r, lay: (lay.shard_of[r.doc_id], r), lay=AsSingleton(layout))
            | "GroupShards" >> beam.GroupByKey()
            | "ShardSuffixArrays" >> beam.Map(writers.write_shard, plan=plan, layout=AsSingleton(layout))
        )
        reused = (  # an append's untouched parent shards
            p
            | "ParentShards" >> beam.Create(list(range(len(plan.base.shards))) if plan.base else [])
            | "ReuseShards" >> beam.FlatMap(append.link_untouched_shard, plan=plan, layout=AsSingleton(layout))
        )
        shards_done = (built, reused) | "ShardsDone" >> beam.Flatten()
    if plan.sparse:  # no rows: the stream and suffix array are the whole version
        staged = p | "NoStaged" >> beam.Create([])
        normaliser = p | "NoNormaliser" >> beam.Create([])
        fragments = p | "NoFragments" >> beam.Create([])
        dense = p | "NoDense" >> beam.Create([None])
    else:
        fragments = staged | "WriteFragments" >> beam.FlatMap(
            steps.write_fragment, normaliser=AsSingleton(normaliser), layout=AsSingleton(layout), plan=plan
        )
        dense = (  # the compact dense files: every fragment's rows meet on one worker (memory-mapped outputs)
            fragments
            | "CollectDenseRows" >> beam.combiners.ToList()
            | "WriteDense" >> beam.Map(writers.write_dense, normaliser=AsSingleton(normaliser), layout=AsSingleton(layout), plan=plan)
        )
    num_rejected = (
        prepared.rejected
        | "CollectRejected" >> beam.combiners.ToList()
        | "WriteRejected" >> beam.Map(writers.write_rejected, plan=plan)
    )
    read_counts = records | "RecordsPerSource" >> beam.Map(lambda r: r.source_index) | "CountRead" >> beam.combiners.Count.PerElement()
    rejected_counts = (
        prepared.rejected | "RejectedPerSource" >> beam.Map(lambda r: r.source_index) | "CountRejected" >> beam.combiners.Count.PerElement()
    )
    summary = (
        fragments
        | "CollectFragments" >> beam.combiners.ToList()
        | "Summary" >> beam.Map(
            _write_summary, plan=plan, layout=AsSingleton(layout), num_rejected=AsSingleton(num_rejected),
            read_counts=AsDict(read_counts), rejected_counts=AsDict(rejected_counts), shards_done=AsList(shards_done),
            dense=AsSingleton(dense),
        )
    )
    return BuildOutputs(records, documents, prepared.rejected, staged, normaliser, layout, fragments, summary)


def _write_summary(
    written: list[WrittenFragment], plan: BuildPlan, layout: StreamLayout, num_rejected: int, read_counts: dict,
    rejected_counts: dict, shards_done: list[int], dense: dict | None = None,
) -> BuildSummary:
    """Everything the driver needs to commit, as one small JSON file in the staging folder
    (written after every fragment and suffix-array shard, and, one array, after the stream)."""
    if plan.sa_shard_tokens is not None and sorted(shards_done) != list(range(len(layout.shards))):
        raise RuntimeError(f"internal: shards written {sorted(shards_done)}, layout has {len(layout.shards)}")
    summary = summarise(
        written, layout, plan.base, num_rejected=num_rejected, source_indices=[s.index for s in plan.sources],
        read_counts=read_counts, rejected_counts=rejected_counts, dense=dense,
    )
    files.write_summary(plan, summary)
    return summary
