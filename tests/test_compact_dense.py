"""Compact dense versions (issue 13): int8 codes block-sorted by next token in memory-mapped
version files, continuations from the token stream, faiss indexes for large blocks.

Search meets a recall bound against exact float32 search and equals the exact int8 search in
blocks below the threshold; opening maps the files without reading the vectors; dresd and
respec stay identical to ar in float32 on a compact version, also with every dense file damaged
(and `specstore verify` names the file); an old-form version opens through its table and decodes
identically; an append's dense files equal a fresh build's of the concatenated corpus.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstore.pipelines.writers import ANN_RERANK
from specstore.runtime import dense_files as df
from specstore.runtime.api import generate
from specstore.runtime.cli import main
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.store import Store
from specstore.schemas.manifest import ModelInfo
from tests.datastore_helpers import PROMPTS, model_hidden, write_datastore

INFO = ModelInfo(model_id="m", revision="r", tokenizer_hash="t", vocab_size=6, hidden_size=16)
K = 10


def skewed_store(path, *, ann_threshold: int, compact: bool = True, seed: int = 0, table_format: int | None = None):
    """8 documents of 300 tokens over a 6-token vocabulary, token 0 half of them (one large
    block), with random hidden states; returns (store, manifest, docs, hiddens)."""
    rng = np.random.default_rng(seed)
    docs = [rng.choice(6, size=300, p=[0.5, 0.2, 0.1, 0.1, 0.05, 0.05]).tolist() for _ in range(8)]
    hiddens = [rng.normal(size=(300, 16)) for _ in docs]
    store = Store(path, create=True)
    manifest = write_datastore(store, "code", docs, hiddens, INFO, pca_dims=8, continuation_length=5, compact=compact,
                               ann_threshold=ann_threshold, table_format=table_format)
    return store, manifest, docs, hiddens


def rows_by_block(ds, docs, hiddens):
    """Exact reference rows: per next token, (stream positions, float32 vectors) of the positions it follows."""
    vectors = ds.normaliser.apply(np.concatenate(hiddens))
    positions, nexts, start = [], [], 0
    for d in docs:
        positions.append(start + np.arange(len(d) - 1))
        nexts.append(np.asarray(d[1:]))
        start += len(d) + 1
    keep = np.concatenate([np.append(np.ones(len(d) - 1, bool), False) for d in docs])
    positions, nexts, vectors = np.concatenate(positions), np.concatenate(nexts), vectors[keep]
    return {int(t): (positions[nexts == t], vectors[nexts == t]) for t in np.unique(nexts)}


def exact(vectors, positions, query, k):
    scores = vectors.astype(np.float64) @ query.astype(np.float64)
    order = np.lexsort((np.arange(len(scores)), -scores))[:k]
    return positions[order]


def test_search_meets_recall_and_is_exact_below_the_threshold(tmp_path):
    store, manifest, docs, hiddens = skewed_store(tmp_path, ann_threshold=500)
    assert manifest.dense.ann_blocks == [0]  # token 0's block (~1200 rows) is the only one above 500
    assert manifest.dense.ann_rerank == ANN_RERANK  # recorded, so that a later default does not change this version
    ds = Datastore.open(store, "code", INFO)
    blocks = rows_by_block(ds, docs, hiddens)
    assert len(ds.dense) == sum(len(p) for p, _ in blocks.values()) == manifest.dense.num_rows
    scales = np.asarray(manifest.dense.scales, np.float32)
    rng = np.random.default_rng(1)
    recall = {"ann": [], "int8": []}
    for _ in range(40):
        query = ds.normaliser.apply(rng.normal(size=(1, 16)))[0]
        for token, (positions, vectors) in blocks.items():
            found = ds.dense.search(torch.from_numpy(query), K, next_token=token)
            truth = exact(vectors, positions, query, K)
            share = len(set(found.rows.tolist()) & set(truth.tolist())) / len(truth)
            if token in manifest.dense.ann_blocks:
                recall["ann"].append(share)
            else:  # below the threshold: exactly the int8 search, in the same order
                codes = df.quantise(vectors, scales).astype(np.float32)
                assert found.rows.tolist() == exact(codes, positions, query / scales, K).tolist()
                recall["int8"].append(share)
    assert ds.dense._ann.loaded[0] is not None  # token 0's block was searched through its faiss index
    # measured on this fixture: 0.98 (faiss candidates reranked on int8) and 0.99 (int8, exact)
    assert np.mean(recall["ann"]) >= 0.85 and np.mean(recall["int8"]) >= 0.9


def test_prefetch_reads_every_index_in_the_background_and_changes_no_result(tmp_path):
    store, manifest, _, _ = skewed_store(tmp_path, ann_threshold=100)
    assert len(manifest.dense.ann_blocks) >= 2
    cold = Datastore.open(store, "code", INFO)
    assert cold.prefetching == [] and cold.dense._ann.loaded == {}  # nothing read until a search asks
    warm = Datastore.open(store, "code", INFO, prefetch=True)
    names = sorted(t.name for t in warm.prefetching)
    assert names == ["specstore-dense-prefetch", "specstore-prefetch"]
    for thread in warm.prefetching:
        thread.join(timeout=60)
        assert not thread.is_alive()
    loaded = warm.dense._ann.loaded
    assert sorted(loaded) == sorted(manifest.dense.ann_blocks) and all(v is not None for v in loaded.values())
    rng = np.random.default_rng(3)
    for _ in range(20):
        query = torch.from_numpy(warm.normaliser.apply(rng.normal(size=(1, 16)))[0])
        for token in range(6):
            a, b = cold.dense.search(query, K, next_token=token), warm.dense.search(query, K, next_token=token)
            assert a.rows.tolist() == b.rows.tolist() and np.array_equal(a.scores, b.scores)


def test_open_maps_the_files_without_reading_the_vectors(tmp_path, capsys):
    store, manifest, _, _ = skewed_store(tmp_path, ann_threshold=500)
    folder = store.files_dir("code", manifest.build_id)
    vectors = folder / df.VECTORS_FILE
    header = len(vectors.read_bytes()) - manifest.dense.num_rows * manifest.pca_dims
    data = bytearray(vectors.read_bytes())
    data[header:] = np.random.default_rng(0).integers(0, 256, size=len(data) - header, dtype=np.uint8).tobytes()
    vectors.write_bytes(bytes(data))  # every code replaced, same size: only a full hash sees it
    ds = Datastore.open(store, "code", INFO)  # maps: reads the header and the block table only
    assert isinstance(ds.dense._vectors, np.memmap) and isinstance(ds.dense.rows, np.memmap)
    assert str(ds.dense._vectors.filename) == str(vectors.resolve())
    assert main(["verify", "--store", str(store.root), "--ref", "code@1"]) == 2
    assert "dense/vectors.npy fails its checksum" in capsys.readouterr().err


def test_a_header_that_disagrees_with_the_manifest_is_refused(tmp_path):
    from specstore.runtime.errors import ChecksumError

    store, manifest, _, _ = skewed_store(tmp_path, ann_threshold=500)
    folder = store.files_dir("code", manifest.build_id)
    np.save(folder / df.POSITIONS_FILE, np.zeros(manifest.dense.num_rows, dtype=np.int32))  # same size, other type
    with pytest.raises(ChecksumError, match="positions.npy has dtype int32"):
        Datastore.open(store, "code", INFO)


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    """The tiny model (seed 3), its greedy answers to PROMPTS and those documents' hidden states."""
    from specstore.runtime.models import load_model
    from tests.helpers import make_tiny_model

    folder = tmp_path_factory.mktemp("own-model")
    loaded = load_model(str(make_tiny_model(folder / "model", seed=3)), dtype="float32", device="cpu")
    outputs = {p: generate(loaded.model, loaded.tokenizer, p, "ar", 24) for p in PROMPTS}
    docs = [r.prompt_ids + r.token_ids for r in outputs.values()]
    return loaded, {p: r.token_ids for p, r in outputs.items()}, docs, model_hidden(loaded.model, docs)


