"""What-if for the cost-aware pruner: trees pruned under one price of a tree node, priced under another.

    python benchmarks/prune_price.py --references q_code_id.json --store /work/bench_store \\
        --datastore code-id --methods respec,dresd,rest --prune-scales 1.0,1.6,2.5 --true-scale 1.6

Replays the bench result's ``ar`` references (greedy verification: MAT from the text alone, as
``specstore simulate``) with each method cost-aware, its pruner given the bench's stored cost model
with ``tree_scale`` set to each of ``--prune-scales`` (the tree part of a step that much dearer
than the table says, as ``CostModel.observe`` would learn it), and prices every run's trees with
the same model at ``--true-scale``: whether pricing nodes right (or dearer, or cheaper) buys
speed. Prints MAT, verified nodes per step and the predicted speedup over ar per setting.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--references", required=True, help="a bench result JSON with ar references and a cost model")
    p.add_argument("--store", required=True)
    p.add_argument("--datastore", required=True)
    p.add_argument("--methods", default="respec,dresd,rest")
    p.add_argument("--prune-scales", default="1.0,1.6,2.5")
    p.add_argument("--true-scale", type=float, default=1.0)
    args = p.parse_args()

    from specstore.runtime.bench.report import load_result
    from specstore.runtime.bench.simulate import predicted_seconds, references_from, replay
    from specstore.runtime.cost import CostModel
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.drafters import registry
    from specstore.runtime.models import load_model
    from specstore.runtime.store import Store

    bench = load_result(args.references)
    if bench.cost_model is None:
        raise SystemExit("the bench result has no cost model (run the bench with a cost-aware method)")
    refs = references_from(bench)
    lm = load_model(None, dtype="float32")  # the references' states, as specstore simulate computes them
    ds = Datastore.open(Store(args.store), args.datastore, lm.info)
    table = json.loads(json.dumps(bench.cost_model))
    truth = CostModel.from_json(table | {"tree_scale": args.true_scale, "online": False})
    print(f"| method | prune scale | MAT | nodes per step | predicted speedup (true scale {args.true_scale}) |\n|---|---|---|---|---|")
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        for scale in (float(s) for s in args.prune_scales.split(",")):
            priced = CostModel.from_json(table | {"tree_scale": scale, "online": False})
            reps = replay(lambda m=method, c=priced: registry.make_drafter(m, ds, cost=c), refs, bench.max_new_tokens, lm.model)
            method_s, ar_s = predicted_seconds(reps, truth)
            tokens = sum(r.stats.num_tokens for r in reps)
            steps = sum(r.stats.steps for r in reps)
            drafted = sum(r.stats.num_drafted for r in reps)
            print(f"| {method} | {scale} | {tokens / steps:.3f} | {drafted / steps:.2f} | {ar_s / method_s:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
