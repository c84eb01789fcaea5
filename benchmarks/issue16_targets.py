"""Issue 16's targets, checked on bench results: one line a target and set, what was measured
(with its 95% interval over prompts where there is one) and whether it holds.

    python benchmarks/issue16_targets.py code-id=code_id.json chat-ood=chat_ood.json \\
        code-full=code_full.json chat-large=chat_large.json \\
        [--predicted code-id=sim_code_id.json ...]

Each SET=FILE is a ``specstore bench --out`` JSON (methods interleaved in one run, as the issue
asks). The sets are named as in BENCHMARKS.md: ``code-id`` and ``chat-ood`` (the `make bench`
datastores), ``code-full`` (the 0.93M-token code datastore) and ``chat-large`` (the 1M-token chat
one); a set not given is not checked. ``--predicted SET=FILE`` takes ``specstore simulate ...
--json`` output on the same result, for the simulator's target. The targets:

- every lossless retrieval method (pld, rest, dresd, respec) at 1.0x ``ar`` or more, every set;
- dresd at or above rest in speed (paired over prompts), every set;
- respec at 2.0x on code-id, 1.8x on code-full, 1.7x on chat-large;
- respec ahead of SuffixDecoding by 15% or more (paired) on those three;
- respec's MAT at or above pld's in every question category, every set;
- every lossless method's output identical to ``ar``'s (checked in float32: the issue's identity
  is float32's; in bf16 a k-token verification rounds differently from a 1-token step);
- the simulator's predicted speedup within 10% of the measured one, each method (with --predicted).

A target holds on the point estimate; the interval says how sure that is. The issue states its
targets for bf16 on an AVX-512 CPU: each result's device and dtype head the output. Exit status
0 when every checked target holds, 1 when one does not, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paired_ratio import paired, ratio  # noqa: E402

from specstore.runtime.bench.metrics import bootstrap_speedup  # noqa: E402
from specstore.runtime.bench.report import load_result  # noqa: E402
from specstore.runtime.errors import SpecstoreError  # noqa: E402

LOSSLESS = ("pld", "rest", "dresd", "respec")
RESPEC_FLOOR = {"code-id": 2.0, "code-full": 1.8, "chat-large": 1.7}
AHEAD_OF_SUFFIX = 1.15  # respec / SuffixDecoding on RESPEC_FLOOR's sets
PREDICTION_TOLERANCE = 0.10
SETS = ("code-id", "chat-ood", "code-full", "chat-large")


def _interval(ci) -> str:
    return "" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def check(results: dict, predicted: dict | None = None) -> list[tuple[str, str, str, bool | None]]:
    """``(target, set, measured, holds)`` rows; holds is None where a method the target needs did not run."""
    predicted = predicted or {}
    rows: list[tuple[str, str, str, bool | None]] = []
    for name, result in results.items():
        methods = result.methods
        for m in LOSSLESS:
            if m not in methods:
                rows.append((f"{m} >= 1.0x ar", name, "not run", None))
                continue
            s = methods[m].speedup_vs_ar
            rows.append((f"{m} >= 1.0x ar", name, f"{s:.2f}x{_interval(methods[m].speedup_ci)}", s >= 1.0))
        rows.append(_paired_row("dresd >= rest (paired)", name, result, "dresd", "rest", 1.0))
        if name in RESPEC_FLOOR:
            floor = RESPEC_FLOOR[name]
            if "respec" in methods:
                s = methods["respec"].speedup_vs_ar
                rows.append((f"respec >= {floor}x ar", name, f"{s:.2f}x{_interval(methods['respec'].speedup_ci)}", s >= floor))
            else:
                rows.append((f"respec >= {floor}x ar", name, "not run", None))
            rows.append(_paired_row(f"respec >= {AHEAD_OF_SUFFIX:.2f}x SuffixDecoding (paired)", name, result, "respec",
                                    "suffixdecoding", AHEAD_OF_SUFFIX))
        if "respec" in methods and "pld" in methods:
            cats = sorted(set(methods["respec"].per_category) & set(methods["pld"].per_category))
            below = [c for c in cats if methods["respec"].per_category[c].mat < methods["pld"].per_category[c].mat]
            closest = min(cats, key=lambda c: methods["respec"].per_category[c].mat - methods["pld"].per_category[c].mat) if cats else None
            text = (f"{len(cats) - len(below)} of {len(cats)} categories" +
                    (f"; closest {closest}: {methods['respec'].per_category[closest].mat:.2f} / "
                     f"{methods['pld'].per_category[closest].mat:.2f}" if closest else "") +
                    (f"; below in {', '.join(below)}" if below else ""))
            rows.append(("respec MAT >= pld MAT, each category", name, text, not below))
        lossless = [m for m, r in methods.items() if m != "ar" and r.lossless and r.identical_to_ar is not None]
        if result.dtype != "float32":
            rows.append(("identical to ar (float32)", name, f"{result.dtype}: not checked", None))
        else:
            differ = [m for m in lossless if not methods[m].identical_to_ar]
            rows.append(("identical to ar (float32)", name,
                         f"{len(lossless) - len(differ)} of {len(lossless)} methods" + (f"; differ: {', '.join(differ)}" if differ else ""),
                         not differ))
        for row in predicted.get(name, []):
            m = row.get("method")
            if m not in methods or row.get("predicted_speedup") is None or row.get("rank", 1) != 1:
                continue
            measured, guess = methods[m].speedup_vs_ar, row["predicted_speedup"]
            off = guess / measured - 1.0
            rows.append((f"simulator within {PREDICTION_TOLERANCE:.0%}: {m}", name,
                         f"predicted {guess:.2f}x, measured {measured:.2f}x ({off:+.1%})", abs(off) <= PREDICTION_TOLERANCE))
    return rows


def _paired_row(target: str, name: str, result, a: str, b: str, floor: float) -> tuple[str, str, str, bool | None]:
    pairs = paired(result.prompts, a, b)
    if not pairs:
        return target, name, f"{a} or {b} not run", None
    value = ratio(pairs)
    return target, name, f"{value:.3f}{_interval(bootstrap_speedup(pairs))}", value >= floor


def read_predicted(path: Path) -> list[dict]:
    """``specstore simulate`` output: its ``--json`` rows, or the rows of its Markdown table
    (method, options, cost-aware, MAT, drafted tokens, drafting ms, predicted speedup, rank)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecstoreError(f"--predicted {path}: {exc.strerror or exc}") from None
    try:
        rows = json.loads(text)
        if isinstance(rows, list) and all(isinstance(r, dict) for r in rows):
            return rows
    except ValueError:
        pass
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 8 or not cells[6].endswith("x"):
            continue
        try:
            rows.append({"method": cells[0], "predicted_speedup": float(cells[6][:-1]), "rank": int(cells[7])})
        except ValueError:
            continue
    if not rows:
        raise SpecstoreError(f"--predicted {path}: no simulate rows in it (its --json output or its table)")
    return rows


