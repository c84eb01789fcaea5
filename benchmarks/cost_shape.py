"""What the cost table's shape buys: trees pruned under the bench's table, priced under a finer one.

    python benchmarks/cost_shape.py --store /work/bench_store \\
        --run code_id.json:code-id --run chat_ood.json:chat-ood --methods respec,dresd,rest

Measures a fine table once (every node count 1-8, then 10, 12, 16, 24, 32, 48, 64, at 128 and
1,024 cached tokens; cached in ``--fine``) and takes it as the truth. For each bench result's
``ar`` references (greedy replay, as ``specstore simulate``), each method is pruned under three
prices of the bench's stored table (node counts as it was measured; online corrections off, the
same ``--offset`` for any tree in all three): ``curve`` (runtime/cost.py's non-decreasing curve
through the medians), ``hinge`` (the least-squares ``a + b * max(n - knee, 0)`` the cost model
used until the twelfth session, kept here for the comparison) and ``truth`` (the fine table
itself); every run's trees are then priced under the truth. Prints MAT, verified nodes per step
and the predicted speedup over ar.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

FINE_NODES = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)


def hinge_fit(nodes, seconds) -> tuple[float, float, int]:
    """``(a, b, knee)``: for each knee (0 and the sizes but the two largest) runtime/cost.py's
    ``_line`` through ``max(nodes - knee, 0)``; the least squared relative error wins."""
    from specstore.runtime.cost import _line

    x, y = np.asarray(nodes, dtype=float), np.asarray(seconds, dtype=float)
    best = None
    for knee in [0, *sorted({int(n) for n in x})[:-2]]:
        u = np.maximum(x - knee, 0.0)
        a, b = _line(u, y)
        err = float(np.sum(((a + b * u - y) / y) ** 2))
        if best is None or err < best[0] * (1 - 1e-6) - 1e-12:
            best = (err, (a, b, knee))
    return best[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--run", action="append", required=True, help="RESULT.json:DATASTORE (repeatable)")
    p.add_argument("--methods", default="respec,dresd,rest")
    p.add_argument("--offset", type=float, default=0.05, help="what any tree adds, relative to a plain step")
    p.add_argument("--fine", default="fine_cost_table.json", help="the fine table's cache file")
    args = p.parse_args()

    from specstore.runtime.bench.report import load_result
    from specstore.runtime.bench.simulate import context_limit, predicted_seconds, references_from, replay
    from specstore.runtime.cost import CostModel, ForwardStep, measure
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.drafters import registry
    from specstore.runtime.models import load_model
    from specstore.runtime.store import Store

    class HingeCost(CostModel):
        """The stored table priced by the old hinge (per context row, through the padded sizes),
        given as the curve's points at every whole node count: the same line pieces, knees whole."""

        def __post_init__(self) -> None:
            CostModel.__post_init__(self)
            grid = [float(n) for n in range(1, max(self.nodes) + 1)]
            hinges = [hinge_fit(xs, ys) for xs, ys in self.curve]
            self.curve = [(grid, [a + b * max(n - knee, 0.0) for n in grid]) for a, b, knee in hinges]

    lm = load_model(None, dtype="float32")
    fine_path = Path(args.fine)
    if fine_path.exists():
        fine = json.loads(fine_path.read_text())
    else:
        m = measure(ForwardStep(lm.model), nodes=FINE_NODES, contexts=(128, 1024), repeats=5)
        fine = {"nodes": m.nodes, "contexts": m.contexts, "seconds": m.seconds}
        fine_path.write_text(json.dumps(fine))
    truth = CostModel(fine["nodes"], fine["contexts"], fine["seconds"], {}, tree_offset=args.offset, online=False)
    print("| run | method | pruned under | MAT | nodes per step | speedup priced by the fine table |\n|---|---|---|---|---|---|")
    for spec in args.run:
        path, name = spec.rsplit(":", 1)
        bench = load_result(path)
        refs = references_from(bench)
        ds = Datastore.open(Store(args.store), name, model_info=lm.info, dense=True)
        c = bench.cost_model
        prices = {"curve": CostModel(c["nodes"], c["contexts"], c["seconds"], {}, tree_offset=args.offset, online=False),
                  "hinge": HingeCost(c["nodes"], c["contexts"], c["seconds"], {}, tree_offset=args.offset, online=False),
                  "truth": truth}
        for method in (m.strip() for m in args.methods.split(",") if m.strip()):
            for label, priced in prices.items():
                reps = replay(lambda m=method, c=priced, d=ds: registry.make_drafter(m, d, cost=c), refs, bench.max_new_tokens,
                              lm.model, context_limit(lm.model))
                method_s, ar_s = predicted_seconds(reps, truth)
                tokens = sum(r.stats.num_tokens for r in reps)
                steps = sum(r.stats.steps for r in reps)
                drafted = sum(r.stats.num_drafted for r in reps)
                print(f"| {name} | {method} | {label} | {tokens / steps:.3f} | {drafted / steps:.2f} | {ar_s / method_s:.3f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
