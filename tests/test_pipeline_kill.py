"""A build killed in the middle leaves the previous version intact and nothing half-visible;
and the same build runs under Beam's multi-processing DirectRunner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specstore.pipelines import steps
from specstore.pipelines.build import build
from specstore.runtime import dense_files as df
from specstore.runtime.datastore import Datastore
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.store import Store
from tests.helpers import BUILD_OPTIONS, CORPUS_DIR

OPTIONS = {k: v for k, v in BUILD_OPTIONS.items() if k != "max_doc_tokens"}  # documents as long as the default allows


def _big_corpus(folder: Path, num_files: int = 400) -> Path:
    """Enough text that embedding takes seconds with batch_tokens=64 (many small batches)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(num_files):
        (folder / f"doc{i:04d}.txt").write_text(" ".join(f"word{(i * 7 + j) % 97}" for j in range(60)))
    return folder


def _kill_while_embedding(cmd: list[str], files_root: Path, batches: int, env: dict) -> None:
    """Run the build ``cmd`` and SIGKILL it once ``batches`` embedded batches are staged."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if len(list(files_root.glob("*/_staging/embed-*.npz"))) >= batches:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the build finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_build_leaves_previous_version_intact(tiny_model_dir, tmp_path):
    store = Store(tmp_path / "s", create=True)
    first = build(store, "k", [str(CORPUS_DIR / "instruct.jsonl")], model=tiny_model_dir, **OPTIONS).manifest
    catalogue_before = [(v.version, v.build_id) for v in store.versions("k")]
    corpus = _big_corpus(tmp_path / "big")
    cmd = [sys.executable, "-m", "specstore.runtime.cli", "build", "--store", str(store.root), "--name", "k",
           "--corpus", str(corpus), "--format", "code-dir", "--model", tiny_model_dir, "--pca-dims", "8", "--batch-tokens", "64"]
    files_root = store.root / "_files" / "k"
    _kill_while_embedding(cmd, files_root, 3, os.environ | {"HF_HUB_OFFLINE": "1"})  # several batches embedded and written
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


def _codes(store: Store, manifest) -> np.ndarray:
    return np.load(store.files_dir(manifest.name, manifest.build_id) / df.VECTORS_FILE)


def test_killed_build_resumes_from_its_staged_batches(tiny_model_dir, tmp_path):
    """SIGKILL mid-embedding, then ``build --resume``: the staged batches are reused (not embedded
    again), the version equals an uninterrupted build's, and the killed build's folder goes."""
    store = Store(tmp_path / "s", create=True)
    corpus = _big_corpus(tmp_path / "big", 200)
    cmd = [sys.executable, "-m", "specstore.runtime.cli", "build", "--store", str(store.root), "--name", "r",
           "--corpus", str(corpus), "--format", "code-dir", "--model", tiny_model_dir, "--pca-dims", "8", "--batch-tokens", "64",
           "--dtype", "float32"]
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    files_root = store.root / "_files" / "r"
    _kill_while_embedding(cmd, files_root, 5, env)
    (killed,) = [p.name for p in files_root.iterdir()]
    staged = sorted((files_root / killed / "_staging").glob("embed-*.npz"))
    with np.load(staged[0]) as first:
        first_ids = set(first["doc_ids"].tolist())
    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "reused from a killed build" in done.stdout and f"resuming build {killed}" in done.stderr
    resumed = store.resolve("r").manifest
    assert not (files_root / killed).exists()  # its batches moved into the new build, the rest removed
    fresh = build(store, "r", [str(corpus)], fmt="code-dir", model=tiny_model_dir, pca_dims=8, batch_tokens=64, dtype="float32",
                  progress=False, force=True).manifest
    assert (resumed.num_documents, resumed.num_tokens) == (fresh.num_documents, fresh.num_tokens)
    a = store.open_table(resumed.tokens_table).to_arrow().sort_by("offset")
    b = store.open_table(fresh.tokens_table).to_arrow().sort_by("offset")
    assert a.column("token_id").equals(b.column("token_id")) and a.column("continuation").equals(b.column("continuation"))
    diff = np.abs(_codes(store, resumed).astype(np.int16) - _codes(store, fresh).astype(np.int16))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99  # same vectors up to the normaliser's summation order
    assert first_ids  # the reused batches really were the killed build's: their documents are in the new version
    again = subprocess.run([*cmd, "--resume", "--force"], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode != 0 and "no unfinished build of 'r'" in again.stderr


class _Crash(RuntimeError):
    pass


def _crash_after(monkeypatch, batches: int) -> None:
    """Make the in-process build fail after ``batches`` embedded batches (a crash mid-build)."""
    original = steps.EmbedFn.process
    count = {"n": 0}

    def process(self, docs, total=None):
        if count["n"] >= batches:
            raise _Crash("injected")
        count["n"] += 1
        yield from original(self, docs, total)

    monkeypatch.setattr(steps.EmbedFn, "process", process)


def test_resume_reuses_whole_batches_only_and_refuses_other_settings(tiny_model_dir, tmp_path, monkeypatch):
    store = Store(tmp_path / "s", create=True)
    corpus = [str(_big_corpus(tmp_path / "big", 120))]
    options = dict(fmt="code-dir", model=tiny_model_dir, pca_dims=8, batch_tokens=64, progress=False)
    with pytest.raises(SpecstoreError, match="no unfinished build"):
        build(store, "c", corpus, resume=True, **options)
    with monkeypatch.context() as m:
        _crash_after(m, 4)
        with pytest.raises(Exception, match="injected"):
            build(store, "c", corpus, **options)
    staging = next((store.root / "_files" / "c").iterdir()) / "_staging"
    staged = sorted(staging.glob("embed-*.npz"))
    assert len(staged) == 4 and (staging / "resume.json").is_file()
    cut = staged[-1]
    cut.write_bytes(cut.read_bytes()[:100])  # a file cut short is not reused: its documents are embedded again
    with pytest.raises(SpecstoreError, match="same corpus, settings and model"):
        build(store, "c", corpus, resume=True, **(options | {"pca_dims": 6}))
    with monkeypatch.context() as m:  # the resumed build crashes too: the next resume takes both builds' batches
        _crash_after(m, 2)
        with pytest.raises(Exception, match="injected"):
            build(store, "c", corpus, resume=True, **options)
    folders = list((store.root / "_files" / "c").iterdir())
    assert len(folders) == 2
    staged = [p for f in folders for p in (f / "_staging").glob("embed-*.npz") if p != cut]
    whole = 0
    for path in staged:
        with np.load(path) as data:
            whole += int(data["lengths"].sum())
    result = build(store, "c", corpus, resume=True, **options)
    assert len(staged) == 5 and result.resumed_tokens == whole and 0 < whole < result.manifest.num_tokens
    assert not any(f.exists() for f in folders)  # both unfinished builds went with the commit
    fresh = build(store, "c", corpus, force=True, **options)
    assert fresh.resumed_tokens == 0 and fresh.manifest.num_tokens == result.manifest.num_tokens
    assert np.abs(_codes(store, result.manifest).astype(np.int16) - _codes(store, fresh.manifest).astype(np.int16)).max() <= 1
    assert store.versions("c")[-1].version == 2 and len(list((store.root / "_files" / "c").iterdir())) == 2
