"""Datastore.open: references, manifest checks naming the field, checksums, the dense index."""

import numpy as np
import pytest
import torch

from specstore.runtime.datastore import Datastore
from specstore.runtime.dense import DenseIndex
from specstore.runtime.errors import ChecksumError, DatastoreNotFoundError, ManifestMismatchError
from specstore.runtime.forward import hidden_states
from specstore.runtime.store import Store
from specstore.schemas.manifest import ModelInfo
from tests.datastore_helpers import (
    CHAT_RECORDS,
    CODE_RECORDS,
    pipeline_store,
    tiny_datastore,
    write_datastore,
)

INFO = ModelInfo(model_id="m", revision="r", tokenizer_hash="t", vocab_size=50, hidden_size=16)


def random_store(path, num_docs=4, length=30, versions=1):
    rng = np.random.default_rng(0)
    store = Store(path, create=True)
    manifests = []
    for _ in range(versions):
        docs = [[int(t) for t in rng.integers(0, 50, size=length)] for _ in range(num_docs)]
        hid = [rng.normal(size=(length, 16)) for _ in docs]
        manifests.append(write_datastore(store, "code", docs, hid, INFO, pca_dims=4, continuation_length=5))
    return store, manifests


def test_open_by_name_version_and_tag(tmp_path):
    store, (m1, m2) = random_store(tmp_path, versions=2)
    store.set_tag("code@1", "prod")
    assert Datastore.open(store, "code", INFO).manifest.build_id == m2.build_id
    assert Datastore.open(store, "code@1", INFO).manifest.build_id == m1.build_id
    ds = Datastore.open(str(tmp_path), "code@prod", INFO)
    assert ds.ref == "code@1" and ds.manifest.build_id == m1.build_id
    assert len(ds.suffix) == 4 * 31 and len(ds.dense) == 4 * 29  # a row per position a token follows
    # continuations come from the token stream the suffix array indexes, cut at the document's end
    stream = np.asarray(ds.suffix.stream)
    assert ds.continuations.draft(0, int(stream[1]), 4) == stream[2:6].tolist()
    assert ds.continuations.draft(27, int(stream[28]), 4) == [int(stream[29])]
    assert ds.continuations.draft(0, int(stream[1]) + 1, 4) == []  # not the token after it: nothing
    assert Datastore.open(store, "code", INFO, dense=False).dense is None


def test_batched_stream_continuations_equal_one_by_one():
    """``StreamContinuations.drafts`` (Python lists for a few positions, one gather for more) gives what ``draft`` gives per position: cut at
    a separator or an id outside the vocabulary, at the stream's end, nothing for a position
    outside the stream or whose next token is not the pending one; sharded streams too."""
    from types import SimpleNamespace

    from specstore.runtime.dense_files import StreamContinuations

    rng = np.random.default_rng(4)
    for trial in range(30):
        stream = rng.integers(-1, 12, size=int(rng.integers(1, 60))).astype(np.int32)  # -1: separators; 10, 11: outside
        shards = [stream] if trial % 3 else [stream[: len(stream) // 2], stream[len(stream) // 2 :]]
        suffix = SimpleNamespace(stream=stream) if len(shards) == 1 else SimpleNamespace(shards=[SimpleNamespace(stream=x) for x in shards])
        cont = StreamContinuations(suffix, vocab_size=10)
        positions = rng.integers(-3, len(stream) + 3, size=(3, 12, 40)[trial % 3])  # a few in lists, many in one gather
        for pending in {int(stream[min(max(p + 1, 0), len(stream) - 1)]) for p in positions} | {3}:
            for length in (0, 1, 4, 9):
                assert cont.drafts(positions, pending, length) == [cont.draft(int(p), pending, length) for p in positions]


def test_unknown_references_fail_clearly(tmp_path):
    store, _ = random_store(tmp_path)
    for ref, message in [("chat", "no datastore named 'chat'"), ("code@9", "no version 9"), ("code@prod", "no tag 'prod'")]:
        with pytest.raises(DatastoreNotFoundError, match=message):
            Datastore.open(store, ref, INFO)
    with pytest.raises(DatastoreNotFoundError, match="does not exist"):
        Datastore.open(tmp_path / "nowhere", "code")


@pytest.mark.parametrize("field", ["tokenizer_hash", "vocab_size", "hidden_size", "revision"])
def test_model_mismatch_names_the_field(tmp_path, field):
    store, _ = random_store(tmp_path)
    other = INFO.model_copy(update={field: 999 if isinstance(getattr(INFO, field), int) else "other"})
    with pytest.raises(ManifestMismatchError, match=f"'{field}'") as err:
        Datastore.open(store, "code", other)
    assert err.value.field == field


def test_corrupted_files_fail_their_checksum(tmp_path):
    store, (m,) = random_store(tmp_path)
    stream = store.files_dir("code", m.build_id) / "stream.npy"
    data = bytearray(stream.read_bytes())
    data[-3] ^= 0xFF  # same size, different content
    stream.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="stream.npy fails its checksum"):
        Datastore.open(store, "code", INFO, verify=True)  # full checksums on request
    table_file = next(k for k in m.files if k.endswith(".lance"))
    path = store.root / table_file
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ChecksumError, match="bytes, manifest says"):
        Datastore.open(store, "code", INFO, verify=False)  # sizes are checked even without hashing


