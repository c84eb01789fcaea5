"""Scale-out: a suffix array built in shards (``--sa-shard-tokens``) answers like one array over
the whole stream, the runtime opens it and REST decodes the same; the multi-processing
DirectRunner builds the same content as one process."""

from __future__ import annotations

import numpy as np
import pytest

from specstore.pipelines.build import build
from specstore.runtime.api import generate
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.models import load_model
from specstore.runtime.normaliser import NORMALISER_FILE
from specstore.runtime.sharded_suffix import ShardedSuffixIndex, shard_files
from specstore.runtime.store import Store
from specstore.runtime.suffix_array import SuffixIndex, build_suffix_array, join_documents
from tests.helpers import BUILD_OPTIONS, CORPUS_DIR

CORPUS = [str(CORPUS_DIR / n) for n in ("instruct.jsonl", "chat.jsonl", "notes.txt", "code")]


def _index(docs) -> SuffixIndex:
    stream, _ = join_documents(docs)
    return SuffixIndex(stream, build_suffix_array(stream))


def _same_answers(one: SuffixIndex, sharded: ShardedSuffixIndex, docs, rng) -> None:
    assert len(one) == len(sharded)
    for _ in range(200):
        d = docs[rng.integers(len(docs))]
        i = int(rng.integers(len(d)))
        pattern = d[i : i + int(rng.integers(1, 5))]
        assert sharded.positions(pattern).tolist() == one.positions(pattern).tolist()
        context = list(rng.integers(0, 6, 3)) + list(d[: i + 1])
        a, b = one.longest_suffix_match(context, 8, 1), sharded.longest_suffix_match(context, 8, 1)
        assert (a is None and b is None) or (a.length, a.count) == (b.length, b.count)
        if a is not None:
            assert sharded.continuations(b, 4).tolist() == one.continuations(a, 4).tolist()
            assert sharded.continuations(b, 4, 3).tolist() == one.continuations(a, 4, 3).tolist()
            assert len(sharded.continuations(b, 4, 3, spread=True)) == min(3, a.count)


def test_sharded_index_answers_like_one_array():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 6, rng.integers(1, 30)).astype(np.int32) for _ in range(40)]
    cuts = [0, 7, 8, 25, 40]
    sharded = ShardedSuffixIndex([_index(docs[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)])
    _same_answers(_index(docs), sharded, docs, rng)


def _rows(store: Store, m) -> dict:
    return store.open_table(m.tokens_table).to_arrow().sort_by("offset").to_pydict()


def _compare_builds(tiny_model_dir, tmp_path, **sharded_options):
    store = Store(tmp_path / "s", create=True)
    one = build(store, "one", CORPUS, model=tiny_model_dir, **BUILD_OPTIONS).manifest
    two = build(store, "two", CORPUS, model=tiny_model_dir, sa_shard_tokens=120, **BUILD_OPTIONS, **sharded_options).manifest
    a, b = _rows(store, one), _rows(store, two)
    for column in ("doc_id", "position", "offset", "token_id", "continuation", "continuation_len"):
        assert a[column] == b[column], column
    np.testing.assert_allclose(np.asarray(a["embedding"]), np.asarray(b["embedding"]), atol=1e-5)
    info = load_model(tiny_model_dir, dtype="float32").info
    ds_one, ds_two = Datastore.open(store, "one", info), Datastore.open(store, "two", info)
    assert isinstance(ds_two.suffix, ShardedSuffixIndex) and len(ds_two.suffix.shards) > 2
    assert sum(k.endswith("suffix_array.npy") for k in two.files) == len(ds_two.suffix.shards)
    stream = np.concatenate([np.asarray(s.stream) for s in ds_two.suffix.shards])
    np.testing.assert_array_equal(stream, np.asarray(ds_one.suffix.stream))
    docs = [np.asarray(d, dtype=np.int32) for d in np.split(stream, np.flatnonzero(stream == -1) + 1) if len(d) > 1]
    docs = [d[d >= 0] for d in docs]
    _same_answers(ds_one.suffix, ds_two.suffix, docs, np.random.default_rng(1))
    loaded = load_model(tiny_model_dir, dtype="float32")
    for prompt in ("Write a function that adds two numbers.", "def add(a, b):"):
        want = generate(loaded.model, loaded.tokenizer, prompt, make_drafter("rest", ds_one), 24).token_ids
        assert generate(loaded.model, loaded.tokenizer, prompt, make_drafter("rest", ds_two), 24).token_ids == want
    return store


def test_sharded_build_equals_one_array(tiny_model_dir, tmp_path):
    _compare_builds(tiny_model_dir, tmp_path)


def test_append_onto_shards_equals_a_full_sharded_build(tiny_model_dir, tmp_path):
    store = Store(tmp_path / "s", create=True)
    parent = build(store, "p", CORPUS[:2], model=tiny_model_dir, sa_shard_tokens=150, **BUILD_OPTIONS).manifest
    parent_files = store.files_dir("p", parent.build_id)
    with pytest.raises(SpecstoreError, match="keeps the parent's suffix-array layout"):
        build(store, "p", CORPUS, model=tiny_model_dir, mode="append", sa_shard_tokens=500, **BUILD_OPTIONS)
    appended = build(store, "p", CORPUS, model=tiny_model_dir, mode="append", **BUILD_OPTIONS).manifest
    assert appended.settings["sa_shard_tokens"] == 150 and appended.lineage.added_documents > 0
    reference = build(Store(tmp_path / "r", create=True), "p", CORPUS, model=tiny_model_dir, sa_shard_tokens=150,
                      normaliser=parent_files / NORMALISER_FILE, **BUILD_OPTIONS).manifest
    files, ref_files = store.files_dir("p", appended.build_id), Store(tmp_path / "r").files_dir("p", reference.build_id)
    names = sorted(str(f.relative_to(files)) for f in shard_files(files))
    assert names == sorted(str(f.relative_to(ref_files)) for f in shard_files(ref_files)) and len(names) > len(shard_files(parent_files))
    for name in names:
        np.testing.assert_array_equal(np.load(files / name), np.load(ref_files / name), err_msg=name)
    a, b = _rows(store, appended), _rows(Store(tmp_path / "r"), reference)
    for column in ("doc_id", "position", "offset", "token_id", "continuation", "continuation_len"):
        assert a[column] == b[column], column
    # the parent's untouched shards were reused: linked or copied, byte for byte
    parent_names = [str(f.relative_to(parent_files)) for f in shard_files(parent_files)]
    reused = [n for n in parent_names if (files / n).read_bytes() == (parent_files / n).read_bytes()]
    last_shard = parent_names[-1].rsplit("/", 1)[0]
    assert reused == [n for n in parent_names if not n.startswith(last_shard + "/")]  # the last took new documents: rebuilt
    Datastore.open(store, "p@2")  # every file verifies against the manifest's checksums


@pytest.mark.slow
def test_multi_processing_sharded_build_equals_single_process(tiny_model_dir, tmp_path):
    _compare_builds(tiny_model_dir, tmp_path, beam_args=["--direct_running_mode=multi_processing", "--direct_num_workers=2"])
