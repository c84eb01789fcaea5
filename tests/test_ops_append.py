"""Incremental versions: ``--append`` embeds only new documents on top of the parent's rows,
stream and normaliser, and equals a full build with that normaliser; ``--refit`` recomputes
everything over the parent's corpus plus the new one; the manifest records the lineage."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specstore.pipelines.build import build
from specstore.runtime.cli import main
from specstore.runtime.datastore import Datastore
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.normaliser import NORMALISER_FILE, Normaliser
from specstore.runtime.store import Store
from specstore.runtime.suffix_array import SA_FILE, STREAM_FILE
from tests.helpers import BUILD_OPTIONS, CORPUS_DIR

OLD = [str(CORPUS_DIR / n) for n in ("instruct.jsonl", "notes.txt")]
NEW = [str(CORPUS_DIR / n) for n in ("chat.jsonl", "code")]
ROW_COLUMNS = ("doc_id", "position", "offset", "token_id", "continuation", "continuation_len")


def _rows(store: Store, manifest) -> dict:
    return store.open_table(manifest.tokens_table).to_arrow().sort_by("offset").to_pydict()


def test_append_equals_a_full_build_with_the_same_normaliser(tiny_model_dir, tmp_path, capsys):
    store = Store(tmp_path / "s", create=True)
    parent = build(store, "a", OLD, model=tiny_model_dir, **BUILD_OPTIONS).manifest
    parent_files = store.files_dir("a", parent.build_id)
    # the append keeps the parent's settings even when others are given
    appended = build(store, "a", OLD + NEW, model=tiny_model_dir, mode="append", **(BUILD_OPTIONS | {"pca_dims": 4})).manifest
    assert appended.version == 2 and appended.parent_version == 1 and appended.pca_dims == 8
    lineage = appended.lineage
    assert lineage.mode == "append" and lineage.normaliser_from == parent.build_id
    assert lineage.added_sources == [str(Path(p).resolve()) for p in NEW]
    assert lineage.added_documents == appended.num_documents - parent.num_documents > 0
    assert lineage.added_tokens == appended.num_tokens - parent.num_tokens
    assert [s.path for s in appended.sources] == [str(Path(p).resolve()) for p in OLD + NEW]

    reference = build(Store(tmp_path / "r", create=True), "a", OLD + NEW, model=tiny_model_dir, normaliser=parent_files / NORMALISER_FILE, **BUILD_OPTIONS).manifest
    ref_store = Store(tmp_path / "r")
    files = store.files_dir("a", appended.build_id)
    ref_files = ref_store.files_dir("a", reference.build_id)
    for name in (STREAM_FILE, SA_FILE):
        np.testing.assert_array_equal(np.load(files / name), np.load(ref_files / name))
    np.testing.assert_array_equal(Normaliser.load(files / NORMALISER_FILE).components, Normaliser.load(parent_files / NORMALISER_FILE).components)
    a, b = _rows(store, appended), _rows(ref_store, reference)
    for column in ROW_COLUMNS:
        assert a[column] == b[column], column
    np.testing.assert_allclose(np.asarray(a["embedding"]), np.asarray(b["embedding"]), atol=1e-5)
    np.testing.assert_allclose(appended.domain_centroid, reference.domain_centroid, atol=1e-6)
    assert (appended.num_documents, appended.num_tokens) == (reference.num_documents, reference.num_tokens)
    assert [s.sha256 for s in appended.sources] == [s.sha256 for s in reference.sources]
    # the parent's rows were reused, not re-embedded: same bytes as in version 1
    old = _rows(store, parent)
    n = len(old["offset"])
    assert np.asarray(a["embedding"][:n]).tobytes() == np.asarray(old["embedding"]).tobytes()
    Datastore.open(store, "a@2")  # every file of the appended version verifies

    # nothing new to append: no new version; the CLI says so
    capsys.readouterr()
    argv = ["build", "--store", str(store.root), "--name", "a", "--corpus", *NEW, "--model", tiny_model_dir, "--append"]
    assert main(argv) == 0 and "a@2: unchanged" in capsys.readouterr().out

    # refit: the parent's corpus plus a new file, normaliser refitted
    extra = tmp_path / "extra.txt"
    extra.write_text("A short extra note about retrieval datastores and their versions.")
    assert main(argv[:6] + [str(extra), "--model", tiny_model_dir, "--refit", "--pca-dims", "8", "--continuation-length", "4",
                            "--batch-tokens", "256", "--max-doc-tokens", "96"]) == 0
    assert "a@3: " in capsys.readouterr().out
    refit = store.resolve("a@3").manifest
    assert refit.lineage.mode == "refit" and refit.lineage.normaliser_from is None and refit.parent_version == 2
    assert [s.path for s in refit.sources] == [s.path for s in appended.sources] + [str(extra.resolve())]
    refit_norm = Normaliser.load(store.files_dir("a", refit.build_id) / NORMALISER_FILE)
    assert not np.allclose(refit_norm.mean, Normaliser.load(parent_files / NORMALISER_FILE).mean)
    with pytest.raises(SpecstoreError, match="--append needs an existing version"):
        build(store, "other", NEW, model=tiny_model_dir, mode="append", **BUILD_OPTIONS)
