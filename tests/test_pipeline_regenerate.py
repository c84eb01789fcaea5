"""``--regenerate``: the model writes the responses itself (batched greedy, left padding)."""

from __future__ import annotations

import json

import numpy as np
import torch

from specstore.pipelines.build import build
from specstore.pipelines.embed import generate_responses
from specstore.runtime.models import load_model
from specstore.runtime.store import Store


def test_regenerated_documents_are_the_models_greedy_answers(tiny_model_dir, tmp_path):
    corpus = tmp_path / "q.jsonl"
    rows = [{"turns": ["Name a colour."]}, {"instruction": "Say something long about the sea and the sky.", "output": "ignored"},
            {"turns": ["Hi"]}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = build(tmp_path / "s", "id", [str(corpus)], model=tiny_model_dir, regenerate=True, max_new_tokens=6, pca_dims=4, progress=False)
    m = result.manifest
    assert m.regenerated and (m.num_documents, m.num_rejected) == (3, 0)
    loaded = load_model(tiny_model_dir, dtype="float32")
    data = Store(tmp_path / "s").open_table(m.tokens_table).to_arrow().sort_by("offset").to_pydict()
    docs = {}
    for d, t in zip(data["doc_id"], data["token_id"], strict=True):
        docs.setdefault(d, []).append(t)
    tok = loaded.tokenizer
    first = list(docs.values())[0]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert first[: len(prompt_ids)] == prompt_ids and 0 < len(first) - len(prompt_ids) <= 6
    # a batched, left-padded generation equals generating each prompt alone
    ids = np.asarray(prompt_ids, dtype=np.int32)
    alone = loaded.model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False)[0].tolist()
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    long_prompt = np.asarray(tok("a much longer prompt " * 5, add_special_tokens=False)["input_ids"], dtype=np.int32)
    batched, _ = generate_responses(loaded.model, [ids, long_prompt], max_new_tokens=6, pad_id=tok.pad_token_id, eos_ids=eos)
    expected = alone[: next((i + 1 for i in range(len(prompt_ids), len(alone)) if alone[i] in eos), len(alone))]
    assert batched.tolist() == expected == first
