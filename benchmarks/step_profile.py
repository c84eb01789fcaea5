"""Where a decoding step's time goes, per method: drafting, the verification forward, acceptance,
cache compaction and the rest of the loop, measured on real prompts side by side.

    python benchmarks/step_profile.py --store /work/speedstore --datastore code@prod \\
        --questions ../shared/data/codealpaca/code_alpaca_2k.jsonl.gz --skip 1900 --limit 6 \\
        --methods ar,respec,suffixdecoding --max-new-tokens 128

Every prompt goes through every method in turn (the order rotating), through the same
``TreeVerifier`` code a request uses, with its ``tree_logits``, acceptance and ``compact`` timed
per call (perf_counter around each; the forward's share includes building the tree's mask).
Trees are sized as ``specstore generate`` sizes them (``--cost-aware``, default auto).
Prints per method: steps, MAT, nodes verified per step and milliseconds per step for each part,
and the whole step relative to ``ar``'s; ``--json`` writes the same.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--datastore", required=True)
    p.add_argument("--questions", required=True)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--methods", default="ar,pld,respec")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cost-aware", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from specstore.runtime import verify as verify_module
    from specstore.runtime.api import generate
    from specstore.runtime.bench.questions import load_questions
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.drafters import registry
    from specstore.runtime.models import load_model
    from specstore.runtime.store import Store

    loaded = load_model(None, dtype=args.dtype)
    store = Store(args.store)
    datastore = Datastore.open(store, args.datastore, loaded.info)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    cost = registry.cost_model_for(loaded, methods, args.cost_aware, quiet=False)

    def drafter_for(method: str):
        if method == "suffixdecoding":
            from specstore.runtime.drafters.suffixdecoding import SuffixDecodingDrafter

            return SuffixDecodingDrafter(datastore)
        use = cost if registry.uses_cost(method, args.cost_aware) else None
        return registry.make_drafter(method, datastore if method not in ("ar", "pld") else None, cost=use)

    drafters = {m: drafter_for(m) for m in methods}
    timings: dict[str, dict[str, float]] = {m: defaultdict(float) for m in methods}
    current = {"method": None}
    verifier = verify_module.TreeVerifier

    def timed(name, fn):
        def wrapper(self, *a, **k):
            t = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                timings[current["method"]][name] += time.perf_counter() - t
        return wrapper

    verifier.tree_logits = timed("forward", verifier.tree_logits)
    verifier._accept = timed("accept", verifier._accept)
    verifier.compact = timed("compact", verifier.compact)
    prompts = [q.turns[0] for q in load_questions(args.questions, limit=args.limit, skip=args.skip)]
    rows: dict[str, dict] = {m: defaultdict(float) for m in methods}
    for i, prompt in enumerate(prompts):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for m in order:
            current["method"] = m
            before = dict(timings[m])
            t = time.perf_counter()
            out = generate(loaded.model, loaded.tokenizer, prompt, drafter=drafters[m], max_new_tokens=args.max_new_tokens)
            wall = time.perf_counter() - t
            s = out.stats
            prefill = s.verifying_s - sum(timings[m][k] - before.get(k, 0.0) for k in ("forward", "accept", "compact"))
            r = rows[m]
            r["wall_s"] += wall
            r["steps"] += s.steps - 1  # the prefill apart
            r["committed"] += s.num_tokens - 1
            r["drafted"] += s.num_drafted
            r["drafting_s"] += s.drafting_s
            r["prefill_s"] += max(prefill, 0.0)
        print(f"  {i + 1}/{len(prompts)}", flush=True)
    report = {}
    for m in methods:
        r, t = rows[m], timings[m]
        steps = max(r["steps"], 1)
        ms = {k: 1e3 * v / steps for k, v in (("drafting", r["drafting_s"]), ("forward", t["forward"]),
                                               ("accept", t["accept"]), ("compact", t["compact"]))}
        step_s = (r["wall_s"] - r["prefill_s"]) / steps
        ms["other"] = 1e3 * step_s - sum(ms.values())
        report[m] = {"steps": int(r["steps"]), "mat": r["committed"] / steps, "nodes_per_step": r["drafted"] / steps,
                     "ms_per_step": ms, "step_ms": 1e3 * step_s,
                     "tokens_per_s": r["committed"] / (r["wall_s"] - r["prefill_s"])}
    base = report.get("ar", {}).get("step_ms")
    print("\n| method | MAT | nodes/step | drafting | forward | accept | compact | other | step (ms) | step / ar's | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m, r in report.items():
        ms = r["ms_per_step"]
        rel = f"{r['step_ms'] / base:.3f}" if base else "-"
        print(f"| {m} | {r['mat']:.3f} | {r['nodes_per_step']:.1f} | {ms['drafting']:.2f} | {ms['forward']:.2f} | "
              f"{ms['accept']:.2f} | {ms['compact']:.2f} | {ms['other']:.2f} | {r['step_ms']:.1f} | {rel} | {r['tokens_per_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "methods": report}, f, indent=1)


if __name__ == "__main__":
    main()
