"""DReSD at scale on a built dense version: open time, resident memory and propose latency.

Two steps, so that the measuring process never loads the model (its weights would swamp the
memory figures):

    # 1. real queries: the target's hidden states over held-out Python sources (default: this
    #    project's runtime/ and pipelines/, which no corpus built from a virtualenv contains)
    python benchmarks/dense_scale.py queries --out dense_queries.npz --count 2000
    # 2. the version, in a process of its own
    python benchmarks/dense_scale.py measure --store /work/scale/store --ref code-10m-dense@bench \\
        --queries dense_queries.npz [--out result.json]

    # 3. synthetic large blocks (labelled so): what one block of 10^6-10^7 rows costs
    python benchmarks/dense_scale.py synthetic --store /work/scale/store --name code-1m-dense --rows 1000000,5000000

``synthetic`` fits a Gaussian (mean and covariance) to the largest next-token block of a real
dense version (its vectors as the runtime sees them, after PCA and L2), draws ``--rows`` rows
from it per size, quantises them with the build's per-dimension scales, writes the build's
approximate index over them (``write_ann_index``: IVF-PQ, 4 sqrt(n) lists) and searches through
the runtime's ``DenseIndex.from_blocks`` with the manifest's probes and rerank: index build
time, index bytes per row (the file, which the runtime reads whole on the block's first search),
the search's
p50/p99 and recall@10 against an exact scan of the int8 block, for queries drawn from the same
Gaussian. A real block has more structure than a Gaussian (clusters an inverted file finds), so
recall here is a floor; latency depends on the sizes, not the values. At 1M tokens the largest
block held 5.2% of the rows, so a block of 5M rows is about what a 100M-token version's largest
block holds.

``measure`` reports: ``Datastore.open`` and the drafter's setup time; the process' anonymous
resident memory (beyond the page cache of mapped files) per token after the open, after the
first proposes, and after all ``--count`` proposes (by then every approximate index the queries
reach is read); the version's bytes per token on disk (table, files, indexes); and dresd's
``propose`` latency (the whole drafter step: normalise the query, filtered search, continuations
from the stream, the trie) per query, p50/p90/p99 over all of them and over the second half
(indexes loaded). ``--prefetch`` opens as ``serve`` does (the mapped pages and every approximate
index read in a background thread after the open) and waits for that before the proposes, so
no propose reads an index; its time and the memory after it are reported. Queries are real contexts: position p's hidden state with the token after it
as the pending token, so the next-token filter sees the blocks decoding meets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the sibling benchmarks' helpers

from retrieval_latency import memory_kib  # noqa: E402  (this process' anonymous / file-backed resident memory)


def make_queries(args) -> None:
    import torch

    from specstore.runtime.models import load_model

    torch.manual_seed(0)
    loaded = load_model(args.model, dtype=args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    files = [f for d in args.held_out for f in sorted(Path(d).rglob("*.py"))]
    rng = np.random.default_rng(0)
    hidden, pending, contexts = [], [], []
    per_file = max(1, args.count // max(len(files), 1) + 1)
    for f in files:
        ids = tokenizer(f.read_text(errors="ignore"), add_special_tokens=False)["input_ids"][: args.window]
        if len(ids) < 48:
            continue
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        states = out.hidden_states[-1][0].float().numpy()
        for p in rng.choice(np.arange(32, len(ids) - 1), size=min(per_file, len(ids) - 33), replace=False):
            hidden.append(states[p])
            pending.append(ids[p + 1])
            contexts.append(ids[max(0, p + 2 - 64) : p + 2])
    order = rng.permutation(len(hidden))[: args.count]
    width = max(len(c) for c in contexts)
    ctx = np.full((len(order), width), -1, dtype=np.int64)
    for row, i in enumerate(order):
        ctx[row, : len(contexts[i])] = contexts[i]
    np.savez(args.out, hidden=np.asarray(hidden, np.float32)[order], pending=np.asarray(pending)[order], contexts=ctx,
             model=str(loaded.info.model_id), dtype=args.dtype)
    print(f"wrote {len(order)} queries from {len(files)} files to {args.out}")


def disk_bytes(store, manifest) -> dict:
    """The version's bytes on disk: its tokens table's folder (data files, Lance's manifests and
    transaction files) and its files folder (the manifest's checksummed files outside the table;
    the manifest also lists the table's data files, which the folder's size already counts)."""
    table_prefix = f"{manifest.tokens_table}.lance/" if manifest.tokens_table else None
    files = sum(info.num_bytes for rel, info in manifest.files.items() if not (table_prefix and rel.startswith(table_prefix)))
    table = 0
    if manifest.tokens_table:
        folder = Path(store.table_uri(manifest.tokens_table))
        table = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    ann = sum(info.num_bytes for rel, info in manifest.files.items() if "/ann/" in rel)
    n = manifest.num_tokens
    return {"table_bytes": table, "file_bytes": files, "ann_bytes": ann,
            "bytes_per_token": round((table + files) / n, 2), "ann_bytes_per_token": round(ann / n, 2)}


def lat(samples: list[float]) -> dict:
    ms = np.asarray(samples) * 1e3
    return {f"p{q}_ms": round(float(np.percentile(ms, q)), 3) for q in (50, 90, 99)} | {"n": len(samples)}


def measure(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.drafters.base import DecodeState
    from specstore.runtime.drafters.dresd import DresdDrafter
    from specstore.runtime.store import Store

    data = np.load(args.queries)
    hidden, contexts = data["hidden"], data["contexts"]
    store = Store(args.store)
    before = memory_kib()
    t = time.perf_counter()
    ds = Datastore.open(store, args.ref, prefetch=args.prefetch)
    open_s = time.perf_counter() - t
    opened = memory_kib()
    prefetch_s = None
    if args.prefetch:  # what a server does after the open (serve opens so): wait for it, then measure
        for thread in ds.prefetching:
            thread.join()
        prefetch_s = round(time.perf_counter() - t - open_s, 3)
        prefetched = memory_kib()
    t = time.perf_counter()
    drafter = DresdDrafter.from_datastore(ds)
    setup_s = time.perf_counter() - t
    ready = memory_kib()
    n = ds.manifest.num_tokens

    def anon(now):
        return round((now["RssAnon"] - before["RssAnon"]) * 1024 / n, 2)

    dense = ds.manifest.dense
    report = {"ref": ds.ref, "tokens": n, "rows": dense.num_rows if dense else None,
              "ann_blocks": len(dense.ann_blocks) if dense else None, "ann_threshold": dense.ann_threshold if dense else None,
              "open_s": round(open_s, 3), "prefetch": args.prefetch, "prefetch_s": prefetch_s, "drafter_setup_s": round(setup_s, 3),
              "anon_bytes_per_token": {"open": anon(opened), "drafter": anon(ready)}, **disk_bytes(store, ds.manifest)}
    if args.prefetch:
        report["anon_bytes_per_token"]["prefetched"] = anon(prefetched)
    times = []
    for i in range(len(hidden)):
        ctx = [int(x) for x in contexts[i] if x >= 0]
        state = DecodeState(tokens=ctx, num_prompt=len(ctx), last_hidden=torch.from_numpy(hidden[i]), budget=32)
        t = time.perf_counter()
        drafter.propose(state)
        times.append(time.perf_counter() - t)
        if i == 99:
            report["anon_bytes_per_token"]["first_100"] = anon(memory_kib())
    report["anon_bytes_per_token"]["all"] = anon(memory_kib())
    report["file_backed_mib"] = round((memory_kib()["RssFile"] - before["RssFile"]) / 1024, 1)
    report["propose"] = lat(times)
    report["propose_second_half"] = lat(times[len(times) // 2 :])
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def synthetic(args) -> None:
    import tempfile

    import faiss
    import torch

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    from dense_ann import load_rows

    from specstore.pipelines.writers import ANN_RERANK, write_ann_index
    from specstore.runtime import dense_files as df
    from specstore.runtime.dense import DenseIndex

    emb, nxt, manifest = load_rows(args.store, args.name, None)
    tokens, counts = np.unique(nxt[nxt >= 0], return_counts=True)
    largest = int(tokens[np.argmax(counts)])
    block = emb[nxt == largest].astype(np.float64)
    mean, cov = block.mean(axis=0), np.cov(block, rowvar=False)
    scales = (df.CODE_MAX / np.clip(df.SCALE_SIGMAS * emb.std(axis=0), 1 / df.CODE_MAX, 1.0)).astype(np.float32)
    rng = np.random.default_rng(0)
    report = {"source": f"{manifest.name}@{manifest.version}", "source_block_rows": int(len(block)),
              "source_block_share": round(float(len(block) / (nxt >= 0).sum()), 4), "sizes": []}
    for n in [int(x) for x in args.rows.split(",")]:
        codes = np.empty((n, emb.shape[1]), dtype=np.int8)
        for start in range(0, n, 1_000_000):
            stop = min(n, start + 1_000_000)
            draw = rng.multivariate_normal(mean, cov, size=stop - start, method="cholesky").astype(np.float32)
            codes[start:stop] = df.quantise(draw, scales)
        queries = rng.multivariate_normal(mean, cov, size=args.queries, method="cholesky").astype(np.float32)
        folder = Path(tempfile.mkdtemp(prefix="dense-syn-"))
        t = time.perf_counter()
        write_ann_index(folder / "block.faiss", codes, scales)
        build_s = time.perf_counter() - t
        index = faiss.read_index(str(folder / "block.faiss"))  # read whole, as the runtime does: resident = the file
        faiss.extract_index_ivf(index).nprobe = args.nprobe
        approx = df.ApproximateBlock(index, args.rerank or ANN_RERANK)
        dense = DenseIndex.from_blocks(codes, scales, np.arange(n, dtype=np.int64), {0: (0, n)}, lambda _token, block=approx: block)
        times, recalls = [], []
        deq = None
        for i, q in enumerate(queries):
            t = time.perf_counter()
            found = dense.search(torch.from_numpy(q), 10, next_token=0)
            times.append(time.perf_counter() - t)
            if i < args.recall_queries:
                if deq is None:
                    deq = torch.from_numpy(codes.astype(np.float32) / scales) if n <= 20_000_000 else None
                if deq is not None:
                    truth = set(torch.topk(deq @ torch.from_numpy(q), 10).indices.tolist())
                    recalls.append(len(truth & set(found.rows.tolist())) / 10)
        del deq
        row = {"rows": n, "index_build_s": round(build_s, 1), "index_bytes_per_row": round((folder / "block.faiss").stat().st_size / n, 2),
               "nprobe": args.nprobe, "rerank": args.rerank or ANN_RERANK,
               "recall_at_10": round(float(np.mean(recalls)), 4) if recalls else None, **lat(times)}
        report["sizes"].append(row)
        print(json.dumps(row), flush=True)
        del index, approx, dense, codes
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    q = sub.add_parser("queries", help="compute real queries with the model")
    q.add_argument("--out", required=True)
    q.add_argument("--count", type=int, default=2000)
    q.add_argument("--held-out", nargs="+", default=[str(ROOT / "runtime"), str(ROOT / "pipelines")])
    q.add_argument("--window", type=int, default=1024, help="tokens of each file run through the model")
    q.add_argument("--model", default=None)
    q.add_argument("--dtype", default="bfloat16", help="the dtype the store was built with")
    m = sub.add_parser("measure", help="open a version and time dresd's propose")
    m.add_argument("--store", required=True)
    m.add_argument("--ref", required=True)
    m.add_argument("--queries", required=True)
    m.add_argument("--threads", type=int, default=1)
    m.add_argument("--prefetch", action="store_true",
                   help="open as serve does (Datastore.open(prefetch=True): pages and every approximate index read in the "
                        "background) and wait for it before the proposes")
    m.add_argument("--out")
    y = sub.add_parser("synthetic", help="one synthetic block of each size, drawn from a real version's largest block")
    y.add_argument("--store", required=True)
    y.add_argument("--name", required=True, help="a dense datastore (its newest version)")
    y.add_argument("--rows", default="1000000,5000000", help="comma-separated block sizes")
    y.add_argument("--queries", type=int, default=1000)
    y.add_argument("--recall-queries", type=int, default=200)
    y.add_argument("--nprobe", type=int, default=64)
    y.add_argument("--rerank", type=int, default=0, help="candidates per neighbour (0: the build's default)")
    y.add_argument("--threads", type=int, default=1)
    y.add_argument("--out")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    {"queries": make_queries, "measure": measure, "synthetic": synthetic}[args.command](args)


if __name__ == "__main__":
    main()
