"""The benchmark scripts' own logic that their figures rest on: the chat stream's held-out split
(by instruction, never by row), the serving loop's paired before/after comparison and the paired
ratio of two methods' tokens/s (benchmarks/paired_ratio.py), and the check of issue 16's targets
(benchmarks/issue16_targets.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chat_stream_holds_out_instructions_not_rows(tmp_path):
    rows = [{"instruction": f"question {i}", "output": f"answer {i} by {m}", "generator": m}
            for m in ("alpha", "beta", "gamma") for i in range(10)]
    source = tmp_path / "outputs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "stream"
    subprocess.run([sys.executable, str(BENCHMARKS / "chat_stream.py"), "--source", str(source), "--out-dir", str(out),
                    "--every", "3", "--warm", "2", "--reference-model", "beta"], check=True, capture_output=True)
    corpus = [json.loads(line) for line in (out / "corpus.jsonl").read_text().splitlines()]
    stream = [json.loads(line) for line in (out / "stream.jsonl").read_text().splitlines()]
    held = {"question 0", "question 3", "question 6", "question 9"}
    assert {r["instruction"] for r in corpus} == {f"question {i}" for i in range(10)} - held
    assert len(corpus) == 3 * 6  # every model's answer to every other instruction
    assert stream[:2] == corpus[:2]  # the warm-up records come first
    served = stream[2:]
    assert [r["instruction"] for r in served] == ["question 0", "question 3", "question 6", "question 9"]
    assert all(r["output"].endswith("by beta") for r in served)  # the reference model's answer


def test_serve_loop_compare_pairs_prompts():
    compare = _load("serve_loop").compare
    rng = np.random.default_rng(1)
    before = [{"committed": int(c), "steps": 40, "new_tokens": 64, "wall_s": float(w)}
              for c, w in zip(rng.integers(50, 90, 30), rng.uniform(1.0, 3.0, 30), strict=True)]
    after = [dict(r, committed=r["committed"] + 8, wall_s=r["wall_s"] * 0.9) for r in before]
    out = compare(before, after)
    mat = out["mat"]
    assert mat["after"] > mat["before"] and mat["ratio"] > 1.0
    lo, hi = mat["interval"]
    assert lo <= mat["ratio"] <= hi and lo > 1.0  # the same prompts on both sides: the gain is clear
    speed = out["tokens_per_s"]
    assert abs(speed["ratio"] - 1 / 0.9) < 1e-3 and speed["interval"][0] > 1.0
    same = compare(before, [dict(r) for r in before])
    assert same["mat"]["ratio"] == 1.0 and same["mat"]["interval"] == [1.0, 1.0]


def test_paired_ratio_pools_tokens_per_second_over_paired_prompts(tmp_path):
    from specstore.schemas.bench import BenchResult, PromptRecord

    mod = _load("paired_ratio")

    def rec(method, pid, tokens, wall):
        return PromptRecord(method=method, prompt_id=str(pid), category="c", num_tokens=tokens, steps=1,
                            accepted_per_step=[1], num_drafted=0, num_accepted=0, wall_s=wall, drafting_s=0.0,
                            verifying_s=wall)

    # prompt 1: a at 20 tokens/s, b at 10; prompt 2: a at 10, b at 10; prompt 3: b only (unpaired)
    prompts = [rec("a", 1, 100, 5.0), rec("b", 1, 100, 10.0), rec("a", 2, 50, 5.0), rec("b", 2, 50, 5.0),
               rec("b", 3, 10, 100.0)]
    pairs = mod.paired(prompts, "a", "b")
    assert [(b.prompt_id, a.prompt_id, b.method, a.method) for b, a in pairs] == [("1", "1", "b", "a"), ("2", "2", "b", "a")]
    assert mod.ratio(pairs) == (150 / 10) / (150 / 15)  # pooled, not a mean of per-prompt ratios
    path = tmp_path / "bench.json"
    path.write_text(BenchResult(created_at="t", command="c", machine={}, device="cpu", dtype="float32", model="m",
                                datastore=None, manifest_sha256=None, torch_version="t", transformers_version="t",
                                questions="q", max_new_tokens=8, temperature=0.0, methods={},
                                prompts=prompts).model_dump_json())
    out = subprocess.run([sys.executable, str(BENCHMARKS / "paired_ratio.py"), str(path), "--a", "a", "--b", "b"],
                         check=True, capture_output=True, text=True).stdout
    low, high = (float(x) for x in out.split("[")[1].split("]")[0].split(","))
    assert out.startswith("a / b tokens/s: 1.500 [") and "2 prompts" in out and 1.0 <= low <= 1.5 <= high <= 2.0
    missing = subprocess.run([sys.executable, str(BENCHMARKS / "paired_ratio.py"), str(path), "--a", "a", "--b", "c"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "no prompt" in missing.stderr


def test_paired_ratio_reprices_drafting_per_step_of_the_same_prompt():
    """``--drafting-like C``: a's records keep their steps and verification, their drafting
    becomes their steps times C's drafting a step on the same prompt; "none" drops it."""
    from specstore.schemas.bench import PromptRecord

    mod = _load("paired_ratio")

    def rec(method, pid, steps, wall, drafting):
        return PromptRecord(method=method, prompt_id=str(pid), category="c", num_tokens=100, steps=steps,
                            accepted_per_step=[1] * steps, num_drafted=0, num_accepted=0, wall_s=wall,
                            drafting_s=drafting, verifying_s=wall - drafting)

    # prompt 1: a drafts 0.5 s over 50 steps, c 0.1 s over 100 steps (1 ms a step): a's would be 0.05 s
    prompts = [rec("a", 1, 50, 2.0, 0.5), rec("c", 1, 100, 3.0, 0.1), rec("a", 2, 10, 1.0, 0.2)]
    like = mod.repriced(prompts, "a", "c")
    assert [(r.method, r.prompt_id) for r in like] == [("a", "1"), ("c", "1")]  # a's prompt 2: c did not run it
    assert abs(like[0].wall_s - (2.0 - 0.5 + 0.05)) < 1e-12 and abs(like[0].drafting_s - 0.05) < 1e-12
    assert like[1] is prompts[1] and prompts[0].wall_s == 2.0  # others as they were, the input untouched
    none = mod.repriced(prompts, "a", "none")
    assert [r.wall_s for r in none] == [1.5, 3.0, 0.8]