def own_store(path, own_model, **options):
    loaded, _, docs, hiddens = own_model
    store = Store(path, create=True)
    return store, write_datastore(store, "own", docs, hiddens, loaded.info, **options)


def decodes_like_ar(store, loaded, ar) -> dict[str, float]:
    ds = Datastore.open(store, "own", loaded.info)
    mats = {}
    for method in ("dresd", "respec"):
        drafter = make_drafter(method, ds)
        total = 0.0
        for prompt, expected in ar.items():
            result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=len(expected))
            assert result.token_ids == expected, (method, prompt)
            total += result.stats.mat
        mats[method] = total / len(ar)
    return mats


def test_compact_version_with_approximate_blocks_decodes_like_ar(tmp_path, own_model):
    loaded, ar, _, _ = own_model
    store, manifest = own_store(tmp_path, own_model, ann_threshold=3)
    assert manifest.dense is not None and manifest.dense.ann_blocks  # some blocks searched through faiss
    mats = decodes_like_ar(store, loaded, ar)
    ds = Datastore.open(store, "own", loaded.info)
    make_drafter("dresd", ds)
    for prompt in ar:
        generate(loaded.model, loaded.tokenizer, prompt, make_drafter("dresd", ds), max_new_tokens=8)
    assert any(v is not None for v in ds.dense._ann.loaded.values())  # decoding went through faiss
    assert mats["dresd"] > 1.5 and mats["respec"] > 1.5  # the datastore holds these answers: it drafts them


