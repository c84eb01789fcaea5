"""The files of a version that the build's single-writer steps write.

Owns writing, into the version's (not yet visible) file folder: the token stream and suffix
array (whole, or one shard at a time), the normaliser (fitted here, or a given one copied), the
tokens table's Lance fragments (uncommitted), a compact version's dense files (int8 codes
block-sorted by next token, their stream positions, the block table and an approximate index
per large block: runtime/dense_files.py) and the rejected records; each checked against the
stream layout (layout.py). Plain functions of the plan and their inputs: no Beam, no progress
bars (the adapters in steps.py and transforms.py add them). Nothing here makes anything visible:
commit.py does.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np

from specstore.pipelines import append
from specstore.pipelines.append import parent_stream
from specstore.pipelines.embed import StagedBatch, load_staged
from specstore.pipelines.files import local_copy, output, version_rel
from specstore.pipelines.layout import StreamLayout, stream_layout
from specstore.pipelines.normalise import NormStats, fit_normaliser
from specstore.pipelines.plan import REJECTED_FILE, BuildPlan
from specstore.pipelines.render import Rejection, TokenRef
from specstore.pipelines.rows import rows_table
from specstore.pipelines.summary import WrittenFragment
from specstore.runtime import dense_files as df
from specstore.runtime.normaliser import NORMALISER_FILE, Normaliser
from specstore.runtime.sharded_suffix import shard_dir
from specstore.runtime.suffix_array import build_suffix_array, join_documents, save_suffix_index


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
    first = int(min(starts))
    dense_path = None
    if plan.compact:
        codes = df.quantise(embeddings, normaliser.code_scales())
        dense_path = _stage_dense_rows(plan, first, docs, starts, codes)
        table = rows_table(doc_ids, docs, starts, codes, plan.continuation_length, plan.vocab_size, plan.table_format)
    else:
        table = rows_table(doc_ids, docs, starts, embeddings, plan.continuation_length)
    fragments = write_fragments(table, plan.table_uri, schema=plan.table_schema,
                                storage_options=plan.location.options or None,
                                data_storage_version=TABLE_STORAGE_VERSION if plan.compact else None)
    return WrittenFragment(
        first_offset=first, fragments=tuple(json.dumps(f.to_json()) for f in fragments), num_rows=table.num_rows,
        embedding_sum=tuple(embeddings.astype(np.float64).sum(axis=0).tolist()), dense_path=dense_path,
    )


TABLE_STORAGE_VERSION = "2.1"  # Lance's file format with compressed encodings: the doc/position/offset columns shrink ~8x


def _stage_dense_rows(plan: BuildPlan, first: int, docs: list[np.ndarray], starts: list[int], codes: np.ndarray) -> str:
    """One fragment's rows for the dense files, staged as ``_staging/dense-<offset>.npz``:
    codes, stream positions and next tokens of the positions a token follows in their document."""
    positions = np.concatenate([s + np.arange(len(d), dtype=np.int64) for d, s in zip(docs, starts, strict=True)])
    nexts = np.concatenate([np.append(np.asarray(d[1:], dtype=np.int64), -1) for d in docs])
    keep = nexts >= 0
    rel = f"{plan.staging_name}/dense-{first:014d}.npz"
    with output(plan, rel) as path:
        np.savez(path, codes=codes[keep], positions=positions[keep], next=nexts[keep].astype(np.int32))
    return plan.location.child(version_rel(plan, rel)) if plan.remote else str(path)


def write_dense(written: list[WrittenFragment], normaliser: Normaliser, layout: StreamLayout, plan: BuildPlan) -> dict | None:
    """The compact dense files of the version (runtime/dense_files.py): every block's rows (an
    append's parent's and each fragment's staged ones) in stream order; an approximate index for each block of at least ``plan.ann_threshold`` rows (an append's
    untouched block keeps its parent's, linked). Two passes over the staged rows (counts, then
    placement into memory-mapped outputs): memory stays a few fragments' worth. Returns the
    manifest's ``dense`` fields (None for a non-compact build)."""
    if not plan.compact or normaliser is None:
        return None
    options = dict(plan.storage_options)
    parts = [w.dense_path for w in sorted(written, key=lambda w: w.first_offset)]
    parent = append.parent_dense(plan.base, options) if plan.base is not None else None
    counts = np.zeros(plan.model_info.vocab_size, dtype=np.int64)
    if parent is not None:
        np.add.at(counts, parent.blocks[:, 0], parent.blocks[:, 2] - parent.blocks[:, 1])
    for part in parts:
        with local_copy(part, options) as path, np.load(path) as data:
            np.add.at(counts, data["next"], 1)
    tokens = np.flatnonzero(counts)
    blocks = df.block_table(tokens, counts[tokens])
    num_rows = int(counts.sum())
    pos_dtype = df.positions_dtype(layout.num_entries)
    scales = normaliser.code_scales()
    cursor = np.zeros(len(counts), dtype=np.int64)
    cursor[tokens] = blocks[:, 1]
    touched = set()
    with output(plan, df.DENSE_DIR, folder=True) as folder:
        codes = np.lib.format.open_memmap(folder / "vectors.npy", mode="w+", dtype=np.int8, shape=(num_rows, plan.pca_dims))
        positions = np.lib.format.open_memmap(folder / "positions.npy", mode="w+", dtype=np.dtype(pos_dtype), shape=(num_rows,))
        if parent is not None:
            for t, s, e in parent.blocks.tolist():
                at = cursor[t]
                codes[at : at + e - s] = parent.codes[s:e]
                positions[at : at + e - s] = parent.positions[s:e]
                cursor[t] += e - s
        for part in parts:
            with local_copy(part, options) as path, np.load(path) as data:
                nexts = data["next"].astype(np.int64)
                order = np.argsort(nexts, kind="stable")
                sorted_next = nexts[order]
                uniq, first, cnt = np.unique(sorted_next, return_index=True, return_counts=True)
                dest = cursor[sorted_next] + np.arange(len(order)) - np.repeat(first, cnt)
                codes[dest] = data["codes"][order]
                positions[dest] = data["positions"][order]
                cursor[uniq] += cnt
                touched.update(uniq.tolist())
        if not np.array_equal(cursor[tokens], blocks[:, 2]):
            raise RuntimeError("internal: dense rows do not fill their blocks")
        for _, s, e in blocks.tolist():  # fragments hold documents of one padded width: put each block in stream order
            pos = np.asarray(positions[s:e])
            if e - s > 1 and np.any(pos[1:] < pos[:-1]):
                order = np.argsort(pos, kind="stable")
                positions[s:e] = pos[order]
                codes[s:e] = np.asarray(codes[s:e])[order]
        np.save(folder / "blocks.npy", blocks)
        ann_blocks, reused = [], []
        for t, s, e in blocks.tolist():
            if e - s < plan.ann_threshold:
                continue
            ann_blocks.append(t)
            if parent is not None and t in parent.ann_blocks and t not in touched:
                reused.append(t)  # linked below, once the folder is in place
                continue
            (folder / "ann").mkdir(exist_ok=True)
            write_ann_index(folder / df.ann_file(t).split("/", 1)[1], np.asarray(codes[s:e]), scales)
        codes.flush()
        positions.flush()
        del codes, positions
    for t in reused:
        plan.location.copy(f"{plan.base.files_rel}/{df.ann_file(t)}", version_rel(plan, df.ann_file(t)))
    return {"scales": [float(x) for x in scales], "num_rows": num_rows, "positions_dtype": pos_dtype,
            "ann_threshold": plan.ann_threshold, "ann_blocks": ann_blocks, "ann_rerank": ANN_RERANK,
            "table_format": plan.table_format}


