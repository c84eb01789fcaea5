"""Sparse-only datastores (``build --index sparse``): the tokenizer alone writes the same stream
and suffix array as a dense build (one array and shards), the model's weights are never loaded,
rest/pld/respec decode exactly as ar in float32 on them (respec without its dense source), dresd
is one clear error, and versions, append, routing and the unchanged check know the index kind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specstore.pipelines.build import build
from specstore.runtime.api import generate
from specstore.runtime.cli import main
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.models import load_model
from specstore.runtime.normaliser import NORMALISER_FILE
from specstore.runtime.sharded_suffix import shard_files
from specstore.runtime.store import Store
from specstore.runtime.suffix_array import INDEX_FILES
from tests.datastore_helpers import CODE_RECORDS, PROMPTS
from tests.helpers import BUILD_OPTIONS, CORPUS_DIR

CORPUS = [str(CORPUS_DIR / n) for n in ("instruct.jsonl", "chat.jsonl", "notes.txt", "code")]
OLD = [str(CORPUS_DIR / n) for n in ("instruct.jsonl", "notes.txt")]
NEW = [str(CORPUS_DIR / n) for n in ("chat.jsonl", "code")]
SHARD_TOKENS = 200
LOSSLESS = ("pld", "rest", "respec")


def _index_files(store: Store, manifest) -> list[Path]:
    files = store.files_dir(manifest.name, manifest.build_id)
    return shard_files(files) or [files / n for n in INDEX_FILES]


def _same_index(store_a: Store, a, store_b: Store, b) -> None:
    fa, fb = _index_files(store_a, a), _index_files(store_b, b)
    assert [p.name for p in fa] == [p.name for p in fb] and len(fa) >= 2
    for x, y in zip(fa, fb, strict=True):
        ax, ay = np.load(x), np.load(y)
        assert ax.dtype == ay.dtype and len(ax) > 0
        np.testing.assert_array_equal(ax, ay)


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    """One store holding a dense and a sparse build of the fixture corpus, each as one suffix
    array (``dense``, ``sparse``) and in shards (``dense-sh``, ``sparse-sh``)."""
    store = Store(tmp_path_factory.mktemp("sparse") / "s", create=True)
    built = {}
    for name, index, shards in [("dense", "dense", None), ("sparse", "sparse", None),
                                ("dense-sh", "dense", SHARD_TOKENS), ("sparse-sh", "sparse", SHARD_TOKENS)]:
        built[name] = build(store, name, CORPUS, model=tiny_model_dir, index=index, sa_shard_tokens=shards,
                            tag="prod", **BUILD_OPTIONS).manifest
    return store, built


@pytest.mark.parametrize("suffix", ["", "-sh"])
def test_sparse_build_has_the_dense_builds_stream_and_suffix_array(pair, suffix):
    store, built = pair
    dense, sparse = built["dense" + suffix], built["sparse" + suffix]
    assert (dense.index, sparse.index) == ("dense", "sparse")
    assert (sparse.num_documents, sparse.num_tokens) == (dense.num_documents, dense.num_tokens)
    assert sparse.model == dense.model  # the folder's fingerprint equals the loaded model's
    if suffix:
        assert len(shard_files(store.files_dir("sparse-sh", sparse.build_id))) > 2  # really sharded
    _same_index(store, dense, store, sparse)
    # nothing dense: no tokens table, no normaliser, none of them in the manifest
    files = store.files_dir(sparse.name, sparse.build_id)
    assert sparse.tokens_table == "" and not (files / NORMALISER_FILE).exists()
    assert not list(store.root.glob(f"{Store.table_name(sparse.name, sparse.build_id)}*"))
    assert not any(NORMALISER_FILE in f or ".lance" in f for f in sparse.files)
    assert any(NORMALISER_FILE in f for f in dense.files)


@pytest.mark.parametrize("shards", [None, SHARD_TOKENS])
def test_many_chunks_and_spill_files_build_the_same_index(pair, tiny_model_dir, tmp_path, monkeypatch, shards):
    """Workers read sources in chunks and spill tokens to staging files (so no stage holds the
    corpus): with chunks of 64 bytes, two files per chunk and tiny spill files, the
    stream, suffix array and first-token table equal those of the default build."""
    from specstore.pipelines import corpus, plan, steps

    monkeypatch.setattr(corpus, "CHUNK_BYTES", 64)
    monkeypatch.setattr(corpus, "CHUNK_FILES", 2)
    monkeypatch.setattr(steps, "SPILL_TOKENS", 50)
    planned, spilled = [], []
    monkeypatch.setattr(plan, "plan_chunks", lambda source: planned.extend(corpus.plan_chunks(source)) or corpus.plan_chunks(source))
    flush = steps.SpillTokensFn._flush
    monkeypatch.setattr(steps.SpillTokensFn, "_flush", lambda self: spilled.append(1) or flush(self))
    store, built = pair
    other = Store(tmp_path / "s", create=True)
    manifest = build(other, "sparse", CORPUS, model=tiny_model_dir, index="sparse", sa_shard_tokens=shards,
                     **BUILD_OPTIONS).manifest
    assert len(planned) > 6 and len(spilled) > 6  # really many chunks and spill files
    _same_index(store, built["sparse" + ("-sh" if shards else "")], other, manifest)
    assert not (other.files_dir("sparse", manifest.build_id) / "_staging").exists()  # spill files gone with the staging


def test_sparse_build_never_loads_the_model(tiny_model_dir, tmp_path, monkeypatch):
    import transformers

    from specstore.pipelines import workers
    from specstore.runtime import models

    def refuse(*args, **kwargs):
        raise AssertionError("a sparse build loaded the model")

    monkeypatch.setattr(workers, "shared_model", refuse)
    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    store = Store(tmp_path / "s", create=True)
    m = build(store, "nomodel", CORPUS, model=tiny_model_dir, index="sparse", **BUILD_OPTIONS).manifest
    assert m.index == "sparse" and m.num_tokens > 0 and m.model.tokenizer_hash
    with pytest.raises(AssertionError, match="loaded the model"):  # the patch is live: a dense build trips it
        build(store, "dense", CORPUS, model=tiny_model_dir, **BUILD_OPTIONS)


def test_dresd_on_a_sparse_version_is_one_clear_error(pair, tiny_model_dir, capsys):
    from specstore.runtime.engine import Engine

    store, _ = pair
    loaded = load_model(tiny_model_dir, dtype="float32", device="cpu")
    ds = Datastore.open(store, "sparse", loaded.info)  # dense=True: a sparse version opens without one
    assert ds.dense is None and ds.normaliser is None
    with pytest.raises(SpecstoreError, match=r"no dense index .* rebuild it with --index dense"):
        ds.load_dense()
    with pytest.raises(SpecstoreError, match=r"method 'dresd' needs a dense index, and datastore sparse@1 is sparse"):
        make_drafter("dresd", ds)
    with pytest.raises(SpecstoreError, match="method 'dresd' needs a dense index"):
        Engine(loaded, store, "sparse", method="dresd", refresh_seconds=None)
    engine = Engine(loaded, store, "sparse", method="rest", refresh_seconds=None)
    with pytest.raises(SpecstoreError, match="method 'dresd' needs a dense index"):
        engine.generate("def add(a, b):", method="dresd", max_new_tokens=4)
    capsys.readouterr()
    assert main(["generate", "--store", str(store.root), "--datastore", "sparse@prod", "--method", "dresd", "--prompt", "hi",
                 "--model", tiny_model_dir, "--dtype", "float32"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specstore: error: method 'dresd' needs a dense index"), captured.err
    assert "--index dense" in lines[0] and captured.out == ""


@pytest.fixture(scope="module")
def own_sparse(tmp_path_factory):
    """A sparse datastore of a tiny model's own greedy answers (so retrieval finds something),
    built by the pipeline from chat records; ``(store, loaded, ar_outputs)``."""
    from tests.helpers import make_tiny_model

    folder = tmp_path_factory.mktemp("own-sparse")
    path = make_tiny_model(folder / "model", seed=3)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    outputs = {p: generate(loaded.model, loaded.tokenizer, p, "ar", max_new_tokens=24) for p in PROMPTS}
    corpus = folder / "own.jsonl"
    corpus.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                       {"role": "assistant", "content": r.text}]}) + "\n"
                              for p, r in outputs.items()))
    store = Store(folder / "store", create=True)
    build(store, "own", [str(corpus)], model=str(path), index="sparse", **BUILD_OPTIONS)
    return store, loaded, {p: r.token_ids for p, r in outputs.items()}


def test_lossless_methods_on_a_sparse_version_equal_ar_float32(own_sparse):
    store, loaded, ar = own_sparse
    ds = Datastore.open(store, "own", loaded.info)
    mats = {}
    for method in LOSSLESS:
        drafter = make_drafter(method, ds)
        total = 0.0
        for prompt in PROMPTS:
            result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=24)
            assert result.token_ids == ar[prompt], (method, prompt)
            total += result.stats.mat
        mats[method] = total / len(PROMPTS)
    assert mats["rest"] > 1.2 and mats["respec"] > 1.2, mats  # the sparse index is really drafted from


def test_respec_on_a_sparse_version_skips_its_dense_source(own_sparse):
    from specstore.runtime.engine import Engine

    store, loaded, ar = own_sparse
    ds = Datastore.open(store, "own", loaded.info, dense=True)
    drafter = make_drafter("respec", ds, entropy_threshold=float("inf"))
    assert drafter.pool.dense is None and drafter.pool.suffix is ds.suffix
    prompt = PROMPTS[0]
    result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=24)
    assert result.token_ids == ar[prompt] and drafter.num_retrieved_steps > 0
    engine = Engine(loaded, store, "own", method="respec", refresh_seconds=None)  # opens dense=True: nothing to load
    served = engine.generate(prompt, max_new_tokens=24)
    assert served.token_ids == ar[prompt] and served.datastore == "own@1"


def test_routing_among_sparse_versions_is_lexical(own_sparse, tiny_model_dir, tmp_path):
    from specstore.runtime.engine import Engine

    store, loaded, ar = own_sparse
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "SELECT name FROM users WHERE id = 1;\n" * 20}) + "\n")
    build(store, "sql", [str(other)], model=str(Path(loaded.path)), index="sparse", **BUILD_OPTIONS)
    engine = Engine(loaded, store, "own,sql", method="rest", refresh_seconds=None)
    result = engine.generate(PROMPTS[0], max_new_tokens=24)
    assert result.datastore == "own@1" and result.routing["own@1"] > result.routing["sql@1"]
    assert result.token_ids == ar[PROMPTS[0]]
    assert engine.generate("SELECT name FROM users WHERE", max_new_tokens=4).datastore == "sql@1"


def test_versions_json_and_listing_show_the_index(pair, capsys):
    store, _ = pair
    capsys.readouterr()
    for name, index in (("dense", "dense"), ("sparse", "sparse")):
        assert main(["versions", "--store", str(store.root), "--name", name, "--json"]) == 0
        [row] = json.loads(capsys.readouterr().out)
        assert row["index"] == index and row["tags"] == ["prod"]
    assert main(["versions", "--store", str(store.root), "--name", "sparse"]) == 0
    header, line = capsys.readouterr().out.strip().splitlines()
    assert "index" in header.split() and "sparse" in line.split()


def test_dense_and_sparse_builds_of_one_corpus_are_not_unchanged(tiny_model_dir, tmp_path):
    store = Store(tmp_path / "s", create=True)
    dense = build(store, "x", OLD, model=tiny_model_dir, **BUILD_OPTIONS)
    sparse = build(store, "x", OLD, model=tiny_model_dir, index="sparse", **BUILD_OPTIONS)
    assert not sparse.unchanged and sparse.manifest.version == dense.manifest.version + 1
    again = build(store, "x", OLD, model=tiny_model_dir, index="sparse", **BUILD_OPTIONS)
    assert again.unchanged and again.manifest.version == sparse.manifest.version


@pytest.mark.parametrize("shards", [None, SHARD_TOKENS])
def test_append_onto_a_sparse_version_equals_a_full_sparse_build(tiny_model_dir, tmp_path, shards, capsys):
    store = Store(tmp_path / "s", create=True)
    parent = build(store, "a", OLD, model=tiny_model_dir, index="sparse", sa_shard_tokens=shards, **BUILD_OPTIONS).manifest
    capsys.readouterr()
    argv = ["build", "--store", str(store.root), "--name", "a", "--corpus", *OLD, *NEW, "--model", tiny_model_dir,
            "--append", "--max-doc-tokens", "96"]
    assert main(argv) == 0  # no --index: the parent's kind
    assert "(sparse)" in capsys.readouterr().out
    appended = store.resolve("a").manifest
    assert appended.index == "sparse" and appended.version == 2 and appended.lineage.mode == "append"
    assert appended.lineage.added_documents > 0 and appended.num_tokens > parent.num_tokens
    ref_store = Store(tmp_path / "r", create=True)
    reference = build(ref_store, "a", OLD + NEW, model=tiny_model_dir, index="sparse", sa_shard_tokens=shards, **BUILD_OPTIONS).manifest
    assert (appended.num_documents, appended.num_tokens) == (reference.num_documents, reference.num_tokens)
    _same_index(store, appended, ref_store, reference)
    ds = Datastore.open(store, "a", verify=True)  # every file of the appended version matches its checksum
    assert len(ds.suffix) == appended.num_tokens + appended.num_documents


def test_append_refuses_to_mix_index_kinds(tiny_model_dir, tmp_path, capsys):
    store = Store(tmp_path / "s", create=True)
    build(store, "sp", OLD, model=tiny_model_dir, index="sparse", **BUILD_OPTIONS)
    build(store, "de", OLD, model=tiny_model_dir, **BUILD_OPTIONS)
    with pytest.raises(SpecstoreError, match=r"--append keeps the parent's index kind: sp@1 is sparse, not dense"):
        build(store, "sp", OLD + NEW, model=tiny_model_dir, mode="append", index="dense", **BUILD_OPTIONS)
    capsys.readouterr()
    assert main(["build", "--store", str(store.root), "--name", "de", "--corpus", *OLD, *NEW, "--model", tiny_model_dir,
                 "--append", "--index", "sparse"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--append keeps the parent's index kind: de@1 is dense, not sparse" in lines[0]
    assert [r.version for r in store.versions("sp")] == [1] and [r.version for r in store.versions("de")] == [1]


def test_tags_and_gc_on_sparse_versions(tiny_model_dir, tmp_path, capsys):
    store = Store(tmp_path / "s", create=True)
    first = build(store, "g", OLD, model=tiny_model_dir, index="sparse", **BUILD_OPTIONS).manifest
    build(store, "g", OLD + NEW, model=tiny_model_dir, index="sparse", tag="prod", **BUILD_OPTIONS)
    assert store.resolve("g@prod").version == 2
    assert main(["gc", "--store", str(store.root), "--name", "g", "--keep", "1"]) == 0
    assert [r.version for r in store.versions("g")] == [2]
    assert not store.files_dir("g", first.build_id).exists()
    assert len(Datastore.open(store, "g@prod").suffix) > 0


@pytest.mark.model
@pytest.mark.slow
def test_default_model_sparse_datastore_lossless_methods_equal_ar_float32(tmp_path):
    """The real default model, float32, real code text in a sparse datastore built by the
    pipeline (tokenizer only): pld, rest and respec decode exactly what ar decodes."""
    corpus = tmp_path / "code.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CODE_RECORDS))
    store = Store(tmp_path / "store", create=True)
    build(store, "code", [str(corpus)], index="sparse", progress=False, tag="prod")
    loaded = load_model(None, dtype="float32", device="cpu")
    ds = Datastore.open(store, "code@prod", loaded.info)
    prompts = ["Write a Python function that reverses a string.", "Write a Python function that adds two numbers."]
    mats = {}
    for method in LOSSLESS:
        drafter = make_drafter(method, ds)
        for prompt in prompts:
            ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=48)
            result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=48)
            assert result.token_ids == ar.token_ids, (method, prompt)
            mats[method] = mats.get(method, 0.0) + result.stats.mat / len(prompts)
    assert mats["rest"] > 1.0, mats


def test_refit_keeps_the_parents_index_kind_unless_told(tiny_model_dir, tmp_path):
    store = Store(tmp_path / "s", create=True)
    build(store, "r", OLD, model=tiny_model_dir, index="sparse", **BUILD_OPTIONS)
    kept = build(store, "r", NEW, model=tiny_model_dir, mode="refit", **BUILD_OPTIONS).manifest
    assert kept.index == "sparse" and kept.lineage.mode == "refit" and len(kept.sources) == len(OLD + NEW)
    dense = build(store, "r", [], model=tiny_model_dir, mode="refit", index="dense", **BUILD_OPTIONS).manifest
    assert dense.index == "dense" and dense.num_tokens == kept.num_tokens and dense.tokens_table
    loaded = load_model(tiny_model_dir, dtype="float32", device="cpu")
    assert Datastore.open(store, "r", loaded.info).dense is not None
