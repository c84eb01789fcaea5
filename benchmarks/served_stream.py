"""A served stream: N prompts of one domain, in order, through one Engine, the overlay off and on.

For each method (rest, respec by default) an engine serves the prompts one after another, once
with the overlay off and once on (``--overlay-tokens``, responses only unless
``--overlay-prompts``), with the tree sizing ``specstore serve`` uses (``--cost-aware``, default
auto: the cost model measured once, one calibration per engine kept across its requests); with
``arctic-inference`` installed (``make install-suffixdecoding``), SuffixDecoding serves the same
stream with its learning on (one drafter for the whole stream, every response kept in its global
tree) as the anchor, interleaved with the other runs. Reported per run, over the last half of
the stream (where learning has had the first half to work with) and over all of it: MAT (tokens
committed per target forward, pooled over requests) and tokens/s (new tokens over the wall time
of ``engine.generate``, which includes adding the response to the overlay), drafting time per
step, and the overlay's accepted tokens. Every run serves each prompt in turn (the
order rotating), so that machine load drifts hit all alike and tokens/s compare within the run. Before the model runs, the overlay's own costs: adding a request and one
search (``suffix_sample``, as rest does per step) at ``--overlay-tokens`` tokens of real text.

    python benchmarks/served_stream.py --store /work/speedstore --datastore code@prod \\
        --prompts ../shared/data/codealpaca/code_alpaca_2k.jsonl.gz --skip 1000 --limit 200 \\
        --max-new-tokens 128 --dtype bfloat16 --json served_stream.json

CodeAlpaca records 1000 on are in no datastore this opens when ``code@prod`` holds records 0-999.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np

from specstore.runtime.drafters import registry
from specstore.runtime.engine import Engine
from specstore.runtime.models import load_model
from specstore.runtime.overlay import DEFAULT_MAX_TOKENS, ServedOverlay
from specstore.runtime.retrieval import suffix_sample
from specstore.runtime.store import Store


def read_prompts(path: str, skip: int, limit: int) -> list[str]:
    """Instructions (with their input, when any) of records ``skip`` .. ``skip + limit``."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        records = [json.loads(line) for line in f]
    out = []
    for r in records[skip : skip + limit]:
        text = r.get("instruction") or r.get("prompt") or r["turns"][0]
        if r.get("input"):
            text += "\n\n" + r["input"]
        out.append(text)
    return out


def overlay_costs(tokenizer, path: str, max_tokens: int, skip: int) -> dict:
    """Fill an overlay to ``max_tokens`` with real responses (the records' outputs), time each
    add, then time ``suffix_sample`` (rest's per-step search) on held-out contexts."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        records = [json.loads(line) for line in f]
    docs = [tokenizer(r.get("output") or r.get("response", ""), add_special_tokens=False)["input_ids"] for r in records]
    overlay, adds = ServedOverlay(max_tokens), []
    i = 0
    while overlay.num_evicted < 50 or overlay.num_tokens < 0.9 * max_tokens:  # full, and evicting
        t = time.perf_counter()
        overlay.add(docs[i % skip])
        adds.append(time.perf_counter() - t)
        i += 1
    rng, searches, hits = np.random.default_rng(0), [], 0
    held_out = [d for d in docs[skip:] if len(d) > 20]
    for _ in range(2000):
        doc = held_out[rng.integers(len(held_out))]
        context = doc[: int(rng.integers(4, len(doc)))]
        t = time.perf_counter()
        found = suffix_sample(overlay, context, 10, max_span=16, min_span=2, max_matches=1000)
        searches.append(time.perf_counter() - t)
        hits += found is not None
    ms = lambda a: {"mean_ms": float(np.mean(a) * 1e3), "p99_ms": float(np.percentile(a, 99) * 1e3)}  # noqa: E731
    return {"tokens": overlay.num_tokens, "requests_added": i, "add": ms(adds), "search": ms(searches),
            "search_hit_rate": hits / len(searches)}


def summarise(rows: list[dict]) -> dict:
    tokens = sum(r["committed"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    new = sum(r["new_tokens"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    return {"requests": len(rows), "mat": tokens / steps, "tokens_per_s": new / wall, "wall_s": wall,
            "drafting_ms_per_step": 1e3 * sum(r["drafting_s"] for r in rows) / steps,
            "overlay_accepted": sum(r["overlay_accepted"] for r in rows)}


def serve_one(engine: Engine, prompt: str, max_new_tokens: int, drafter=None) -> dict:
    t = time.perf_counter()
    if drafter is None:
        result = engine.generate(prompt, max_new_tokens=max_new_tokens)
    else:
        result = engine.generate(prompt, drafter=drafter, max_new_tokens=max_new_tokens)
    wall = time.perf_counter() - t
    s = result.stats
    return {"committed": s.num_tokens, "steps": s.steps, "new_tokens": len(result.token_ids), "wall_s": wall,
            "drafting_s": s.drafting_s, "overlay_accepted": (result.overlay or {}).get("accepted", 0),
            "token_ids": result.token_ids}


def serve_streams(runs: dict[str, tuple], prompts: list[str], max_new_tokens: int) -> dict[str, list[dict]]:
    """Each prompt in turn through every run's engine (``label -> (engine, drafter or None)``),
    the runs' order rotating from one prompt to the next so that load drifts hit all alike."""
    rows: dict[str, list[dict]] = {label: [] for label in runs}
    labels = list(runs)
    for i, prompt in enumerate(prompts):
        for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
            engine, drafter = runs[label]
            rows[label].append(serve_one(engine, prompt, max_new_tokens, drafter))
        if (i + 1) % 5 == 0:
            line = ", ".join(f"{k} {summarise(v[len(v) // 2 :])['mat']:.3f}" for k, v in rows.items())
            print(f"  {i + 1}/{len(prompts)}: MAT over the last half so far: {line}", flush=True)
    return rows


