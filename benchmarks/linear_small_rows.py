"""Small products on this CPU: ``F.linear`` against oneDNN's packed product per weight shape of the
default model, and whole verification steps with linear.py's small-rows rule measured (``auto``)
against every product packed, alternating in one process.

    python benchmarks/linear_small_rows.py --dtype float32

Part 1 prints microseconds per product at 1-17 rows for each of the model's weight shapes (median
of 5 rounds): ``F.linear``, the packed product, and ``torch.mm`` on a transposed contiguous copy
of the weight (not used by linear.py yet; on this project's AVX-512 Xeon without native bf16 it was
the fastest float32 product from 1 to 9 rows). Part 2 times a verification step (``TreeVerifier.step``, 200 cached tokens, bushy
trees of 0-8 nodes as the cost model builds them) under ``SPECSTORE_LINEAR_SMALL_ROWS=auto`` and
``packed``, three rounds in alternating order, and prints each round and the medians, with the
shapes the rule gave to ``F.linear``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--products-only", action="store_true", help="part 1 only")
    args = p.parse_args()

    import numpy as np
    import torch

    from specstore.runtime import linear
    from specstore.runtime.cost import bushy_tree
    from specstore.runtime.models import load_model
    from specstore.runtime.verify import TreeVerifier

    dtype = getattr(torch, args.dtype)
    model = load_model(None, dtype=args.dtype, device="cpu").model
    shapes = sorted({(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    print(f"{args.dtype}: microseconds per product, F.linear / packed / mm on the transposed weight")
    for k, n in shapes:
        w = torch.randn(n, k).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        wt = w.t().contiguous()
        reps = max(2, min(50, int(4e6 // (k * n))))
        cells = []
        for rows in (1, 2, 3, 5, 9, 17):
            x = torch.randn(1, rows, k).to(dtype)
            plain = linear._seconds(lambda v, w=w: torch.nn.functional.linear(v, w), x, reps)
            oned = linear._seconds(lambda v, pk=packed: torch.ops.mkldnn._linear_pointwise(v, pk, None, "none", [], ""), x, reps)
            mm = linear._seconds(lambda v, wt=wt: torch.matmul(v, wt), x, reps)
            cells.append(f"{rows}: {plain * 1e6:.0f} / {oned * 1e6:.0f} / {mm * 1e6:.0f}")
        print(f"  {k} x {n}: " + ", ".join(cells))
    if args.products_only:
        return 0

    rng = np.random.default_rng(0)

    def set_mode(mode: str) -> None:
        os.environ["SPECSTORE_LINEAR_SMALL_ROWS"] = mode
        linear._small.clear()
        for module in model.modules():
            module.__dict__.pop(linear._ATTR, None)  # packed (and decided) again on the next call

    def steps() -> dict[int, float]:
        out = {}
        for nodes in (0, 1, 2, 4, 8):
            times = []
            for _ in range(4):
                verifier = TreeVerifier(model)
                verifier.prefill(rng.integers(100, 40000, 200).tolist())
                tree = bushy_tree(nodes, 40000, rng)
                verifier.step(5, tree)
                for _ in range(3):
                    start = time.perf_counter()
                    verifier.step(7, tree)
                    times.append(time.perf_counter() - start)
            out[nodes] = statistics.median(times) * 1e3
        return out

    results: dict[str, list[dict[int, float]]] = {"auto": [], "packed": []}
    for r in range(args.rounds):
        for mode in (("packed", "auto") if r % 2 == 0 else ("auto", "packed")):
            set_mode(mode)
            row = steps()
            results[mode].append(row)
            extra = f"  (F.linear for {sorted(k[1:3] for k, v in linear._small.items() if v)})" if mode == "auto" else ""
            print(f"round {r + 1} {mode}: " + " ".join(f"{n}: {ms:.1f}" for n, ms in row.items()) + " ms" + extra, flush=True)
    for mode, rows in results.items():
        print(f"median {mode}: " + " ".join(f"{n}: {statistics.median(x[n] for x in rows):.1f}" for n in rows[0]) + " ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
