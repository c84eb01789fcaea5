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
import json
import sys

import numpy as np


def paired(prompts: list[dict], a: str, b: str) -> tuple[np.ndarray, np.ndarray]:
    """``[P, 2]`` tokens and ``[P, 2]`` wall seconds of methods ``a`` and ``b`` on the prompts both ran."""
    by_prompt: dict[tuple, dict[str, dict]] = {}
    for r in prompts:
        by_prompt.setdefault((r["prompt_id"], r.get("turn", 1)), {})[r["method"]] = r
    both = [v for v in by_prompt.values() if a in v and b in v]
    tokens = np.array([[v[a]["num_tokens"], v[b]["num_tokens"]] for v in both], dtype=float).reshape(-1, 2)
    wall = np.array([[v[a]["wall_s"], v[b]["wall_s"]] for v in both], dtype=float).reshape(-1, 2)
    return tokens, wall


def ratio(tokens: np.ndarray, wall: np.ndarray, sample: np.ndarray | None = None) -> np.ndarray | float:
    """Pooled tokens/s of column 0 over column 1 (per resample when ``sample`` [R, P] is given)."""
    if sample is None:
        return float((tokens[:, 0].sum() / wall[:, 0].sum()) / (tokens[:, 1].sum() / wall[:, 1].sum()))
    t, w = tokens[sample], wall[sample]  # [R, P, 2]
    return (t[..., 0].sum(1) / w[..., 0].sum(1)) / (t[..., 1].sum(1) / w[..., 1].sum(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="a specstore bench --out JSON")
    p.add_argument("--a", default="respec", help="the method on top (default respec)")
    p.add_argument("--b", default="suffixdecoding", help="the method below (default suffixdecoding)")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of the prompts")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with open(args.result) as handle:
        prompts = json.load(handle).get("prompts", [])
    tokens, wall = paired(prompts, args.a, args.b)
    if len(tokens) == 0:
        print(f"no prompt in {args.result} was run by both {args.a} and {args.b}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    boots = ratio(tokens, wall, rng.integers(0, len(tokens), size=(args.resamples, len(tokens))))
    lo, hi = np.percentile(boots, [2.5, 97.5])
    print(f"{args.a} / {args.b} tokens/s: {ratio(tokens, wall):.3f} [{lo:.3f}, {hi:.3f}] (95%, {len(tokens)} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
