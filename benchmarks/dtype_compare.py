"""Which dtype to decode in on this machine: every method in bf16 and in float32, side by side in
one run, against plain decoding in each.

    python benchmarks/dtype_compare.py --store /work/bench_store --datastore code-id \\
        --questions ../shared/data/codealpaca/code_alpaca_2k.jsonl.gz --skip 1900 --limit 8 \\
        --methods ar,pld,rest,dresd,respec --max-new-tokens 128

The model is loaded twice (bf16 and float32), each with its own cost model (the cached table of
runtime/cost.py, measured when missing) and its own drafters, built as the bench builds them
(``--cost-aware auto``). Every prompt goes through every (dtype, method) pair in turn, the order
rotating from prompt to prompt, so drift of the machine falls on all of them alike. Prints per
pair: MAT, nodes verified per step, tokens/s, and the speedup over bf16 ``ar`` and over ``ar``
of its own dtype, each with a 95% bootstrap interval over prompts (runtime/bench/metrics.py);
``--json`` writes the same. What ``--dtype auto`` picks here (runtime/device.py) is printed too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

DTYPES = ("bfloat16", "float32")


@dataclass(slots=True)
class Run:
    wall_s: float
    num_tokens: int
    steps: int
    num_drafted: int


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--datastore", required=True)
    p.add_argument("--questions", required=True)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--methods", default="ar,pld,rest,dresd,respec")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from specstore.runtime.api import generate, prompt_ids
    from specstore.runtime.bench.metrics import bootstrap_speedup, speedup_of
    from specstore.runtime.bench.questions import load_questions
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.device import auto_dtype_name
    from specstore.runtime.drafters.registry import (
        COST_AWARE_DEFAULT,
        cost_model_for,
        make_drafter,
        needs_dense,
        uses_cost,
    )
    from specstore.runtime.models import load_model
    from specstore.runtime.store import Store

    methods = list(dict.fromkeys(["ar", *[m.strip() for m in args.methods.split(",") if m.strip()]]))
    questions = load_questions(args.questions, limit=args.limit, skip=args.skip)
    store = Store(args.store)
    loaded, drafters = {}, {}
    for dt in DTYPES:
        lm = loaded[dt] = load_model(None, dtype=dt, device="cpu")
        ds = Datastore.open(store, args.datastore, model_info=lm.info, dense=needs_dense(methods))
        cost = cost_model_for(lm, methods)
        for m in methods:
            drafters[dt, m] = make_drafter(m, datastore=ds, cost=cost if uses_cost(m, COST_AWARE_DEFAULT) else None)
        generate(lm.model, lm.tokenizer, "Hello", drafter="ar", max_new_tokens=4)  # one-off costs out of the timing
    pairs = [(dt, m) for m in methods for dt in DTYPES]
    runs: dict[tuple[str, str], list[Run]] = {pair: [] for pair in pairs}
    tok = loaded[DTYPES[0]].tokenizer
    for i, q in enumerate(questions):
        ids = prompt_ids(tok, [{"role": "user", "content": q.turns[0]}])
        order = pairs[i % len(pairs):] + pairs[: i % len(pairs)]
        for dt, m in order:
            lm = loaded[dt]
            start = time.perf_counter()
            res = generate(lm.model, lm.tokenizer, ids, drafter=drafters[dt, m], max_new_tokens=args.max_new_tokens)
            runs[dt, m].append(Run(time.perf_counter() - start, len(res.token_ids), res.stats.steps, res.stats.num_drafted))
        print(f"prompt {i + 1}/{len(questions)} done", flush=True)

    base = runs["bfloat16", "ar"]
    rows = []
    for dt, m in pairs:
        rs = runs[dt, m]
        own = runs[dt, "ar"]

        def ratio(ref, rs=rs):
            value = float(speedup_of([r.wall_s for r in ref], [r.num_tokens for r in ref],
                                     [r.wall_s for r in rs], [r.num_tokens for r in rs]))
            return value, bootstrap_speedup(list(zip(ref, rs, strict=True)))

        rows.append({
            "dtype": dt, "method": m, "mat": sum(r.num_tokens for r in rs) / sum(r.steps for r in rs),
            "nodes_per_step": sum(r.num_drafted for r in rs) / sum(r.steps for r in rs),
            "tokens_per_s": sum(r.num_tokens for r in rs) / sum(r.wall_s for r in rs),
            "median_prompt_tokens_per_s": statistics.median(r.num_tokens / r.wall_s for r in rs),
            "vs_bf16_ar": ratio(base), "vs_own_ar": ratio(own),
        })
    print(f"\n--dtype auto here: {auto_dtype_name('cpu')}; {len(questions)} prompts, {args.max_new_tokens} new tokens\n")
    print("| dtype | method | MAT | nodes / step | tokens/s | vs bf16 ar [95%] | vs own dtype's ar [95%] |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        def fmt(v):
            value, ci = v
            return f"{value:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        print(f"| {r['dtype']} | {r['method']} | {r['mat']:.2f} | {r['nodes_per_step']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{fmt(r['vs_bf16_ar'])} | {fmt(r['vs_own_ar'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "auto": auto_dtype_name("cpu"), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