@pytest.mark.parametrize("damaged", ["vectors", "positions", "blocks", "ann"])
def test_damaged_dense_files_never_change_the_output(tmp_path, own_model, damaged, capsys):
    loaded, ar, _, _ = own_model
    store, manifest = own_store(tmp_path, own_model, ann_threshold=3)
    folder = store.files_dir("own", manifest.build_id)
    rel = {"vectors": df.VECTORS_FILE, "positions": df.POSITIONS_FILE, "blocks": df.BLOCKS_FILE,
           "ann": df.ann_file(manifest.dense.ann_blocks[0])}[damaged]
    path = folder / rel
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(0)
    start = 128 if rel.endswith(".npy") else 0  # keep a .npy header (a bad one is refused on open, named)
    for i in rng.choice(np.arange(start, len(data)), size=min(64, len(data) - start), replace=False):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    decodes_like_ar(store, loaded, ar)
    capsys.readouterr()
    assert main(["verify", "--store", str(store.root), "--ref", "own@1"]) == 2
    assert f"{rel} fails its checksum" in capsys.readouterr().err


def test_old_form_version_opens_through_its_table_and_decodes_like_ar(tmp_path, own_model):
    loaded, ar, _, _ = own_model
    store, manifest = own_store(tmp_path, own_model, compact=False)
    assert manifest.dense is None and not any("/dense/" in f for f in manifest.files)
    table = store.open_table(manifest.tokens_table)
    assert str(table.schema.field("embedding").type) == "fixed_size_list<item: float>[8]"
    ds = Datastore.open(store, "own", loaded.info)
    assert isinstance(ds.continuations, np.ndarray) and ds.continuations.shape == (manifest.num_tokens, 10)
    old = decodes_like_ar(store, loaded, ar)
    compact_store, _ = own_store(tmp_path / "compact", own_model)
    new = decodes_like_ar(compact_store, loaded, ar)
    assert abs(old["dresd"] - new["dresd"]) < 0.5  # same drafts up to int8 rounding of the rows


