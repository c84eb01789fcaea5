"""Dense retrieval at scale: what compact vectors and an approximate index for large blocks cost
in recall and buy in latency, on a real dense datastore.

Run: ``python benchmarks/dense_ann.py --store /work/scale/store --name code-1m-dense``. Reads the
version's tokens table (old float32 or compact int8 form) with lance directly, then:

- **quantisation**: recall@10 of the filtered neighbours (same next token) against exact float32
  search, for float16, int8 with one global scale (127 over [-1, 1], what the build writes) and
  int8 with a per-dimension max-abs scale;
- **approximate index per large block**: for each block of at least ``--min-block`` rows, faiss
  (IVF with 8-bit scalar codes; HNSW over 8-bit codes) and Lance's own vector index (IVF_PQ,
  IVF_HNSW_SQ on a dataset of that block) against exact search of the int8 block: recall@10
  against exact float32, p50/p99 latency per query and the index's bytes per row.

- **the runtime's compact search end to end** (``--runtime``): the float32 rows quantised with
  per-dimension scales spanning 4 standard deviations (the build's rule, runtime/dense_files.py;
  here the standard deviations are measured, the build derives them from the PCA variances),
  block-sorted, faiss indexes written by the build's own ``write_ann_index`` for blocks of at
  least ``--ann-threshold`` rows, searched through ``DenseIndex.from_blocks``: recall@10 against
  exact float32 search and the search's p50/p99 over queries drawn uniformly over rows.

Queries are datastore rows themselves (their own row left out of the answers), sampled uniformly
over rows, so frequent next tokens get queried as often as decoding meets them. Prints one JSON
object (and writes it to ``--out``). Owns no library code.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def load_rows(store: str, name: str, version: int | None):
    from specstore.runtime.store import Store

    st = Store(store)
    record = st.resolve(name if version is None else f"{name}@{version}")
    m = record.manifest
    import lance

    ds = lance.dataset(st.table_uri(m.tokens_table))
    data = ds.to_table(columns=["embedding", "continuation"])
    emb = np.asarray(data.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)).reshape(len(data), -1)
    cont = np.asarray(data.column("continuation").combine_chunks().flatten().to_numpy(zero_copy_only=False)).reshape(len(data), -1)
    nxt = cont[:, 0].astype(np.int64)
    if emb.dtype == np.int8:  # compact form: scales in the manifest
        emb = emb.astype(np.float32) / np.asarray(m.dense.scales, np.float32)
        nxt[nxt >= m.model.vocab_size] = -1
    return emb.astype(np.float32), nxt, m


def topk_exact(block: np.ndarray, q: np.ndarray, k: int, exclude: int) -> np.ndarray:
    scores = torch.from_numpy(block) @ torch.from_numpy(q)
    if 0 <= exclude < len(scores):
        scores[exclude] = -np.inf
    k = min(k, len(scores) - (1 if exclude >= 0 else 0))
    return torch.topk(scores, k).indices.numpy()


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return len(set(found.tolist()) & set(truth.tolist())) / max(len(truth), 1)


def quantisation(emb, nxt, queries, k):
    order = np.argsort(nxt, kind="stable")
    inv = np.empty_like(order)
    inv[order] = np.arange(len(order))
    s_nxt = nxt[order]
    sorted_emb = emb[order]
    maxabs = np.abs(emb).max(axis=0)
    variants = {
        "float16": sorted_emb.astype(np.float16).astype(np.float32),
        "int8_global": np.clip(np.rint(sorted_emb * 127), -127, 127) / 127.0,
        "int8_per_dim": np.clip(np.rint(sorted_emb * (127 / maxabs)), -127, 127) / (127 / maxabs),
    }
    variants = {k_: v.astype(np.float32) for k_, v in variants.items()}
    out = {name: [] for name in variants}
    for row in queries:
        t = nxt[row]
        lo, hi = np.searchsorted(s_nxt, t, "left"), np.searchsorted(s_nxt, t, "right")
        if hi - lo < 2:
            continue
        own = inv[row] - lo
        truth = topk_exact(sorted_emb[lo:hi], emb[row], k, own)
        for name, vecs in variants.items():
            out[name].append(recall(topk_exact(vecs[lo:hi], emb[row], k, own), truth))
    res = {name: round(float(np.mean(v)), 4) for name, v in out.items()}
    res["queries"] = len(next(iter(out.values())))
    res["max_abs_per_dim_range"] = [round(float(maxabs.min()), 3), round(float(maxabs.max()), 3)]
    return res


def _lat(times):
    t = np.asarray(times) * 1e3
    return {"p50_ms": round(float(np.percentile(t, 50)), 4), "p99_ms": round(float(np.percentile(t, 99)), 4)}


def ann_blocks(emb, nxt, k, min_block, num_queries, rng, methods):
    import faiss

    faiss.omp_set_num_threads(1)
    tokens, counts = np.unique(nxt[nxt >= 0], return_counts=True)
    large = [(int(t), int(c)) for t, c in zip(tokens, counts, strict=True) if c >= min_block]
    large.sort(key=lambda tc: -tc[1])
    results = []
    for token, count in large:
        rows = np.flatnonzero(nxt == token)
        block = emb[rows]
        q8 = np.clip(np.rint(block * 127), -127, 127).astype(np.int8)
        deq = q8.astype(np.float32) / 127.0
        qrows = rng.choice(len(rows), size=min(num_queries, len(rows)), replace=False)
        truths = [topk_exact(block, block[i], k, int(i)) for i in qrows]
        entry = {"token": token, "rows": count, "methods": {}}
        # exact int8 scan (what small blocks get)
        times, recs = [], []
        qt = torch.from_numpy(q8)
        for i, truth in zip(qrows, truths, strict=True):
            t0 = time.perf_counter()
            sc = qt.float() @ torch.from_numpy(block[i] / 127.0)
            sc[int(i)] = -np.inf
            top = torch.topk(sc, k).indices.numpy()
            times.append(time.perf_counter() - t0)
            recs.append(recall(top, truth))
        entry["methods"]["exact_int8"] = {"recall": round(float(np.mean(recs)), 4), **_lat(times), "index_bytes_per_row": 0}
        for method in methods:
            built = build_index(method, deq, count)
            if built is None:
                continue
            search, nbytes, build_s, cleanup = built
            times, recs = [], []
            for i, truth in zip(qrows, truths, strict=True):
                t0 = time.perf_counter()
                top = search(block[i], k + 1)
                times.append(time.perf_counter() - t0)
                top = np.asarray([r for r in top if r != int(i) and r >= 0][:k])
                recs.append(recall(top, truth))
            entry["methods"][method] = {"recall": round(float(np.mean(recs)), 4), **_lat(times),
                                        "index_bytes_per_row": round(nbytes / count, 1), "build_s": round(build_s, 2)}
            cleanup()
        results.append(entry)
        print(json.dumps(entry), flush=True)
    return results


def build_index(method, deq, count):
    import faiss

    d = deq.shape[1]
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="dense-ann-"))
    if method.startswith("faiss_ivf_sq8"):
        nlist = max(16, int(4 * np.sqrt(count)))
        nprobe = int(method.rsplit("_p", 1)[1]) if "_p" in method else 16
        quant = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFScalarQuantizer(quant, d, nlist, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
        index.by_residual = False
        index.train(deq)
        index.add(deq)
        index.nprobe = nprobe
    elif method.startswith("faiss_ivfpq"):  # faiss_ivfpq<M>_p<nprobe>_r<rerank factor>: PQ candidates, reranked exactly on int8
        m_sub = int(method.split("_")[1][len("ivfpq"):])
        nprobe = int(method.split("_p")[1].split("_")[0])
        factor = int(method.rsplit("_r", 1)[1])
        nlist = max(16, int(4 * np.sqrt(count)))
        quant = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFPQ(quant, d, nlist, m_sub, 8, faiss.METRIC_INNER_PRODUCT)
        index.train(deq)
        index.add(deq)
        index.nprobe = nprobe
        build_s = time.perf_counter() - t0
        faiss.write_index(index, str(tmp / "index.faiss"))
        nbytes = (tmp / "index.faiss").stat().st_size

        def search(q, k, index=index):
            _, ids = index.search(q.reshape(1, -1).astype(np.float32), k * factor)
            ids = ids[0][ids[0] >= 0]
            scores = deq[ids] @ q
            return ids[np.argsort(-scores, kind="stable")[:k]]

        return search, nbytes, build_s, lambda: shutil.rmtree(tmp, ignore_errors=True)
    elif method.startswith("faiss_hnsw_sq8"):
        index = faiss.IndexHNSWSQ(d, faiss.ScalarQuantizer.QT_8bit, 16, faiss.METRIC_INNER_PRODUCT)
        index.train(deq)
        index.add(deq)
        index.hnsw.efSearch = 64
    elif method.startswith("lance"):
        import lance
        import pyarrow as pa

        table = pa.table({"vector": pa.FixedSizeListArray.from_arrays(pa.array(deq.ravel()), d)})
        ds = lance.write_dataset(table, tmp / "block.lance")
        nlist = max(16, int(np.sqrt(count)))
        kind = "IVF_HNSW_SQ" if "hnsw" in method else "IVF_PQ"
        kwargs = {"num_sub_vectors": 16} if kind == "IVF_PQ" else {}
        ds = ds.create_index("vector", index_type=kind, metric="dot", num_partitions=nlist, **kwargs)
        nbytes = sum(f.stat().st_size for f in (tmp / "block.lance" / "_indices").rglob("*") if f.is_file())
        build_s = time.perf_counter() - t0

        def search(q, k, ds=ds):
            res = ds.to_table(nearest={"column": "vector", "q": q, "k": k, "nprobes": 16, "refine_factor": 4},
                              with_row_id=True, columns=[])
            return res.column("_rowid").to_numpy().astype(np.int64)

        return search, nbytes, build_s, lambda: shutil.rmtree(tmp, ignore_errors=True)
    else:
        return None
    build_s = time.perf_counter() - t0
    faiss.write_index(index, str(tmp / "index.faiss"))
    nbytes = (tmp / "index.faiss").stat().st_size

    def search(q, k, index=index):
        _, ids = index.search(q.reshape(1, -1).astype(np.float32), k)
        return ids[0]

    return search, nbytes, build_s, lambda: shutil.rmtree(tmp, ignore_errors=True)


def runtime_search(emb, nxt, queries, k, threshold, nprobe=32, rerank=4):
    """Recall@k and latency of DenseIndex.from_blocks over compact arrays made from ``emb``."""
    from specstore.pipelines.writers import write_ann_index
    from specstore.runtime import dense_files as df
    from specstore.runtime.dense import DenseIndex

    scales = (df.CODE_MAX / np.clip(df.SCALE_SIGMAS * emb.std(axis=0), 1 / df.CODE_MAX, 1.0)).astype(np.float32)
    valid = np.flatnonzero(nxt >= 0)
    order = valid[np.argsort(nxt[valid], kind="stable")]
    codes = df.quantise(emb[order], scales)
    tokens, counts = np.unique(nxt[order], return_counts=True)
    table = df.block_table(tokens, counts)
    blocks = {int(t): (int(a), int(b)) for t, a, b in table}
    tmp = Path(tempfile.mkdtemp(prefix="dense-rt-"))
    indexes, t0 = {}, time.perf_counter()
    for t, a, b in table.tolist():
        if b - a >= threshold:
            write_ann_index(tmp / f"{t}.faiss", codes[a:b], scales)
            import faiss

            idx = faiss.read_index(str(tmp / f"{t}.faiss"))
            faiss.extract_index_ivf(idx).nprobe = nprobe
            indexes[t] = df.ApproximateBlock(idx, rerank)
    build_s = time.perf_counter() - t0
    index = DenseIndex.from_blocks(codes, scales, order.astype(np.int64), blocks, indexes.get)
    recalls, times, ann_recalls = [], [], []
    for row in queries:
        t = int(nxt[row])
        a, b = blocks[t]
        if b - a < 2:
            continue
        members = order[a:b]
        scores = torch.from_numpy(emb[members]) @ torch.from_numpy(emb[row])
        scores[members == row] = -np.inf
        truth = set(members[torch.topk(scores, min(k, b - a - 1)).indices.numpy()].tolist())
        t0 = time.perf_counter()
        found = index.search(torch.from_numpy(emb[row]), k + 1, next_token=t)
        times.append(time.perf_counter() - t0)
        got = [r for r in found.rows.tolist() if r != row][:k]
        share = len(truth & set(got)) / len(truth)
        recalls.append(share)
        if t in indexes:
            ann_recalls.append(share)
    shutil.rmtree(tmp, ignore_errors=True)
    rows_in_ann = int(sum(b - a for t, (a, b) in blocks.items() if t in indexes))
    return {"ann_threshold": threshold, "nprobe": nprobe, "rerank": rerank, "ann_blocks": len(indexes), "rows_in_ann_blocks": rows_in_ann,
            "ann_build_s": round(build_s, 1), "queries": len(recalls), "recall": round(float(np.mean(recalls)), 4),
            "recall_in_ann_blocks": round(float(np.mean(ann_recalls)), 4) if ann_recalls else None,
            "queries_in_ann_blocks": len(ann_recalls), **_lat(times)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--version", type=int)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--queries", type=int, default=2000, help="queries for the quantisation recall")
    ap.add_argument("--block-queries", type=int, default=200, help="queries per large block")
    ap.add_argument("--min-block", type=int, default=20000, help="blocks of at least this many rows get the ANN comparison")
    ap.add_argument("--max-blocks", type=int, default=3)
    ap.add_argument("--methods", default="faiss_ivf_sq8_p8,faiss_ivf_sq8_p16,faiss_ivf_sq8_p32,faiss_hnsw_sq8,lance_ivf_pq,lance_ivf_hnsw_sq")
    ap.add_argument("--skip-quantisation", action="store_true")
    ap.add_argument("--skip-blocks", action="store_true", help="skip the per-block library comparison")
    ap.add_argument("--runtime", default="", help="comma-separated --ann-threshold values for the end-to-end runtime search, "
                    "each optionally THRESHOLD:NPROBE:RERANK (default 32 probes, 4 candidates per neighbour)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    emb, nxt, m = load_rows(args.store, args.name, args.version)
    report = {"store": args.store, "ref": f"{m.name}@{m.version}", "rows": int(len(emb)), "k": args.k}
    valid = np.flatnonzero(nxt >= 0)
    if not args.skip_quantisation:
        report["quantisation"] = quantisation(emb, nxt, rng.choice(valid, size=args.queries, replace=False), args.k)
        print(json.dumps(report["quantisation"]), flush=True)
    tokens, counts = np.unique(nxt[valid], return_counts=True)
    report["largest_blocks"] = sorted(counts.tolist(), reverse=True)[:10]
    if args.runtime:
        queries = rng.choice(valid, size=args.queries, replace=False)
        report["runtime"] = []
        for spec in args.runtime.split(","):
            t, *rest = [int(x) for x in spec.split(":")]
            report["runtime"].append(runtime_search(emb, nxt, queries, args.k, t, *rest))
            print(json.dumps(report["runtime"][-1]), flush=True)
        print(json.dumps(report["runtime"]), flush=True)
    if args.skip_blocks:
        print(json.dumps(report, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        return
    keep = set(sorted(zip(counts.tolist(), tokens.tolist(), strict=True), reverse=True)[: args.max_blocks])
    mask = np.isin(nxt, [t for _, t in keep])
    sub_nxt = np.where(mask, nxt, -1)
    report["blocks"] = ann_blocks(emb, sub_nxt, args.k, args.min_block, args.block_queries, rng, args.methods.split(","))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
