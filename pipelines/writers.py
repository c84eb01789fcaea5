"""The files of a version that the build's single-writer steps write.

Owns writing, into the version's (not yet visible) file folder: the token stream and suffix
array (whole, or one shard at a time), the normaliser (fitted here, or a given one copied), the
tokens table's Lance fragments (uncommitted) and the rejected records; each checked against the
stream layout (layout.py). Plain functions of the plan and their inputs: no Beam, no progress
bars (the adapters in steps.py and transforms.py add them). Nothing here makes anything visible:
commit.py does.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np

from specstore.pipelines.append import parent_stream
from specstore.pipelines.embed import StagedBatch, load_staged
from specstore.pipelines.files import local_copy, output
from specstore.pipelines.layout import StreamLayout, stream_layout
from specstore.pipelines.normalise import NormStats, fit_normaliser
from specstore.pipelines.plan import REJECTED_FILE, BuildPlan
from specstore.pipelines.render import Rejection, TokenRef
from specstore.pipelines.rows import rows_table
from specstore.pipelines.summary import WrittenFragment
from specstore.runtime.normaliser import NORMALISER_FILE, Normaliser
from specstore.runtime.sharded_suffix import shard_dir
from specstore.runtime.suffix_array import build_suffix_array, join_documents, save_suffix_index
from specstore.schemas.tables import tokens_schema


def fit_and_save(stats: NormStats | None, plan: BuildPlan) -> Normaliser | None:
    """Fit the normaliser and write normaliser.npz (None when there is nothing to fit)."""
    if stats is None or stats.n < 2:
        return None
    normaliser = fit_normaliser(stats, plan.pca_dims)
    with output(plan, NORMALISER_FILE) as path:
        normaliser.save(path)
    return normaliser


def reuse_normaliser(_, plan: BuildPlan) -> Normaliser:
    """Copy the normaliser an append (or a fixed-normaliser build) reuses into this build's files."""
    with local_copy(plan.normaliser_path, dict(plan.storage_options)) as source:
        normaliser = Normaliser.load(source)
    with output(plan, NORMALISER_FILE) as path:
        normaliser.save(path)
    return normaliser


def spill_tokens(docs: list[tuple[int, np.ndarray]], plan: BuildPlan) -> list[TokenRef]:
    """Write ``(doc_id, tokens)`` documents to one staging file; their references."""
    if not docs:
        return []
    rel = f"{plan.staging_name}/tokens-{docs[0][0]}-{uuid.uuid4().hex[:8]}.npy"
    with output(plan, rel) as path:
        np.save(path, np.concatenate([np.asarray(tokens, dtype=np.int32) for _, tokens in docs]))
    offsets = np.cumsum([0] + [len(tokens) for _, tokens in docs[:-1]]).tolist()
    return [TokenRef(doc_id, len(tokens), rel, o) for (doc_id, tokens), o in zip(docs, offsets, strict=True)]


def load_tokens(refs: list[TokenRef], plan: BuildPlan) -> list[tuple[int, np.ndarray]]:
    """The spilled tokens of ``refs`` as ``(doc_id, tokens)`` in doc_id order, reading each
    staging file once (memory-mapped when local)."""
    by_file: dict[str, list[TokenRef]] = {}
    for ref in refs:
        by_file.setdefault(ref.file, []).append(ref)
    out = []
    for rel, group in by_file.items():
        with local_copy(plan.location.child(f"{plan.files_rel}/{rel}") if plan.remote else str(Path(plan.files_dir, rel)),
                        dict(plan.storage_options)) as path:
            tokens = np.load(path, mmap_mode="r")
            out.extend((r.doc_id, np.array(tokens[r.offset : r.offset + r.length], dtype=np.int32)) for r in group)
    return sorted(out, key=lambda d: d[0])


def write_stream(refs: list[TokenRef], plan: BuildPlan) -> StreamLayout:
    """Join all documents in doc_id order (after the parent's stream, for an append), build and
    save the suffix array; return the layout."""
    docs = load_tokens(refs, plan)
    layout = stream_layout([(doc, len(tokens)) for doc, tokens in docs], plan.base)
    stream, _ = join_documents([tokens for _, tokens in docs])
    if plan.base is not None:
        stream = np.concatenate([parent_stream(plan.base, None, dict(plan.storage_options)), stream])
    if len(stream) != layout.num_entries:
        raise RuntimeError(f"internal: a stream of {len(stream)} entries, the layout says {layout.num_entries}")
    with output(plan, "", folder=True) as folder:
        save_suffix_index(folder, stream, build_suffix_array(stream))
    return layout


def write_shard(keyed: tuple[int, list[TokenRef]], plan: BuildPlan, layout: StreamLayout) -> int:
    """One shard's stream and suffix array (built on the worker that reads only this shard's
    tokens); a parent's shard that takes new documents is rebuilt from its stream followed by theirs."""
    index, refs = keyed
    docs = load_tokens(list(refs), plan)
    stream, _ = join_documents([tokens for _, tokens in docs])
    expected = layout.shards[index]
    if expected.base_length:
        stream = np.concatenate([parent_stream(plan.base, index, dict(plan.storage_options)), stream])
    first = expected.offset + expected.base_length
    if len(stream) != expected.length or layout.starts[docs[0][0]] != first:
        raise RuntimeError(f"internal: shard {index} has {len(stream)} entries, layout says {expected}")
    with output(plan, shard_dir(Path(), index).as_posix(), folder=True) as folder:
        save_suffix_index(folder, stream, build_suffix_array(stream))
    return index


def write_fragment(staged: StagedBatch, normaliser: Normaliser, layout: StreamLayout, plan: BuildPlan) -> WrittenFragment:
    """Rows of one staging file -> Lance fragments of the tokens table (not yet committed)."""
    from lance.fragment import write_fragments

    with local_copy(staged.path, dict(plan.storage_options)) as path:
        doc_ids, docs, hidden = load_staged(str(path))
    embeddings = normaliser.apply(hidden)
    del hidden
    starts = [layout.starts[d] for d in doc_ids]
    table = rows_table(doc_ids, docs, starts, embeddings, plan.continuation_length)
    fragments = write_fragments(table, plan.table_uri, schema=tokens_schema(plan.pca_dims, plan.continuation_length),
                                storage_options=plan.location.options or None)
    return WrittenFragment(
        first_offset=int(min(starts)), fragments=tuple(json.dumps(f.to_json()) for f in fragments), num_rows=table.num_rows,
        embedding_sum=tuple(embeddings.astype(np.float64).sum(axis=0).tolist()),
    )


def write_rejected(rejections: list[Rejection], plan: BuildPlan) -> int:
    """All rejected records, in source and record order, one JSON object per line."""
    rejections = sorted(rejections, key=lambda r: (r.source_index, r.record_index))
    with output(plan, REJECTED_FILE) as path, open(path, "w", encoding="utf-8") as out:
        for r in rejections:
            out.write(json.dumps(r.to_json(plan.source_path(r.source_index)), ensure_ascii=False) + "\n")
    return len(rejections)