def test_issue16_targets_checks_each_target_and_fails_the_ones_missed(tmp_path, capsys):
    """benchmarks/issue16_targets.py: a target holds on the point estimate; one missed makes the
    exit status 1 and its row says no; identity is checked only in float32; the simulator's rows
    come from simulate's table or its --json output."""
    from specstore.schemas.bench import BenchResult, MethodResult, PromptRecord, Summary

    mod = _load("issue16_targets")

    def rec(method, pid, wall):
        return PromptRecord(method=method, prompt_id=str(pid), category="c", num_tokens=100, steps=10,
                            accepted_per_step=[10] * 10, num_drafted=0, num_accepted=0, wall_s=wall, drafting_s=0.0,
                            verifying_s=wall)

    # seconds per prompt: respec 2.1x ar, SuffixDecoding 1.7x (respec 1.235x ahead), dresd 1.2x, rest 1.3x
    walls = {"ar": 4.2, "pld": 3.0, "rest": 4.2 / 1.3, "dresd": 3.5, "respec": 2.0, "suffixdecoding": 4.2 / 1.7}

    def result(dtype, pld_mat_b):
        prompts = [rec(m, p, w * (1 + 0.01 * p)) for p in range(4) for m, w in walls.items()]
        methods = {}
        for m, w in walls.items():
            cats = {c: Summary(num_prompts=2, num_tokens=200, mat=mat, acceptance_rate=0.1, tokens_per_s=1.0,
                               speedup_vs_ar=1.0, drafting_share=0.0)
                    for c, mat in {"a": 2.0 if m == "respec" else 1.5, "b": 2.0 if m == "respec" else pld_mat_b}.items()}
            methods[m] = MethodResult(num_prompts=4, num_tokens=400, mat=1.5, acceptance_rate=0.1, tokens_per_s=1.0,
                                      speedup_vs_ar=walls["ar"] / w, speedup_ci=(0.9 * walls["ar"] / w, 1.1 * walls["ar"] / w),
                                      drafting_share=0.0, lossless=True, identical_to_ar=None if m == "ar" else m != "pld",
                                      per_category=cats)
        return BenchResult(created_at="t", command="c", machine={}, device="cpu", dtype=dtype, model="m", datastore="d@1",
                           manifest_sha256=None, torch_version="t", transformers_version="t", questions="q",
                           max_new_tokens=8, temperature=0.0, methods=methods, prompts=prompts)

    rows = {(t, s): (text, holds) for t, s, text, holds in mod.check({"code-id": result("bfloat16", 1.8)})}
    assert rows[("respec >= 2.0x ar", "code-id")][1] is True
    assert rows[("respec >= 1.15x SuffixDecoding (paired)", "code-id")][0].startswith("1.235 [")
    assert rows[("dresd >= rest (paired)", "code-id")][1] is False  # 1.2x against 1.3x
    assert rows[("respec MAT >= pld MAT, each category", "code-id")] == ("2 of 2 categories; closest b: 2.00 / 1.80", True)
    assert rows[("identical to ar (float32)", "code-id")] == ("bfloat16: not checked", None)
    path = tmp_path / "r.json"
    path.write_text(result("float32", 2.5).model_dump_json())
    table = tmp_path / "sim.txt"
    table.write_text("| method | options | cost-aware | MAT | drafted tokens per step | drafting ms per step | predicted speedup vs ar | rank |\n"
                     "|---|---|---|---|---|---|---|---|\n| respec | {} | on | 2.0 | 5.0 | 1.0 | 2.50x | 1 |\n"
                     "| dresd | {} | on | 1.5 | 5.0 | 1.0 | 1.25x | 1 |\n")
    code = mod.main([f"chat-large={path}", "--predicted", f"chat-large={table}"])
    out = capsys.readouterr().out
    assert code == 1 and "chat-large: d@1, cpu float32, 4 prompts" in out
    assert "| respec MAT >= pld MAT, each category | chat-large | 1 of 2 categories; closest b: 2.00 / 2.50; below in b | **no** |" in out
    assert "| identical to ar (float32) | chat-large | 4 of 5 methods; differ: pld | **no** |" in out
    assert "| simulator within 10%: respec | chat-large | predicted 2.50x, measured 2.10x (+19.0%) | **no** |" in out
    assert "| simulator within 10%: dresd | chat-large | predicted 1.25x, measured 1.20x (+4.2%) | yes |" in out
    assert "| respec >= 1.7x ar | chat-large | 2.10x [1.89, 2.31] | yes |" in out
    (tmp_path / "sim.json").write_text(json.dumps([{"method": "rest", "predicted_speedup": 1.3, "rank": 1}]))
    assert mod.main([f"code-full={path}", "--predicted", f"code-full={tmp_path / 'sim.json'}"]) == 1
    assert "| simulator within 10%: rest | code-full | predicted 1.30x, measured 1.30x (+0.0%) | yes |" in capsys.readouterr().out
    assert mod.main([f"nowhere={path}"]) == 2 and "SET one of" in capsys.readouterr().err


