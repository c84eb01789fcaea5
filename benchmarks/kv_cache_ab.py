"""Whole verification steps with the in-place cache (runtime/kv_cache.py) against transformers'
``torch.cat`` layers, side by side in one process.

    python benchmarks/kv_cache_ab.py [--contexts 300,1000] [--nodes 0,6] [--steps 24] [--dtype auto]

Two verifiers on the same loaded model, one per cache kind, each prefilled with the same
``--contexts`` tokens; then ``--steps`` steps of a chain of ``--nodes`` draft nodes (0: a plain
step), the two kinds alternating which goes first, each timed around ``TreeVerifier.step``.
Nothing is accepted, so each step grows the cache by one token, as a rejected draft does. Prints
the median of all but the first 4 steps of each kind and the share saved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="300,1000", help="cached tokens before the timed steps")
    p.add_argument("--nodes", default="0,6", help="draft nodes a step (0: a plain step)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()

    from specstore.runtime.models import load_model
    from specstore.runtime.tree import DraftTree
    from specstore.runtime.verify import TreeVerifier

    model = load_model(None, dtype=args.dtype).model
    print("| cached tokens, tree nodes | growing | torch.cat | saved |\n|---|---|---|---|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        verifiers = {}
        for kind, env in (("growing", "1"), ("cat", "0")):
            os.environ["SPECSTORE_GROWING_CACHE"] = env
            verifiers[kind] = TreeVerifier(model)
            verifiers[kind].prefill(list(range(100, 100 + ctx)))
        os.environ.pop("SPECSTORE_GROWING_CACHE")
        for n in (int(x) for x in args.nodes.split(",")):
            tree = DraftTree.chain(list(range(200, 200 + n))) if n else DraftTree.empty()
            times = {kind: [] for kind in verifiers}
            for step in range(args.steps):
                for kind in (("growing", "cat") if step % 2 else ("cat", "growing")):
                    start = time.perf_counter()
                    verifiers[kind].step(5, tree)
                    times[kind].append(time.perf_counter() - start)
            med = {kind: 1000 * statistics.median(t[4:]) for kind, t in times.items()}
            print(f"| {ctx}, {n} | {med['growing']:.2f} ms | {med['cat']:.2f} ms | {100 * (1 - med['growing'] / med['cat']):.1f}% |",
                  flush=True)


if __name__ == "__main__":
    main()
