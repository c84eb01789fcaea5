"""Scheduled rebuilds: an unchanged corpus (same content hashes), settings and model create no
new version and say so; a changed corpus creates exactly one; --force rebuilds anyway."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specstore.pipelines.build import build
from specstore.runtime.cli import main
from specstore.runtime.store import Store
from tests.helpers import make_tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "corpus"
OPTIONS = dict(pca_dims=8, continuation_length=4, batch_tokens=256, max_doc_tokens=96, progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def test_unchanged_corpus_makes_no_new_version(tiny, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(FIXTURES / "instruct.jsonl", corpus)
    store = Store(tmp_path / "s", create=True)
    first = build(store, "r", [str(corpus)], model=tiny, **OPTIONS)
    assert not first.unchanged and first.manifest.version == 1
    again = build(store, "r", [str(corpus)], model=tiny, tag="prod", **OPTIONS)
    assert again.unchanged and again.manifest.version == 1
    assert [v.version for v in store.versions("r")] == [1] and store.resolve("r@prod").version == 1
    # the same content under another path is the same corpus
    moved = tmp_path / "moved.jsonl"
    shutil.copy(corpus, moved)
    assert build(store, "r", [str(moved)], model=tiny, **OPTIONS).unchanged
    # a changed setting or a changed corpus makes one new version
    assert build(store, "r", [str(corpus)], model=tiny, **(OPTIONS | {"pca_dims": 4})).manifest.version == 2
    argv = ["build", "--store", str(store.root), "--name", "r", "--corpus", str(corpus), "--model", tiny, "--pca-dims", "4",
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
