"""The build through Beam's portable job API with workers in separate processes (Beam's own
Python job service and an EXTERNAL worker pool, the path Dataflow, Flink and Spark take): the
version equals a DirectRunner build of the same corpus (stream, suffix array, normaliser, table)."""

from __future__ import annotations

import numpy as np

from specstore.runtime.cli import main
from specstore.runtime.normaliser import NORMALISER_FILE
from specstore.runtime.store import Store
from specstore.runtime.suffix_array import SA_FILE, STREAM_FILE
from tests.helpers import CORPUS_DIR
from tests.portable_helpers import portable_services

OPTIONS = ["--pca-dims", "8", "--continuation-length", "4", "--batch-tokens", "256", "--max-doc-tokens", "96", "--dtype", "float32"]


def _build(store, tiny_model_dir, *extra) -> int:
    corpus = [str(CORPUS_DIR / "instruct.jsonl"), str(CORPUS_DIR / "code")]
    return main(["build", "--store", str(store), "--name", "p", "--corpus", *corpus, "--model", tiny_model_dir, *OPTIONS, *extra])


def _version(root):
    store = Store(root)
    m = store.resolve("p@1").manifest
    files = store.files_dir("p", m.build_id)
    table = store.open_table(m.tokens_table).to_arrow().sort_by([("doc_id", "ascending"), ("position", "ascending")])
    return m, files, table


def test_portable_build_equals_the_direct_build(tiny_model_dir, tmp_path):
    assert _build(tmp_path / "direct", tiny_model_dir) == 0
    with portable_services(tmp_path) as beam_options:
        assert _build(tmp_path / "portable", tiny_model_dir, *beam_options) == 0
    (a, fa, ta), (b, fb, tb) = _version(tmp_path / "direct"), _version(tmp_path / "portable")
    assert (a.num_documents, a.num_tokens) == (b.num_documents, b.num_tokens)
    for name in (STREAM_FILE, SA_FILE):
        assert np.array_equal(np.load(fa / name), np.load(fb / name)), name
    na, nb = np.load(fa / NORMALISER_FILE), np.load(fb / NORMALISER_FILE)
    assert sorted(na.files) == sorted(nb.files)
    for key in na.files:
        np.testing.assert_allclose(na[key], nb[key], rtol=1e-4, atol=1e-5, err_msg=key)
    assert ta.column_names == tb.column_names
    for column in ("doc_id", "position", "token_id", "continuation", "continuation_len"):
        assert ta.column(column).equals(tb.column(column)), column
    np.testing.assert_allclose(np.stack(ta.column("embedding").to_numpy(zero_copy_only=False)),
                               np.stack(tb.column("embedding").to_numpy(zero_copy_only=False)), rtol=1e-3, atol=1e-4)
