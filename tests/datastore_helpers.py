"""Test helpers: commit a small datastore version through the build's own writers, without Beam.

Composes what a pipeline build runs, minus reading, rendering and the model forward: given
documents (token ids) and their hidden states, the build's writers write the stream and suffix
array, fit and save the normaliser, stage the hidden states and write the tokens table's
fragments, and the build's ``finalise`` commits the version (checksums, manifest, one catalogue
row). So runtime tests get a datastore in the real format without a build or a Beam pipeline.
``pipeline_store`` is the other way: a real build (DirectRunner) of JSONL records.
"""

from __future__ import annotations

import numpy as np
import torch

from specstore.pipelines import writers
from specstore.pipelines.commit import finalise
from specstore.pipelines.embed import save_staged
from specstore.pipelines.normalise import NormStats
from specstore.pipelines.plan import BuildPlan
from specstore.pipelines.summary import summarise
from specstore.runtime.forward import hidden_states
from specstore.runtime.store import Store
from specstore.schemas.manifest import Manifest, ModelInfo


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
    compact: bool = True,
    ann_threshold: int | None = None,
    table_format: int | None = None,
) -> Manifest:
    """Commit documents ``docs`` (doc ids 0, 1, ...) with hidden states ``hiddens[i]`` [T_i, H]
    as a new version of ``name``, built with ``info``'s model; ``compact`` False writes the old
    form (float32 table, no dense files), as versions built before the compact form are;
    ``table_format`` 1 the compact table's first layout (schemas/tables.py TABLE_FORMAT)."""
    build_id = Store.new_build_id()
    plan = BuildPlan(
        name=name, build_id=build_id, store_root=str(store.root), table_uri=store.table_uri(Store.table_name(name, build_id)),
        files_dir=str(store.files_dir(name, build_id)), sources=(), model_path="", model_info=info, pca_dims=pca_dims,
        continuation_length=continuation_length, compact=compact,
        **({} if ann_threshold is None else {"ann_threshold": ann_threshold}),
        **({} if table_format is None else {"table_format": table_format}),
    )
    doc_ids = list(range(len(docs)))
    tokens = [np.asarray(d, dtype=np.int32) for d in docs]
    layout = writers.write_stream(writers.spill_tokens(list(zip(doc_ids, tokens, strict=True)), plan), plan)
    normaliser = writers.fit_and_save(NormStats.of(np.concatenate(hiddens)), plan)
    staged = save_staged(plan.staging_dir, "all", doc_ids, tokens, list(hiddens), plan.spill_dtype)
    written = writers.write_fragment(staged, normaliser, layout, plan)
    writers.write_rejected([], plan)
    dense = writers.write_dense([written], normaliser, layout, plan)
    summary = summarise([written], layout, None, num_rejected=0, source_indices=[], read_counts={}, rejected_counts={}, dense=dense)
    summary.write(plan.summary_path)
    return finalise(store, plan, tag=tag).manifest


def stream_continuations(ds, length: int | None = None) -> np.ndarray:
    """The continuation of every stream position of an opened version, as an old-form table
    row holds it: int [len(stream), L], the L tokens after the position cut at its document's
    end and padded with -1; all -1 for a separator. A compact version's dense row ids are
    stream positions, so this indexes like its ``continuations`` reader."""
    length = length or ds.manifest.continuation_length
    shards = getattr(ds.suffix, "shards", None) or [ds.suffix]
    stream = np.concatenate([np.asarray(s.stream) for s in shards]).astype(np.int64)
    out = np.full((len(stream), length), -1, dtype=np.int64)
    for p in np.flatnonzero(stream >= 0):
        window = stream[p + 1 : p + 1 + length]
        cut = np.flatnonzero(window < 0)
        window = window[: int(cut[0]) if cut.size else len(window)]
        out[p, : len(window)] = window
    return out


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


def pipeline_store(folder, model, records: list[dict], name: str):
    """A datastore built by the real pipeline (DirectRunner) from JSONL records."""
    import json

    from specstore.pipelines.build import build

    corpus = folder / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    return build(folder / "store", name, [str(corpus)], model=model, pca_dims=8, progress=False, tag="prod").manifest


CODE_RECORDS = [
    {"instruction": "Write a Python function that adds two numbers.", "output": "def add(a, b):\n    return a + b"},
    {"instruction": "Write a Python function that reverses a string.", "output": "def reverse(s):\n    return s[::-1]"},
    {"instruction": "Write a Python function that returns the maximum of a list.",
     "output": "def maximum(values):\n    best = values[0]\n    for v in values:\n        if v > best:\n            best = v\n    return best"},
]
CHAT_RECORDS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "The capital of France is Paris."}]},
    {"messages": [{"role": "user", "content": "Give me a tip for sleeping well."},
                  {"role": "assistant", "content": "Go to bed at the same time every night and keep your room dark and cool."}]},
]