def test_dense_search_is_exact_with_and_without_the_filter():
    rng = np.random.default_rng(1)
    emb = rng.normal(size=(500, 8)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    nxt = rng.integers(-1, 6, size=500)
    index = DenseIndex(emb, nxt)
    for _ in range(20):
        q = rng.normal(size=8).astype(np.float32)
        scores = emb @ q
        found = index.search(torch.from_numpy(q), 7)
        assert np.array_equal(found.rows, np.argsort(-scores)[:7])
        tok = int(rng.integers(0, 6))
        rows = np.flatnonzero(nxt == tok)
        found = index.search(q, 7, next_token=tok)
        assert np.array_equal(found.rows, rows[np.argsort(-scores[rows])][:7])
        assert np.allclose(found.scores, scores[found.rows])
    assert len(index.search(q, 5, next_token=1234)) == 0
    assert index.block_size(1234) == 0
    tok = int(nxt[0])
    assert len(index.search(q, 10_000, next_token=tok)) == index.block_size(tok) == int((nxt == tok).sum())


def test_dense_search_is_the_same_below_and_above_the_topk_cut(monkeypatch):
    """Blocks above TOPK_FROM rows cut with torch.topk first, smaller ones in numpy at once:
    both give the exact top k, ties broken by row (quantised scores make many ties)."""
    from specstore.runtime import dense as dense_mod

    rng = np.random.default_rng(2)
    emb = np.round(rng.normal(size=(6000, 4)), 1).astype(np.float32)  # coarse values: tied scores
    nxt = rng.integers(0, 2, size=6000)
    index = DenseIndex(emb, nxt)
    for _ in range(10):
        q = np.round(rng.normal(size=4), 1).astype(np.float32)
        tok = int(rng.integers(0, 2))
        rows = np.flatnonzero(nxt == tok)
        scores = emb[rows] @ q
        want = rows[np.lexsort((rows, -scores))][:9]
        monkeypatch.setattr(dense_mod, "TOPK_FROM", 4096)  # blocks of ~3,000 rows: numpy at once
        small = index.search(q, 9, next_token=tok)
        monkeypatch.setattr(dense_mod, "TOPK_FROM", 100)  # the same blocks through torch.topk first
        large = index.search(q, 9, next_token=tok)
        assert small.rows.tolist() == large.rows.tolist() == want.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dense_search_on_cuda_matches_cpu():
    rng = np.random.default_rng(2)
    emb = rng.normal(size=(2000, 16)).astype(np.float32)
    nxt = rng.integers(0, 4, size=2000)
    cpu, gpu = DenseIndex(emb, nxt), DenseIndex(emb, nxt, device="cuda")
    q = rng.normal(size=16).astype(np.float32)
    for tok in (None, 0, 3):
        assert np.array_equal(cpu.search(q, 10, tok).rows, gpu.search(torch.from_numpy(q).cuda(), 10, tok).rows)


def test_stored_vectors_equal_a_fresh_query_transform(tmp_path):
    store, loaded, manifest = tiny_datastore(tmp_path)
    ds = Datastore.open(store, "code", loaded.info)
    table = store.open_table(manifest.tokens_table).to_arrow().to_pylist()
    row = next(r for r in table if r["doc_id"] == 2 and r["position"] == 5)
    doc = [r["token_id"] for r in table if r["doc_id"] == 2]
    hidden = hidden_states(loaded.model, torch.tensor([doc[:6]]))[0, -1]  # the live query at that token
    query = ds.normaliser.apply_torch(hidden)
    scales = np.asarray(manifest.dense.scales)  # the table holds int8 codes: code / scale is the vector
    assert np.allclose(query.numpy(), np.asarray(row["embedding"]) / scales, atol=0.5 / scales.min() + 1e-4)
    found = ds.dense.search(query, 1, next_token=row["continuation"][0])
    assert found.rows[0] == row["offset"]  # row ids of a compact version are stream positions
    expected = [t for t in row["continuation"] if t != 65535]  # uint16, padded with 65535
    assert [expected[0]] + ds.continuations.draft(int(found.rows[0]), expected[0], 9) == expected


def check_methods_match_ar(ds, loaded, prompts, max_new_tokens) -> dict[str, float]:
    from specstore.runtime.api import generate
    from specstore.runtime.drafters.registry import make_drafter

    mats = {}
    for method in ("rest", "dresd"):
        drafter = make_drafter(method, ds)
        total = 0.0
        for prompt in prompts:
            ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=max_new_tokens).token_ids
            result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=max_new_tokens)
            assert result.token_ids == ar, (method, prompt)
            total += result.stats.mat
        mats[method] = total / len(prompts)
    return mats


