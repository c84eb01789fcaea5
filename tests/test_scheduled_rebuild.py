"""examples/scheduled_rebuild.sh, the command a cron line or an Airflow task runs: the first run
builds, a run over an unchanged folder creates nothing and keeps the tag, a new file is appended
and tagged, and gc keeps only what it is told to (docs/SCHEDULING.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from specstore.runtime.store import Store
from tests.helpers import CORPUS_DIR

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "scheduled_rebuild.sh"


def _run(store: Path, corpus: Path, model: str, keep: int = 3) -> str:
    env = os.environ | {"SPECSTORE": str(Path(sys.executable).parent / "specstore"), "KEEP": str(keep), "TAG": "prod"}
    options = ["--model", model, "--dtype", "float32", "--pca-dims", "8", "--continuation-length", "4",
               "--batch-tokens", "256", "--max-doc-tokens", "96"]
    done = subprocess.run(["bash", str(SCRIPT), str(store), "docs", str(corpus), *options], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_scheduled_rebuild_is_idempotent_appends_tags_and_collects(tiny_model_dir, tmp_path):
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    corpus.mkdir()
    shutil.copy(CORPUS_DIR / "instruct.jsonl", corpus / "2026-11-30.jsonl")

    assert "docs@1 (tag prod)" in _run(store, corpus, tiny_model_dir)
    first = Store(store).resolve("docs@prod")
    assert first.version == 1 and first.manifest.num_documents == 4

    # nothing new: no version, the tag stays
    assert "unchanged" in _run(store, corpus, tiny_model_dir)
    assert [v.version for v in Store(store).versions("docs")] == [1]

    # a new closed segment lands: appended (only its documents are new), tagged; gc keeps one
    shutil.copy(CORPUS_DIR / "chat.jsonl", corpus / "2026-12-01.jsonl")
    out = _run(store, corpus, tiny_model_dir, keep=1)
    assert "docs@2 (tag prod)" in out and "added by append" in out
    s = Store(store)
    assert [v.version for v in s.versions("docs")] == [2]
    newest = s.resolve("docs@prod")
    assert newest.version == 2 and newest.manifest.num_documents > first.manifest.num_documents
    assert newest.manifest.lineage.mode == "append" and newest.manifest.lineage.added_sources == [str(corpus / "2026-12-01.jsonl")]


def test_scheduled_rebuild_without_arguments_prints_usage():
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage: scheduled_rebuild.sh STORE NAME CORPUS_DIR" in done.stdout
