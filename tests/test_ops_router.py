"""Domain routing: with several datastores, each prompt goes to the datastore whose domain
centroid is nearest to the prompt's reduced embeddings; the CLI reports which it used."""

from __future__ import annotations

import json

import pytest

from specstore.pipelines.build import build
from specstore.runtime.api import prompt_ids
from specstore.runtime.cli import main
from specstore.runtime.datastore import Datastore
from specstore.runtime.models import load_model
from specstore.runtime.router import Router
from specstore.runtime.store import Store
from tests.helpers import BUILD_OPTIONS

OPTIONS = BUILD_OPTIONS | {"batch_tokens": 512, "max_doc_tokens": 128}
CODE = [f"def f{i}(x, y):\n    return x * {i} + y  # {i}\n\nprint(f{i}(1, 2))\n" for i in range(12)]
CHAT = [f"The weather on day {i} was sunny and warm, so we walked to the lake and talked for hours." for i in range(12)]


@pytest.fixture(scope="module")
def two_domains(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("route")
    store = Store(root / "s", create=True)
    for name, texts in (("code", CODE), ("chat", CHAT)):
        folder = root / name
        folder.mkdir()
        for i, text in enumerate(texts[:-2]):  # the last two of each domain are held out
            (folder / f"{i:02d}.{'py' if name == 'code' else 'txt'}").write_text(text)
        build(store, name, [str(folder)], model=tiny_model_dir, fmt="code-dir", tag="prod", **OPTIONS)
    return store, tiny_model_dir


def test_router_scores_by_the_definition(two_domains):
    """The score of a datastore is the cosine between the mean of the prompt's content embeddings
    (template positions left out, through that datastore's normaliser) and its domain centroid;
    the best score wins. (Whether that finds the right domain is a property of the real model,
    measured by benchmarks/routing_eval.py: a tiny random model has no domains to find.)"""
    import numpy as np
    import torch

    from specstore.runtime.forward import hidden_states
    from specstore.runtime.router import content_span

    store, model_dir = two_domains
    loaded = load_model(model_dir, dtype="float32")
    opened = [Datastore.open(store, ref, loaded.info, dense=False) for ref in ("code@prod", "chat@prod")]
    router = Router(opened)
    template = prompt_ids(loaded.tokenizer, "")
    for prompt in CODE[-2:] + CHAT[-2:]:
        ids = prompt_ids(loaded.tokenizer, prompt)
        start, end = content_span(ids, template)
        assert 0 < start < end < len(ids)  # the system prompt and the assistant marker are left out
        hidden = hidden_states(loaded.model, torch.tensor([ids]))[0, start:end].numpy()
        want = {}
        for ds in opened:
            mean = ds.normaliser.apply(hidden).astype(np.float64).mean(axis=0)
            centroid = np.asarray(ds.manifest.domain_centroid)
            want[ds.ref] = float(mean @ centroid / (np.linalg.norm(mean) * np.linalg.norm(centroid)))
        route = router.route(loaded.model, ids, template)
        assert route.scores == pytest.approx(want, abs=1e-9)
        assert opened[route.index].ref == max(want, key=want.get)


def test_cli_reports_the_datastore_it_used(two_domains, capsys):
    store, model_dir = two_domains
    capsys.readouterr()
    argv = ["generate", "--store", str(store.root), "--datastore", "code@prod,chat@prod", "--method", "rest", "--model", model_dir,
            "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "8", "--json", "--prompt"]
    for prompt in (CHAT[-1], CODE[-1]):
        assert main(argv + [prompt]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert set(out["routing"]) == {"code@1", "chat@1"}
        assert out["datastore"] == max(out["routing"], key=out["routing"].get)
        name = out["datastore"].split("@")[0]
        single = argv[:4] + [f"{name}@prod"] + argv[5:]
        assert main(single + [prompt]) == 0  # the same decode as with that datastore alone
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == out["token_ids"]


def test_content_span_leaves_out_what_the_prompt_shares_with_the_template():
    from specstore.runtime.router import content_span

    template = [1, 2, 3, 9, 8]  # system prompt 1 2 3, the message goes here, then 9 8
    assert content_span([1, 2, 3, 5, 6, 7, 9, 8], template) == (3, 6)
    assert content_span([5, 6, 7], template) == (0, 3)  # nothing shared: everything counts
    assert content_span([1, 2, 3, 9, 8], template) == (0, 5)  # nothing would be left: everything counts
    assert content_span([1, 2, 3, 5, 9, 8], template) == (3, 4)  # a one-token message
    assert content_span([4, 5], None) == (0, 2)