def test_pipeline_built_datastore_opens_and_decodes(tmp_path):
    from specstore.runtime.models import load_model
    from tests.helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    loaded = load_model(str(model), dtype="float32", device="cpu")
    answers = {p: generate_text(loaded, p) for p in ("def add(a, b):", "Name three colours.")}
    records = [{"instruction": p, "output": a} for p, a in answers.items()]
    manifest = pipeline_store(tmp_path, str(model), records, "tiny")
    ds = Datastore.open(tmp_path / "store", "tiny@prod", loaded.info)
    # the stored vectors are what the runtime computes for a live query (same normaliser)
    table = ds.store.open_table(manifest.tokens_table).to_arrow().to_pylist()
    doc = [r for r in table if r["doc_id"] == table[0]["doc_id"]]
    doc.sort(key=lambda r: r["position"])
    ids = [r["token_id"] for r in doc]
    hidden = hidden_states(loaded.model, torch.tensor([ids[:10]]))[0, -1]
    scales = np.asarray(manifest.dense.scales)
    assert np.allclose(ds.normaliser.apply_torch(hidden).numpy(), np.asarray(doc[9]["embedding"]) / scales, atol=1e-3 + 0.5 / scales.min())
    mats = check_methods_match_ar(ds, loaded, list(answers), 16)
    assert mats["rest"] > 1.0 and mats["dresd"] > 1.0  # the datastore holds the model's own answers
    # another model with the same tokenizer is refused, naming the field
    other = load_model(str(make_tiny_model(tmp_path / "other", hidden=48)), dtype="float32", device="cpu")
    with pytest.raises(ManifestMismatchError, match="'hidden_size'"):
        Datastore.open(tmp_path / "store", "tiny", other.info)
    stream = ds.store.files_dir("tiny", manifest.build_id) / "stream.npy"
    stream.write_bytes(stream.read_bytes()[:-4] + b"\x01\x02\x03\x04")
    with pytest.raises(ChecksumError, match="stream.npy"):
        Datastore.open(tmp_path / "store", "tiny", loaded.info, verify=True)  # same size: only a hash sees it


def generate_text(loaded, prompt: str) -> str:
    from specstore.runtime.api import generate

    return generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=24).text


@pytest.mark.model
@pytest.mark.slow
def test_default_model_code_and_chat_datastores_match_ar(tmp_path):
    from specstore.runtime.models import load_model

    loaded = load_model(None, dtype="float32", device="cpu")
    for name, records, prompts in [
        ("code", CODE_RECORDS, ["Write a Python function that reverses a string."]),
        ("chat", CHAT_RECORDS, ["What is the capital of France?"]),
    ]:
        pipeline_store(tmp_path, None, records, name)
        ds = Datastore.open(tmp_path / "store", f"{name}@prod", loaded.info)
        mats = check_methods_match_ar(ds, loaded, prompts, 32)
        assert all(m >= 1.0 for m in mats.values())
