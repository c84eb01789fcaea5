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
from tests.helpers import make_tiny_model

OPTIONS = dict(pca_dims=8, continuation_length=4, batch_tokens=512, max_doc_tokens=128, progress=False)
CODE = [f"def f{i}(x, y):\n    return x * {i} + y  # {i}\n\nprint(f{i}(1, 2))\n" for i in range(12)]
CHAT = [f"The weather on day {i} was sunny and warm, so we walked to the lake and talked for hours." for i in range(12)]


@pytest.fixture(scope="module")
def two_domains(tmp_path_factory):
    root = tmp_path_factory.mktemp("route")
    tiny = str(make_tiny_model(root / "model"))
    store = Store(root / "s", create=True)
    for name, texts in (("code", CODE), ("chat", CHAT)):
        folder = root / name
        folder.mkdir()
        for i, text in enumerate(texts[:-2]):  # the last two of each domain are held out
            (folder / f"{i:02d}.{'py' if name == 'code' else 'txt'}").write_text(text)
        build(store, name, [str(folder)], model=tiny, fmt="code-dir", tag="prod", **OPTIONS)
    return store, tiny


def test_router_picks_the_domain_of_held_out_prompts(two_domains):
    store, tiny = two_domains
    loaded = load_model(tiny, dtype="float32")
    opened = [Datastore.open(store, ref, loaded.info, dense=False) for ref in ("code@prod", "chat@prod")]
    router = Router(opened)
    for expected, prompts in ((0, CODE[-2:]), (1, CHAT[-2:])):
        for prompt in prompts:
            route = router.route(loaded.model, prompt_ids(loaded.tokenizer, prompt))
            assert route.index == expected, (prompt, route.scores)


def test_cli_reports_the_datastore_it_used(two_domains, capsys):
    store, tiny = two_domains
    capsys.readouterr()
    argv = ["generate", "--store", str(store.root), "--datastore", "code@prod,chat@prod", "--method", "rest", "--model", tiny,
            "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "8", "--json", "--prompt"]
    assert main(argv + [CHAT[-1]]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["datastore"] == "chat@1" and set(out["routing"]) == {"code@1", "chat@1"}
    assert main(argv + [CODE[-1]]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["datastore"] == "code@1"
