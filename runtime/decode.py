"""The decode loop: prefill, then propose -> verify -> commit -> observe until a stop.

Owns the stop rules (EOS, also inside an accepted draft; ``max_new_tokens``; the model's
context), the draft budget handed to drafters, cutting drafts at any id outside the verifier's
``vocab_size`` (a damaged datastore costs speed, never a crash), passing a drafter's own
acceptance rule to the verifier, and the step statistics. Drives any ``Verifier``: the target's TreeVerifier, or the
simulator's replay of a stored reference (bench/simulate.py). Works on token ids only: prompts,
chat templates and text belong to api.py.

Stops exactly where plain decoding stops: accepted draft tokens after an EOS or beyond the
limit are cut before they are committed. A prompt must leave room for one new token
(``len(prompt) < context``) unless ``max_new_tokens`` is 0; there is no silent truncation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch

from specstore.runtime.drafters.base import DecodeState, Drafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.sampling import Sampling
from specstore.runtime.tree import clip_depth, within_vocab
from specstore.runtime.verify import TreeVerifier


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
    def num_tokens(self) -> int:
        """Tokens committed (the prefill's included)."""
        return sum(self.accepted_per_step)

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
    target,
    prompt_ids: list[int],
    drafter: Drafter,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos_ids: Iterable[int] = (),
    on_commit: Callable[[list[int]], None] | None = None,
    *,
    context: int | None = None,
) -> Decoded:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; ``on_commit`` sees each batch of
    newly committed ids.

    ``target``: a causal LM (a TreeVerifier with ``sampling`` is built over it; ``context``
    defaults to its ``max_position_embeddings``) or a ready ``Verifier`` (``sampling`` is then
    its business; ``context`` None means no limit beyond ``max_new_tokens``)."""
    if isinstance(target, torch.nn.Module):
        verifier, context = TreeVerifier(target, sampling), context if context is not None else context_limit(target)
    else:
        verifier = target
    prompt_ids, eos = [int(t) for t in prompt_ids], frozenset(int(e) for e in eos_ids)
    _check(prompt_ids, max_new_tokens, context)
    stats = DecodeStats()
    if max_new_tokens == 0:
        return Decoded([], stats, "length")
    limit = len(prompt_ids) + max_new_tokens if context is None else min(context, len(prompt_ids) + max_new_tokens)
    state = DecodeState(tokens=list(prompt_ids), num_prompt=len(prompt_ids))
    drafter.reset(list(prompt_ids))
    acceptance = getattr(drafter, "acceptance", None)  # a drafter's own rule; None = sampling's
    vocab = getattr(verifier, "vocab_size", None)  # drafted ids outside it never reach the verifier
    timed = getattr(verifier, "timed", True)  # a replay's steps take no real time: drafters must not learn from it

    def commit(proposed: list[int], hidden, logits) -> str | None:
        """Append what a forward produced (cut at EOS and the limits); the stop reason, if any."""
        new, hit_eos = _cut(proposed, limit - len(state.tokens), eos)
        state.tokens.extend(new)
        state.last_hidden, state.last_logits = hidden, logits
        stats.steps += 1
        stats.accepted_per_step.append(len(new))
        if on_commit is not None and new:
            on_commit(new)
        if hit_eos:
            return "eos"
        if len(state.tokens) < limit:
            return None
        return "length" if len(state.tokens) - len(prompt_ids) >= max_new_tokens else "context"

    clock = time.perf_counter()
    first = verifier.prefill(prompt_ids)
    stats.verifying_s += time.perf_counter() - clock
    stop = commit([first.bonus], first.hidden, first.logits)
    while stop is None:
        # propose: draft tokens along one path, leaving room for the bonus, within both limits
        clock = time.perf_counter()
        state.budget, state.step = limit - len(state.tokens) - 1, stats.steps
        tree = within_vocab(clip_depth(drafter.propose(state), state.budget), vocab)
        drafted = time.perf_counter()
        # verify
        out = verifier.step(state.tokens[-1], tree, acceptance)
        verified = time.perf_counter()
        # commit
        result = out.result
        stop = commit([*result.accepted_tokens, result.bonus], out.hidden, out.logits)
        kept = stats.accepted_per_step[-1]
        stats.num_drafted += result.num_drafted
        stats.num_accepted += min(len(result.accepted_tokens), kept)
        if result.relaxed:
            stats.num_relaxed += sum(result.relaxed[:kept])
        # observe
        observed = time.perf_counter()
        state.verify_s = verified - drafted if timed else None
        drafter.observe(state, tree, result)
        stats.drafting_s += drafted - clock + time.perf_counter() - observed
        stats.verifying_s += verified - drafted
    return Decoded(state.tokens[len(prompt_ids) :], stats, stop)


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
