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
