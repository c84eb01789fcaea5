"""One method's tokens/s over another's in a bench result, with a paired bootstrap interval.

The bench reports each method against ``ar``; issue 16 also asks how far ReSpec is ahead of
SuffixDecoding. This reads a ``specstore bench --out`` JSON, pairs the two methods' records of
each prompt (and turn), and prints the ratio of their pooled tokens/s (new tokens over wall
seconds, summed over the prompts) with a 95% interval from resampling the prompts, the same
prompts for both sides (so that load which hit one prompt hits both sides of its ratio).

    python benchmarks/paired_ratio.py code_id.json [--a respec] [--b suffixdecoding] [--resamples 2000]

``--drafting-like C`` asks what the ratio would have been had ``a``'s drafting cost, a step,
what method ``C``'s did on the same prompt (``none``: no drafting at all): each of ``a``'s
records keeps its steps and verification seconds, and its drafting seconds become its steps
times ``C``'s drafting seconds a step (BENCHMARKS.md, twenty-seventh session).

    python benchmarks/paired_ratio.py chat_large.json --drafting-like suffixdecoding
"""

from __future__ import annotations

import argparse
import sys

from specstore.runtime.bench.metrics import BOOTSTRAP_RESAMPLES, bootstrap_speedup, speedup_of
from specstore.runtime.bench.report import load_result
from specstore.runtime.errors import SpecstoreError


def paired(prompts, a: str, b: str) -> list[tuple]:
    """``(b's record, a's record)`` of each prompt (and turn) both methods ran: the bench's own
    (reference, method) pairs, so metrics.py's speedup and its bootstrap apply as they are."""
    return [(v[b], v[a]) for v in by_prompt(prompts).values() if a in v and b in v]


def by_prompt(prompts) -> dict[tuple, dict]:
    """Each (prompt, turn)'s records, by method."""
    out: dict[tuple, dict] = {}
    for r in prompts:
        out.setdefault((r.prompt_id, r.turn), {})[r.method] = r
    return out


def repriced(prompts, a: str, like: str) -> list:
    """``prompts`` with each of ``a``'s records' wall seconds as if its drafting had cost, a
    step, what ``like``'s did on the same prompt and turn (``like`` "none": nothing); a record of
    ``a`` whose prompt ``like`` did not run is left out."""
    records = by_prompt(prompts)
    out = []
    for r in prompts:
        if r.method != a:
            out.append(r)
            continue
        if like == "none":
            per_step = 0.0
        else:
            other = records[(r.prompt_id, r.turn)].get(like)
            if other is None:
                continue
            per_step = other.drafting_s / max(other.steps, 1)
        out.append(r.model_copy(update={"wall_s": r.wall_s - r.drafting_s + r.steps * per_step,
                                        "drafting_s": r.steps * per_step}))
    return out


def ratio(pairs: list[tuple]) -> float:
    """Pooled tokens/s of the pairs' second records over their first ones'."""
    cols = [[r.wall_s for r, _ in pairs], [r.num_tokens for r, _ in pairs],
            [r.wall_s for _, r in pairs], [r.num_tokens for _, r in pairs]]
    return float(speedup_of(*cols))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="a specstore bench --out JSON")
    p.add_argument("--a", default="respec", help="the method on top (default respec)")
    p.add_argument("--b", default="suffixdecoding", help="the method below (default suffixdecoding)")
    p.add_argument("--resamples", type=int, default=BOOTSTRAP_RESAMPLES, help="bootstrap resamples of the prompts")
    p.add_argument("--drafting-like", metavar="METHOD",
                   help="price a's drafting a step as METHOD's on the same prompt ('none': no drafting): what the ratio would be")
    args = p.parse_args()
    try:
        prompts = load_result(args.result).prompts
        if args.drafting_like:
            prompts = repriced(prompts, args.a, args.drafting_like)
        pairs = paired(prompts, args.a, args.b)
    except SpecstoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not pairs:
        print(f"no prompt in {args.result} was run by both {args.a} and {args.b}", file=sys.stderr)
        return 2
    interval = bootstrap_speedup(pairs, resamples=args.resamples)
    shown = "" if interval is None else f" [{interval[0]:.3f}, {interval[1]:.3f}]"
    priced = f", {args.a}'s drafting priced as {args.drafting_like}'s" if args.drafting_like else ""
    print(f"{args.a} / {args.b} tokens/s: {ratio(pairs):.3f}{shown} (95%, {len(pairs)} prompts{priced})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
