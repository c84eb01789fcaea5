"""Metrics computed from per-prompt step logs (pure functions; tests feed hand-made logs)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence

import numpy as np

from specstore.schemas.bench import PromptRecord, Summary


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where the sequences differ (a length difference counts), None if identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_LEVEL = 0.95
BOOTSTRAP_SEED = 0


def speedup_of(ar_wall, ar_tokens, wall, tokens):
    """Tokens/s ratio over paired prompts (arrays, or [resamples, prompts] arrays): equals the
    wall-time ratio when outputs match, stays fair when they do not."""
    return (np.sum(tokens, axis=-1) / np.sum(wall, axis=-1)) / (np.sum(ar_tokens, axis=-1) / np.sum(ar_wall, axis=-1))


def bootstrap_speedup(pairs: Sequence[tuple[PromptRecord, PromptRecord]], resamples: int = BOOTSTRAP_RESAMPLES,
                      level: float = BOOTSTRAP_LEVEL, seed: int = BOOTSTRAP_SEED) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the speedup over prompts: ``resamples`` draws of the
    (ar, method) pairs with replacement (paired: a prompt's two times stay together), the
    speedup of each draw, the central ``level`` share. None for fewer than two prompts."""
    if len(pairs) < 2:
        return None
    cols = np.array([(a.wall_s, a.num_tokens, r.wall_s, r.num_tokens) for a, r in pairs], dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(pairs), size=(resamples, len(pairs)))
    draws = cols[idx]  # [resamples, prompts, 4]
    with np.errstate(divide="ignore", invalid="ignore"):
        values = speedup_of(draws[..., 0], draws[..., 1], draws[..., 2], draws[..., 3])
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def summarise(records: Sequence[PromptRecord], ar_records: Sequence[PromptRecord] | None = None) -> Summary:
    """Aggregate one method's records; ``ar_records`` (same prompts) give the speedup."""
    if not records:
        raise ValueError("no records to summarise")
    tokens = sum(r.num_tokens for r in records)
    steps = sum(r.steps for r in records)
    drafted = sum(r.num_drafted for r in records)
    accepted = sum(r.num_accepted for r in records)
    wall = sum(r.wall_s for r in records)
    drafting = sum(r.drafting_s for r in records)
    hist: Counter[int] = Counter()
    for r in records:
        # the first forward is the prefill (one token, no draft); later steps accepted n drafts + 1 bonus
        hist.update(max(n - 1, 0) for n in r.accepted_per_step[1:])
    latencies = [ms for r in records for ms in r.retrieval_ms]
    identical = [r.identical_to_ar for r in records if r.identical_to_ar is not None]
    speedup = interval = None
    if ar_records:
        ar_by_key = {(r.prompt_id, r.turn): r for r in ar_records}
        pairs = [(ar_by_key[(r.prompt_id, r.turn)], r) for r in records if (r.prompt_id, r.turn) in ar_by_key]
        ar_wall, wall_same = sum(a.wall_s for a, _ in pairs), sum(r.wall_s for _, r in pairs)
        ar_tok, tok_same = sum(a.num_tokens for a, _ in pairs), sum(r.num_tokens for _, r in pairs)
        if pairs and wall_same > 0 and ar_wall > 0 and tok_same > 0:
            # tokens/s ratio: equals the wall-time ratio when outputs match, stays fair when they do not
            speedup = (tok_same / wall_same) / (ar_tok / ar_wall)
            interval = bootstrap_speedup(pairs)
    return Summary(
        num_prompts=len(records),
        num_tokens=tokens,
        mat=tokens / steps if steps else 0.0,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        speedup_vs_ar=speedup,
        speedup_ci=interval,
        speedup_ci_level=BOOTSTRAP_LEVEL if interval is not None else None,
        drafting_share=drafting / wall if wall > 0 else 0.0,
        retrieval_ms_median=statistics.median(latencies) if latencies else None,
        accepted_length_histogram=dict(sorted(hist.items())),
        identical_to_ar=all(identical) if identical else None,
        identical_share=sum(identical) / len(identical) if identical else None,
        num_relaxed=sum(r.num_relaxed for r in records),
    )
