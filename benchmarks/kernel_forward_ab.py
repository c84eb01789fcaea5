"""Decoding with the float32 kernel forward (runtime/kernel_forward.py) on and off, paired prompt
by prompt in one process: how much faster each method runs, and each method's speedup over
``ar`` either way.

    python benchmarks/kernel_forward_ab.py --store /work/bench_store --datastore code-id \\
        --questions ../shared/data/codealpaca/code_alpaca_2k.jsonl.gz --skip 1900 --limit 12 \\
        --methods ar,pld,respec --option respec.head=HEAD

Every prompt runs every (method, on/off) pair in turn, the order rotating prompt by prompt;
``SPECSTORE_KERNEL_FORWARD`` is switched between requests (each request's verifier reads it).
Each side has its own drafters and its own cost table (measured first where missing: the two
forwards price trees differently). Prints per method the median tokens/s on and off, on's
tokens/s over off's and each side's speedup over ``ar``, each pooled over the prompts with the
bench's paired bootstrap interval (bench/metrics.py: ``speedup_of``, ``bootstrap_speedup``), and
whether every output matched ``ar``'s. ``--report RUN.json`` prints the table of a saved run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

import numpy as np


def _ratio(rows: list[dict], a: str, b: str, unit: str = "") -> str:
    """``a``'s tokens/s over ``b``'s, pooled over the prompts, with the bench's paired interval."""
    from specstore.runtime.bench.metrics import bootstrap_speedup, speedup_of

    pairs = [tuple(SimpleNamespace(wall_s=r[k]["wall_s"], num_tokens=r[k]["tokens"]) for k in (b, a)) for r in rows]
    value = speedup_of(*np.array([(x.wall_s, x.num_tokens, y.wall_s, y.num_tokens) for x, y in pairs], dtype=float).T)
    interval = bootstrap_speedup(pairs)
    return f"{value:.3f}{unit}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def report(rows: list[dict], methods: list[str]) -> None:
    """The table of a run (``rows``: each prompt's records by ``method:1`` / ``method:0``)."""
    print("\n| method | tokens/s on (median) | off | on / off [95%] | speedup over ar on | off | identical to ar on / off |")
    print("|---|---|---|---|---|---|---|")
    for m in methods:
        on, off = ([r[f"{m}:{side}"]["tokens"] / r[f"{m}:{side}"]["wall_s"] for r in rows] for side in "10")
        same = {side: sum(r[f"{m}:{side}"]["token_ids"] == r[f"ar:{side}"]["token_ids"] for r in rows) for side in "10"}
        print(f"| {m} | {np.median(on):.1f} | {np.median(off):.1f} | {_ratio(rows, f'{m}:1', f'{m}:0')} | "
              f"{_ratio(rows, f'{m}:1', 'ar:1', 'x')} | {_ratio(rows, f'{m}:0', 'ar:0', 'x')} | "
              f"{same['1']}/{len(rows)} / {same['0']}/{len(rows)} |")
    same_ar = sum(r["ar:1"]["token_ids"] == r["ar:0"]["token_ids"] for r in rows)
    print(f"\nar's tokens the same on and off on {same_ar} of {len(rows)} prompts")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", default=None, help="print the table of a run saved with --json, and stop")
    p.add_argument("--store")
    p.add_argument("--datastore")
    p.add_argument("--questions")
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--methods", default="ar,pld,respec", help="comma-separated; ar is added when missing")
    p.add_argument("--option", action="append", default=[], help="METHOD.KEY=VALUE, as the bench takes it")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="write every prompt's records here")
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        rows = saved["prompts"]
        report(rows, [k.split(":")[0] for k in rows[0] if k.endswith(":1")])
        return
    if not (args.store and args.datastore and args.questions):
        p.error("--store, --datastore and --questions are required (or --report)")

    from specstore.runtime.api import generate
    from specstore.runtime.bench.questions import load_questions
    from specstore.runtime.bench.runner import parse_options
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.drafters import registry
    from specstore.runtime.models import load_model
    from specstore.runtime.store import Store

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "ar" not in methods:
        methods.insert(0, "ar")
    options = parse_options(args.option)
    loaded = load_model(None, dtype="float32")
    datastore = Datastore.open(Store(args.store), args.datastore, loaded.info)
    costs = {}
    for side in ("1", "0"):
        os.environ["SPECSTORE_KERNEL_FORWARD"] = side
        costs[side] = registry.cost_model_for(loaded, methods, "auto", quiet=False)

    def drafter(method: str, side: str):
        cost = costs[side] if registry.uses_cost(method, "auto") else None
        ds = None if method in ("ar", "pld") else datastore
        return registry.make_drafter(method, ds, cost=cost, **options.get(method, {}))

    variants = [(m, side) for m in methods for side in ("1", "0")]
    drafters = {v: drafter(*v) for v in variants}
    prompts = [q.turns[0] for q in load_questions(args.questions, limit=args.limit, skip=args.skip)]
    rows = []
    for i, prompt in enumerate(prompts):
        record = {}
        for method, side in variants[i % len(variants):] + variants[: i % len(variants)]:
            os.environ["SPECSTORE_KERNEL_FORWARD"] = side
            t = time.perf_counter()
            out = generate(loaded.model, loaded.tokenizer, prompt, drafter=drafters[method, side],
                           max_new_tokens=args.max_new_tokens)
            record[f"{method}:{side}"] = {"wall_s": time.perf_counter() - t, "tokens": len(out.token_ids),
                                          "token_ids": out.token_ids}
        rows.append(record)
        print(f"  {i + 1}/{len(prompts)}", flush=True)
    os.environ.pop("SPECSTORE_KERNEL_FORWARD", None)

    report(rows, methods)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "prompts": rows}, f)


if __name__ == "__main__":
    main()
