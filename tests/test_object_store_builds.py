"""Builds into an object store (a moto S3 server the tests start on 127.0.0.1): the CLI round
trip (build, append, versions, tag, gc, generate) with a version equal to a local build of the
same corpus; two concurrent builds of one name; a killed build leaves nothing visible; and the
build through Beam's portable path with separate workers into the bucket."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from specstore.runtime.api import generate
from specstore.runtime.cli import main
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.models import load_model
from specstore.runtime.normaliser import NORMALISER_FILE
from specstore.runtime.store import Store
from specstore.runtime.suffix_array import SA_FILE, STREAM_FILE
from tests.helpers import CORPUS_DIR
from tests.portable_helpers import portable_services
from tests.s3_helpers import s3_server

OPTIONS = ["--pca-dims", "8", "--continuation-length", "4", "--batch-tokens", "256", "--max-doc-tokens", "96", "--dtype", "float32"]
FIRST = [str(CORPUS_DIR / "instruct.jsonl"), str(CORPUS_DIR / "code")]
SECOND = [str(CORPUS_DIR / "chat.jsonl")]


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def _build(store: str, s3, model: str, corpus: list[str], *extra: str, name: str = "b") -> int:
    opts = s3.cli() if store.startswith("s3://") else []
    return main(["build", "--store", store, *opts, "--name", name, "--corpus", *corpus, "--model", model, *OPTIONS, *extra])


def _arrays(store: Store, ref: str) -> dict[str, np.ndarray]:
    """The version's stream, suffix array, normaliser arrays and table columns."""
    m = store.resolve(ref).manifest
    folder = Store.files_rel(m.name, m.build_id)
    out = {}
    for name in (STREAM_FILE, SA_FILE):
        out[name] = np.load(io.BytesIO(store.location.read_bytes(f"{folder}/{name}")))
    with np.load(io.BytesIO(store.location.read_bytes(f"{folder}/{NORMALISER_FILE}"))) as norm:
        out |= {f"normaliser.{k}": norm[k] for k in norm.files}
    table = store.open_table(m.tokens_table).to_arrow().sort_by([("doc_id", "ascending"), ("position", "ascending")])
    for column in ("doc_id", "position", "token_id", "continuation_len"):
        out[column] = table.column(column).to_numpy()
    out["continuation"] = np.stack(table.column("continuation").to_numpy(zero_copy_only=False))
    out["embedding"] = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        if key.startswith("normaliser.") or key == "embedding":
            np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-5, err_msg=key)
        else:
            assert np.array_equal(a[key], b[key]), key


def test_cli_round_trip_building_on_s3(s3, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECSTORE_FILE_CACHE", str(tmp_path / "cache"))
    uri, local = s3.uri(), str(tmp_path / "local")
    assert _build(uri, s3, tiny_model_dir, FIRST, "--tag", "prod") == 0
    assert "b@1 (tag prod)" in capsys.readouterr().out
    assert _build(local, s3, tiny_model_dir, FIRST) == 0
    store = Store(uri, storage_options=s3.options)
    _assert_same(_arrays(store, "b@1"), _arrays(Store(local), "b@1"))
    assert not list(store.location.walk(f"{Store.files_rel('b', store.resolve('b@1').build_id)}/_staging"))

    # append: only the new source, on top of the parent's rows, stream and normaliser
    assert _build(uri, s3, tiny_model_dir, FIRST + SECOND, "--append") == 0
    out = capsys.readouterr().out
    assert "b@2: " in out and "added by append" in out
    assert _build(local, s3, tiny_model_dir, FIRST + SECOND, "--append") == 0
    _assert_same(_arrays(store, "b@2"), _arrays(Store(local), "b@2"))
    v2 = store.resolve("b@2").manifest
    assert v2.lineage.mode == "append" and v2.num_documents > store.resolve("b@1").manifest.num_documents
    assert _build(uri, s3, tiny_model_dir, FIRST + SECOND, "--append") == 0  # nothing new
    assert "unchanged" in capsys.readouterr().out

    capsys.readouterr()
    assert main(["versions", "--store", uri, *s3.cli(), "--name", "b", "--json"]) == 0
    assert [v["version"] for v in json.loads(capsys.readouterr().out)] == [1, 2]
    assert main(["tag", "--store", uri, *s3.cli(), "--ref", "b@2", "--tag", "prod"]) == 0
    assert main(["verify", "--store", uri, *s3.cli(), "--ref", "b@2"]) == 0
    assert main(["gc", "--store", uri, *s3.cli(), "--name", "b", "--keep", "1", "--grace-seconds", "0"]) == 0
    assert "removed versions 1" in capsys.readouterr().out
    assert [v.version for v in store.versions("b")] == [2]
    # the appended version owns its files: it decodes after its parent was collected, like the local one
    loaded = load_model(tiny_model_dir, dtype="float32")
    ds = Datastore.open(store, "b@prod", loaded.info)
    prompt = "def add(a, b):"
    ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=16).token_ids
    for method in ("rest", "dresd"):
        assert generate(loaded.model, loaded.tokenizer, prompt, make_drafter(method, datastore=ds), max_new_tokens=16).token_ids == ar
    argv = ["generate", "--store", uri, *s3.cli(), "--datastore", "b@prod", "--method", "rest", "--model", tiny_model_dir,
            "--dtype", "float32", "--prompt", prompt, "--max-new-tokens", "16", "--json"]
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["token_ids"] == ar