def test_compact_table_types(tmp_path):
    import lance
    import pyarrow as pa

    from specstore.pipelines.rows import continuations
    from specstore.schemas.tables import CONTINUATION_ZSTD, TABLE_FORMAT, ZSTD

    store, manifest, docs, _ = skewed_store(tmp_path, ann_threshold=500)
    assert manifest.dense.table_format == TABLE_FORMAT == 2
    table = store.open_table(manifest.tokens_table).to_arrow().sort_by("offset")
    assert table.schema.field("embedding").type == pa.list_(pa.int8(), 8)
    assert table.schema.field("continuation").type == pa.list_(pa.uint16())  # exactly 5 per row, compressed by Lance
    assert table.schema.field("token_id").type == pa.uint16()
    # plain Lance sees the encoding metadata the writer honoured
    schema = lance.dataset(str(store.table_uri(manifest.tokens_table))).schema
    for name in ("position", "offset", "token_id"):
        assert schema.field(name).metadata == {k.encode(): v.encode() for k, v in ZSTD.items()}, name
    assert schema.field("continuation").type.value_field.metadata == {k.encode(): v.encode() for k, v in CONTINUATION_ZSTD.items()}
    assert pa.compute.all(pa.compute.equal(pa.compute.list_value_length(table.column("continuation")), 5)).as_py()
    cont = np.asarray(table.column("continuation").to_pylist())
    lens = np.asarray(table.column("continuation_len").to_pylist())
    last = len(docs[0]) - 1  # the first document's last token: nothing follows, all padding
    assert lens[last] == 0 and np.all(cont[last] == 65535)
    assert cont[0].tolist() == docs[0][1:6] and lens[0] == 5
    # every row reads back exactly: its continuation, padded with 65535, and the other columns
    expected = np.concatenate([continuations(np.asarray(d), 5)[0] for d in docs])
    np.testing.assert_array_equal(cont, np.where(expected < 0, 65535, expected))
    assert table.column("token_id").to_pylist() == [t for d in docs for t in d]
    assert table.column("position").to_pylist() == [p for d in docs for p in range(len(d))]
    starts = np.cumsum([0] + [len(d) + 1 for d in docs[:-1]])  # each document, then a separator
    assert table.column("offset").to_pylist() == [int(s) + p for s, d in zip(starts, docs, strict=True) for p in range(len(d))]
    # the table's codes are the dense files' rows, in stream order
    codes = np.load(store.files_dir("code", manifest.build_id) / df.VECTORS_FILE)
    positions = np.load(store.files_dir("code", manifest.build_id) / df.POSITIONS_FILE)
    emb = np.asarray(table.column("embedding").to_pylist(), dtype=np.int8)
    offsets = np.asarray(table.column("offset").to_pylist())
    row_of = {int(o): i for i, o in enumerate(offsets)}
    assert np.array_equal(codes, emb[[row_of[int(p)] for p in positions]])


def table_bytes(store, manifest) -> int:
    folder = store.root / f"{manifest.tokens_table}.lance"
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_the_compressed_table_layout_holds_the_same_rows_in_fewer_bytes(tmp_path):
    first, m1, _, _ = skewed_store(tmp_path / "1", ann_threshold=500, table_format=1)
    second, m2, _, _ = skewed_store(tmp_path / "2", ann_threshold=500)
    assert (m1.dense.table_format, m2.dense.table_format) == (1, 2)
    a = first.open_table(m1.tokens_table).to_arrow().sort_by("offset")
    b = second.open_table(m2.tokens_table).to_arrow().sort_by("offset")
    assert str(a.schema.field("continuation").type) == "fixed_size_list<item: uint16>[5]"
    for name in a.column_names:
        assert a.column(name).to_pylist() == b.column(name).to_pylist(), name
    # 5 uint16 continuation tokens are 10 B a row uncompressed (layout 1); zstd takes most of it
    saved = (table_bytes(first, m1) - table_bytes(second, m2)) / m1.num_tokens
    assert saved > 6, saved


def test_a_compact_version_in_the_first_table_layout_opens_and_decodes_as_before(tmp_path, own_model):
    import pyarrow as pa

    from specstore.schemas.manifest import DenseFiles

    loaded, ar, _, _ = own_model
    store, manifest = own_store(tmp_path, own_model, ann_threshold=3, table_format=1)
    assert manifest.dense.table_format == 1
    recorded = manifest.dense.model_dump()
    del recorded["table_format"]  # a manifest written before the layout was recorded
    assert DenseFiles.model_validate(recorded).table_format == 1
    assert isinstance(store.open_table(manifest.tokens_table).schema.field("continuation").type, pa.FixedSizeListType)
    Datastore.open(store, "own", loaded.info, verify=True)
    new_store, _ = own_store(tmp_path / "new", own_model, ann_threshold=3)
    assert decodes_like_ar(store, loaded, ar) == decodes_like_ar(new_store, loaded, ar)  # the table is not on the search path


