"""The benchmark scripts' own logic that their figures rest on: the chat stream's held-out split
(by instruction, never by row), the serving loop's paired before/after comparison and the paired
ratio of two methods' tokens/s (benchmarks/paired_ratio.py)."""

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