def test_sparse_build_on_s3(s3, tiny_model_dir, tmp_path):
    uri = s3.uri()
    assert _build(uri, s3, tiny_model_dir, FIRST, "--index", "sparse", "--sa-shard-tokens", "100") == 0
    store = Store(uri, storage_options=s3.options)
    m = store.resolve("b").manifest
    assert m.index == "sparse" and any("/shards/" in f for f in m.files)
    assert main(["verify", "--store", uri, *s3.cli(), "--ref", "b@1"]) == 0


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "specstore.runtime.cli", *args]


def test_two_concurrent_builds_of_one_name_get_distinct_versions(s3, tiny_model_dir):
    uri = s3.uri()
    Store(uri, create=True, storage_options=s3.options)
    procs = [subprocess.Popen(_cli("build", "--store", uri, *s3.cli(), "--name", "c", "--corpus", *corpus, "--model", tiny_model_dir, *OPTIONS),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
             for corpus in (FIRST, SECOND)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    records = Store(uri, storage_options=s3.options).versions("c")
    assert [r.version for r in records] == [1, 2]
    assert sorted(len(r.manifest.sources) for r in records) == [1, 2]  # each build's own corpus, nothing lost or mixed
    assert len({r.build_id for r in records}) == 2


def test_a_killed_build_leaves_no_visible_version(s3, tiny_model_dir, tmp_path):
    uri = s3.uri()
    assert _build(uri, s3, tiny_model_dir, SECOND) == 0
    store = Store(uri, storage_options=s3.options)
    first = store.resolve("b").build_id
    proc = subprocess.Popen(_cli("build", "--store", uri, *s3.cli(), "--name", "b", "--corpus", *FIRST, "--model", tiny_model_dir, *OPTIONS),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:  # until the build has written files of its own
            if any(e != first for e, _ in store.location.list_dir("_files/b")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the build finished before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert [r.build_id for r in store.versions("b")] == [first]
    assert Datastore.open(store, "b", dense=False).ref == "b@1"


@pytest.mark.slow
def test_portable_build_into_s3_equals_the_direct_build(s3, tiny_model_dir, tmp_path):
    uri, local = s3.uri(), str(tmp_path / "local")
    assert _build(local, s3, tiny_model_dir, FIRST) == 0
    with portable_services(tmp_path) as beam_options:
        assert _build(uri, s3, tiny_model_dir, FIRST, *beam_options) == 0
    _assert_same(_arrays(Store(uri, storage_options=s3.options), "b@1"), _arrays(Store(local), "b@1"))


def test_crashed_build_on_s3_resumes(s3, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """--resume in a bucket: the crashed build's staged objects are copied into the new build,
    which equals an uninterrupted one, and the crashed build's objects go."""
    from specstore.pipelines import steps

    monkeypatch.setenv("SPECSTORE_FILE_CACHE", str(tmp_path / "cache"))
    uri = s3.uri()
    store = Store(uri, storage_options=s3.options)
    original, count = steps.EmbedFn.process, {"n": 0}

    def crash_after_two(self, docs, total=None):
        if count["n"] >= 2:
            raise RuntimeError("injected crash")
        count["n"] += 1
        yield from original(self, docs, total)

    with monkeypatch.context() as m:
        m.setattr(steps.EmbedFn, "process", crash_after_two)
        with pytest.raises(Exception, match="injected crash"):
            _build(uri, s3, tiny_model_dir, FIRST, "--batch-tokens", "64", name="rs")
    (crashed,) = [e for e, _ in store.location.list_dir("_files/rs")]
    staged = [rel for rel, is_file, _, _ in store.location.walk(f"_files/rs/{crashed}/_staging") if is_file and "/embed-" in rel]
    assert len(staged) == 2
    assert _build(uri, s3, tiny_model_dir, FIRST, "--batch-tokens", "64", "--resume", name="rs") == 0
    assert "reused from a killed build" in capsys.readouterr().out
    assert not list(store.location.walk(f"_files/rs/{crashed}"))
    assert _build(uri, s3, tiny_model_dir, FIRST, "--batch-tokens", "64", "--force", name="rs") == 0
    _assert_same(_arrays(store, "rs@1"), _arrays(store, "rs@2"))
