"""A build killed in the middle leaves the previous version intact and nothing half-visible;
and the same build runs under Beam's multi-processing DirectRunner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specstore.pipelines.build import build
from specstore.runtime.datastore import Datastore
from specstore.runtime.store import Store
from tests.helpers import BUILD_OPTIONS, CORPUS_DIR

OPTIONS = {k: v for k, v in BUILD_OPTIONS.items() if k != "max_doc_tokens"}  # documents as long as the default allows


def _big_corpus(folder: Path, num_files: int = 400) -> Path:
    """Enough text that embedding takes seconds with batch_tokens=64 (many small batches)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(num_files):
        (folder / f"doc{i:04d}.txt").write_text(" ".join(f"word{(i * 7 + j) % 97}" for j in range(60)))
    return folder


def test_killed_build_leaves_previous_version_intact(tiny_model_dir, tmp_path):
    store = Store(tmp_path / "s", create=True)
    first = build(store, "k", [str(CORPUS_DIR / "instruct.jsonl")], model=tiny_model_dir, **OPTIONS).manifest
    catalogue_before = [(v.version, v.build_id) for v in store.versions("k")]
    corpus = _big_corpus(tmp_path / "big")
    cmd = [sys.executable, "-m", "specstore.runtime.cli", "build", "--store", str(store.root), "--name", "k",
           "--corpus", str(corpus), "--format", "code-dir", "--model", tiny_model_dir, "--pca-dims", "8", "--batch-tokens", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    files_root = store.root / "_files" / "k"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            staged = [p for p in files_root.glob("*/_staging/*.npz")]
            if len(staged) >= 3:  # it has embedded and written several batches
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the build finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(list(files_root.iterdir())) == 2  # the killed build's files exist ...
    assert [(v.version, v.build_id) for v in store.versions("k")] == catalogue_before  # ... but are not visible
    assert store.resolve("k").version == 1
    ds = Datastore.open(store, "k")  # every file of version 1 still verifies
    assert ds.manifest.build_id == first.build_id and len(ds.dense) == first.dense.num_rows


@pytest.mark.slow
def test_multi_processing_runner_gives_the_same_rows(tiny_model_dir, tmp_path):
    corpus = [str(CORPUS_DIR / n) for n in ("instruct.jsonl", "notes.txt", "code")]
    store = Store(tmp_path / "s", create=True)
    one = build(store, "mp", corpus, model=tiny_model_dir, **OPTIONS).manifest
    two = build(store, "mp", corpus, model=tiny_model_dir, beam_args=["--direct_running_mode=multi_processing", "--direct_num_workers=2"], **OPTIONS).manifest
    assert (two.num_documents, two.num_tokens) == (one.num_documents, one.num_tokens)
    a = store.open_table(one.tokens_table).to_arrow().sort_by("offset")
    b = store.open_table(two.tokens_table).to_arrow().sort_by("offset")
    assert a.column("token_id").equals(b.column("token_id")) and a.column("continuation").equals(b.column("continuation"))
