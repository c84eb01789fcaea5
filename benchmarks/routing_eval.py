"""Domain routing on held-out prompts: does the router pick the right datastore, and is the MAT
of routed decoding close to the best single datastore's?

For every held-out prompt of every domain (default: the float32 ``ar`` references that
``benchmarks/reference_compare.py`` writes, CodeAlpaca 1900-1929 and MT-Bench questions 1-4 of
each category), the router scores the prompt against all datastores (nearest domain centroid in
each datastore's own reduced space, as ``specstore generate --datastore a,b`` does). Then
``specstore simulate``'s replay gives the MAT of a method with (a) the routed datastore, and (b)
each datastore alone, on the same references. Prints routing accuracy per domain and the MATs.

    python benchmarks/routing_eval.py --datastores code-full,chat-large \\
        --references code=bench_results/ref_code_eval.json,chat=bench_results/ref_mt_eval.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    from specstore.runtime.api import prompt_ids
    from specstore.runtime.bench.report import load_result
    from specstore.runtime.bench.simulate import reference_states, references_from, simulate_one
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.decode import context_limit
    from specstore.runtime.drafters.registry import make_drafter
    from specstore.runtime.models import load_model
    from specstore.runtime.router import Router

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=str(ROOT / "bench_store"))
    ap.add_argument("--datastores", default="code-full,chat-large", help="comma list; the i-th serves the i-th domain below")
    ap.add_argument("--references", default="code=bench_results/ref_code_eval.json,chat=bench_results/ref_mt_eval.json",
                    help="DOMAIN=bench json with ar references, comma separated, in the order of --datastores")
    ap.add_argument("--method", default="respec")
    args = ap.parse_args()
    refs_by_domain = [item.split("=", 1) for item in args.references.split(",")]
    names = [n.strip() for n in args.datastores.split(",")]
    if len(names) != len(refs_by_domain):
        raise SystemExit("--datastores and --references must list the same number of domains")
    lm = load_model(None, dtype="float32")
    opened = [Datastore.open(args.store, n, model_info=lm.info, dense=True) for n in names]
    router = Router(opened)
    template = prompt_ids(lm.tokenizer, "")  # the chat template around an empty message
    ctx = context_limit(lm.model)
    drafters = [make_drafter(args.method, ds) for ds in opened]
    rows = []
    for truth, (domain, path) in enumerate(refs_by_domain):
        bench = load_result(ROOT / path if not Path(path).is_absolute() else path)
        refs = references_from(bench)
        picked, tokens, steps = 0, 0, 0
        single = [[0, 0] for _ in opened]
        for ref in refs:
            route = router.route(lm.model, ref.prompt_ids, template)
            picked += route.index == truth
            states = reference_states(lm.model, ref)
            for i, drafter in enumerate(drafters):
                sim = simulate_one(drafter, ref, bench.max_new_tokens, ctx, states)
                single[i][0] += sim.num_tokens
                single[i][1] += sim.steps
                if i == route.index:
                    tokens, steps = tokens + sim.num_tokens, steps + sim.steps
        rows.append((domain, names[truth], len(refs), picked, tokens / steps,
                     [t / s for t, s in single]))
    print(f"| domain | prompts | routed to its own datastore | {args.method} MAT routed | "
          + " | ".join(f"MAT {n} only" for n in names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for domain, own, n, picked, routed, singles in rows:
        print(f"| {domain} ({own}) | {n} | {picked}/{n} | {routed:.3f} | " + " | ".join(f"{m:.3f}" for m in singles) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
