"""The chat stream of the served-stream benchmark: AlpacaEval instructions split into a datastore
corpus and a held-out stream of prompts, by instruction (never by row).

    python benchmarks/chat_stream.py --out-dir /work/chatstream
    specstore build --store /work/chatstream/store --name chat --corpus /work/chatstream/corpus.jsonl \\
        --index sparse --tag prod
    python benchmarks/served_stream.py --store /work/chatstream/store --datastore chat@prod \\
        --prompts /work/chatstream/stream.jsonl --skip 400 --limit 200 ...

The 805 distinct instructions of ``alpaca_eval_outputs/model_outputs_37models.jsonl.gz`` (37 models'
answers to each), in the order they first appear: every ``--every``-th one (0, 4, 8, ...) is
held out, the others' answers by every model are the corpus (``corpus.jsonl``: one
``{"instruction", "output"}`` record per answer). ``stream.jsonl`` holds ``--warm`` corpus
records first (their outputs fill the overlay when served_stream.py measures its costs; with
``--skip`` equal to it they are not served), then the held-out instructions in order, each with
one model's answer (``--reference-model``) as its ``output``: served_stream.py serves only the
instruction; the answer gives its overlay-cost measurement held-out text to search with.
Nothing here is committed; prints the counts.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

DEFAULT_SOURCE = Path(__file__).resolve().parents[2] / "shared" / "data" / "alpaca_eval_outputs" / "model_outputs_37models.jsonl.gz"


def split(rows: list[dict], every: int) -> tuple[list[str], set[str]]:
    """(distinct instructions in first-appearance order, the held-out ones: every ``every``-th)."""
    order: list[str] = []
    seen: set[str] = set()
    for r in rows:
        if r["instruction"] not in seen:
            seen.add(r["instruction"])
            order.append(r["instruction"])
    return order, set(order[::every])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default=str(DEFAULT_SOURCE), help="AlpacaEval outputs (JSONL, .gz ok)")
    p.add_argument("--out-dir", required=True, help="writes corpus.jsonl and stream.jsonl here")
    p.add_argument("--every", type=int, default=4, help="hold out every N-th instruction (default 4)")
    p.add_argument("--warm", type=int, default=400, help="corpus records at the head of stream.jsonl (default 400)")
    p.add_argument("--reference-model", default="gpt4_1106_preview", help="whose answer a held-out record carries")
    args = p.parse_args()
    if args.every < 2:
        raise SystemExit("chat_stream: --every must be >= 2")
    opener = gzip.open if args.source.endswith(".gz") else open
    with opener(args.source, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    order, held = split(rows, args.every)
    corpus = [{"instruction": r["instruction"], "output": r["output"]} for r in rows
              if r["instruction"] not in held and r.get("output", "").strip()]
    answers: dict[str, str] = {}
    for r in rows:
        if r["instruction"] in held and r.get("output", "").strip():
            if r.get("generator") == args.reference_model or r["instruction"] not in answers:
                answers[r["instruction"]] = r["output"]
    stream = corpus[: args.warm] + [{"instruction": i, "output": answers.get(i, "")} for i in order if i in held]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, records in (("corpus.jsonl", corpus), ("stream.jsonl", stream)):
        with open(out / name, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    print(json.dumps({"instructions": len(order), "held_out": len(held), "corpus_records": len(corpus),
                      "stream_records": len(stream), "warm": min(args.warm, len(corpus)), "out_dir": str(out)}))


if __name__ == "__main__":
    main()
