"""Question files for benchmarks: MT-Bench / Spec-Bench, HumanEval and instruction JSONL.

Each loads into ``Question`` records: an id, a category and one or more user turns (a
multi-turn question's later turns are asked after the model's own earlier answers).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from specstore.runtime.errors import SpecstoreError


@dataclass(frozen=True, slots=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]
    raw_prompt: bool = False  # HumanEval: complete the code as given, no chat template


def _records(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise SpecstoreError(f"cannot read questions file {path}: {exc.strerror or exc}") from None
    text = text.strip()
    if text.startswith("["):
        return json.loads(text)
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SpecstoreError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
    return rows


def to_question(row: dict, index: int) -> Question:
    if "turns" in row:  # MT-Bench / Spec-Bench
        return Question(str(row.get("question_id", index)), str(row.get("category", "mt_bench")), tuple(row["turns"]))
    if "task_id" in row and "prompt" in row:  # HumanEval
        return Question(str(row["task_id"]), "humaneval", (row["prompt"],), raw_prompt=True)
    if "instruction" in row:  # instruction format (Alpaca, CodeAlpaca, ...)
        text = row["instruction"]
        if row.get("input"):
            text = f"{text}\n\n{row['input']}"
        return Question(str(row.get("id", index)), str(row.get("category", "instruction")), (text,))
    raise SpecstoreError(
        f"question record {index} has none of the known shapes (turns / task_id+prompt / instruction): keys {sorted(row)}"
    )


def load_questions(path: str | Path, limit: int | None = None, skip: int = 0) -> list[Question]:
    """Questions of a file, in file order; ``skip`` then ``limit`` select a slice."""
    path = Path(path)
    if not path.is_file():
        raise SpecstoreError(f"questions file {path} does not exist")
    rows = _records(path)
    questions = [to_question(row, i) for i, row in enumerate(rows)]
    questions = questions[skip:]
    return questions[:limit] if limit is not None else questions
