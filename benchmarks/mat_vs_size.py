"""MAT against datastore size: how big should my datastore be?

Replays greedy ``ar`` references (a ``specstore bench`` result with method ar, on prompts that
are in no datastore) against datastores of growing size with the simulator (exact MAT under
greedy verification, no decoding), for each method, and writes one JSON file that ``specstore
report`` turns into a table and, with ``--plots``, a plot of MAT against tokens:

    specstore bench --store S --questions heldout.jsonl --methods ar --max-new-tokens 128 --out refs.json
    python benchmarks/mat_vs_size.py --store S --datastores code-1m,code-10m,code-sparse \
        --dense code-1m-dense --references refs.json --out mat_vs_size.json
    specstore report mat_vs_size.json --plots docs/bench

Sparse datastores get rest and respec (respec without its dense source); ``--dense`` ones get
dresd too. Each MAT comes with a 95% bootstrap interval over prompts (2,000 resamples, seed 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def bootstrap(tokens: np.ndarray, steps: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of total tokens / total steps over prompts resampled with replacement."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(tokens), size=(resamples, len(tokens)))
    ratios = tokens[idx].sum(axis=1) / steps[idx].sum(axis=1)
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--datastores", required=True, help="comma list of references (sparse or dense)")
    ap.add_argument("--dense", default="", help="comma list of dense references, for dresd as well")
    ap.add_argument("--references", required=True, help="a bench result with method ar")
    ap.add_argument("--methods", default="rest,respec")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="the model the references came from (default: the embedded one)")
    args = ap.parse_args(argv)

    from specstore.runtime.bench.report import load_result
    from specstore.runtime.bench.simulate import references_from, simulate
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.decode import context_limit
    from specstore.runtime.drafters.registry import make_drafter, needs_dense, needs_states
    from specstore.runtime.models import load_model
    from specstore.runtime.store import Store

    bench = load_result(args.references)
    refs = references_from(bench)
    store = Store(args.store)
    lm = load_model(args.model, dtype="float32")
    context = context_limit(lm.model)
    jobs = [(r.strip(), [m.strip() for m in args.methods.split(",")]) for r in args.datastores.split(",") if r.strip()]
    jobs += [(r.strip(), ["dresd", *[m.strip() for m in args.methods.split(",")]]) for r in args.dense.split(",") if r.strip()]
    rows = []
    for ref, methods in jobs:
        started = time.perf_counter()
        ds = Datastore.open(store, ref, model_info=lm.info, dense=needs_dense(methods))
        opened = time.perf_counter() - started
        for method in methods:
            sims = simulate(lambda method=method, ds=ds: make_drafter(method, datastore=ds), refs, bench.max_new_tokens,
                            lm.model if needs_states([method]) else None, context)
            tokens = np.array([s.num_tokens for s in sims], dtype=np.float64)
            steps = np.array([s.steps for s in sims], dtype=np.float64)
            low, high = bootstrap(tokens, steps)
            rows.append({"datastore": ds.ref, "index": ds.manifest.index, "tokens": ds.manifest.num_tokens, "method": method,
                         "mat": float(tokens.sum() / steps.sum()), "mat_low": low, "mat_high": high, "open_s": round(opened, 3)})
            print(json.dumps(rows[-1]), file=sys.stderr)
    out = {"kind": "mat_vs_size", "references": args.references, "questions": bench.questions, "num_prompts": len(refs),
           "max_new_tokens": bench.max_new_tokens, "model": bench.model, "rows": rows}
    with open(args.out, "w") as handle:
        json.dump(out, handle, indent=1)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
