"""Build benchmark: throughput per stage, embedding vs raw forward, suffix-array time, peak memory.

Run: ``python benchmarks/bench_build.py --corpus ../shared/data/codealpaca/code_alpaca_2k.jsonl.gz
--max-docs 200``. Measures, with the default model unless ``--model``:

- the whole build end to end (``specstore build`` in a subprocess: wall time, tokens/s, peak RSS);
- each stage alone in this process on the same records, through a real plan (``plan_build``)
  and the build's own functions and model: read+render+tokenise, embedding (batches by padded
  width, forward, spill to staging, normaliser statistics), normaliser fit, stream + suffix
  array, and fragment writing (apply + rows + Lance fragment);
- the model's raw batched forward on random ids of the same batch shapes, as the limit the
  embedding stage is compared with (timed batch by batch, alternating with the embedding step);
- suffix-array construction for ``--sa-tokens`` random tokens.

Prints one JSON object (and writes it to ``--out`` if given). Owns no library code.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _rss_mib(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux reports KiB


def _end_to_end(args, workdir: Path) -> dict:
    cmd = [sys.executable, "-m", "specstore.runtime.cli", "build", "--store", str(workdir / "store"), "--name", "bench",
           "--corpus", *args.corpus, "--max-docs", str(args.max_docs), "--dtype", args.dtype, "--batch-tokens", str(args.batch_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"build failed: {proc.stderr.strip().splitlines()[-1:]}")
    from specstore.runtime.store import Store

    m = Store(workdir / "store").resolve("bench").manifest
    return {"seconds": round(seconds, 2), "num_documents": m.num_documents, "num_tokens": m.num_tokens,
            "tokens_per_s": round(m.num_tokens / seconds, 1), "peak_rss_mib": round(_rss_mib(resource.RUSAGE_CHILDREN), 1)}


def _stages(args, workdir: Path) -> dict:
    from specstore.pipelines import workers, writers
    from specstore.pipelines.corpus import read_records
    from specstore.pipelines.embed import embed_documents, padded_width, plan_batches, save_staged
    from specstore.pipelines.normalise import NormStats, fit_normaliser, sample_rows
    from specstore.pipelines.plan import plan_build
    from specstore.pipelines.render import Document, prepare
    from specstore.runtime.device import resolve_build_dtype
    from specstore.runtime.store import Store

    plan = plan_build(Store(workdir / "store", create=True), "bench", args.corpus, model=args.model, dtype=resolve_build_dtype(args.dtype),
                      batch_tokens=args.batch_tokens, max_docs=args.max_docs, progress=False)
    loaded = workers.shared_model(plan.model_path, plan.dtype)  # the model the plan was checked with, as in a build
    device = next(loaded.model.parameters()).device
    out: dict = {}
    t = time.perf_counter()
    docs: list[Document] = []
    for source in plan.sources:
        for record in read_records(source, limit=args.max_docs):
            docs += [d for d in prepare(record, source.format, loaded.tokenizer, max_doc_tokens=plan.max_doc_tokens) if isinstance(d, Document)]
    docs = docs[: args.max_docs]
    num_tokens = sum(len(d.tokens) for d in docs)
    out["read_render_tokenise"] = _rate(num_tokens, time.perf_counter() - t)

    batches = plan_batches([len(d.tokens) for d in docs], plan.batch_tokens)
    staged, stats = [], NormStats.empty(loaded.info.hidden_size)
    shapes = [(len(b), padded_width(max(len(docs[i].tokens) for i in b))) for b in batches]
    padded_tokens = sum(rows * width for rows, width in shapes)
    gen = torch.Generator().manual_seed(0)

    def raw_forward(rows: int, width: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            ids = torch.randint(0, loaded.info.vocab_size, (rows, width), generator=gen).to(device)
            loaded.model.base_model(input_ids=ids, use_cache=False)
        return time.perf_counter() - start

    def embed_step(n: int, group: list[Document]) -> float:
        nonlocal stats
        start = time.perf_counter()
        hidden = embed_documents(loaded.model, [d.tokens for d in group])
        staged.append(save_staged(plan.staging_dir, f"b{n}", [d.doc_id for d in group], [d.tokens for d in group], hidden, plan.spill_dtype))
        stats = stats.merge(NormStats.of(sample_rows(np.concatenate(hidden), plan.fit_rows_per_batch)))
        return time.perf_counter() - start

    # untimed pass: the first forward of each new shape builds its kernels (oneDNN primitives,
    # bf16 weight layouts); a long build amortises that, so neither timed pass below pays it
    out["warmup_s"] = round(sum(raw_forward(rows, width) for rows, width in shapes), 3)
    # the limit: the same forward shapes on random ids, no staging, no statistics. Timed batch
    # by batch, paired with the embedding step of that batch (in alternating order), so that
    # the machine's drift hits both alike
    embed_s, raw_s, ratios = 0.0, 0.0, []
    for n, (b, (rows, width)) in enumerate(zip(batches, shapes, strict=True)):
        group = [docs[i] for i in b]
        if n % 2:
            e, r = embed_step(n, group), raw_forward(rows, width)
        else:
            r, e = raw_forward(rows, width), embed_step(n, group)
        embed_s, raw_s = embed_s + e, raw_s + r
        ratios.append((sum(len(d.tokens) for d in group) / e) / (rows * width / r))
    out["embed"] = _rate(num_tokens, embed_s) | {"padding_share": round(1 - num_tokens / padded_tokens, 3)}
    out["raw_forward"] = _rate(padded_tokens, raw_s)
    out["embed_vs_raw_forward"] = round(out["embed"]["tokens_per_s"] / out["raw_forward"]["tokens_per_s"], 3)
    out["embed_vs_raw_forward_median_batch"] = round(float(np.median(ratios)), 3)

    t = time.perf_counter()
    normaliser = fit_normaliser(stats, plan.pca_dims)
    out["normaliser_fit_s"] = round(time.perf_counter() - t, 3)

    t = time.perf_counter()
    layout = writers.write_stream([(d.doc_id, d.tokens) for d in docs], plan)
    out["stream_and_suffix_array"] = _rate(num_tokens, time.perf_counter() - t)

    t = time.perf_counter()
    for s in staged:
        writers.write_fragment(s, normaliser, layout, plan)
    out["write_fragments"] = _rate(num_tokens, time.perf_counter() - t)
    out["num_tokens"] = num_tokens
    out["peak_rss_mib"] = round(_rss_mib(), 1)
    return out


def _rate(tokens: int, seconds: float) -> dict:
    return {"seconds": round(seconds, 3), "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}


def _suffix_array(num_tokens: int) -> dict:
    from specstore.runtime.suffix_array import build_suffix_array

    stream = np.random.default_rng(0).integers(0, 49152, size=num_tokens, dtype=np.int32)
    t = time.perf_counter()
    sa = build_suffix_array(stream)
    return {"num_tokens": num_tokens, "seconds": round(time.perf_counter() - t, 2), "dtype": str(sa.dtype)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", nargs="+", default=["../shared/data/codealpaca/code_alpaca_2k.jsonl.gz"])
    p.add_argument("--max-docs", type=int, default=200)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"], help="auto: as a build resolves it")
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--sa-tokens", type=int, default=10_000_000)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="specstore-bench-") as tmp:
        workdir = Path(tmp)
        result = {"end_to_end": _end_to_end(args, workdir / "e2e"), "stages": _stages(args, workdir / "stages"),
                  "suffix_array": _suffix_array(args.sa_tokens), "dtype": args.dtype, "max_docs": args.max_docs,
                  "cpus": os.cpu_count()}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
