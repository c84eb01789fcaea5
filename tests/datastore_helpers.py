"""Test helper: commit a small datastore version through the store contract, without the pipelines.

Writes exactly what a pipeline build commits (tokens table with the shared schema, stream and
suffix array, normaliser, manifest with checksums keyed relative to the store root, one catalogue
row), from given documents and their hidden states, so runtime tests need neither Beam nor a
build. The normaliser fit here is a plain numpy SVD, good enough for tests.
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import torch

from specstore.runtime.forward import hidden_states
from specstore.runtime.normaliser import NORMALISER_FILE, Normaliser
from specstore.runtime.store import Store, checksum_files
from specstore.runtime.suffix_array import build_suffix_array, join_documents, save_suffix_index
from specstore.schemas.manifest import Manifest, ModelInfo
from specstore.schemas.tables import PAD_TOKEN, tokens_schema


def fit_normaliser(hidden: np.ndarray, dims: int) -> Normaliser:
    mean, std = hidden.mean(0), hidden.std(0) + 1e-3
    z = (hidden - mean) / std
    pca_mean = z.mean(0)
    _, _, vt = np.linalg.svd(z - pca_mean, full_matrices=False)
    comps = np.zeros((dims, hidden.shape[1]))
    comps[: min(dims, vt.shape[0])] = vt[:dims]
    return Normaliser(mean.astype(np.float64), std.astype(np.float64), comps, pca_mean.astype(np.float64))


def model_hidden(model, docs: list[list[int]]) -> list[np.ndarray]:
    """Last-layer hidden state at every position of each document (one forward per document)."""
    return [hidden_states(model, torch.tensor([d]))[0].numpy() for d in docs]


def write_datastore(
    store: Store,
    name: str,
    docs: list[list[int]],
    hiddens: list[np.ndarray],
    info: ModelInfo,
    *,
    pca_dims: int = 8,
    continuation_length: int = 10,
    tag: str | None = None,
) -> Manifest:
    build_id = Store.new_build_id()
    files = store.files_dir(name, build_id)
    stream, starts = join_documents(docs)
    save_suffix_index(files, stream, build_suffix_array(stream))
    all_hidden = np.concatenate(hiddens).astype(np.float64)
    normaliser = fit_normaliser(all_hidden, pca_dims)
    normaliser.save(files / NORMALISER_FILE)
    rows = {k: [] for k in ("doc_id", "position", "offset", "token_id", "embedding", "continuation", "continuation_len")}
    for doc_id, (doc, hid) in enumerate(zip(docs, hiddens, strict=True)):
        emb = normaliser.apply(hid)
        for pos, tok in enumerate(doc):
            cont = list(doc[pos + 1 : pos + 1 + continuation_length])
            rows["doc_id"].append(doc_id)
            rows["position"].append(pos)
            rows["offset"].append(int(starts[doc_id]) + pos)
            rows["token_id"].append(int(tok))
            rows["embedding"].append(emb[pos].tolist())
            rows["continuation"].append(cont + [PAD_TOKEN] * (continuation_length - len(cont)))
            rows["continuation_len"].append(len(cont))
    table_name = Store.table_name(name, build_id)
    schema = tokens_schema(pca_dims, continuation_length)
    store._db.create_table(table_name, data=pa.Table.from_pydict(rows, schema=schema), schema=schema)
    table_dir = store.root / f"{table_name}.lance"
    names = [str(p.relative_to(store.root)) for p in sorted(table_dir.rglob("*.lance"))]
    names += [str((files / f).relative_to(store.root)) for f in ("stream.npy", "suffix_array.npy", NORMALISER_FILE)]
    manifest = Manifest(
        name=name,
        build_id=build_id,
        created_at=datetime.now(UTC),
        pipeline_version="test-helper",
        model=info,
        pca_dims=pca_dims,
        continuation_length=continuation_length,
        num_documents=len(docs),
        num_tokens=int(sum(len(d) for d in docs)),
        num_rejected=0,
        sources=[],
        tokens_table=table_name,
        files=checksum_files(store.root, names),
    )
    committed = store.commit(manifest)
    if tag:
        store.set_tag(f"{name}@{committed.version}", tag)
    return committed


TEXTS = [
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "The quick brown fox jumps over the lazy dog. The lazy dog sleeps all day.",
    "def mul(a, b):\n    return a * b\n\nprint(mul(3, 4))\n",
    "Speculative decoding drafts tokens cheaply and verifies them with the target model in one pass.",
]


def tiny_datastore(folder, name: str = "code", texts: list[str] | None = None, **options):
    """A tiny random llama model saved under ``folder/model`` and a datastore of ``texts`` built
    with its hidden states in the store ``folder/store``. Returns ``(store, loaded_model, manifest)``."""
    from specstore.runtime.models import load_model
    from tests.helpers import make_tiny_model

    path = make_tiny_model(folder / "model")
    loaded = load_model(str(path), dtype="float32", device="cpu")
    docs = [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in (texts or TEXTS)]
    store = Store(folder / "store", create=True)
    manifest = write_datastore(store, name, docs, model_hidden(loaded.model, docs), loaded.info, **options)
    return store, loaded, manifest


PROMPTS = ["def add(a, b):", "The quick brown fox", "Write a haiku about the sea."]


def own_output_datastore(folder, max_new_tokens: int = 24):
    """An in-domain datastore for the tiny model: each document is a prompt and the model's own
    greedy answer, so retrieval has something to find. Returns ``(store, loaded, ar_outputs)``
    with ``ar_outputs[prompt]`` the plain greedy ids."""
    from specstore.runtime.api import generate
    from specstore.runtime.models import load_model
    from tests.helpers import make_tiny_model

    path = make_tiny_model(folder / "model", seed=3)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    outputs = {p: generate(loaded.model, loaded.tokenizer, p, "ar", max_new_tokens) for p in PROMPTS}
    docs = [r.prompt_ids + r.token_ids for r in outputs.values()]
    store = Store(folder / "store", create=True)
    write_datastore(store, "own", docs, model_hidden(loaded.model, docs), loaded.info)
    return store, loaded, {p: r.token_ids for p, r in outputs.items()}
