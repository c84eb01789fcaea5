"""The decode loop: prefill, then propose -> verify -> commit -> observe until a stop.

Owns the stop rules (EOS, also inside an accepted draft; ``max_new_tokens``; the model's
context), the draft budget handed to drafters, and the step statistics. Works on token ids
only: prompts, chat templates and text belong to api.py.

Stops exactly where plain decoding stops: accepted draft tokens after an EOS or beyond the
limit are cut before they are committed. A prompt must leave room for one new token
(``len(prompt) < context``) unless ``max_new_tokens`` is 0; there is no silent truncation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from specstore.runtime.drafters.base import DecodeState, Drafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.sampling import Sampling
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import TreeVerifier, clip_depth


@dataclass(slots=True)
class DecodeStats:
    """``steps``: target forwards including the prefill; ``accepted_per_step``: tokens each
    forward committed (the prefill commits 1); drafting_s covers propose + observe, verifying_s
    the forwards (prefill included), acceptance and cache compaction."""

    steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    num_relaxed: int = 0  # accepted by a lossy relaxed rule (ReSpec --relaxed on), counted in num_accepted too
    drafting_s: float = 0.0
    verifying_s: float = 0.0

    @property
    def mat(self) -> float:
        """Mean tokens committed per target forward (exactly 1.0 for plain decoding)."""
        return sum(self.accepted_per_step) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "mat": self.mat, "acceptance_rate": self.acceptance_rate}


@dataclass(slots=True)
class Decoded:
    token_ids: list[int]  # generated ids only (an EOS that stopped decoding included)
    stats: DecodeStats
    stop_reason: str  # "eos" | "length" | "context"


def context_limit(model) -> int | None:
    """Positions the model can take (``max_position_embeddings``), None when it has no limit."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return int(limit) if limit else None


def _cut(new: list[int], room: int, eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """Cut newly accepted tokens at the first EOS (kept; True) or at ``room`` tokens."""
    for i, tok in enumerate(new[:room]):
        if tok in eos_ids:
            return new[: i + 1], True
    return new[:room], False


def decode(
    model,
    prompt_ids: list[int],
    drafter: Drafter,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos_ids: Iterable[int] = (),
    on_commit: Callable[[list[int]], None] | None = None,
) -> Decoded:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; ``on_commit`` sees each batch of
    newly committed ids."""
    prompt_ids, eos, ctx = [int(t) for t in prompt_ids], frozenset(int(e) for e in eos_ids), context_limit(model)
    _check(prompt_ids, max_new_tokens, ctx)
    stats = DecodeStats()
    if max_new_tokens == 0:
        return Decoded([], stats, "length")
    ctx = ctx if ctx is not None else len(prompt_ids) + max_new_tokens
    verifier, tree = TreeVerifier(model, sampling), DraftTree.empty()
    state = DecodeState(tokens=list(prompt_ids), num_prompt=len(prompt_ids))
    drafter.reset(list(prompt_ids))

    clock = time.perf_counter()
    out = verifier.prefill(prompt_ids)
    stats.verifying_s += time.perf_counter() - clock
    while True:  # commit what the last forward produced, then draft and verify the next step
        room = min(max_new_tokens - len(state.generated), ctx - len(state.tokens))
        new, hit_eos = _cut([*out.result.accepted_tokens, out.result.bonus], room, eos)
        state.tokens.extend(new)
        state.last_hidden, state.last_logits = out.hidden, out.logits
        stats.steps += 1
        stats.accepted_per_step.append(len(new))
        stats.num_drafted += out.result.num_drafted
        stats.num_accepted += min(len(out.result.accepted_tokens), len(new))
        stats.num_relaxed += sum(out.result.relaxed[: len(new)])
        if on_commit is not None and new:
            on_commit(new)
        clock = time.perf_counter()
        if stats.steps > 1:
            drafter.observe(state, tree, out.result)
        stop = "eos" if hit_eos else "length" if len(state.generated) >= max_new_tokens else None
        if stop is None and len(state.tokens) >= ctx:
            stop = "context"
        if stop is not None:
            stats.drafting_s += time.perf_counter() - clock
            return Decoded(state.generated, stats, stop)
        # draft tokens along one path, leaving room for the bonus, within both limits
        state.budget = min(max_new_tokens - len(state.generated), ctx - len(state.tokens)) - 1
        state.step = stats.steps
        tree = clip_depth(drafter.propose(state), state.budget)
        stats.drafting_s += time.perf_counter() - clock

        clock = time.perf_counter()
        out = verifier.step(state.tokens[-1], tree)
        stats.verifying_s += time.perf_counter() - clock


def _check(prompt_ids: list[int], max_new_tokens: int, ctx: int | None) -> None:
    if max_new_tokens < 0:
        raise SpecstoreError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not prompt_ids:
        raise SpecstoreError("the prompt is empty: give at least one token (the chat template usually adds some)")
    if ctx is not None and max_new_tokens > 0 and len(prompt_ids) >= ctx:
        raise SpecstoreError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context is {ctx}: "
            "shorten it to leave room for new tokens (no silent truncation)"
        )
