"""The bench runner and the simulator on a small pipeline-built datastore with a tiny model:
the result has its contract fields, lossless methods are identical to ar in float32, the
simulator reproduces the bench's MAT exactly, and both commands run end to end from the CLI."""

import json
from pathlib import Path

import pytest

from specstore.runtime.bench import runner
from specstore.runtime.bench.report import report
from specstore.runtime.bench.runner import parse_options, run_bench, run_order
from specstore.runtime.bench.simulate import references_from, simulate
from specstore.runtime.cost import CostModel
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.models import load_model
from tests.helpers import make_tiny_model

# a CPU-like verification cost: 1.05x a plain step at 1 node, 1.3x at 8, 3x at 64
COST = CostModel([0, 1, 8, 64], [0], [[0.01, 0.0105, 0.013, 0.03]], {"test": True}, online=False)  # trees from the text alone
AWARE = ["pld+cost", "rest+cost", "dresd+cost", "respec+cost"]
PROMPTS = ["def add(a, b):", "Name three colours.", "Write a haiku about rain.", "Sort a list in Python."]
ORDERS: list[list[str]] = []  # bench_setup's run order, prompt by prompt


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
    with pytest.MonkeyPatch.context() as patch:  # the order each prompt ran the methods in
        patch.setattr(runner, "run_order", lambda methods, k: ORDERS.append(run_order(methods, k)) or ORDERS[-1])
        result = run_bench(store=str(folder / "store"), datastore="code", questions=str(questions),
                           methods=["pld", "rest", "dresd", "respec", "hf"], turns=2, max_new_tokens=24, model=str(model),
                           dtype="float32", device="cpu", progress=False, cost_aware="both", cost=COST)
    return folder, model, loaded, result


def test_run_order_rotates_so_every_method_takes_every_place():
    methods = ["ar", "pld", "rest"]
    orders = [run_order(methods, k) for k in range(6)]
    assert orders[:3] == [["ar", "pld", "rest"], ["pld", "rest", "ar"], ["rest", "ar", "pld"]] and orders[3:] == orders[:3]
    assert all(sorted(o) == sorted(methods) for o in orders)


def test_bench_result_contract(bench_setup, tmp_path):
    folder, _, _, result = bench_setup
    # every prompt and turn ran each method once, the order rotating by one place a prompt
    names = list(result.methods)
    assert ORDERS == [names[k % len(names):] + names[:k % len(names)] for k in range(len(PROMPTS) * 2)]
    assert list(result.methods) == ["ar", "pld", "pld+cost", "rest", "rest+cost", "dresd", "dresd+cost", "respec",
                                    "respec+cost", "hf"]
    assert CostModel.from_json(result.cost_model).seconds == COST.seconds
    # each method's own copy: the cost-aware ones prune with theirs, the others' (ar included)
    # only follow their steps, for the simulator's prices
    assert sorted(result.cost_models) == sorted(m for m in result.methods if m != "hf")
    assert all(CostModel.from_json(c).seconds == COST.seconds for c in result.cost_models.values())
    for name, m in result.methods.items():
        lo, hi = m.speedup_ci
        assert lo <= m.speedup_vs_ar <= hi and m.speedup_ci_level == 0.95
        assert m.mat >= 1.0 and 0.0 <= m.acceptance_rate <= 1.0 and m.tokens_per_s > 0 and m.speedup_vs_ar > 0
        assert 0.0 <= m.drafting_share < 1.0 and m.lossless is True
        assert set(m.per_category) == {"a", "b"}
        assert m.num_prompts == len(PROMPTS) * 2  # both turns
        if name != "ar":
            assert m.identical_to_ar is True, name  # float32 greedy: every lossless method equals ar, cost-aware too
    assert result.methods["ar"].mat == 1.0
    assert result.methods["rest"].mat > 1.0 and result.methods["dresd"].mat > 1.0
    assert result.datastore == "code@1" and len(result.manifest_sha256) == 64
    if Path("/proc/stat").exists():  # every run's other work on the host was measured (bench/host.py)
        assert all(r.host_other_s is not None and r.host_other_s >= 0 and r.host_steal_s >= 0 for r in result.prompts)
    out = tmp_path / "r.json"
    out.write_text(result.model_dump_json())
    md = report([str(out)], tmp_path / "plots")
    assert "| rest |" in md and "| rest+cost |" in md and ("Host" in md) == Path("/proc/stat").exists() and (tmp_path / "plots" / "r_mat_speedup.png").is_file()
    lo, hi = result.methods["rest+cost"].speedup_ci
    assert f"{result.methods['rest+cost'].speedup_vs_ar:.2f}x [{lo:.2f}, {hi:.2f}]" in md


