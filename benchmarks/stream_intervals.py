"""Intervals for a served stream: paired bootstrap over the prompts of the stream's last half.

Reads the JSON that ``benchmarks/served_stream.py --json`` writes (per-request rows of every
run) and prints each run's MAT (tokens committed per target forward, pooled) and tokens/s (new
tokens over wall time, pooled) over the last half of the stream with a 95% bootstrap interval,
and their ratios to the first run whose label says ``off`` (resampling the same prompts for
both, so load that hit one prompt hits both sides of its ratio).

    python benchmarks/stream_intervals.py served_stream.json [--resamples 5000]
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def pooled(rows: list[dict], key_num: str, key_den: str, sample: np.ndarray | None = None):
    num = np.array([r[key_num] for r in rows], dtype=float)
    den = np.array([r[key_den] for r in rows], dtype=float)
    if sample is None:
        return num.sum() / den.sum()
    return num[sample].sum(axis=1) / den[sample].sum(axis=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="served_stream.py's --json output")
    p.add_argument("--resamples", type=int, default=5000)
    args = p.parse_args()
    runs = json.loads(open(args.result).read())["runs"]
    labels = list(runs)
    halves = {label: runs[label]["requests"][len(runs[label]["requests"]) // 2 :] for label in labels}
    n = len(halves[labels[0]])
    sample = np.random.default_rng(0).integers(0, n, size=(args.resamples, n))
    base = next((label for label in labels if "off" in label), labels[0])
    for label in labels:
        for name, keys in (("MAT", ("committed", "steps")), ("tokens/s", ("new_tokens", "wall_s"))):
            value, boot = pooled(halves[label], *keys), pooled(halves[label], *keys, sample)
            line = f"{label:32s} {name:8s} {value:.3f} ({np.percentile(boot, 2.5):.3f}-{np.percentile(boot, 97.5):.3f})"
            if label != base and len(halves[label]) == n:
                ratio = boot / pooled(halves[base], *keys, sample)
                line += (f"  / {base}: {value / pooled(halves[base], *keys):.3f}x "
                         f"({np.percentile(ratio, 2.5):.3f}-{np.percentile(ratio, 97.5):.3f})")
            print(line)


if __name__ == "__main__":
    main()