def test_an_append_keeps_its_compact_parents_table_layout(tiny_model_dir, tmp_path, monkeypatch):
    from dataclasses import replace

    from specstore.pipelines import build as build_module
    from specstore.pipelines.build import build
    from tests.helpers import BUILD_OPTIONS, CORPUS_DIR

    plan_build = build_module.plan_build
    with monkeypatch.context() as patch:  # the parent as compact builds before the second layout wrote it
        patch.setattr(build_module, "plan_build", lambda *a, **k: replace(plan_build(*a, **k), table_format=1))
        parent = build(tmp_path / "s", "a", [str(CORPUS_DIR / "notes.txt")], model=tiny_model_dir, **BUILD_OPTIONS).manifest
    assert parent.dense.table_format == 1
    appended = build(tmp_path / "s", "a", [str(CORPUS_DIR / "notes.txt"), str(CORPUS_DIR / "chat.jsonl")], model=tiny_model_dir,
                     mode="append", **BUILD_OPTIONS).manifest
    assert appended.dense.table_format == 1 and appended.num_tokens > parent.num_tokens
    ds = Datastore.open(tmp_path / "s", "a@2", verify=True)  # one table, one schema: the parent's rows and the new ones
    table = ds.store.open_table(appended.tokens_table).to_arrow()
    assert table.num_rows == appended.num_tokens and str(table.schema.field("continuation").type).startswith("fixed_size_list")


def test_append_dense_files_equal_a_fresh_build_and_reuse_untouched_indexes(tiny_model_dir, tmp_path):
    import os

    from specstore.pipelines.build import build
    from specstore.runtime.normaliser import NORMALISER_FILE
    from tests.helpers import BUILD_OPTIONS, CORPUS_DIR

    old = [str(CORPUS_DIR / n) for n in ("instruct.jsonl", "notes.txt")]
    (tmp_path / "new.txt").write_text("Quokka, the quokka, and the quokka.")  # a few tokens: most large blocks untouched
    new = [str(tmp_path / "new.txt")]
    options = BUILD_OPTIONS | {"ann_threshold": 20}
    store = Store(tmp_path / "s", create=True)
    parent = build(store, "a", old, model=tiny_model_dir, **options).manifest
    appended = build(store, "a", old + new, model=tiny_model_dir, mode="append", **BUILD_OPTIONS).manifest
    parent_files = store.files_dir("a", parent.build_id)
    ref_store = Store(tmp_path / "r", create=True)
    reference = build(ref_store, "a", old + new, model=tiny_model_dir, normaliser=parent_files / NORMALISER_FILE, **options).manifest
    assert appended.dense.ann_threshold == 20 and appended.dense.scales == reference.dense.scales
    assert appended.dense.ann_blocks == reference.dense.ann_blocks and parent.dense.ann_blocks
    files, ref_files = store.files_dir("a", appended.build_id), ref_store.files_dir("a", reference.build_id)
    for name in (df.POSITIONS_FILE, df.BLOCKS_FILE):
        np.testing.assert_array_equal(np.load(files / name), np.load(ref_files / name))
    codes, ref_codes = np.load(files / df.VECTORS_FILE).astype(int), np.load(ref_files / df.VECTORS_FILE).astype(int)
    assert np.abs(codes - ref_codes).max() <= 1  # float noise of another batching may round a code the other way
    # a large block the new rows do not touch keeps the parent's index file (linked, not rebuilt)
    blocks = {int(t): (s, e) for t, s, e in np.load(parent_files / df.BLOCKS_FILE)}
    new_blocks = {int(t): (s, e) for t, s, e in np.load(files / df.BLOCKS_FILE)}
    untouched = [t for t in parent.dense.ann_blocks if blocks[t][1] - blocks[t][0] == new_blocks[t][1] - new_blocks[t][0]]
    touched = [t for t in parent.dense.ann_blocks if t not in untouched]
    assert untouched and len(touched) < len(parent.dense.ann_blocks)
    for t in untouched:
        assert os.path.samefile(files / df.ann_file(t), parent_files / df.ann_file(t)) or \
            (files / df.ann_file(t)).read_bytes() == (parent_files / df.ann_file(t)).read_bytes()
    for t in touched:
        assert not os.path.samefile(files / df.ann_file(t), parent_files / df.ann_file(t))
    Datastore.open(store, "a@2", verify=True).load_dense()


