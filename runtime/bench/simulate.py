"""`specstore simulate`: MAT from stored greedy ``ar`` references, without decoding.

Under greedy verification the accepted path is the longest tree path that equals the
reference, and the bonus token is the reference's next token, so a drafter can be replayed
against references alone: the same states (tokens, budget, hidden state and logits at the last
processed token), the same trees, the same feedback. pld and rest need no model at all; dresd
and respec read hidden states and logits from one full forward over each reference. The
result equals the bench's MAT for the same settings (tests/test_simulate.py).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specstore.runtime.bench.runner import NEEDS_DATASTORE, parse_options
from specstore.runtime.decode import context_limit
from specstore.runtime.drafters.base import DecodeState, VerifyResult
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.forward import forward_with_hidden
from specstore.runtime.sampling import children_lists
from specstore.runtime.verify import clip_depth
from specstore.schemas.bench import BenchResult


@dataclass(slots=True)
class Reference:
    prompt_ids: list[int]
    output_ids: list[int]  # greedy ar output (ends with EOS when decoding stopped on one)


@dataclass(slots=True)
class SimResult:
    num_tokens: int
    steps: int
    accepted_per_step: list[int]
    num_drafted: int
    num_accepted: int

    @property
    def mat(self) -> float:
        return self.num_tokens / self.steps if self.steps else 0.0


def greedy_walk(tree, expected: list[int]) -> tuple[list[int], int | None]:
    """Accepted node indices along the reference, and the bonus (None past the reference's end)."""
    children, tokens = children_lists(tree), tree.tokens.tolist()
    accepted, row = [], 0
    while True:
        depth = len(accepted)
        want = expected[depth] if depth < len(expected) else None
        nxt = next((c for c in children[row] if tokens[c] == want), None) if want is not None else None
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        row = nxt + 1


def simulate_one(drafter, ref: Reference, max_new_tokens: int, ctx: int | None,
                 states: tuple[torch.Tensor, torch.Tensor] | None = None) -> SimResult:
    """Replay one reference. ``states``: (hidden [T, H], logits [T, V]) of prompt + output."""
    prompt, out = ref.prompt_ids, ref.output_ids
    ctx = ctx if ctx is not None else len(prompt) + max_new_tokens
    state = DecodeState(tokens=list(prompt), num_prompt=len(prompt))
    drafter.reset(list(prompt))
    res = SimResult(0, 0, [], 0, 0)
    if not out:
        return res
    new, tree, result = [out[0]], None, None  # the prefill commits the first token
    while True:
        state.tokens.extend(new)
        if states is not None:
            state.last_hidden, state.last_logits = states[0][len(state.tokens) - 2], states[1][len(state.tokens) - 2]
        res.steps += 1
        res.accepted_per_step.append(len(new))
        if result is not None:
            res.num_drafted += result.num_drafted
            res.num_accepted += min(len(result.accepted_tokens), len(new))
            drafter.observe(state, tree, result)
        done = len(state.generated)
        if done >= len(out):
            res.num_tokens = done
            return res
        state.budget = min(max_new_tokens - done, ctx - len(state.tokens)) - 1
        state.step = res.steps
        tree = clip_depth(drafter.propose(state), state.budget)
        accepted, bonus = greedy_walk(tree, out[done:])
        tokens = tree.tokens[accepted].tolist()
        result = VerifyResult(accepted, tokens, bonus if bonus is not None else -1, len(tree))
        new = (tokens + ([bonus] if bonus is not None else []))[: len(out) - done]


@torch.inference_mode()
def reference_states(model, ref: Reference) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([ref.prompt_ids + ref.output_ids], device=next(model.parameters()).device)
    logits, hidden, _ = forward_with_hidden(model, input_ids=ids, use_cache=False)
    return hidden[0], logits[0]


def simulate(make: Callable[[], object], refs: list[Reference], max_new_tokens: int, model=None) -> list[SimResult]:
    drafter = make()
    ctx = context_limit(model) if model is not None else None
    return [simulate_one(drafter, r, max_new_tokens, ctx, reference_states(model, r) if model is not None else None)
            for r in refs]


def references_from(result: BenchResult) -> list[Reference]:
    refs = [Reference(r.prompt_ids, r.output_ids) for r in result.prompts
            if r.method == "ar" and r.prompt_ids is not None and r.output_ids is not None]
    if not refs:
        raise SpecstoreError("the bench result holds no ar references (prompt_ids/output_ids of method ar)")
    return refs


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def run_simulate_command(args) -> int:
    from specstore.runtime.bench.report import load_result
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.models import load_model

    bench = load_result(args.references)
    refs = references_from(bench)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    base = parse_options(args.option)
    sweeps = {m: {k: [_value(x) for x in str(v).split(",")] if not isinstance(v, list) else v for k, v in o.items()}
              for m, o in parse_options(args.sweep).items()}
    need_model = any(m in ("dresd", "respec") for m in methods)
    lm = load_model(args.model, dtype="float32") if (need_model or any(m in NEEDS_DATASTORE for m in methods)) else None
    ds = None
    if any(m in NEEDS_DATASTORE for m in methods):
        if args.datastore is None:
            raise SpecstoreError("rest, dresd and respec need --datastore")
        ds = Datastore.open(args.store, args.datastore, model_info=lm.info, dense=need_model)
    rows = []
    for m in methods:
        grid = sweeps.get(m, {})
        keys = sorted(grid)
        values = [v if isinstance(v, list) else [v] for v in (grid[k] for k in keys)]
        for combo in itertools.product(*values) if keys else [()]:
            opts = {**base.get(m, {}), **dict(zip(keys, combo, strict=True))}
            sims = simulate(lambda m=m, opts=opts: make_drafter(m, datastore=ds, **opts), refs, bench.max_new_tokens,
                            lm.model if need_model else None)
            tokens, steps = sum(s.num_tokens for s in sims), sum(s.steps for s in sims)
            drafted = sum(s.num_drafted for s in sims)
            rows.append({"method": m, "options": opts, "mat": tokens / steps if steps else 0.0,
                         "drafted_per_step": drafted / max(steps - len(sims), 1), "num_prompts": len(sims)})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("| method | options | MAT | drafted tokens per step |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['method']} | {json.dumps(r['options'])} | {r['mat']:.3f} | {r['drafted_per_step']:.1f} |")
    return 0
