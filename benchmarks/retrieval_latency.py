"""Retrieval latency per decode step for REST and DReSD, and the dense search backends compared.

Model-free: the suffix array is built over real code (Python's standard library, tokenised with
the default tokenizer); contexts come from held-out files. The dense part uses unit vectors
with the stream's real next-token distribution (so block sizes are realistic), at 100k and 1M
rows, and compares exact full search, exact next-token-block search (ours), and faiss HNSW
(unfiltered ANN then the filter, as an ANN index must) with recall against exact filtered search.

    python benchmarks/retrieval_latency.py [--tokens 2000000]

With ``--store DIR --ref NAME@VERSION`` it measures a built version instead (e.g. the sparse
80M-token code datastore of docs/SCALING.md): the time ``Datastore.open`` takes, this process'
resident memory before and after the open and after the first propose (anonymous memory, i.e.
beyond the page cache of the mapped files, and file-backed pages separately, from
/proc/self/status), and REST propose latency on contexts from ``--held-out`` files (default:
this project's own sources, which no installed-package corpus holds).
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from specstore.runtime.dense import DenseIndex
from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.drafters.dresd import DresdDrafter
from specstore.runtime.drafters.rest import RestDrafter
from specstore.runtime.normaliser import Normaliser
from specstore.runtime.suffix_array import SuffixIndex, build_suffix_array, join_documents


def code_docs(tokenizer, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    docs, held_out, total = [], [], 0
    for i, f in enumerate(files):
        ids = tokenizer(f.read_text(errors="ignore"), add_special_tokens=False)["input_ids"]
        if i % 50 == 0:
            held_out.append(ids)
        elif total < max_tokens:
            docs.append(ids)
            total += len(ids)
        if total >= max_tokens and len(held_out) >= 20:
            break
    return docs, held_out


def ms(samples: list[float]) -> str:
    a = np.array(samples) * 1e3
    return f"mean {a.mean():.3f} ms, p50 {np.median(a):.3f}, p99 {np.percentile(a, 99):.3f}"


def bench_rest(index, held_out: list[list[int]], steps: int = 500) -> None:
    drafter = RestDrafter(index)
    rng = np.random.default_rng(0)
    times, cpu, sizes, hits = [], [], [], 0
    for _ in range(steps):
        doc = held_out[rng.integers(len(held_out))]
        cut = int(rng.integers(20, max(21, len(doc) - 1)))
        state = DecodeState(tokens=doc[:cut], num_prompt=cut, budget=64)
        t, c = time.perf_counter(), time.thread_time()
        tree = drafter.propose(state)
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
        sizes.append(len(tree))
        hits += len(tree) > 0
    print(f"rest over {len(index):,} tokens: {ms(times)}; tree nodes mean {np.mean(sizes):.1f}; drafted on {hits}/{steps} steps")
    # CPU time of this thread (page faults included): what wall time would be with the cores to itself
    print(f"  the same steps in CPU time (excludes waiting for a core on a shared machine): {ms(cpu)}")
    # the index remembers its widest narrowed intervals: the second half is the warmed-up state
    half = steps // 2
    print(f"  the last {steps - half} steps (warm interval cache): wall {ms(times[half:])}; CPU {ms(cpu[half:])}")


def bench_dense(next_tokens: np.ndarray, num_rows: int, dims: int = 64, k: int = 10, queries: int = 300) -> None:
    rng = np.random.default_rng(1)
    nxt = next_tokens[:num_rows]
    emb = rng.normal(size=(len(nxt), dims)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    index = DenseIndex(emb, nxt)
    qs = rng.normal(size=(queries, dims)).astype(np.float32)
    toks = nxt[rng.integers(len(nxt), size=queries)]  # pending tokens drawn like the data
    print(f"dense, {len(nxt):,} rows x {dims}: largest next-token block {max(index.block_size(int(t)) for t in np.unique(nxt)):,}")
    for label, fn in [
        ("exact, full (no filter)", lambda q, t: index.search(q, k)),
        ("exact, next-token block", lambda q, t: index.search(q, k, next_token=int(t))),
    ]:
        times = []
        for q, t in zip(qs, toks, strict=True):
            s = time.perf_counter()
            fn(q, t)
            times.append(time.perf_counter() - s)
        print(f"  {label}: {ms(times)}")
    # the drafter's whole step: normaliser on a hidden state + search + trie
    hidden = 576
    norm = Normaliser(np.zeros(hidden), np.ones(hidden), np.linalg.qr(rng.normal(size=(hidden, dims)))[0].T, np.zeros(hidden))
    cont = np.stack([nxt] + [np.roll(nxt, -i) for i in range(1, 10)], axis=1).astype(np.int32)
    drafter = DresdDrafter(norm, index, cont)
    times = []
    for t in toks:
        state = DecodeState(tokens=[0, int(t)], num_prompt=2, last_hidden=torch.randn(hidden), budget=64)
        s = time.perf_counter()
        drafter.propose(state)
        times.append(time.perf_counter() - s)
    print(f"  dresd propose (normalise + block search + trie): {ms(times)}")
    try:
        import faiss
    except ImportError:
        print("  faiss not installed: ANN comparison skipped")
        return
    faiss.omp_set_num_threads(1)
    for m_links, ef in [(32, 64), (32, 256)]:
        t0 = time.perf_counter()
        ann = faiss.IndexHNSWFlat(dims, m_links, faiss.METRIC_INNER_PRODUCT)
        ann.hnsw.efConstruction = 80
        ann.add(emb)
        ann.hnsw.efSearch = ef
        build_s = time.perf_counter() - t0
        times, recall_full, recall_filtered = [], [], []
        for q, t in zip(qs, toks, strict=True):
            s = time.perf_counter()
            _, found = ann.search(q[None], max(k, ef))
            keep = [int(r) for r in found[0] if r >= 0 and nxt[r] == t][:k]
            times.append(time.perf_counter() - s)
            exact_full = set(index.search(q, k).rows.tolist())
            recall_full.append(len(exact_full & set(found[0][:k].tolist())) / k)
            exact = index.search(q, k, next_token=int(t)).rows.tolist()
            recall_filtered.append(len(set(exact) & set(keep)) / max(1, len(exact)))
        print(f"  faiss HNSW M={m_links} ef={ef} (build {build_s:.1f} s), top-{max(k, ef)} then filter: {ms(times)}; "
              f"recall@{k} unfiltered {np.mean(recall_full):.3f}, filtered {np.mean(recall_filtered):.3f}")


def memory_kib() -> dict[str, int]:
    """This process' resident memory (KiB): anonymous (heap, arrays) and file-backed (mapped files)."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1])
    return out


