"""An interrupted rebuild, at any stage (inside the pipeline, after the tokens table's Lance
commit, at the catalogue commit), leaves the newest complete version intact and readable; the
next run completes the work, and gc removes what the failed runs left."""

from __future__ import annotations

from pathlib import Path

import pytest

from specstore.pipelines import commit, writers
from specstore.pipelines.build import build
from specstore.runtime.datastore import Datastore
from specstore.runtime.retention import collect
from specstore.runtime.store import Store
from tests.helpers import BUILD_OPTIONS, CORPUS_DIR


class Interrupted(Exception):
    pass


def _fail(*args, **kwargs):
    raise Interrupted("simulated crash")


STAGES = {
    "pipeline": (writers, "write_stream"),  # inside Beam, after embedding started
    "table committed": (commit, "checksum_files"),  # the new tokens table exists, the catalogue row does not
    "catalogue": (Store, "commit"),  # everything written, the single commit point fails
}


def test_interrupted_rebuild_at_any_stage(tiny_model_dir, tmp_path, monkeypatch):
    store = Store(tmp_path / "s", create=True)
    first = build(store, "i", [str(CORPUS_DIR / "instruct.jsonl")], model=tiny_model_dir, tag="prod", **BUILD_OPTIONS).manifest
    more = [str(CORPUS_DIR / "instruct.jsonl"), str(CORPUS_DIR / "chat.jsonl")]
    for stage, (owner, attr) in STAGES.items():
        for mode in ("append", "full"):
            with monkeypatch.context() as patch:
                patch.setattr(owner, attr, _fail)
                with pytest.raises(Exception) as info:
                    build(store, "i", more, model=tiny_model_dir, mode=mode, **BUILD_OPTIONS)
                assert "simulated crash" in str(info.value), stage
            assert [(v.version, v.build_id) for v in store.versions("i")] == [(1, first.build_id)], stage
            ds = Datastore.open(store, "i")  # newest complete version: every checksum verifies
            assert ds.record.version == 1 and len(ds.dense) == first.dense.num_rows
    # leftovers, invisible (a run that failed inside Beam before writing anything leaves none)
    leftovers = {p.name for p in (store.root / "_files" / "i").iterdir()} - {first.build_id}
    assert 2 * (len(STAGES) - 1) <= len(leftovers) <= 2 * len(STAGES)
    # the next run completes the work
    done = build(store, "i", more, model=tiny_model_dir, mode="append", **BUILD_OPTIONS).manifest
    assert done.version == 2 and done.lineage.added_sources == [str(Path(more[1]).resolve())]
    Datastore.open(store, "i@2")
    report = collect(store, "i", keep=1, grace_seconds=0)
    assert report.removed_versions == [] and set(report.orphan_builds) >= leftovers  # v1 is tagged
    assert sorted(p.name for p in (store.root / "_files" / "i").iterdir()) == sorted([first.build_id, done.build_id])
    assert len(list(store.root.glob("i__*.lance"))) == 2