def write_rejected(rejections: list[Rejection], plan: BuildPlan) -> int:
    """All rejected records, in source and record order, one JSON object per line."""
    rejections = sorted(rejections, key=lambda r: (r.source_index, r.record_index))
    with output(plan, REJECTED_FILE) as path, open(path, "w", encoding="utf-8") as out:
        for r in rejections:
            out.write(json.dumps(r.to_json(plan.source_path(r.source_index)), ensure_ascii=False) + "\n")
    return len(rejections)


# product-quantiser bytes per row (fewer when the dimensions do not divide). 8 rather than 16: on the
# real 1M-token code store (docs/SCALING.md) 8 codes with 16 candidates reranked per neighbour gave
# the same recall@10 (0.9535 against 0.9545, measured side by side) as 16 codes with 8, in 17 instead of 26 bytes
# per indexed row and a sixth of the training time
ANN_SUBQUANTISERS = 8
ANN_RERANK = 16  # candidates per wanted neighbour the runtime reranks exactly (manifest.dense.ann_rerank)


def write_ann_index(path: Path, codes: np.ndarray, scales: np.ndarray) -> None:
    """A block's approximate index (faiss IVF with product-quantised codes, inner product) over
    its dequantised rows, ids = row offsets in the block; the runtime reranks its candidates
    exactly on the int8 rows. Sized to the block: about 4 sqrt(n) lists (at least 39 training
    rows each), 8-bit sub-quantisers when there are enough rows to train them."""
    import faiss

    vectors = np.ascontiguousarray(codes, dtype=np.float32) / np.asarray(scales, dtype=np.float32)
    n, d = vectors.shape
    nlist = int(np.clip(int(4 * np.sqrt(n)), 1, max(1, n // 39)))
    m = max(x for x in range(1, min(ANN_SUBQUANTISERS, d) + 1) if d % x == 0)
    nbits = int(np.clip(np.floor(np.log2(max(n // 39, 2))), 1, 8))
    index = faiss.IndexIVFPQ(faiss.IndexFlatIP(d), d, nlist, m, nbits, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = 1234
    index.train(vectors)
    index.add(vectors)
    tmp = path.with_name(f".{path.name}.tmp")
    faiss.write_index(index, str(tmp))
    tmp.replace(path)