def test_remote_compact_version_fetches_an_index_on_its_first_search(tmp_path, own_model, monkeypatch):
    from specstore.runtime.storage import Location
    from tests.s3_helpers import s3_server, upload_tree

    loaded, ar, _, _ = own_model
    local, manifest = own_store(tmp_path / "local", own_model, ann_threshold=3)
    monkeypatch.setenv("SPECSTORE_FILE_CACHE", str(tmp_path / "cache"))
    ann = {manifest.files[f"{Store.files_rel('own', manifest.build_id)}/{df.ann_file(t)}"].sha256 for t in manifest.dense.ann_blocks}

    def cached() -> set[str]:
        return {p.name for p in (tmp_path / "cache" / "objects").glob("*/*") if not p.name.endswith(".lock")}

    with s3_server() as s3:
        uri = s3.uri()
        upload_tree(local.root, Location.of(uri, s3.options))
        store = Store(uri, storage_options=s3.options)
        ds = Datastore.open(store, "own", loaded.info)
        assert not cached() & ann  # open fetched the mapped files, no index
        for prompt, expected in ar.items():
            assert generate(loaded.model, loaded.tokenizer, prompt, make_drafter("dresd", ds), max_new_tokens=len(expected)).token_ids == expected
        used = [t for t, index in ds.dense._ann.loaded.items() if index is not None]
        assert used and len(cached() & ann) == len(used)  # each index searched was fetched (and checked) once


def test_an_append_to_an_old_form_version_stays_in_the_old_form(tiny_model_dir, tmp_path, monkeypatch):
    from dataclasses import replace

    from specstore.pipelines import build as build_module
    from specstore.pipelines.build import build
    from tests.helpers import BUILD_OPTIONS, CORPUS_DIR

    plan_build = build_module.plan_build
    with monkeypatch.context() as patch:  # the parent as builds before the compact form wrote it
        patch.setattr(build_module, "plan_build", lambda *a, **k: replace(plan_build(*a, **k), compact=False))
        parent = build(tmp_path / "s", "a", [str(CORPUS_DIR / "notes.txt")], model=tiny_model_dir, **BUILD_OPTIONS).manifest
    assert parent.dense is None
    appended = build(tmp_path / "s", "a", [str(CORPUS_DIR / "notes.txt"), str(CORPUS_DIR / "chat.jsonl")], model=tiny_model_dir,
                     mode="append", **BUILD_OPTIONS).manifest
    assert appended.dense is None and appended.num_tokens > parent.num_tokens
    ds = Datastore.open(tmp_path / "s", "a@2", verify=True)  # one table, one (old) schema: every row loads
    assert isinstance(ds.continuations, np.ndarray) and len(ds.dense) == appended.num_tokens


@pytest.mark.slow
def test_default_model_compact_version_with_indexed_blocks_decodes_like_ar(tmp_path):
    """The real default model (SmolLM2-135M-Instruct), float32: a compact build whose frequent
    next tokens' blocks are searched through faiss; dresd and respec equal ar."""
    import json

    from specstore.pipelines.build import build
    from specstore.runtime.models import load_model

    corpus = tmp_path / "code.jsonl"
    rows = [
        {"instruction": "Write a Python function that returns the square of x.", "output": "def square(x):\n    return x * x"},
        {"instruction": "Write a Python function that returns the cube of x.", "output": "def cube(x):\n    return x * x * x"},
        {"instruction": "Sum a list in Python.", "input": "nums = [1, 2, 3]", "output": "total = sum(nums)\nprint(total)"},
    ]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = build(tmp_path / "s", "code", [str(corpus)], pca_dims=16, progress=False, ann_threshold=4).manifest
    assert manifest.dense is not None and manifest.dense.ann_blocks
    loaded = load_model(None, dtype="float32")
    ds = Datastore.open(tmp_path / "s", "code", loaded.info)
    for prompt in ("Write a Python function that returns the square of x.", "Sum a list in Python."):
        ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=24)
        for method in ("dresd", "respec"):
            assert generate(loaded.model, loaded.tokenizer, prompt, make_drafter(method, ds), max_new_tokens=24).token_ids == ar.token_ids
    assert any(index is not None for index in ds.dense._ann.loaded.values())  # faiss answered some searches



