"""The serving loop, measured: serve a stream with logging on, ``build --append`` the log, move
the tag, let the engine switch, and compare a second held-out stream before and after.

    python benchmarks/serve_loop.py --store COPY_OF_STORE --name code --tag prod \
        --prompts ../shared/data/codealpaca/code_alpaca_2k.jsonl.gz --serve 1100:1300 --heldout 1300:1400

The store is changed (a new version is appended and tagged): give it a copy. Both streams are
prompts of the questions file by record range; neither may be in the datastore.

1. An engine opened on ``NAME@TAG`` serves the served stream with logging on (the first of
   ``--methods``; no overlay, so that what changes afterwards is the datastore alone).
2. ``build --append`` of the log, tagged ``--tag``; ``engine.refresh()`` switches the engine, and
   one request checks that the new version serves it.
3. The held-out stream through two fresh engines, one pinned to the version before
   (``NAME@V``) and one to the version after, each prompt through both in turn (the order
   alternating), for every method: so tokens/s compare side by side, and neither engine has
   learnt from the served stream (their cost-aware calibrations start alike).

Trees are sized as ``specstore serve`` sizes them (``--cost-aware``, default auto). Prints one JSON
object: the versions, the log, and per method MAT and tokens/s on the held-out stream before and
after, with the after/before ratio and a paired bootstrap 95% interval over its prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _range(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    return int(a), int(b)


def _serve(engine, prompt: str, method: str, max_new_tokens: int) -> dict:
    started = time.perf_counter()
    result = engine.generate(prompt, method=method, max_new_tokens=max_new_tokens)
    return {"committed": result.stats.num_tokens, "steps": result.stats.steps, "new_tokens": len(result.token_ids),
            "wall_s": time.perf_counter() - started, "datastore": result.datastore}


def _pooled(rows: list[dict], num: str, den: str, sample: np.ndarray | None = None):
    a = np.array([r[num] for r in rows], dtype=float)
    b = np.array([r[den] for r in rows], dtype=float)
    return a.sum() / b.sum() if sample is None else a[sample].sum(axis=1) / b[sample].sum(axis=1)


def compare(before: list[dict], after: list[dict], resamples: int = 5000) -> dict:
    """MAT and tokens/s of both (pooled over prompts), and after/before with a paired bootstrap
    95% interval (the same resampled prompts on both sides)."""
    sample = np.random.default_rng(0).integers(0, len(before), size=(resamples, len(before)))
    out = {}
    for name, keys in (("mat", ("committed", "steps")), ("tokens_per_s", ("new_tokens", "wall_s"))):
        ratio = _pooled(after, *keys, sample) / _pooled(before, *keys, sample)
        out[name] = {"before": round(_pooled(before, *keys), 3), "after": round(_pooled(after, *keys), 3),
                     "ratio": round(_pooled(after, *keys) / _pooled(before, *keys), 4),
                     "interval": [round(float(np.percentile(ratio, 2.5)), 4), round(float(np.percentile(ratio, 97.5)), 4)]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--tag", default="prod")
    ap.add_argument("--prompts", required=True, help="questions file (any format specstore bench reads)")
    ap.add_argument("--serve", type=_range, required=True, help="record range FIRST:END of the served stream")
    ap.add_argument("--heldout", type=_range, required=True, help="record range of the held-out stream")
    ap.add_argument("--methods", default="rest,respec")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None)
    ap.add_argument("--cost-aware", default="auto", choices=["auto", "on", "off"], help="tree sizing, as specstore serve (default auto)")
    ap.add_argument("--out", default=None, metavar="FILE", help="also write the JSON, per-request rows included, here")
    args = ap.parse_args(argv)

    from specstore.pipelines.build import build
    from specstore.runtime.bench.questions import load_questions
    from specstore.runtime.drafters import registry
    from specstore.runtime.engine import Engine
    from specstore.runtime.models import load_model
    from specstore.runtime.served_log import ServedLog
    from specstore.runtime.store import Store

    def prompts(span):
        first, end = span
        return [q.turns[0] for q in load_questions(args.prompts, limit=end - first, skip=first)]

    served_prompts, heldout = prompts(args.serve), prompts(args.heldout)
    if set(served_prompts) & set(heldout):
        raise SystemExit("the served and held-out streams overlap")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    log = Path(tempfile.mkdtemp(prefix="serve-loop-")) / "served.jsonl"
    store = Store(args.store)
    ref = f"{args.name}@{args.tag}"
    store.resolve(ref)
    loaded = load_model(args.model, dtype=args.dtype)
    cost = registry.cost_model_for(loaded, methods, args.cost_aware, quiet=False)

    def engine_on(reference: str, **options) -> Engine:
        return Engine(loaded, store, reference, method=methods[0], refresh_seconds=None, cost=cost,
                      cost_aware=args.cost_aware, **options)

    engine = engine_on(ref, log=ServedLog(log))  # only the served stream is logged: the next version's data
    result: dict = {"reference": ref, "before": engine.datastores[ref], "methods": methods, "cost_aware": args.cost_aware}
    started = time.perf_counter()
    served = []
    for i, prompt in enumerate(served_prompts):
        served.append(_serve(engine, prompt, methods[0], args.max_new_tokens))
        if (i + 1) % 20 == 0:
            print(f"  served {i + 1}/{len(served_prompts)}", file=sys.stderr, flush=True)
    result["served_stream"] = {"requests": len(served), "mat": round(_pooled(served, "committed", "steps"), 3),
                               "seconds": round(time.perf_counter() - started, 1)}
    engine.log = None
    result["log_lines"] = sum(1 for _ in open(log, encoding="utf-8"))
    started = time.perf_counter()
    built = build(store, args.name, [str(log)], model=args.model, mode="append", tag=args.tag, dtype=args.dtype, progress=False)
    result["appended"] = {"version": built.manifest.version, "added_documents": built.manifest.lineage.added_documents,
                          "added_tokens": built.manifest.lineage.added_tokens, "seconds": round(time.perf_counter() - started, 1)}
    engine.refresh()
    result["after"] = engine.datastores[ref]
    result["switched_request_served_by"] = _serve(engine, heldout[0], methods[0], 8)["datastore"]
    pinned = {"before": engine_on(result["before"]), "after": engine_on(result["after"])}
    rows: dict = {m: {"before": [], "after": []} for m in methods}
    for i, prompt in enumerate(heldout):
        for m in methods:
            for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
                rows[m][side].append(_serve(pinned[side], prompt, m, args.max_new_tokens))
        if (i + 1) % 10 == 0:
            print(f"  held-out {i + 1}/{len(heldout)}", file=sys.stderr, flush=True)
    result["heldout"] = {m: compare(rows[m]["before"], rows[m]["after"]) for m in methods}
    result["heldout_requests"] = rows
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(json.dumps({k: v for k, v in result.items() if k != "heldout_requests"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
