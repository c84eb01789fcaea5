"""The build with the real default model (SmolLM2-135M-Instruct) on three short documents."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specstore.pipelines.build import build
from specstore.runtime.datastore import Datastore
from specstore.runtime.forward import hidden_states
from specstore.runtime.models import DEFAULT_MODEL, load_model

pytestmark = pytest.mark.model


def test_default_model_build(tmp_path):
    corpus = tmp_path / "code.jsonl"
    rows = [
        {"instruction": "Write a Python function that returns the square of x.", "input": "", "output": "def square(x):\n    return x * x"},
        {"instruction": "Print hello in JavaScript.", "input": "", "output": "console.log('hello');"},
        {"instruction": "Sum a list in Python.", "input": "nums = [1, 2, 3]", "output": "total = sum(nums)"},
    ]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = build(tmp_path / "s", "code", [str(corpus)], pca_dims=16, progress=False)
    m = result.manifest
    assert m.model.model_id == DEFAULT_MODEL and m.model.hidden_size == 576
    assert (m.version, m.num_documents, m.num_rejected) == (1, 3, 0)
    loaded = load_model(None, dtype="float32")
    ds = Datastore.open(tmp_path / "s", "code", loaded.info)  # the manifest matches the default model
    table = ds.store.open_table(m.tokens_table).to_arrow().sort_by("offset").to_pydict()
    first = np.asarray(table["doc_id"]) == table["doc_id"][0]
    tokens = [t for t, keep in zip(table["token_id"], first, strict=True) if keep]
    assert loaded.tokenizer.decode(tokens).rstrip().endswith("return x * x<|im_end|>")
    fresh = ds.normaliser.apply(hidden_states(loaded.model, torch.tensor([tokens]))[0].numpy())
    scales = np.asarray(m.dense.scales)  # int8 codes: code / scale is the vector, to half a step
    np.testing.assert_allclose(np.asarray(table["embedding"])[first] / scales, fresh, atol=1e-3 + 0.5 / scales.min())

    # every lossless method decodes token-identically to plain greedy decoding (float32, real model)
    from specstore.runtime.api import generate
    from specstore.runtime.drafters.registry import make_drafter

    for prompt in ("Write a Python function that returns the square of x.", "Sum a list in Python."):
        ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=24)
        for method in ("pld", "rest", "dresd", "respec"):
            out = generate(loaded.model, loaded.tokenizer, prompt, make_drafter(method, ds), max_new_tokens=24)
            assert out.token_ids == ar.token_ids, (method, prompt)
            assert out.stats.steps <= ar.stats.steps
