"""`specstore simulate`: MAT from stored greedy ``ar`` references, without decoding.

Under greedy verification the accepted path is the longest tree path that equals the
reference, and the bonus token is the reference's next token, so a drafter can be replayed
against references alone. Owns the replay verifier (``ReplayVerifier``: the TreeVerifier's
interface, answering from the reference) and the command; the loop is decode.py's own
``decode``, so the states (tokens, budget, hidden state and logits at the last processed
token), trees, feedback and stops are the bench's by construction. pld and rest need no model
at all; methods that read the target's states (the registry's ``states``: dresd, respec) get
them from one full forward over each reference.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specstore.runtime.bench.runner import parse_options
from specstore.runtime.decode import DecodeStats, context_limit, decode
from specstore.runtime.drafters.registry import datastore_methods, make_drafter, needs_dense, needs_states
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.forward import forward_with_hidden
from specstore.runtime.sampling import children_lists
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import AcceptanceRule, Prefill, StepOutput, VerifyResult
from specstore.schemas.bench import BenchResult


@dataclass(slots=True)
class Reference:
    prompt_ids: list[int]
    output_ids: list[int]  # greedy ar output (ends with EOS when decoding stopped on one)


def greedy_walk(tree: DraftTree, expected: list[int]) -> tuple[list[int], int | None]:
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


class ReplayVerifier:
    """Answers ``prefill`` and ``step`` from a greedy reference: accepts along it and returns
    the stored hidden state and logits at the last accepted position. ``states``: (hidden
    [T, H], logits [T, V]) over prompt + output, or None for drafters that read neither.

    The decode loop never asks past the reference when its stops are the reference's own (see
    ``simulate_one``); a path that runs past it is accepted up to the end (the end is an EOS
    there, which the loop cuts at) and gets the bonus -1, never committed."""

    def __init__(self, ref: Reference, states: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.full = [*ref.prompt_ids, *ref.output_ids]
        self.states = states
        self.num_done = 0  # tokens of ``full`` committed so far

    def _at(self, position: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (None, None) if self.states is None else (self.states[0][position], self.states[1][position])

    def prefill(self, prompt_ids: list[int]) -> Prefill:
        self.num_done = len(prompt_ids) + 1
        return Prefill(self.full[len(prompt_ids)], *self._at(len(prompt_ids) - 1))

    def step(self, pending: int, tree: DraftTree, acceptance: AcceptanceRule | None = None) -> StepOutput:
        if acceptance is not None:
            raise SpecstoreError("a drafter's own acceptance rule (respec relaxed=on) cannot be replayed: simulate strict drafters")
        assert self.num_done < len(self.full), "the replay ran past its reference"
        accepted, bonus = greedy_walk(tree, self.full[self.num_done :])
        last = self.num_done - 1 + len(accepted)  # the last token the target would have processed
        self.num_done += len(accepted) + 1
        result = VerifyResult(accepted, tree.tokens[accepted].tolist(), -1 if bonus is None else bonus, len(tree))
        return StepOutput(result, *self._at(last))


def simulate_one(drafter, ref: Reference, max_new_tokens: int, context: int | None,
                 states: tuple[torch.Tensor, torch.Tensor] | None = None) -> DecodeStats:
    """Replay one reference through ``decode``. Stops where ar stopped: at ``max_new_tokens``,
    at the ``context`` limit (None: none), or on the reference's last token when it ended
    earlier (an EOS: ar never emits one before it stops on it)."""
    out, done = ref.output_ids, len(ref.prompt_ids) + len(ref.output_ids)
    if not out:
        return DecodeStats()
    ended_early = len(out) < max_new_tokens and (context is None or done < context)
    eos = (out[-1],) if ended_early else ()
    return decode(ReplayVerifier(ref, states), ref.prompt_ids, drafter, max_new_tokens, eos_ids=eos, context=context).stats


@torch.inference_mode()
def reference_states(model, ref: Reference) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([ref.prompt_ids + ref.output_ids], device=next(model.parameters()).device)
    logits, hidden, _ = forward_with_hidden(model, input_ids=ids, use_cache=False)
    return hidden[0], logits[0]


def simulate(make: Callable[[], object], refs: list[Reference], max_new_tokens: int, model=None,
             context: int | None = None) -> list[DecodeStats]:
    """Replay every reference with one drafter from ``make``. ``model``: computes the states
    (hidden, logits) drafters read; ``context``: the target's limit (default: ``model``'s)."""
    drafter = make()
    if context is None and model is not None:
        context = context_limit(model)
    return [simulate_one(drafter, r, max_new_tokens, context, reference_states(model, r) if model is not None else None)
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
    need_states, with_datastore = needs_states(methods), datastore_methods(methods)
    if with_datastore and args.datastore is None:
        raise SpecstoreError(f"methods {', '.join(with_datastore)} need --datastore")
    lm = load_model(args.model, dtype="float32") if (need_states or with_datastore) else None
    ds = None
    if with_datastore:
        from specstore.runtime.store import Store

        ds = Datastore.open(Store.from_args(args), args.datastore, model_info=lm.info, dense=needs_dense(methods))
    rows = []
    for m in methods:
        grid = sweeps.get(m, {})
        keys = sorted(grid)
        values = [v if isinstance(v, list) else [v] for v in (grid[k] for k in keys)]
        for combo in itertools.product(*values) if keys else [()]:
            opts = {**base.get(m, {}), **dict(zip(keys, combo, strict=True))}
            sims = simulate(lambda m=m, opts=opts: make_drafter(m, datastore=ds, **opts), refs, bench.max_new_tokens,
                            lm.model if need_states else None, context_limit(lm.model) if lm is not None else None)
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