def test_simulator_reproduces_bench_mat(bench_setup):
    folder, _, loaded, result = bench_setup
    refs = references_from(result)
    assert len(refs) == len(PROMPTS) * 2
    ds = Datastore.open(folder / "store", "code", loaded.info)
    cost = CostModel.from_json(result.cost_model)
    for label in ("pld", "rest", "dresd", "respec", *AWARE):
        method, aware = label.removesuffix("+cost"), label.endswith("+cost")
        sims = simulate(lambda m=method, c=cost if aware else None: make_drafter(m, datastore=ds, cost=c), refs,
                        result.max_new_tokens, loaded.model)
        recs = [r for r in result.prompts if r.method == label]
        assert [s.accepted_per_step for s in sims] == [r.accepted_per_step for r in recs], label
        sim_mat = sum(s.num_tokens for s in sims) / sum(s.steps for s in sims)
        assert sim_mat == pytest.approx(result.methods[label].mat, abs=1e-12), label


def test_bench_command_end_to_end(bench_setup, tmp_path, capsys, monkeypatch):
    from specstore.runtime.bench.report import load_result
    from specstore.runtime.cli import main

    monkeypatch.setenv("SPECSTORE_CACHE", str(tmp_path / "cache"))  # the cost model is measured there

    folder, model, _, _ = bench_setup
    out = tmp_path / "bench.json"
    code = main(["bench", "--store", str(folder / "store"), "--datastore", "code", "--questions", str(folder / "questions.jsonl"),
                 "--methods", "pld,rest,respec", "--limit", "2", "--max-new-tokens", "12", "--model", str(model),
                 "--dtype", "float32", "--device", "cpu", "--option", "rest.max_nodes=8", "--cost-aware", "on",
                 "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "| respec |" in printed and f"wrote {out}" in printed
    result = load_result(str(out))
    assert list(result.methods) == ["ar", "pld", "rest", "respec"] and result.datastore == "code@1"
    assert all(m.identical_to_ar for name, m in result.methods.items() if name != "ar")
    assert all(m.num_prompts == 2 for m in result.methods.values()) and result.max_new_tokens == 12
    assert all(r.num_drafted <= 8 * (r.steps - 1) for r in result.prompts if r.method == "rest")  # --option reached rest
    assert len(list((tmp_path / "cache" / "cost").glob("*.json"))) == 1  # measured once for the tiny model, cached
    assert CostModel.from_json(result.cost_model).key["dtype"] == "float32" and result.dtype == "float32"
    # each method corrected its own copy online from its own steps, and nothing else's; the
    # simulator takes each method's copy, and the loaded model where a method has none
    from specstore.runtime.bench.simulate import method_cost_model

    base = CostModel.from_json(result.cost_model)
    assert sorted(result.cost_models) == ["ar", "pld", "respec", "rest"] and base.observed == 0
    for m in ("ar", "pld", "rest", "respec"):
        steps = sum(r.steps - 1 for r in result.prompts if r.method == m)  # every step after the prefill
        assert CostModel.from_json(result.cost_models[m]).observed == steps > 0, m
        assert method_cost_model(result, m, base).observed == steps, m
    assert method_cost_model(result, "dresd", base) is base
    # a method that needs a datastore, without one: one clear error line, before any model loads
    code = main(["bench", "--store", str(folder / "store"), "--questions", str(folder / "questions.jsonl"),
                 "--methods", "rest", "--model", str(model)])
    assert code == 2 and "methods rest need --datastore" in capsys.readouterr().err


def test_a_method_variant_runs_beside_its_method_with_its_own_options(bench_setup):
    """``rest`` and ``rest:small`` (max_nodes 2) in one run, interleaved: both identical to ar,
    each with its own options."""
    folder, model, _, _ = bench_setup
    result = run_bench(store=str(folder / "store"), datastore="code", questions=str(folder / "questions.jsonl"),
                       methods=["rest", "rest:small"], limit=2, max_new_tokens=16, model=str(model), dtype="float32",
                       device="cpu", progress=False, cost_aware="off", options={"rest:small": {"max_nodes": 2}})
    assert list(result.methods) == ["ar", "rest", "rest:small"]
    assert all(m.identical_to_ar for name, m in result.methods.items() if name != "ar")
    small = [r for r in result.prompts if r.method == "rest:small"]
    assert len(small) == 2 and all(r.num_drafted <= 2 * (r.steps - 1) for r in small)
    assert max(r.num_drafted - 2 * (r.steps - 1) for r in result.prompts if r.method == "rest") > 0  # rest's own cap is wider


def test_bench_times_nothing_before_the_datastore_prefetch_ends(bench_setup, monkeypatch):
    """The bench opens its datastore with ``prefetch`` and waits for every prefetch thread
    before its warm-up and the first prompt: a cold page or a block's index read is not decoding
    speed."""
    folder, model, _, _ = bench_setup
    opened, seen = [], []
    real_open, real_run = Datastore.open.__func__, runner._run_method

    def open_(cls, *args, **kwargs):
        ds = real_open(cls, *args, **kwargs)
        opened.append((kwargs.get("prefetch"), ds))
        return ds

    def run(*args, **kwargs):
        seen.append([t.is_alive() for t in opened[0][1].prefetching])
        return real_run(*args, **kwargs)

    monkeypatch.setattr(Datastore, "open", classmethod(open_))
    monkeypatch.setattr(runner, "_run_method", run)
    run_bench(store=str(folder / "store"), datastore="code", questions=str(folder / "questions.jsonl"),
              methods=["rest"], limit=1, max_new_tokens=4, model=str(model), dtype="float32", device="cpu",
              progress=False, cost_aware="off")
    assert [p for p, _ in opened] == [True]
    assert seen and seen[0] and not any(alive for alive in seen[0])  # threads started, all ended before the first prompt


def test_simulate_sweep_end_to_end(bench_setup, tmp_path, capsys):
    from specstore.runtime.cli import main

    folder, model, _, result = bench_setup
    refs = tmp_path / "refs.json"
    refs.write_text(result.model_dump_json())
    code = main(["simulate", "--store", str(folder / "store"), "--datastore", "code", "--references", str(refs),
                 "--methods", "pld,rest,respec", "--sweep", "rest.max_nodes=4,64", "--sweep", "respec.max_candidates=1,3",
                 "--option", "pld.num_draft_tokens=10", "--model", str(model), "--cost-aware", "off", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    rows = json.loads(out)
    assert sorted((r["method"], json.dumps(r["options"])) for r in rows) == [
        ("pld", '{"num_draft_tokens": 10}'), ("respec", '{"max_candidates": 1}'), ("respec", '{"max_candidates": 3}'),
        ("rest", '{"max_nodes": 4}'), ("rest", '{"max_nodes": 64}')]
    assert [r["method"] for r in rows] == ["pld", "rest", "rest", "respec", "respec"]
    for method in ("rest", "respec"):  # a sweep is ranked by predicted speedup
        group = [r for r in rows if r["method"] == method]
        assert [r["rank"] for r in group] == [1, 2] and group[0]["predicted_speedup"] >= group[1]["predicted_speedup"] > 0
    mat = {(r["method"], json.dumps(r["options"])): r["mat"] for r in rows}
    # the settings the bench ran with (the defaults) reproduce its MAT exactly
    assert mat[("pld", '{"num_draft_tokens": 10}')] == pytest.approx(result.methods["pld"].mat, abs=1e-12)
    assert mat[("rest", '{"max_nodes": 64}')] == pytest.approx(result.methods["rest"].mat, abs=1e-12)
    assert mat[("respec", '{"max_candidates": 3}')] == pytest.approx(result.methods["respec"].mat, abs=1e-12)
    assert all(r["num_prompts"] == len(PROMPTS) * 2 and r["drafted_per_step"] >= 0 for r in rows)
    assert all(r["drafting_ms_per_step"] > 0 for r in rows)  # timed in the replay
    shapes = {json.dumps(r["options"]): r["drafted_per_step"] for r in rows if r["method"] == "rest"}
    assert shapes['{"max_nodes": 4}'] <= 4 < shapes['{"max_nodes": 64}']  # the swept option reached the drafter
    code = main(["simulate", "--store", str(folder / "store"), "--datastore", "code", "--references", str(refs),
                 "--methods", "pld", "--sweep", "pld.num_draft_tokens=2,4"])
    table = capsys.readouterr().out
    assert code == 0 and table.count("| pld |") == 2 and "predicted speedup vs ar" in table and "drafting ms per step" in table
    code = main(["simulate", "--store", str(folder / "store"), "--datastore", "code", "--references", str(refs),
                 "--methods", "pld", "--drafting-ms", "0.25", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)[0]["drafting_ms_per_step"] == pytest.approx(0.25)
    # cost-aware, with the cost model the bench stored: the bench's +cost MAT again
    code = main(["simulate", "--store", str(folder / "store"), "--datastore", "code", "--references", str(refs),
                 "--methods", "pld,rest,dresd,respec", "--model", str(model), "--cost-aware", "on", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and all(r["cost_aware"] for r in rows)
    for r in rows:
        assert r["mat"] == pytest.approx(result.methods[r["method"] + "+cost"].mat, abs=1e-12), r["method"]


def test_simulate_names_the_replays_other_work_on_the_host_disturbed(bench_setup, tmp_path, capsys, monkeypatch):
    """Each replay's drafting is timed and priced, so simulate meters the host around it
    (bench/host.py) and says which replays other work disturbed; not with --drafting-ms."""
    from specstore.runtime.bench import simulate as simulate_module
    from specstore.runtime.bench.host import Load
    from specstore.runtime.cli import main

    folder, model, _, result = bench_setup
    refs = tmp_path / "refs.json"
    refs.write_text(result.model_dump_json())
    args = ["simulate", "--store", str(folder / "store"), "--datastore", "code", "--references", str(refs),
            "--methods", "pld,rest", "--model", str(model), "--cost-aware", "off"]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    if Path("/proc/stat").exists():
        assert all(r["host_cores"] is not None and r["host_cores"] >= 0 for r in rows)

    class Busy:  # rest's replay ran beside 0.9 cores of other work, pld's alone
        def __init__(self):
            self.calls = 0

        def start(self):
            return object()

        def stop(self, _):
            self.calls += 1
            return Load(1.0, 0.9 if self.calls == 2 else 0.0, 0.0)

    monkeypatch.setattr(simulate_module, "HostMeter", Busy)
    assert main(args) == 0
    table = capsys.readouterr().out
    assert f"**Host busy** during the replays of rest {{}} ({Load(1.0, 0.9, 0.0).cores:.2f} cores)" in table and "pld {}" not in table.split("Host busy")[1]
    assert main([*args, "--drafting-ms", "0.25"]) == 0  # drafting priced at a fixed figure: timings do not matter
    assert "Host busy" not in capsys.readouterr().out


def test_respec_headroom_replays_as_simulate_and_bounds_what_it_lost(bench_setup, tmp_path, capsys):
    """benchmarks/respec_headroom.py: its hooks leave the replay as simulate's (the bench's MAT
    again) and the classes as they were; the oracles bound what the tree got."""
    import importlib.util
    from pathlib import Path

    from specstore.runtime.bench.simulate import ReplayVerifier
    from specstore.runtime.drafters.respec import ReSpecDrafter

    spec = importlib.util.spec_from_file_location("respec_headroom", Path(__file__).resolve().parents[1] / "benchmarks" / "respec_headroom.py")
    headroom = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(headroom)
    folder, model, _, result = bench_setup
    refs = tmp_path / "refs.json"
    refs.write_text(result.model_dump_json())
    from specstore.runtime.cli import main as cli

    # the tiny model's next-token entropy is high: retrieve at every step, so that the pool drafts
    assert cli(["simulate", "--store", str(folder / "store"), "--datastore", "code", "--references", str(refs),
                "--methods", "respec", "--option", "respec.entropy_threshold=inf", "--model", str(model),
                "--cost-aware", "on", "--drafting-ms", "0.5", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)[0]["mat"]
    before = (ReSpecDrafter.propose, ReSpecDrafter._propose, ReplayVerifier.step)
    report = headroom.main(["--references", str(refs), "--store", str(folder / "store"), "--datastore", "code",
                            "--model", str(model), "--option", "entropy_threshold=inf", "--drafting-ms", "0.5",
                            "--json", str(tmp_path / "headroom.json")])
    printed = capsys.readouterr().out
    assert (ReSpecDrafter.propose, ReSpecDrafter._propose, ReplayVerifier.step) == before
    assert report["mat"] == pytest.approx(simulated, abs=1e-12)
    assert report["pool_steps"] > 0 and "pool oracle" in printed and json.loads((tmp_path / "headroom.json").read_text())["mat"] == report["mat"]
    assert report["pool_oracle"] >= report["chosen_oracle"] >= report["accepted"] >= 0
    assert report["first_covered"] >= report["first_accepted"]
    assert report["lost_missing"] + report["lost_cut"] == pytest.approx(report["chosen_oracle"] - report["accepted"])
    assert sum(r["n"] for r in report["calibration"]) == sum(r["n"] for r in report["calibration_by_depth"]) > 0
    # the figures from hand-made steps: two pool steps and one without
    steps = [{"accepted": 0, "pool": [("dense", 2), ("context", 0)], "chosen": [2]},
             {"accepted": 1, "pool": [("suffix", 3), ("resync", 3)], "chosen": [3, 1]}, {"accepted": 2}]
    figures = headroom.summarise(steps)
    assert figures["pool_steps"] == 2 and figures["accepted"] == 0.5 and figures["pool_oracle"] == 2.5
    assert figures["lost_missing"] == 1.0 and figures["lost_cut"] == 1.0 and figures["first_covered"] == 1.0
    assert figures["first_accepted"] == 0.5 and figures["best_source"] == {"dense": 1, "suffix": 1, "resync": 1}
    table = headroom.binned([(0.1, 0), (0.3, 1), (0.35, 0), (0.9, 1)], (0.2, 0.4))
    assert [(r["n"], r["rate"]) for r in table] == [(1, 0.0), (2, 0.5), (1, 1.0)] and table[1]["bin"] == [0.2, 0.4]


def test_option_parsing_and_errors():
    assert parse_options(["rest.max_nodes=32", "dresd.k=3", "respec.relaxed=true", "x.name=abc"]) == {
        "rest": {"max_nodes": 32}, "dresd": {"k": 3}, "respec": {"relaxed": True}, "x": {"name": "abc"}}
    # inf is no JSON, but a threshold of inf (respec: always retrieve) is a number
    assert parse_options(["respec.entropy_threshold=inf", "a.b=-inf"]) == {
        "respec": {"entropy_threshold": float("inf")}, "a": {"b": float("-inf")}}
    with pytest.raises(SpecstoreError):
        parse_options(["rest=3"])
