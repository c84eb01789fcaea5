"""Scheduled rebuilds: an unchanged corpus (same content hashes), settings and model create no
new version and say so; a changed corpus creates exactly one; --force rebuilds anyway."""

from __future__ import annotations

import shutil

from specstore.pipelines.build import build
from specstore.runtime.cli import main
from specstore.runtime.store import Store
from tests.helpers import BUILD_OPTIONS, CORPUS_DIR


def test_unchanged_corpus_makes_no_new_version(tiny_model_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(CORPUS_DIR / "instruct.jsonl", corpus)
    store = Store(tmp_path / "s", create=True)
    first = build(store, "r", [str(corpus)], model=tiny_model_dir, **BUILD_OPTIONS)
    assert not first.unchanged and first.manifest.version == 1
    again = build(store, "r", [str(corpus)], model=tiny_model_dir, tag="prod", **BUILD_OPTIONS)
    assert again.unchanged and again.manifest.version == 1
    assert [v.version for v in store.versions("r")] == [1] and store.resolve("r@prod").version == 1
    # the same content under another path is the same corpus
    moved = tmp_path / "moved.jsonl"
    shutil.copy(corpus, moved)
    assert build(store, "r", [str(moved)], model=tiny_model_dir, **BUILD_OPTIONS).unchanged
    # a changed setting or a changed corpus makes one new version
    assert build(store, "r", [str(corpus)], model=tiny_model_dir, **(BUILD_OPTIONS | {"pca_dims": 4})).manifest.version == 2
    argv = ["build", "--store", str(store.root), "--name", "r", "--corpus", str(corpus), "--model", tiny_model_dir, "--pca-dims", "4",
            "--continuation-length", "4", "--batch-tokens", "256", "--max-doc-tokens", "96", "--dtype", "float32"]  # the API builds above ran in float32
    capsys.readouterr()
    assert main(argv) == 0
    assert "r@2: unchanged" in capsys.readouterr().out
    with open(corpus, "a") as out:
        out.write('{"instruction": "One more question?", "output": "One more answer."}\n')
    assert main(argv) == 0
    assert "r@3: " in capsys.readouterr().out
    assert main(argv) == 0 and "unchanged" in capsys.readouterr().out
    assert main(argv + ["--force"]) == 0 and "r@4: " in capsys.readouterr().out
    assert [v.version for v in store.versions("r")] == [1, 2, 3, 4]
