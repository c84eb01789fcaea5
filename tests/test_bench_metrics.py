"""Benchmark metrics from hand-made step logs give the hand-computed values."""

import pytest

from specstore.runtime.bench.metrics import first_difference, summarise
from specstore.schemas.bench import PromptRecord


def rec(method, pid, tokens, per_step, drafted, accepted, wall, drafting=0.0, identical=None, ms=()):
    return PromptRecord(
        method=method, prompt_id=pid, category="c", num_tokens=tokens, steps=len(per_step),
        accepted_per_step=per_step, num_drafted=drafted, num_accepted=accepted, wall_s=wall,
        drafting_s=drafting, verifying_s=wall - drafting, identical_to_ar=identical, retrieval_ms=list(ms),
    )


def test_hand_computed_summary():
    ar = [rec("ar", "a", 4, [1, 1, 1, 1], 0, 0, 4.0), rec("ar", "b", 3, [1, 1, 1], 0, 0, 2.0)]
    # prompt a: prefill 1, then steps committing 3 (2 drafts + bonus) and 0 drafts + bonus... = 1+3 = 4 tokens in 2 forwards
    # prompt b: prefill 1, then 2 (1 draft + bonus) = 3 tokens in 2 forwards
    rest = [
        rec("rest", "a", 4, [1, 3], 5, 2, 2.0, drafting=0.5, identical=True, ms=(1.0, 3.0)),
        rec("rest", "b", 3, [1, 2], 4, 1, 1.0, drafting=0.1, identical=True, ms=(2.0,)),
    ]
    s = summarise(rest, ar)
    assert s.mat == pytest.approx(7 / 4)
    assert s.acceptance_rate == pytest.approx(3 / 9)
    assert s.tokens_per_s == pytest.approx(7 / 3.0)
    assert s.speedup_vs_ar == pytest.approx((7 / 3.0) / (7 / 6.0))  # = 2.0
    assert s.drafting_share == pytest.approx(0.6 / 3.0)
    assert s.retrieval_ms_median == pytest.approx(2.0)
    assert s.accepted_length_histogram == {1: 1, 2: 1}
    assert s.identical_to_ar is True and s.identical_share == 1.0
    a = summarise(ar, ar)
    assert a.mat == 1.0 and a.speedup_vs_ar == pytest.approx(1.0) and a.acceptance_rate == 0.0


def test_identical_to_ar_fails_on_one_token():
    out_ar = [5, 6, 7, 8]
    assert first_difference(out_ar, [5, 6, 7, 8]) is None
    assert first_difference(out_ar, [5, 6, 9, 8]) == 2
    assert first_difference(out_ar, [5, 6, 7]) == 3
    recs = [rec("pld", "a", 4, [1, 3], 2, 2, 1.0, identical=True), rec("pld", "b", 4, [1, 3], 2, 2, 1.0, identical=False)]
    s = summarise(recs)
    assert s.identical_to_ar is False and s.identical_share == 0.5 and s.speedup_vs_ar is None


def test_empty_records_rejected():
    with pytest.raises(ValueError):
        summarise([])


def paired(n, seed):
    """``n`` prompts: ar times, and a method ~1.5x faster with per-prompt noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ar_wall = rng.uniform(1.0, 3.0, size=n)
    ratio = rng.normal(1.5, 0.3, size=n).clip(0.5)
    ar = [rec("ar", str(i), 100, [1] * 100, 0, 0, float(w)) for i, w in enumerate(ar_wall)]
    fast = [rec("x", str(i), 100, [1, 99], 99, 99, float(w / r)) for i, (w, r) in enumerate(zip(ar_wall, ratio, strict=True))]
    return ar, fast


def test_bootstrap_interval_holds_the_estimate_narrows_and_is_deterministic():
    from specstore.runtime.bench.metrics import bootstrap_speedup

    ar, fast = paired(8, 1)
    s = summarise(fast, ar)
    lo, hi = s.speedup_ci
    assert lo < s.speedup_vs_ar < hi and s.speedup_ci_level == 0.95
    assert summarise(fast, ar).speedup_ci == (lo, hi)  # fixed seed: the same interval every time
    pairs = list(zip(ar, fast, strict=True))
    assert bootstrap_speedup(pairs, seed=1) != (lo, hi)  # another seed, other draws
    ar_many, fast_many = paired(64, 1)
    lo64, hi64 = summarise(fast_many, ar_many).speedup_ci
    assert hi64 - lo64 < hi - lo  # more prompts, a narrower interval
    # identical times on every prompt: no spread at all
    same = [rec("x", str(i), 100, [1, 99], 99, 99, a.wall_s / 2) for i, a in enumerate(ar)]
    assert summarise(same, ar).speedup_ci == pytest.approx((2.0, 2.0))
    assert bootstrap_speedup(pairs[:1]) is None  # one prompt: no interval


def test_results_without_intervals_still_load(tmp_path):
    """A result file written before speedup intervals and cost models existed loads and reports."""
    import json

    from specstore.runtime.bench.report import load_result, markdown_table
    from specstore.schemas.bench import BenchResult, MethodResult

    ar = [rec("ar", "a", 4, [1, 1, 1, 1], 0, 0, 4.0), rec("ar", "b", 3, [1, 1, 1], 0, 0, 2.0)]
    summary = summarise(ar, ar).model_dump(exclude={"speedup_ci", "speedup_ci_level"})
    old = BenchResult(created_at="t", command="c", machine={}, device="cpu", dtype="bfloat16", model="m",
                      datastore=None, manifest_sha256=None, torch_version="2", transformers_version="5",
                      questions="q", max_new_tokens=4, temperature=0.0,
                      methods={"ar": MethodResult(**summary, lossless=True)}).model_dump(mode="json")
    del old["cost_model"]
    for m in old["methods"].values():
        del m["speedup_ci"], m["speedup_ci_level"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = load_result(path)
    assert loaded.methods["ar"].speedup_ci is None and loaded.cost_model is None
    assert "| ar | 1.00 | 0.0% | 1.2 | 1.00x |" in markdown_table(loaded, "old")
