"""Choose ReSpec's thresholds by model-free replay (the measurement behind respec.py's defaults).

Replays greedy ``ar`` references (bench result JSONs) through ``specstore simulate``'s
``simulate_one`` with the hidden states and logits of one float32 forward per reference,
computed once and reused for every setting of the grid. Prints, per setting, MAT, draft nodes
per step and an estimated CPU speedup ``MAT / cost(nodes)``, where ``cost`` interpolates the
verification costs in FINDINGS.md (1.0 at 0 nodes, 1.1 at 8, 1.3 at 16, 2.4 at 64).

    OMP_NUM_THREADS=1 python benchmarks/respec_sweep.py --store S --datastore code tune_code.json tune_mt.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import numpy as np

from specstore.runtime.bench.report import load_result
from specstore.runtime.bench.simulate import reference_states, references_from, simulate_one
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.models import load_model

GRID = {
    "entropy_threshold": [0.5, 1.0, 2.0, 3.0, math.inf],
    "score_threshold": [0.0, 0.5, 0.9],
}


def cost(nodes: float) -> float:
    return float(np.interp(nodes, [0, 8, 16, 64], [1.0, 1.1, 1.3, 2.4]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--datastore", required=True)
    p.add_argument("--grid", default=None, help='JSON {"option": [values]} replacing GRID (infinity: 1e9)')
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="fixed respec option")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("results", nargs="+")
    args = p.parse_args()
    grid = json.loads(args.grid) if args.grid else GRID
    fixed = {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.option)}
    lm = load_model(None, dtype="float32", device="cpu")
    ds = Datastore.open(args.store, args.datastore, lm.info)
    sets = {path: [(r, reference_states(lm.model, r)) for r in references_from(load_result(path))] for path in args.results}
    baselines = {"pld": {}, "rest": {"max_nodes": 24}, "dresd": {"k": 3, "max_nodes": 24}}
    rows = [] if args.no_baselines else [(m, o) for m, o in baselines.items()]
    rows += [("respec", {**fixed, **dict(zip(grid, combo, strict=True))}) for combo in itertools.product(*grid.values())]
    print("| method | options | " + " | ".join(f"{name.split('/')[-1]} MAT / nodes / est. speedup" for name in sets) + " |")
    for method, options in rows:
        cells = []
        for refs in sets.values():
            drafter = make_drafter(method, datastore=ds, **options)
            sims = [simulate_one(drafter, r, 128, None, states) for r, states in refs]
            tokens, steps = sum(s.num_tokens for s in sims), sum(s.steps for s in sims)
            mat = tokens / steps
            nodes = sum(s.num_drafted for s in sims) / max(steps - len(sims), 1)
            cells.append(f"{mat:.3f} / {nodes:.1f} / {mat / cost(nodes):.2f}")
        print(f"| {method} | {options} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
