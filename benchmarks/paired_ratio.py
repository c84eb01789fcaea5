"""One method's tokens/s over another's in a bench result, with a paired bootstrap interval.

The bench reports each method against ``ar``; issue 16 also asks how far ReSpec is ahead of
SuffixDecoding. This reads a ``specstore bench --out`` JSON, pairs the two methods' records of
each prompt (and turn), and prints the ratio of their pooled tokens/s (new tokens over wall
seconds, summed over the prompts) with a 95% interval from resampling the prompts, the same
prompts for both sides (so that load which hit one prompt hits both sides of its ratio).

    python benchmarks/paired_ratio.py code_id.json [--a respec] [--b suffixdecoding] [--resamples 2000]
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
    by_prompt: dict[tuple, dict] = {}
    for r in prompts:
        by_prompt.setdefault((r.prompt_id, r.turn), {})[r.method] = r
    return [(v[b], v[a]) for v in by_prompt.values() if a in v and b in v]


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
    args = p.parse_args()
    try:
        pairs = paired(load_result(args.result).prompts, args.a, args.b)
    except SpecstoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not pairs:
        print(f"no prompt in {args.result} was run by both {args.a} and {args.b}", file=sys.stderr)
        return 2
    interval = bootstrap_speedup(pairs, resamples=args.resamples)
    shown = "" if interval is None else f" [{interval[0]:.3f}, {interval[1]:.3f}]"
    print(f"{args.a} / {args.b} tokens/s: {ratio(pairs):.3f}{shown} (95%, {len(pairs)} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