def _pairs(items: list[str], what: str) -> dict[str, Path]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or name not in SETS:
            raise SpecstoreError(f"{what} {item!r}: give SET=FILE, SET one of {', '.join(SETS)}")
        out[name] = Path(path)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", metavar="SET=FILE", help=f"a bench result per set ({', '.join(SETS)})")
    p.add_argument("--predicted", action="append", default=[], metavar="SET=FILE",
                   help="specstore simulate --json output on that set's result (the simulator's target)")
    args = p.parse_args(argv)
    try:
        results = {name: load_result(path) for name, path in _pairs(args.results, "result").items()}
        predicted = {name: read_predicted(path) for name, path in _pairs(args.predicted, "--predicted").items()}
    except SpecstoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, result in results.items():
        print(f"{name}: {result.datastore}, {result.device} {result.dtype}, {len({r.prompt_id for r in result.prompts})} prompts, "
              f"torch {result.torch_version}")
    print()
    print("| target | set | measured | holds |\n|---|---|---|---|")
    rows = check(results, predicted)
    for target, name, text, holds in rows:
        print(f"| {target} | {name} | {text} | {'-' if holds is None else 'yes' if holds else '**no**'} |")
    failed = [r for r in rows if r[3] is False]
    print(f"\n{len(rows) - len(failed) - sum(r[3] is None for r in rows)} of {len(rows)} checks hold"
          + (f"; {len(failed)} do not" if failed else "") + ".")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
