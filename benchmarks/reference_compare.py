"""ReSpec against SuffixDecoding and the other drafters on full-size datastores (MAT, model-free).

The FINDINGS figures for SuffixDecoding (1.78 MT-Bench / 1.95 CodeAlpaca) were taken on large
out-of-domain datastores; this script rebuilds comparable ones once and compares every drafter
on the same datastore, prompts and greedy references:

- code-full: code_alpaca_2k records 0-1899 + new_codealpaca (4,535), ~0.93M tokens;
- chat-large: the first 3,000 AlpacaEval rows whose instruction is no MT-Bench turn, ~1M tokens.

Questions come in two disjoint splits so that settings are chosen on one and reported on the
other: *tune* (CodeAlpaca records 1960-1989, MT-Bench questions 5-8 of each category) and *eval*
(CodeAlpaca 1900-1929, MT-Bench 1-4 of each category). References are float32 greedy ``ar``
outputs (``specstore bench --methods ar``); MAT comes from ``specstore simulate``, which equals
the bench's MAT for the same settings (tests/test_bench.py). Needs ``make install-suffixdecoding``
for the suffixdecoding row. Run on a quiet machine: about 40 minutes the first time (two builds),
then ~10 minutes.

    python benchmarks/reference_compare.py [--split eval|tune] [--sweep respec.entropy_threshold=0.75,2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

from run_all import DATA, ROOT, prepare_chat, sample_mt_bench  # this folder's suite script

CODE = DATA / "codealpaca" / "code_alpaca_2k.jsonl.gz"


def prepare(corpora: Path) -> dict[str, Path]:
    """The two corpora and the two MT-Bench splits (chat rows and MT-Bench sampling as in run_all.py)."""
    corpora.mkdir(parents=True, exist_ok=True)
    code_rows = [json.loads(line) for line in gzip.open(CODE, "rt")]
    extra = [json.loads(line) for line in gzip.open(DATA / "codealpaca" / "new_codealpaca.jsonl.gz", "rt")]
    held = {r["instruction"].strip().lower() for r in code_rows[1900:]}
    code = [{"instruction": r["instruction"], "input": r.get("input", ""), "output": r["output"]}
            for r in code_rows[:1900] + extra if r["instruction"].strip().lower() not in held]
    code_path = corpora / "code_full.jsonl"
    code_path.write_text("".join(json.dumps(r) + "\n" for r in code))
    chat_path, _ = prepare_chat(corpora / "chat_large", 3000, 0)
    return {"code": code_path, "chat": chat_path,
            "mt_eval": sample_mt_bench(corpora, 4, 0), "mt_tune": sample_mt_bench(corpora, 4, 4)}


def run(cmd: list[str], log: Path | None = None) -> str:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    return proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=str(ROOT / "bench_store"))
    ap.add_argument("--out", default=str(ROOT / "bench_results"))
    ap.add_argument("--split", default="eval", choices=["eval", "tune"])
    ap.add_argument("--methods", default="pld,rest,dresd,respec,suffixdecoding")
    ap.add_argument("--sweep", action="append", default=[], help="passed to specstore simulate")
    ap.add_argument("--option", action="append", default=[], help="passed to specstore simulate")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = prepare(ROOT / "bench_corpora")
    cli = [sys.executable, "-m", "specstore.runtime.cli"]
    for name, corpus in (("code-full", paths["code"]), ("chat-large", paths["chat"])):
        run([*cli, "build", "--store", args.store, "--name", name, "--corpus", str(corpus), "--dtype", "bfloat16"],
            out / f"build_{name}.log")  # unchanged corpus: no new version
    skip = {"eval": "1900", "tune": "1960"}[args.split]
    sets = [("code", "code-full", [str(CODE), "--skip", skip, "--limit", "30"]),
            ("mt", "chat-large", [str(paths[f"mt_{args.split}"])])]
    extra = [f"--sweep={s}" for s in args.sweep] + [f"--option={o}" for o in args.option]
    for label, datastore, questions in sets:
        ref = out / f"ref_{label}_{args.split}.json"
        if not ref.exists():
            run([*cli, "bench", "--store", args.store, "--datastore", datastore, "--questions", *questions,
                 "--methods", "ar", "--dtype", "float32", "--out", str(ref)])
        table = run([*cli, "simulate", "--references", str(ref), "--store", args.store, "--datastore", datastore,
                     "--methods", args.methods, *extra])
        print(f"\n{label} ({args.split} split) against {datastore}\n{table}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
