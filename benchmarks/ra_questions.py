"""Write a retrieval-augmented question set: held-out questions with a long reference in the prompt.

In retrieval-augmented generation the prompt carries a document the answer may copy from, so
prompt lookup (pld) drafts long, correct spans. Issue 16's deliverable 5 asks that ReSpec, which
holds prompt lookup as one of its sources, never fall behind pld there. This script writes such
a set in the Spec-Bench shape (``question_id``, ``category``, ``turns``) for ``specstore bench``
and ``specstore simulate``:

- ``ra-code``: CodeAlpaca 2k records (instruction + input) with the record's own solution given
  as a reference, asked to write the solution with an explanation. Only records at index
  ``--code-from`` on are used (1930 by default: records 0-1899 are in the bench's code
  datastores, 1900-1929 are its eval prompts and 1960-1989 ReSpec's tune split, which is skipped).
- ``ra-chat``: AlpacaEval instructions with one model's answer (the first of the requested
  length, in file order) given as a reference. Instructions found in ``--exclude`` (JSONL corpora
  with an ``instruction`` field, e.g. the chat datastore's corpus) are skipped, so that the
  datastore holds no answer to them.

Only references of ``--min-chars`` to ``--max-chars`` characters are used (long enough to copy
from, short enough for the 2048-token context with 128 new tokens).

    python benchmarks/ra_questions.py --data ../shared/data --out ra_questions.jsonl \\
        --exclude /work/chatstream/corpus.jsonl --per-category 16
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

TUNE = range(1960, 1990)  # ReSpec's tune split of CodeAlpaca 2k (benchmarks/reference_compare.py)

CODE_PROMPT = (
    "Here is a task and a reference solution for it.\n\nTask: {task}\n\nReference solution:\n"
    "```\n{reference}\n```\n\nWrite the solution to the task, using the reference, and explain how it works."
)
CHAT_PROMPT = (
    "Answer the question below. A reference answer is given; use it where it is right.\n\n"
    "Reference answer:\n{reference}\n\nQuestion: {task}"
)


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def code_questions(data: Path, start: int, count: int, lo: int, hi: int) -> list[dict]:
    rows = _jsonl(data / "codealpaca" / "code_alpaca_2k.jsonl.gz")
    out = []
    for index in range(start, len(rows)):
        if index in TUNE or len(out) == count:
            continue
        r = rows[index]
        reference = (r.get("output") or "").strip()
        if not lo <= len(reference) <= hi:
            continue
        task = r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")
        out.append({"question_id": f"ra-code-{index}", "category": "ra-code",
                    "turns": [CODE_PROMPT.format(task=task, reference=reference)]})
    return out


def chat_questions(data: Path, exclude: set[str], count: int, lo: int, hi: int) -> list[dict]:
    rows = _jsonl(data / "alpaca_eval_outputs" / "model_outputs_37models.jsonl.gz")
    out, seen = [], set()
    for index, r in enumerate(rows):
        task, reference = r["instruction"], (r.get("output") or "").strip()
        if len(out) == count:
            break
        if task in exclude or task in seen or not lo <= len(reference) <= hi:
            continue
        seen.add(task)
        out.append({"question_id": f"ra-chat-{index}", "category": "ra-chat",
                    "turns": [CHAT_PROMPT.format(task=task, reference=reference)]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="../shared/data", help="the shared data folder")
    p.add_argument("--out", required=True, help="questions JSONL to write")
    p.add_argument("--per-category", type=int, default=16, help="questions per category")
    p.add_argument("--code-from", type=int, default=1930, help="first CodeAlpaca 2k record to use")
    p.add_argument("--exclude", nargs="*", default=[], help="JSONL corpora whose instructions are skipped")
    p.add_argument("--min-chars", type=int, default=200)
    p.add_argument("--max-chars", type=int, default=2500)
    args = p.parse_args()
    data = Path(args.data)
    exclude = {r.get("instruction") for path in args.exclude for r in _jsonl(Path(path))}
    code = code_questions(data, args.code_from, args.per_category, args.min_chars, args.max_chars)
    chat = chat_questions(data, exclude, args.per_category, args.min_chars, args.max_chars)
    with open(args.out, "w", encoding="utf-8") as handle:
        for q in code + chat:
            handle.write(json.dumps(q) + "\n")
    print(f"wrote {len(code)} ra-code and {len(chat)} ra-chat questions to {args.out}")


if __name__ == "__main__":
    main()
