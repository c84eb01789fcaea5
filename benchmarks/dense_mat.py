"""MAT of dresd and respec with compact dense search against exact float32 search, on one real
old-form dense datastore.

Run: ``python benchmarks/dense_mat.py --store /work/scale/store --ref code-1m-dense --references
refs_ar.json --ann-threshold 50000,5000``. Opens the version as it is (its tokens table's float32
rows, exact search: the reference), replays greedy ``ar`` references (a ``specstore bench``
result with method ar) with the simulator (exact MAT under greedy verification), then swaps in
the compact form made from the same rows in memory, as a compact build writes it (int8 codes
with per-dimension scales spanning 4 measured standard deviations, block-sorted, continuations
from the stream, a faiss index by the build's own ``write_ann_index`` for each block of at
least the threshold) and replays again. Prints one JSON object. Owns no library code.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np


def compact_index(ds, threshold: int, nprobe: int = 32, rerank: int = 4, *, tmp: Path):
    """``(DenseIndex over compact arrays, StreamContinuations)`` made from an old-form version's rows."""
    import faiss

    from specstore.pipelines.writers import write_ann_index
    from specstore.runtime import dense_files as df
    from specstore.runtime.dense import DenseIndex

    old = ds.dense
    emb = old._vectors  # block-sorted float32 rows; old.rows maps them to table rows
    table_rows = np.asarray(old.rows)
    data = ds.store.open_table(ds.manifest.tokens_table).to_lance().to_table(columns=["offset"])
    offsets = data.column("offset").to_numpy()
    scales = (df.CODE_MAX / np.clip(df.SCALE_SIGMAS * emb.std(axis=0), 1 / df.CODE_MAX, 1.0)).astype(np.float32)
    keep, blocks, start = [], {}, 0
    for token, (a, b) in sorted(old._blocks.items()):
        if token < 0:
            continue  # a document's last position: no next token, no compact row
        keep.append(np.arange(a, b))
        blocks[token] = (start, start + b - a)
        start += b - a
    keep = np.concatenate(keep)
    codes = df.quantise(emb[keep], scales)
    positions = offsets[table_rows[keep]].astype(np.int64)
    indexes = {}
    for token, (a, b) in blocks.items():
        if b - a >= threshold:
            path = tmp / f"{token}.faiss"
            write_ann_index(path, codes[a:b], scales)
            index = faiss.read_index(str(path))
            faiss.extract_index_ivf(index).nprobe = nprobe
            indexes[token] = df.ApproximateBlock(index, rerank)
    return DenseIndex.from_blocks(codes, scales, positions, blocks, indexes.get), df.StreamContinuations(ds.suffix, ds.manifest.model.vocab_size)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--ref", required=True, help="an old-form dense version")
    ap.add_argument("--references", required=True, help="a bench result with method ar")
    ap.add_argument("--methods", default="dresd,respec")
    ap.add_argument("--ann-threshold", default="20000:64:16", help="comma list of THRESHOLD[:NPROBE:RERANK] (default probes 32, rerank 4)")
    ap.add_argument("--skip-exact", action="store_true", help="only the compact runs")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from specstore.runtime.bench.report import load_result
    from specstore.runtime.bench.simulate import references_from, simulate
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.decode import context_limit
    from specstore.runtime.drafters.registry import make_drafter
    from specstore.runtime.models import load_model

    bench = load_result(args.references)
    refs = references_from(bench)
    lm = load_model(None, dtype="float32")
    context = context_limit(lm.model)
    ds = Datastore.open(args.store, args.ref, model_info=lm.info, dense=True)
    if ds.manifest.dense is not None:
        raise SystemExit(f"{ds.ref} is already compact: give an old-form dense version")
    exact_index, exact_conts = ds.dense, ds.continuations
    methods = [m.strip() for m in args.methods.split(",")]
    skip_exact = args.skip_exact

    def mat(label):
        out = {}
        for method in methods:
            sims = simulate(lambda method=method: make_drafter(method, datastore=ds), refs, bench.max_new_tokens, lm.model, context)
            out[method] = round(float(sum(s.num_tokens for s in sims) / sum(s.steps for s in sims)), 4)
        print(json.dumps({label: out}), file=sys.stderr, flush=True)
        return out

    report = {"ref": ds.ref, "prompts": len(refs), "max_new_tokens": bench.max_new_tokens}
    if not skip_exact:
        report["exact_float32"] = mat("exact_float32")
    for spec in args.ann_threshold.split(","):
        tmp = Path(tempfile.mkdtemp(prefix="dense-mat-"))
        try:
            ds.dense, ds.continuations = compact_index(ds, *[int(x) for x in spec.split(":")], tmp=tmp)
            report[f"compact_ann_{spec}"] = mat(f"compact_ann_{spec}")
        finally:
            ds.dense, ds.continuations = exact_index, exact_conts
            shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
