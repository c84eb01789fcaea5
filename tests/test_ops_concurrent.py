"""Concurrent use: a serving process decoding with NAME@prod keeps the version it opened while
a rebuild, a re-tag and gc run in other processes; it sees the new version when it reopens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specstore.pipelines.build import build
from specstore.runtime.store import Store
from tests.helpers import BUILD_OPTIONS, CORPUS_DIR

READER = Path(__file__).parent / "ops_reader.py"
FLAGS = ["--pca-dims", "8", "--continuation-length", "4", "--batch-tokens", "256", "--max-doc-tokens", "96"]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "specstore.runtime.cli", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ | {"HF_HUB_OFFLINE": "1"})


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
def test_reader_keeps_its_version_through_rebuild_retag_and_gc(tiny_model_dir, tmp_path):
    store = Store(tmp_path / "s", create=True)
    build(store, "c", [str(CORPUS_DIR / "code")], model=tiny_model_dir, tag="prod", **BUILD_OPTIONS)
    log, reopen, stop = tmp_path / "log.jsonl", tmp_path / "reopen", tmp_path / "stop"
    reader = subprocess.Popen([sys.executable, str(READER), str(store.root), "c@prod", tiny_model_dir, str(log), str(reopen), str(stop)],
                              env=os.environ | {"HF_HUB_OFFLINE": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: log.exists() and log.read_text().count("\n") >= 2)
        started = time.time()
        rebuilt = _cli("build", "--store", str(store.root), "--name", "c", "--corpus", str(CORPUS_DIR / "code"),
                       str(CORPUS_DIR / "notes.txt"), "--model", tiny_model_dir, *FLAGS)
        assert rebuilt.returncode == 0, rebuilt.stderr
        assert _cli("tag", "--store", str(store.root), "--ref", "c@2", "--tag", "prod").returncode == 0
        collected = _cli("gc", "--store", str(store.root), "--name", "c", "--keep", "1")
        assert collected.returncode == 0 and "removed versions 1" in collected.stdout, collected.stdout + collected.stderr
        finished = time.time()
        count = log.read_text().count("\n")
        _wait_for(lambda: log.read_text().count("\n") >= count + 2)  # still decoding after gc removed its version
        reopen.touch()
        _wait_for(lambda: any(json.loads(line)["version"] == 2 for line in log.read_text().splitlines()))
        stop.touch()
        assert reader.wait(timeout=60) == 0, reader.stderr.read()
    finally:
        if reader.poll() is None:
            reader.kill()
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    before = [e for e in entries if e["version"] == 1]
    after = [e for e in entries if e["version"] == 2]
    assert before and after and entries.index(after[0]) == len(before)  # v1 until it reopened, then v2
    assert any(started < e["t"] < finished for e in before)  # it decoded while the others ran
    assert all(e["ids"] == before[0]["ids"] for e in before)
    assert store.resolve("c@prod").version == 2 and [v.version for v in store.versions("c")] == [2]