def record(out: dict, rows: dict[str, list[dict]], path: str | None) -> None:
    """Summaries of each run into ``out["runs"]`` (and ``path``, so far), and whether its outputs
    equal the first run's."""
    for label, requests in rows.items():
        ids = [r.pop("token_ids") for r in requests]
        out.setdefault("reference", ids)
        same = sum(a == b for a, b in zip(ids, out["reference"], strict=True))
        out["runs"][label] = {"last_half": summarise(requests[len(requests) // 2 :]), "all": summarise(requests),
                              "same_output_as_first_run": same, "requests": requests}
        print(label, json.dumps(out["runs"][label]["last_half"]), f"same output as the first run: {same}/{len(ids)}",
              flush=True)
    if path:
        Path(path).write_text(json.dumps({k: v for k, v in out.items() if k != "reference"}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--datastore", required=True, help="NAME[@VERSION|@TAG]")
    p.add_argument("--prompts", required=True, help="JSONL(.gz) with instruction/input (CodeAlpaca) or turns (MT-Bench)")
    p.add_argument("--skip", type=int, default=1000, help="first record used (default 1000)")
    p.add_argument("--limit", type=int, default=200, help="prompts in the stream (default 200)")
    p.add_argument("--methods", default="rest,respec")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default=None)
    p.add_argument("--overlay-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--overlay-prompts", action="store_true")
    p.add_argument("--no-suffixdecoding", action="store_true", help="skip the SuffixDecoding anchor even when installed")
    p.add_argument("--cost-aware", default=registry.COST_AWARE_DEFAULT, choices=["auto", "on", "off"],
                   help="cost-aware tree sizing, as specstore serve (default: %(default)s)")
    p.add_argument("--refresh-cost", action="store_true", help="measure the verification cost model again")
    p.add_argument("--costs-only", action="store_true", help="measure the overlay's add and search costs, then stop")
    p.add_argument("--json", default=None, metavar="PATH", help="write every number here")
    args = p.parse_args()

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    prompts = read_prompts(args.prompts, args.skip, args.limit)
    print(f"{len(prompts)} prompts from {args.prompts} (records {args.skip}..{args.skip + len(prompts) - 1}), "
          f"{args.datastore}, {args.dtype}, max {args.max_new_tokens} new tokens", flush=True)
    out = {"args": vars(args), "overlay_costs": overlay_costs(loaded.tokenizer, args.prompts, args.overlay_tokens, args.skip),
           "runs": {}}
    print("overlay costs:", json.dumps(out["overlay_costs"]), flush=True)
    if args.costs_only:
        return
    store = Store(args.store)
    cost = registry.cost_model_for(loaded, args.methods.split(","), args.cost_aware, refresh=args.refresh_cost, quiet=False)
    if cost is not None:
        out["cost_model"] = cost.to_json()
    runs = {}
    for method in args.methods.split(","):
        for overlay in ("off", "on"):
            ov = ServedOverlay(args.overlay_tokens, prompts=args.overlay_prompts) if overlay == "on" else None
            runs[f"{method} overlay {overlay}"] = (Engine(loaded, store, args.datastore, method=method, overlay=ov,
                                                          refresh_seconds=None, cost=cost, cost_aware=args.cost_aware),
                                                   None)
    if not args.no_suffixdecoding:
        try:
            from specstore.runtime.datastore import Datastore
            from specstore.runtime.drafters.suffixdecoding import SuffixDecodingDrafter

            drafter = SuffixDecodingDrafter(Datastore.open(store, args.datastore, loaded.info), learn=True)
        except Exception as exc:  # the optional extra is missing
            print(f"suffixdecoding: not run ({exc})", flush=True)
        else:  # one drafter for the whole stream: its global tree learns every response
            runs["suffixdecoding (learning)"] = (Engine(loaded, store, args.datastore, method="ar", refresh_seconds=None),
                                                 drafter)
    # every run serves each prompt in turn (order rotating), so tokens/s compare within the run
    record(out, serve_streams(runs, prompts, args.max_new_tokens), args.json)
    print("\n| run | MAT, last half | tokens/s, last half | MAT, all | tokens/s, all | overlay tokens accepted (last half) |")
    print("|---|---|---|---|---|---|")
    for label, run in out["runs"].items():
        h, a = run["last_half"], run["all"]
        print(f"| {label} | {h['mat']:.3f} | {h['tokens_per_s']:.1f} | {a['mat']:.3f} | {a['tokens_per_s']:.1f} | {h['overlay_accepted']} |")


if __name__ == "__main__":
    main()