def bench_version(store: str, ref: str, held_out_dirs: list[str], tokenizer, steps: int, prefetch: bool = False) -> None:
    """Open time, resident memory per token and REST propose latency of one built version."""
    from specstore.runtime.datastore import Datastore

    files = [f for d in held_out_dirs for f in sorted(Path(d).rglob("*.py"))]
    held_out = [ids for ids in (tokenizer(f.read_text(errors="ignore"), add_special_tokens=False)["input_ids"] for f in files)
                if len(ids) > 40]
    before = memory_kib()
    t = time.perf_counter()
    ds = Datastore.open(store, ref, dense=False)
    open_s = time.perf_counter() - t
    opened = memory_kib()
    n = ds.manifest.num_tokens
    print(f"{ds.ref}: {ds.manifest.index}, {n:,} tokens; open {open_s * 1e3:.1f} ms")

    def per_token(now: dict, label: str) -> None:
        anon = (now["RssAnon"] - before["RssAnon"]) * 1024 / n
        file = (now["RssFile"] - before["RssFile"]) * 1024 / n
        print(f"  resident after {label}: anonymous +{anon:.2f} B/token (beyond the page cache), "
              f"file-backed +{file:.2f} B/token (mapped pages)")

    per_token(opened, "open")
    if prefetch:  # what a server does after its open (Datastore.open(prefetch=True)); joined here to time it
        t = time.perf_counter()
        for thread in ds.suffix.prefetch():
            thread.join()
        print(f"  prefetch (the index's pages mapped by a background thread): {time.perf_counter() - t:.2f} s")
        per_token(memory_kib(), "prefetch")
    drafter = RestDrafter(ds.suffix)
    t = time.perf_counter()
    drafter.propose(DecodeState(tokens=held_out[0][:32], num_prompt=32, budget=64))
    print(f"  first propose: {time.perf_counter() - t:.2f} s")
    per_token(memory_kib(), "first propose")
    bench_rest(ds.suffix, held_out, steps)
    per_token(memory_kib(), f"{steps} proposes")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--store", default=None, metavar="DIR", help="measure a built version (with --ref) instead")
    parser.add_argument("--ref", default=None, metavar="NAME@VERSION")
    parser.add_argument("--held-out", nargs="+", default=[str(Path(__file__).resolve().parents[1] / d) for d in ("runtime", "pipelines")],
                        metavar="DIR", help="with --store: .py files whose contexts REST is asked about")
    parser.add_argument("--steps", type=int, default=2000, help="with --store: proposes timed")
    parser.add_argument("--prefetch", action="store_true",
                        help="with --store: map the index's pages first, as a long-lived server does after its open")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from specstore.runtime.models import provision_default_model

    tokenizer = AutoTokenizer.from_pretrained(str(provision_default_model(quiet=True)))
    if args.store is not None:
        if args.ref is None:
            parser.error("--store needs --ref NAME@VERSION")
        bench_version(args.store, args.ref, args.held_out, tokenizer, args.steps, args.prefetch)
        return
    docs, held_out = code_docs(tokenizer, args.tokens)
    stream, _ = join_documents(docs)
    t = time.perf_counter()
    index = SuffixIndex(stream, build_suffix_array(stream))
    print(f"suffix array over {len(stream):,} tokens built in {time.perf_counter() - t:.2f} s")
    bench_rest(index, held_out)
    next_tokens = np.concatenate([np.append(np.asarray(d[1:]), -1) for d in docs]).astype(np.int64)
    for rows in (100_000, 1_000_000):
        if rows <= len(next_tokens):
            bench_dense(next_tokens, rows)


if __name__ == "__main__":
    main()
