"""Retention: ``specstore gc`` removes old untagged versions (catalogue rows and files) and
unfinished builds past the grace period; tagged versions stay; a reader that opened a removed
version keeps decoding with it."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from specstore.runtime.api import generate
from specstore.runtime.cli import main
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.errors import DatastoreNotFoundError, SpecstoreError
from specstore.runtime.retention import collect
from specstore.runtime.store import Store
from tests.datastore_helpers import TEXTS, model_hidden, tiny_datastore, write_datastore


def _fake_build(store: Store, name: str, age_s: float) -> str:
    """The leftovers of a build that never committed: a file folder and a tokens table folder."""
    build_id = Store.new_build_id()
    paths = [store.files_dir(name, build_id) / "_staging", store.root / f"{Store.table_name(name, build_id)}.lance" / "data"]
    for p in paths:
        p.mkdir(parents=True)
        (p / "part.bin").write_bytes(b"x" * 100)
    then = time.time() - age_s
    for p in paths:
        for q in (p / "part.bin", p, p.parent):
            os.utime(q, (then, then))
    return build_id


def test_gc_keeps_newest_and_tagged_and_readers_keep_working(tmp_path, capsys):
    store, loaded, first = tiny_datastore(tmp_path)
    docs = [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    hidden = model_hidden(loaded.model, docs)
    for i in range(4):
        write_datastore(store, "code", docs[: 2 + i % 3], hidden[: 2 + i % 3], loaded.info, tag="prod" if i == 0 else None)
    assert [v.version for v in store.versions("code")] == [1, 2, 3, 4, 5] and store.resolve("code@prod").version == 2
    held = Datastore.open(store, "code@1", loaded.info)  # a reader of the oldest version
    prompt = "def add(a, b):"
    before = generate(loaded.model, loaded.tokenizer, prompt, make_drafter("rest", held), 16).token_ids
    dresd_before = generate(loaded.model, loaded.tokenizer, prompt, make_drafter("dresd", held), 16).token_ids
    query = np.linspace(-1, 1, held.dense.dims).astype(np.float32)
    rows_before = held.dense.search(query, 3).rows.tolist()
    old_orphan, young_orphan = _fake_build(store, "code", 7200), _fake_build(store, "code", 0)
    v1_files = store.files_dir("code", first.build_id)

    report = collect(store, "code", keep=2, grace_seconds=3600)
    assert report.removed_versions == [1, 3] and report.kept == [2, 4, 5]
    assert report.orphan_builds == [old_orphan] and report.num_bytes > 0
    assert [v.version for v in store.versions("code")] == [2, 4, 5]
    assert not v1_files.exists() and not (store.root / f"{first.tokens_table}.lance").exists()
    assert store.files_dir("code", young_orphan).exists()  # maybe still running: left alone
    assert not store.files_dir("code", old_orphan).exists()
    assert not list(store.root.glob(f"{Store.table_name('code', old_orphan)}.lance"))
    with pytest.raises(DatastoreNotFoundError, match="no version 1"):
        Datastore.open(store, "code@1", loaded.info)
    Datastore.open(store, "code@prod", loaded.info)  # tagged: every file still verifies
    # the reader that opened version 1 before gc still decodes and searches the same
    assert generate(loaded.model, loaded.tokenizer, prompt, make_drafter("rest", held), 16).token_ids == before
    assert held.suffix.positions(docs[0][:3]).tolist() == [0]
    assert len(held.dense) == first.dense.num_rows  # its mapped dense files still serve
    assert generate(loaded.model, loaded.tokenizer, prompt, make_drafter("dresd", held), 16).token_ids == dresd_before
    assert held.dense.search(query, 3).rows.tolist() == rows_before

    capsys.readouterr()
    assert main(["gc", "--store", str(store.root), "--name", "code", "--keep", "1", "--dry-run"]) == 0
    assert "would remove versions 4" in capsys.readouterr().out
    assert [v.version for v in store.versions("code")] == [2, 4, 5]
    assert main(["gc", "--store", str(store.root), "--name", "code", "--keep", "1", "--grace-seconds", "0"]) == 0
    out = capsys.readouterr().out
    assert "removed versions 4 (kept 2, 5), 1 unfinished builds" in out
    assert [v.version for v in store.versions("code")] == [2, 5]
    assert write_datastore(store, "code", docs[:2], hidden[:2], loaded.info).version == 6  # numbering never reuses
    with pytest.raises(SpecstoreError, match="--keep must be at least 1"):
        collect(store, "code", keep=0)
