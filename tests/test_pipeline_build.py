"""The whole build on a fixture corpus with a tiny random model: the Beam graph under a
TestPipeline, table rows against the stream and suffix array, embeddings against a fresh
forward, versions and tags, the CLI path, and one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import apache_beam as beam
import numpy as np
import pytest
import torch
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from specstore.pipelines.build import build
from specstore.pipelines.corpus import read_records, resolve_sources
from specstore.pipelines.plan import plan_build
from specstore.pipelines.render import Document, prepare
from specstore.pipelines.transforms import expand_build
from specstore.runtime.cli import main
from specstore.runtime.datastore import Datastore
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.forward import hidden_states
from specstore.runtime.models import load_model
from specstore.runtime.normaliser import NORMALISER_FILE, Normaliser
from specstore.runtime.store import Store
from specstore.runtime.suffix_array import SuffixIndex
from specstore.schemas.tables import PAD_TOKEN
from tests.helpers import BUILD_OPTIONS, CORPUS_DIR

CORPUS = [str(CORPUS_DIR / n) for n in ("instruct.jsonl", "chat.jsonl", "notes.txt", "code")]


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    """A store with version 1 built from the fixture corpus through a TestPipeline."""
    store = Store(tmp_path_factory.mktemp("store") / "s", create=True)
    result = build(store, "fix", CORPUS, model=tiny_model_dir, test_pipeline=BeamTestPipeline(), **BUILD_OPTIONS)
    return store, result


def _expected_documents(tiny_model_dir: str) -> list[Document]:
    loaded = load_model(tiny_model_dir, dtype="float32")
    docs = []
    for source in resolve_sources(CORPUS):
        for record in read_records(source):
            docs += [d for d in prepare(record, source.format, loaded.tokenizer, max_doc_tokens=96) if isinstance(d, Document)]
    return docs


def test_graph_under_test_pipeline(tiny_model_dir, tmp_path):
    store = Store(tmp_path / "s", create=True)
    plan = plan_build(store, "fix", CORPUS, model=tiny_model_dir, **BUILD_OPTIONS)
    expected = _expected_documents(tiny_model_dir)
    with BeamTestPipeline() as p:
        out = expand_build(p, plan)
        assert_that(out.documents | beam.Map(lambda d: (d.doc_id, len(d.tokens))), equal_to([(d.doc_id, len(d.tokens)) for d in expected]))
        assert_that(out.rejected, equal_to([]), label="NoRejections")
        assert_that(
            out.summary | beam.Map(lambda s: (s.num_documents, s.num_tokens, s.num_rows)),
            equal_to([(len(expected), sum(len(d.tokens) for d in expected), sum(len(d.tokens) for d in expected))]),
            label="SummaryCounts",
        )
    assert plan.summary_path.is_file()
    assert not store.versions("fix")  # the pipeline alone commits nothing


def test_rows_match_stream_and_suffix_array(built, tiny_model_dir):
    store, result = built
    m = result.manifest
    assert m.version == 1 and m.num_rejected == 0
    assert sum(s.num_records for s in m.sources) == 4 + 3 + 1 + 2
    files = store.files_dir("fix", m.build_id)
    assert not (files / "_staging").exists()
    index = SuffixIndex.load(files)
    stream = np.asarray(index.stream)
    rows = store.open_table(m.tokens_table).to_arrow().sort_by("offset").to_pydict()
    assert len(rows["offset"]) == m.num_tokens == int((stream != PAD_TOKEN).sum())
    assert stream[rows["offset"]].tolist() == rows["token_id"]
    # documents lie in the stream in doc_id order, each followed by one separator
    starts = [o for o, p in zip(rows["offset"], rows["position"], strict=True) if p == 0]
    doc_ids = [d for d, p in zip(rows["doc_id"], rows["position"], strict=True) if p == 0]
    assert doc_ids == sorted(doc_ids) and len(doc_ids) == m.num_documents
    expected = _expected_documents(tiny_model_dir)
    assert [d.doc_id for d in expected] == doc_ids
    for d, start in zip(expected, starts, strict=True):
        assert stream[start : start + len(d.tokens)].tolist() == d.tokens.tolist()
        assert stream[start + len(d.tokens)] == PAD_TOKEN
    for off, cont, num in zip(rows["offset"], rows["continuation"], rows["continuation_len"], strict=True):
        nxt = stream[off + 1 : off + 1 + 4].tolist()
        real = nxt[: nxt.index(PAD_TOKEN)] if PAD_TOKEN in nxt else nxt
        assert cont == real + [65535] * (4 - len(real)) and num == len(real)  # uint16, padded with 65535
    # every n-gram of every document is found exactly where a brute-force scan finds it
    for n in (1, 2, 3, 5):
        grams = {tuple(d.tokens[i : i + n].tolist()) for d in expected for i in range(len(d.tokens) - n + 1)}
        windows = np.lib.stride_tricks.sliding_window_view(stream, n)
        for g in grams:
            brute = np.flatnonzero((windows == np.array(g)).all(axis=1))
            assert index.positions(g).tolist() == brute.tolist()


def test_embeddings_equal_a_fresh_forward(built, tiny_model_dir):
    store, result = built
    m = result.manifest
    normaliser = Normaliser.load(store.files_dir("fix", m.build_id) / NORMALISER_FILE)
    assert normaliser.dims == 8
    model = load_model(tiny_model_dir, dtype="float32").model
    table = store.open_table(m.tokens_table).to_arrow().sort_by("offset").to_pydict()
    scales = np.asarray(m.dense.scales)
    emb = np.asarray(table["embedding"]) / scales  # int8 codes: code / scale is the vector, to half a step
    for d in _expected_documents(tiny_model_dir):
        sel = np.asarray(table["doc_id"]) == d.doc_id
        fresh = normaliser.apply(hidden_states(model, torch.tensor([d.tokens.tolist()]))[0].numpy())
        np.testing.assert_allclose(emb[sel], fresh, atol=2e-4 + 0.5 / scales.min())
    np.testing.assert_allclose(m.domain_centroid, emb.mean(axis=0), atol=0.5 / scales.min())  # of the float vectors


def test_second_version_tags_and_cli(built, tiny_model_dir, capsys):
    store, first = built
    assert Datastore.open(store, "fix", dense=False).record.version == 1
    store.set_tag("fix@1", "stable")
    code = main(["build", "--store", str(store.root), "--name", "fix", "--corpus", CORPUS[0], CORPUS[2], "--model", tiny_model_dir,
                 "--pca-dims", "8", "--continuation-length", "4", "--tag", "prod", "--direct_num_workers=1"])
    assert code == 0
    assert "fix@2 (tag prod)" in capsys.readouterr().out
    assert [v.version for v in store.versions("fix")] == [1, 2]
    assert store.resolve("fix@prod").version == 2 and store.resolve("fix@stable").version == 1
    assert store.resolve("fix").version == 2
    info = load_model(tiny_model_dir, dtype="float32").info
    old = Datastore.open(store, "fix@1", info)  # its own files, all checksums verified
    assert old.manifest.build_id == first.manifest.build_id and len(old.dense) == first.manifest.dense.num_rows
    assert len(old.suffix) == first.manifest.num_tokens + first.manifest.num_documents
    new = Datastore.open(store, "fix@prod", info)
    assert new.manifest.parent_version == 1 and new.manifest.num_documents < first.manifest.num_documents


def test_bad_input_is_rejected_with_reasons(tiny_model_dir, tmp_path):
    good = [{"instruction": f"Question {i}?", "output": f"Answer {i}."} for i in range(3)]
    lines = [json.dumps(good[0]).encode(), b'{"instruction": "cut', json.dumps({"instruction": "", "output": "x"}).encode(),
             json.dumps(good[1]).encode(), b'{"instruction": "caf\xe9", "output": "x"}',
             json.dumps({"instruction": "long " * 200, "output": "y"}).encode(), b"[1, 2]", json.dumps(good[2]).encode()]
    corpus = tmp_path / "bad.jsonl"
    corpus.write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "empty.txt").write_text("  \n")
    result = build(tmp_path / "s", "bad", [str(corpus), str(tmp_path / "empty.txt")], model=tiny_model_dir, **BUILD_OPTIONS)
    m = result.manifest
    assert (m.num_documents, m.num_rejected) == (3, 6)
    assert [(s.num_records, s.num_rejected) for s in m.sources] == [(8, 5), (1, 1)]
    assert sum(s.num_records for s in m.sources) == m.num_documents + m.num_rejected
    rejected = [json.loads(line) for line in result.rejected_path.read_text().splitlines()]
    assert [(Path(r["source"]).name, r["record"]) for r in rejected] == [
        ("bad.jsonl", 1), ("bad.jsonl", 2), ("bad.jsonl", 4), ("bad.jsonl", 5), ("bad.jsonl", 6), ("empty.txt", 0)
    ]
    reasons = [r["reason"] for r in rejected]
    assert reasons[0].startswith("broken JSON") and reasons[1] == "empty instruction"
    assert reasons[2].startswith("not UTF-8") and reasons[3].startswith("too long: ")
    assert "not an object" in reasons[4] and reasons[5] == "empty record"
    assert rejected[0]["origin"] == "line 2"


def _cli_error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specstore")]  # (model loading may draw bars)
    assert len(lines) == 1 and lines[0].startswith("specstore: error: ") and "Traceback" not in err
    return lines[0]


def test_user_errors_are_one_line(tiny_model_dir, tmp_path, capsys):
    base = ["build", "--store", str(tmp_path / "s"), "--name", "x", "--pca-dims", "8", "--model", tiny_model_dir]
    assert "does not exist" in _cli_error(capsys, base + ["--corpus", str(tmp_path / "missing.jsonl")])
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = _cli_error(capsys, ["build", "--store", str(blocker / "s"), "--name", "x", "--corpus", CORPUS[0], "--model", tiny_model_dir])
    assert "not writable" in err
    assert "not a local Hugging Face model folder" in _cli_error(capsys, base[:-1] + [str(tmp_path), "--corpus", CORPUS[0]])
    with pytest.raises(SystemExit) as exc:  # argparse refuses an unknown --format before any work
        main(base + ["--corpus", CORPUS[0], "--format", "yaml"])
    assert exc.value.code == 2
    with pytest.raises(SpecstoreError, match="unknown corpus format 'yaml'"):
        build(tmp_path / "s", "x", [CORPUS[0]], fmt="yaml", model=tiny_model_dir)
    shutil.rmtree(tmp_path / "s", ignore_errors=True)
    all_bad = tmp_path / "none.jsonl"
    all_bad.write_text("{oops\n")
    assert "no usable documents" in _cli_error(capsys, base + ["--corpus", str(all_bad)])
