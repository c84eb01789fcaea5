"""How far ReSpec's relaxed verification moves the output from plain greedy decoding.

For each question: ``ar``, ``respec`` strict (the control: in bfloat16 tree verification alone
flips near-ties) and ``respec`` with ``relaxed=on`` (plus any ``--option KEY=VALUE`` ReSpec
options), in one process and one dtype (float32 by default, so that strict respec equals ar). Reports MAT, relaxed tokens, exact-match rate
(outputs identical to ar) and token-level similarity to ar (difflib's ratio over token ids,
1.0 = identical), and the mean length of the common prefix. Not a test: a measurement.

    python benchmarks/respec_relaxed.py --store S --datastore code \
        --questions /work/shared/data/codealpaca/code_alpaca_2k.jsonl.gz --skip 1900 --limit 10
"""

from __future__ import annotations

import argparse
import difflib
import json

from specstore.runtime.api import generate, prompt_ids
from specstore.runtime.bench.questions import load_questions
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.models import load_model


def similarity(a: list[int], b: list[int]) -> float:
    return difflib.SequenceMatcher(a=a, b=b, autojunk=False).ratio()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--datastore", required=True)
    p.add_argument("--questions", required=True)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    options = {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.option)}
    lm = load_model(None, dtype=args.dtype, device="cpu")
    ds = Datastore.open(args.store, args.datastore, lm.info)
    drafter = make_drafter("respec", ds, relaxed=True, **options)
    strict = make_drafter("respec", ds, **{k: v for k, v in options.items() if not k.startswith("relaxed")})
    rows = []
    for q in load_questions(args.questions, limit=args.limit, skip=args.skip):
        text = q.turns[0]
        ids = lm.tokenizer(text)["input_ids"] if q.raw_prompt else prompt_ids(lm.tokenizer, [{"role": "user", "content": text}])
        ar = generate(lm.model, lm.tokenizer, ids, "ar", max_new_tokens=args.max_new_tokens)
        rel = generate(lm.model, lm.tokenizer, ids, drafter, max_new_tokens=args.max_new_tokens)
        ctl = generate(lm.model, lm.tokenizer, ids, strict, max_new_tokens=args.max_new_tokens)
        rows.append({"id": q.question_id, "exact": rel.token_ids == ar.token_ids, "similarity": similarity(ar.token_ids, rel.token_ids),
                     "prefix": common_prefix(ar.token_ids, rel.token_ids), "mat": rel.stats.mat, "steps": rel.stats.steps,
                     "tokens": len(rel.token_ids), "num_relaxed": rel.stats.num_relaxed,
                     "strict_exact": ctl.token_ids == ar.token_ids, "strict_mat": ctl.stats.mat})
        print(json.dumps(rows[-1]), flush=True)
    n = len(rows)
    print(json.dumps({
        "options": options, "prompts": n,
        "exact_match_rate": sum(r["exact"] for r in rows) / n,
        "mean_similarity": sum(r["similarity"] for r in rows) / n,
        "mean_common_prefix": sum(r["prefix"] for r in rows) / n,
        "mat": sum(r["tokens"] for r in rows) / sum(r["steps"] for r in rows),
        "strict_exact_match_rate": sum(r["strict_exact"] for r in rows) / n,
        "relaxed_tokens": sum(r["num_relaxed"] for r in rows),
        "tokens": sum(r["tokens"] for r in rows),
    }))


if __name__ == "__main__":
    main()
