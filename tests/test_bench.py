"""The bench runner and the simulator on a small pipeline-built datastore with a tiny model:
the result has its contract fields, lossless methods are identical to ar in float32, and the
simulator reproduces the bench's MAT exactly."""

import json

import pytest

from specstore.runtime.bench.report import report
from specstore.runtime.bench.runner import parse_options, run_bench
from specstore.runtime.bench.simulate import references_from, simulate
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.models import load_model
from tests.helpers import make_tiny_model

PROMPTS = ["def add(a, b):", "Name three colours.", "Write a haiku about rain.", "Sort a list in Python."]


@pytest.fixture(scope="module")
def bench_setup(tmp_path_factory):
    from specstore.pipelines.build import build
    from specstore.runtime.api import generate

    folder = tmp_path_factory.mktemp("bench")
    model = make_tiny_model(folder / "model")
    loaded = load_model(str(model), dtype="float32", device="cpu")
    # an in-domain datastore: the model's own answers to half the prompts, so retrieval hits
    records = [{"instruction": p, "output": generate(loaded.model, loaded.tokenizer, p, max_new_tokens=40).text}
               for p in PROMPTS[:2]]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    build(folder / "store", "code", [str(folder / "corpus.jsonl")], model=str(model), pca_dims=8, progress=False)
    questions = folder / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "a" if i % 2 else "b", "turns": [p, "More."]}) + "\n"
                                 for i, p in enumerate(PROMPTS)))
    result = run_bench(store=str(folder / "store"), datastore="code", questions=str(questions),
                       methods=["pld", "rest", "dresd", "hf"], turns=2, max_new_tokens=24, model=str(model),
                       dtype="float32", device="cpu", progress=False)
    return folder, model, loaded, result


def test_bench_result_contract(bench_setup, tmp_path):
    folder, _, _, result = bench_setup
    assert list(result.methods) == ["ar", "pld", "rest", "dresd", "hf"]
    for name, m in result.methods.items():
        for field in ("mat", "acceptance_rate", "tokens_per_s", "speedup_vs_ar", "drafting_share", "identical_to_ar",
                      "lossless", "per_category"):
            assert hasattr(m, field), field
        assert set(m.per_category) == {"a", "b"}
        assert m.num_prompts == len(PROMPTS) * 2  # both turns
        if name != "ar":
            assert m.identical_to_ar is True, name  # float32 greedy: every lossless method equals ar
    assert result.methods["ar"].mat == 1.0
    assert result.methods["rest"].mat > 1.0 and result.methods["dresd"].mat > 1.0
    assert result.datastore == "code@1" and len(result.manifest_sha256) == 64
    out = tmp_path / "r.json"
    out.write_text(result.model_dump_json())
    md = report([str(out)], tmp_path / "plots")
    assert "| rest |" in md and (tmp_path / "plots" / "r_mat_speedup.png").is_file()


def test_simulator_reproduces_bench_mat(bench_setup):
    folder, _, loaded, result = bench_setup
    refs = references_from(result)
    assert len(refs) == len(PROMPTS) * 2
    ds = Datastore.open(folder / "store", "code", loaded.info)
    for method in ("pld", "rest", "dresd"):
        sims = simulate(lambda m=method: make_drafter(m, datastore=ds), refs, result.max_new_tokens, loaded.model)
        recs = [r for r in result.prompts if r.method == method]
        assert [s.accepted_per_step for s in sims] == [r.accepted_per_step for r in recs], method
        sim_mat = sum(s.num_tokens for s in sims) / sum(s.steps for s in sims)
        assert sim_mat == pytest.approx(result.methods[method].mat, abs=1e-12), method


def test_option_parsing_and_errors():
    assert parse_options(["rest.max_nodes=32", "dresd.k=3", "respec.relaxed=true", "x.name=abc"]) == {
        "rest": {"max_nodes": 32}, "dresd": {"k": 3}, "respec": {"relaxed": True}, "x": {"name": "abc"}}
    with pytest.raises(SpecstoreError):
        parse_options(["rest=3"])
