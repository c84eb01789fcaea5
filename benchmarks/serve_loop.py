"""The serving loop, measured: serve a stream with logging on, ``build --append`` the log, move
the tag, let the engine switch, and compare MAT on a second held-out stream before and after.

    python benchmarks/serve_loop.py --store COPY_OF_STORE --name code --tag prod \
        --prompts ../shared/data/codealpaca/code_alpaca_2k.jsonl.gz --serve 1100:1160 --heldout 1300:1330

The store is changed (a new version is appended and tagged): give it a copy. Both streams are
prompts of the questions file by record range; neither may be in the datastore. Prints one JSON
object: the versions before and after, MAT and tokens/s on the held-out stream for each, and
the log's size. Methods: rest and respec by default (``--methods``), greedy, bf16 by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def _range(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    return int(a), int(b)


def _stream(engine, prompts: list[str], method: str, max_new_tokens: int) -> dict:
    tokens = steps = 0
    seconds = 0.0
    served = set()
    for prompt in prompts:
        started = time.perf_counter()
        result = engine.generate(prompt, method=method, max_new_tokens=max_new_tokens)
        seconds += time.perf_counter() - started
        tokens += result.stats.num_tokens
        steps += result.stats.steps
        served.add(result.datastore)
    return {"mat": round(tokens / steps, 3) if steps else None, "tokens_per_s": round(tokens / seconds, 1), "tokens": tokens,
            "served_by": sorted(served)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--tag", default="prod")
    ap.add_argument("--prompts", required=True, help="questions file (any format specstore bench reads)")
    ap.add_argument("--serve", type=_range, required=True, help="record range FIRST:END of the served stream")
    ap.add_argument("--heldout", type=_range, required=True, help="record range of the held-out stream")
    ap.add_argument("--methods", default="rest,respec")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)

    from specstore.pipelines.build import build
    from specstore.runtime.bench.questions import load_questions
    from specstore.runtime.engine import Engine
    from specstore.runtime.served_log import ServedLog
    from specstore.runtime.store import Store

    def prompts(span):
        first, end = span
        return [q.turns[0] for q in load_questions(args.prompts, limit=end - first, skip=first)]

    served_prompts, heldout = prompts(args.serve), prompts(args.heldout)
    if set(served_prompts) & set(heldout):
        raise SystemExit("the served and held-out streams overlap")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    log = Path(tempfile.mkdtemp(prefix="serve-loop-")) / "served.jsonl"
    store = Store(args.store)
    ref = f"{args.name}@{args.tag}"
    engine = Engine.load(store, ref, model=args.model, dtype=args.dtype, method=methods[0], refresh_seconds=None)
    result: dict = {"reference": ref, "before": engine.datastores[ref], "methods": methods}
    result["heldout_before"] = {m: _stream(engine, heldout, m, args.max_new_tokens) for m in methods}
    engine.log = ServedLog(log)  # only the served stream is logged: it becomes the next version's data
    started = time.perf_counter()
    result["served_stream"] = _stream(engine, served_prompts, methods[0], args.max_new_tokens)
    result["served_seconds"] = round(time.perf_counter() - started, 1)
    engine.log = None
    result["log_lines"] = sum(1 for _ in open(log, encoding="utf-8"))
    built = build(store, args.name, [str(log)], model=args.model, mode="append", tag=args.tag, dtype=args.dtype, progress=False)
    result["appended"] = {"version": built.manifest.version, "added_documents": built.manifest.lineage.added_documents,
                          "added_tokens": built.manifest.lineage.added_tokens}
    engine.refresh()
    result["after"] = engine.datastores[ref]
    result["heldout_after"] = {m: _stream(engine, heldout, m, args.max_new_tokens) for m in methods}
    result["mat_change"] = {m: round(result["heldout_after"][m]["mat"] / result["heldout_before"][m]["mat"] - 1, 4) for m in methods}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