def test_issue16_run_builds_what_is_missing_benches_every_set_and_checks_the_targets(tmp_path, monkeypatch, capsys):
    """benchmarks/issue16_run.py's plan, its CLI calls recorded instead of run: a datastore
    already in its store is not built again, each set benches its own prompts (fewer with
    --prompts), simulate's JSON goes to the check, and the check's status is the exit status."""
    mod = _load("issue16_run")
    calls, built = [], {"code-id"}  # code-id is in its store already
    monkeypatch.setattr(mod, "DATA", tmp_path)  # the corpora's folder (../shared/data) need not exist here
    monkeypatch.setattr(mod, "has_datastore", lambda store, name: name in built)
    monkeypatch.setattr(mod, "run", lambda cmd, log: calls.append(cmd))
    monkeypatch.setattr(mod, "prepare_chat", lambda corpora, records, ids: (corpora / "chat_ood.jsonl", None))
    monkeypatch.setattr(mod, "prepare_full", lambda corpora: {"code": corpora / "code_full.jsonl", "chat": corpora / "chat.jsonl"})
    monkeypatch.setattr(mod, "sample_mt_bench", lambda corpora, n: corpora / f"mt_{n}.jsonl")

    class Done:
        def __init__(self, cmd, returncode=0, stdout=""):
            self.args, self.returncode, self.stdout, self.stderr = cmd, returncode, stdout, ""

    checked = []

    def fake_run(cmd, **_):
        if "simulate" in cmd:
            return Done(cmd, stdout='[{"method": "pld", "predicted_speedup": 1.2, "rank": 1}]')
        checked.append(cmd)
        return Done(cmd, returncode=1, stdout="| target | set | measured | holds |\n")

    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    code = mod.main(["--sets", "code-id,chat-large", "--store", str(tmp_path / "small"), "--full-store", str(tmp_path / "full"),
                     "--corpora", str(tmp_path / "corpora"), "--out", str(tmp_path / "out"), "--prompts", "3"])
    assert code == 1  # the check's status
    builds = [c for c in calls if "build" in c]
    benches = [c for c in calls if "bench" in c]
    assert len(builds) == 1 and builds[0][builds[0].index("--name") + 1] == "chat-large"
    assert builds[0][builds[0].index("--store") + 1] == str(tmp_path / "full")
    assert builds[0][builds[0].index("--corpus") + 1] == str(tmp_path / "corpora" / "chat.jsonl")
    assert [b[b.index("--datastore") + 1] for b in benches] == ["code-id", "chat-large"]
    assert [b[b.index("--limit") + 1] for b in benches] == ["3", "3"]  # 24 and 32 without --prompts
    assert benches[0][benches[0].index("--skip") + 1] == "1900" and "respec.head=auto" in benches[0]
    assert benches[1][benches[1].index("--questions") + 1] == str(tmp_path / "corpora" / "mt_4.jsonl")
    out = tmp_path / "out"
    assert checked[0][2:] == [f"code-id={out / 'code_id.json'}", f"chat-large={out / 'chat_large.json'}",
                              "--predicted", f"code-id={out / 'simulate_code_id.json'}",
                              "--predicted", f"chat-large={out / 'simulate_chat_large.json'}"]
    assert (out / "simulate_code_id.json").read_text().startswith("[{") and (out / "targets.md").is_file()
    try:
        mod.main(["--sets", "code-id,nowhere"])
    except SystemExit as exc:
        assert exc.code == 2 and "nowhere" in capsys.readouterr().err
    else:
        raise AssertionError("an unknown set must be refused")