def test_converted_blocks_are_kept_within_their_budget_and_change_no_result(monkeypatch):
    """int8 rows of a block are converted to float32 once and reused by the next search of that
    block (least recently used dropped first, within CONVERTED_CACHE_BYTES); results equal those
    of a new index's first search."""
    from specstore.runtime import dense as dense_mod

    rng = np.random.default_rng(3)
    codes = rng.integers(-127, 128, size=(300, 8)).astype(np.int8)
    scales = np.full(8, 127.0, dtype=np.float32)
    blocks = {0: (0, 100), 1: (100, 220), 2: (220, 300)}
    rows = np.arange(300, dtype=np.int64)
    index = dense_mod.DenseIndex.from_blocks(codes, scales, rows, blocks)
    monkeypatch.setattr(dense_mod, "CONVERTED_CACHE_BYTES", 220 * 8 * 4)  # blocks 0 and 1 fit, not all three
    first = index._block_tensor(0, 100)
    assert index._block_tensor(0, 100) is first  # kept: the second search converts nothing
    index._block_tensor(100, 220)
    assert list(index._converted) == [(0, 100), (100, 220)] and index._converted_bytes == 220 * 8 * 4
    index._block_tensor(0, 100)  # used again: now the most recent
    index._block_tensor(220, 300)  # no room: the least recently used (block 1) goes
    assert list(index._converted) == [(0, 100), (220, 300)] and index._converted_bytes <= 220 * 8 * 4
    for token in (0, 1, 2, 0, 2, 1):
        q = torch.from_numpy(rng.normal(size=8).astype(np.float32))
        got = index.search(q, 5, next_token=token)
        want = dense_mod.DenseIndex.from_blocks(codes, scales, rows, blocks).search(q, 5, next_token=token)
        assert got.rows.tolist() == want.rows.tolist() and np.array_equal(got.scores, want.scores)
    monkeypatch.setattr(dense_mod, "CONVERTED_CACHE_BYTES", 10)  # a block larger than the budget is never kept
    fresh = dense_mod.DenseIndex.from_blocks(codes, scales, rows, blocks)
    fresh._block_tensor(0, 100)
    assert not fresh._converted and fresh._converted_bytes == 0


@pytest.mark.parametrize("compact", [True, False])
def test_search_hidden_finds_what_search_finds_through_the_kernel(tmp_path, monkeypatch, compact):
    """DenseIndex.search_hidden: the transform, an exact block's scan and its top k in one kernel
    call (gemm.dense_top; an approximate block: the query from it, then the index's candidates
    reranked in another, gemm.dense_rerank), with the rows and scores of
    ``search(normaliser.apply_torch(h))``; without the kernel, search itself."""
    from specstore.runtime import gemm

    store, manifest, docs, hiddens = skewed_store(tmp_path, ann_threshold=500, compact=compact)
    ds = Datastore.open(store, "code", INFO)
    calls = []
    real = gemm.dense_top
    monkeypatch.setattr(gemm, "dense_top", lambda *a, **k: calls.append(a[5] is None) or real(*a, **k))
    reranks, rerank = [], gemm.dense_rerank
    monkeypatch.setattr(gemm, "dense_rerank", lambda *a: reranks.append(a) or rerank(*a))
    rng = np.random.default_rng(5)
    for _ in range(20):
        hidden = torch.from_numpy(rng.normal(size=16).astype(np.float32))
        for h in (hidden, hidden.bfloat16()):
            for token in range(6):
                got = ds.dense.search_hidden(ds.normaliser, h, K, token)
                want = ds.dense.search(ds.normaliser.apply_torch(h), K, next_token=token)
                assert got.rows.tolist() == want.rows.tolist() and got.next_token == token
                np.testing.assert_allclose(got.scores, want.scores, rtol=1e-4, atol=1e-5)
    if gemm.has_dense():
        assert calls.count(False) > 0  # exact blocks scanned in the kernel
        assert calls.count(True) == (40 if compact else 0)  # the approximate block: its query from the kernel
        assert len(reranks) == calls.count(True)  # and its candidates reranked there
    monkeypatch.setattr(gemm, "has_dense", lambda lib=None: False)
    calls.clear()
    h = torch.from_numpy(rng.normal(size=16).astype(np.float32))
    assert ds.dense.search_hidden(ds.normaliser, h, K, 1).rows.tolist() == ds.dense.search(
        ds.normaliser.apply_torch(h), K, next_token=1).rows.tolist()
    assert calls == []
