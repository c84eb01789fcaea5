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

import numpy as np
import torch

from specstore.runtime.bench.host import DISTURBED_CORES, HostMeter
from specstore.runtime.bench.runner import COST_SUFFIX, parse_options, parse_value
from specstore.runtime.decode import DecodeStats, context_limit, decode
from specstore.runtime.drafters.registry import (
    datastore_methods,
    make_drafter,
    needs_dense,
    needs_states,
    uses_cost,
)
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

    timed = False  # its steps take no real time: the decode loop gives drafters no timing to learn from

    def __init__(self, ref: Reference, states: tuple[torch.Tensor, torch.Tensor] | None = None,
                 evict: np.ndarray | None = None):
        self.full = [*ref.prompt_ids, *ref.output_ids]
        self.states = states
        self.evict = evict  # streamed over every step, as a forward streams the weights (cold_buffer)
        self.num_done = 0  # tokens of ``full`` committed so far
        self.trees: list[tuple[int, int]] = []  # per step: (tree nodes, cached tokens before the forward)

    def _at(self, position: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (None, None) if self.states is None else (self.states[0][position], self.states[1][position])

    def prefill(self, prompt_ids: list[int]) -> Prefill:
        self.num_done = len(prompt_ids) + 1
        return Prefill(self.full[len(prompt_ids)], *self._at(len(prompt_ids) - 1))

    def step(self, pending: int, tree: DraftTree, acceptance: AcceptanceRule | None = None) -> StepOutput:
        if acceptance is not None:
            raise SpecstoreError("a drafter's own acceptance rule (respec relaxed=on) cannot be replayed: simulate strict drafters")
        assert self.num_done < len(self.full), "the replay ran past its reference"
        if self.evict is not None:
            self.evict.sum()  # the next propose then finds the caches as decoding's does (cold_buffer)
        self.trees.append((len(tree), self.num_done - 1))
        accepted, bonus = greedy_walk(tree, self.full[self.num_done :])
        last = self.num_done - 1 + len(accepted)  # the last token the target would have processed
        self.num_done += len(accepted) + 1
        result = VerifyResult(accepted, tree.tokens[accepted].tolist(), -1 if bonus is None else bonus, len(tree))
        return StepOutput(result, *self._at(last))


COLD_BUFFER_CAP = 1 << 30  # bytes: the most a replay streams over between steps


def cold_buffer(model, dtype: str) -> np.ndarray | None:
    """A buffer of as many bytes as ``model``'s parameters take in ``dtype`` (the bench's; at most
    ``COLD_BUFFER_CAP``), for ``ReplayVerifier(evict=)``. A decoding step streams the target's
    weights through every cache, so the drafting after it runs cold; a replay has no forward,
    and its drafting ran 2.2-2.9x cheaper than the bench's (chat-large, BENCHMARKS.md), which
    over-predicted the speed of every method that drafts. None without a model."""
    if model is None:
        return None
    width = 2 if dtype in ("bfloat16", "float16") else 4
    nbytes = min(sum(p.numel() for p in model.parameters()) * width, COLD_BUFFER_CAP)
    return np.ones(max(nbytes // 4, 1), dtype=np.float32)


def simulate_one(drafter, ref: Reference, max_new_tokens: int, context: int | None,
                 states: tuple[torch.Tensor, torch.Tensor] | None = None) -> DecodeStats:
    """Replay one reference through ``decode``. Stops where ar stopped: at ``max_new_tokens``,
    at the ``context`` limit (None: none), or on the reference's last token when it ended
    earlier (an EOS: ar never emits one before it stops on it)."""
    return replay_one(drafter, ref, max_new_tokens, context, states).stats


@dataclass(slots=True)
class Replay:
    stats: DecodeStats
    trees: list[tuple[int, int]]  # per verification: (tree nodes, cached tokens)
    prompt_len: int


def replay_one(drafter, ref: Reference, max_new_tokens: int, context: int | None,
               states: tuple[torch.Tensor, torch.Tensor] | None = None, evict: np.ndarray | None = None) -> Replay:
    """``simulate_one`` with each verification's tree size and context (for the speed prediction);
    ``evict``: ``cold_buffer``'s, streamed over between steps."""
    out, done = ref.output_ids, len(ref.prompt_ids) + len(ref.output_ids)
    if not out:
        return Replay(DecodeStats(), [], len(ref.prompt_ids))
    ended_early = len(out) < max_new_tokens and (context is None or done < context)
    eos = (out[-1],) if ended_early else ()
    verifier = ReplayVerifier(ref, states, evict)
    stats = decode(verifier, ref.prompt_ids, drafter, max_new_tokens, eos_ids=eos, context=context).stats
    return Replay(stats, verifier.trees, len(ref.prompt_ids))


def predicted_seconds(replays: list[Replay], cost, ar_cost=None, drafting_s: float | None = None) -> tuple[float, float]:
    """(seconds the replayed method would take, seconds ar would take) on the same references:
    each verification of a tree priced by ``cost`` at its tree size and context, plus the
    replayed drafting time (``drafting_s``: that many seconds a replayed step instead); a
    verification of no tree, ar's forwards (one 0-node forward per token after the first) and
    each request's prefill on both sides (as the bench's wall times hold it; left out where the
    cost model has no prefill measurement) priced by ``ar_cost`` (None: ``cost``): a plain
    forward is the same whichever method drafts (``pricing``)."""
    ar_cost = cost if ar_cost is None else ar_cost
    method = ar = 0.0
    for r in replays:
        if not r.trees:
            continue
        prefill = ar_cost.prefill_seconds(r.prompt_len)
        if prefill is not None:
            method, ar = method + prefill, ar + prefill
        method += float(sum((cost if n > 0 else ar_cost).seconds_for(int(n), int(c)) for n, c in r.trees))
        method += r.stats.drafting_s if drafting_s is None else drafting_s * r.stats.steps
        ar_ctx = r.prompt_len + np.arange(r.stats.num_tokens - 1)  # ar: one forward per later token
        ar += float(sum(ar_cost.seconds_for(0, int(c)) for c in ar_ctx))
    return method, ar


def predicted_speedup(replays: list[Replay], cost, ar_cost=None, drafting_s: float | None = None) -> float | None:
    """Predicted speedup over ar (``predicted_seconds``); None when nothing was decoded."""
    method, ar = predicted_seconds(replays, cost, ar_cost, drafting_s)
    return ar / method if method > 0 else None


@torch.inference_mode()
def reference_states(model, ref: Reference) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([ref.prompt_ids + ref.output_ids], device=next(model.parameters()).device)
    logits, hidden, _ = forward_with_hidden(model, input_ids=ids, use_cache=False)
    return hidden[0], logits[0]


def simulate(make: Callable[[], object], refs: list[Reference], max_new_tokens: int, model=None,
             context: int | None = None) -> list[DecodeStats]:
    """Replay every reference with one drafter from ``make``. ``model``: computes the states
    (hidden, logits) drafters read; ``context``: the target's limit (default: ``model``'s)."""
    return [r.stats for r in replay(make, refs, max_new_tokens, model, context)]


def replay(make: Callable[[], object], refs: list[Reference], max_new_tokens: int, model=None,
           context: int | None = None, evict: np.ndarray | None = None) -> list[Replay]:
    """``simulate`` with each verification's tree size and context (``evict``: replay_one's)."""
    drafter = make()
    if context is None and model is not None:
        context = context_limit(model)
    return [replay_one(drafter, r, max_new_tokens, context, reference_states(model, r) if model is not None else None,
                       evict) for r in refs]


def fixed_drafting(drafter, seconds: float | None):
    """``drafter`` with its cost-aware wrapper (if any) pricing every step's drafting at
    ``seconds`` (None: as measured): ``--drafting-ms``."""
    from specstore.runtime.drafters.cost_aware import CostAwareDrafter

    if seconds is not None and isinstance(drafter, CostAwareDrafter):
        drafter.fix_drafting(seconds)
    return drafter


def _ar_records(result: BenchResult) -> list:
    return [r for r in result.prompts if r.method == "ar" and r.prompt_ids is not None and r.output_ids is not None]


def references_from(result: BenchResult) -> list[Reference]:
    refs = [Reference(r.prompt_ids, r.output_ids) for r in _ar_records(result)]
    if not refs:
        raise SpecstoreError("the bench result holds no ar references (prompt_ids/output_ids of method ar)")
    return refs


def mat_by_category(stats: list[DecodeStats], categories: list[str]) -> dict[str, float]:
    """MAT over the replays of each question category (in order of first appearance)."""
    sums: dict[str, list[int]] = {}
    for s, c in zip(stats, categories, strict=True):
        acc = sums.setdefault(c, [0, 0])
        acc[0] += s.num_tokens
        acc[1] += s.steps
    return {c: t / n if n else 0.0 for c, (t, n) in sums.items()}


def bench_cost_model(bench: BenchResult, args):
    """The cost model the bench's cost-aware drafters used (stored in its result), so that the
    replay prunes as the bench did; else (or with --refresh-cost) the cached one of the model
    in the bench's dtype (or --dtype) on --device, measured when missing."""
    from specstore.runtime.cost import CostModel, load_cost_model
    from specstore.runtime.models import load_model

    if bench.cost_model is not None and not args.refresh_cost:
        try:
            return CostModel.from_json(bench.cost_model)
        except (ValueError, KeyError, TypeError):
            pass
    timed = load_model(args.model, dtype=args.dtype or bench.dtype, device=args.device)
    return load_cost_model(timed.model, timed.info, refresh=args.refresh_cost, quiet=args.json)


def method_cost_model(bench: BenchResult, method: str, fallback, aware: bool = True):
    """The cost model ``method`` ended the bench with (``bench.cost_models``: each method corrects
    its own copy online), else ``fallback``. ``aware``: the cost-aware variant's copy first (its
    ``+cost`` label under ``--cost-aware both``), else the plain one's first."""
    from specstore.runtime.cost import CostModel

    labels = (method + COST_SUFFIX, method) if aware else (method, method + COST_SUFFIX)
    for label in labels:
        data = bench.cost_models.get(label)
        if data is not None:
            try:
                return CostModel.from_json(data)
            except (ValueError, KeyError, TypeError):
                break
    return fallback


def pricing(bench: BenchResult, method: str, table, aware: bool, refresh: bool = False):
    """(the cost model that prices ``method``'s replayed steps, the one that prices ar's): the
    copies each ended the bench with, corrected online from its own steps (the machine as it
    ran: a table measured before the run priced ar's steps 12% above what they took in a
    code-ID run, BENCHMARKS.md, seventeenth session); ``table`` for both where the bench
    stored no copy for either of them (an older result) or with ``--refresh-cost``.

    ``predicted_seconds`` prices the method's trees with its own copy whole, and every plain
    forward (its steps that verified no tree, ar's, the prefills) with ar's: a plain step is the
    same forward whichever method drafts, and ar corrected its ``level`` from every one of its
    steps, a drafting method only from the few it pruned to nothing, whose last dozen
    set it (respec's own level on a chat-OOD run, 1.21 against ar's 1.05, priced its plain steps
    so that it predicted 1.14x against 1.32x measured; BENCHMARKS.md, eighteenth session). But a
    method's tree corrections were learnt against its own level, step by step, so only the two
    together price its trees: where that level lagged, the offset made up for it (dresd on a
    chat-OOD run ended at level 0.91 against ar's 0.71 and offset -0.24; with ar's level its trees
    were priced 22% below a plain step and it predicted 1.46x against 1.11x measured; with its
    own, 1.20x; BENCHMARKS.md, thirty-second session)."""
    if refresh:
        return table, table
    price, ar_price = method_cost_model(bench, method, None, aware), method_cost_model(bench, "ar", None, False)
    if price is None or ar_price is None:
        return table, table
    return price, ar_price


def run_simulate_command(args) -> int:
    from specstore.runtime.bench.report import load_result
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.models import load_model

    bench = load_result(args.references)
    refs = references_from(bench)
    categories = [r.category or "-" for r in _ar_records(bench)]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    base = parse_options(args.option)
    sweeps = {m: {k: [parse_value(x) for x in str(v).split(",")] if not isinstance(v, list) else v for k, v in o.items()}
              for m, o in parse_options(args.sweep).items()}
    need_states, with_datastore = needs_states(methods), datastore_methods(methods)
    if with_datastore and args.datastore is None:
        raise SpecstoreError(f"methods {', '.join(with_datastore)} need --datastore")
    lm = load_model(args.model, dtype="float32") if (need_states or with_datastore) else None
    ds = None
    if with_datastore:
        from specstore.runtime.store import Store

        ds = Datastore.open(Store.from_args(args), args.datastore, model_info=lm.info, dense=needs_dense(methods))
    cost = bench_cost_model(bench, args)
    evict = None if args.warm_drafting else cold_buffer(lm.model if lm is not None else None, bench.dtype)
    fixed = None if getattr(args, "drafting_ms", None) is None else args.drafting_ms / 1e3
    if fixed is not None and not (fixed >= 0 and np.isfinite(fixed)):
        raise SpecstoreError(f"--drafting-ms must be a finite number >= 0, got {args.drafting_ms}")
    rows = []
    meter = HostMeter()  # other work on the host during each replay (its drafting is timed)
    for m in methods:
        grid = sweeps.get(m, {})
        keys = sorted(grid)
        values = [v if isinstance(v, list) else [v] for v in (grid[k] for k in keys)]
        with_cost = None
        if uses_cost(m, args.cost_aware):  # the method's own copy from the bench (a fresh table: the same for all)
            with_cost = cost if args.refresh_cost else method_cost_model(bench, m, cost)
        price, ar_price = pricing(bench, m, cost, with_cost is not None, args.refresh_cost)
        group = []
        for combo in itertools.product(*values) if keys else [()]:
            opts = {**base.get(m, {}), **dict(zip(keys, combo, strict=True))}
            sample = meter.start()
            reps = replay(lambda m=m, opts=opts, c=with_cost: fixed_drafting(make_drafter(m, datastore=ds, cost=c, **opts), fixed),
                          refs, bench.max_new_tokens, lm.model if need_states else None,
                          context_limit(lm.model) if lm is not None else None, evict)
            load = meter.stop(sample)
            sims = [r.stats for r in reps]
            tokens, steps = sum(s.num_tokens for s in sims), sum(s.steps for s in sims)
            drafted = sum(s.num_drafted for s in sims)
            drafting = sum(s.drafting_s for s in sims) if fixed is None else fixed * steps
            group.append({"method": m, "options": opts, "cost_aware": with_cost is not None,
                          "mat": tokens / steps if steps else 0.0,
                          "drafted_per_step": drafted / max(steps - len(sims), 1),
                          "drafting_ms_per_step": 1e3 * drafting / steps if steps else 0.0,
                          "predicted_speedup": predicted_speedup(reps, price, ar_price, fixed), "num_prompts": len(sims),
                          "mat_by_category": mat_by_category(sims, categories),
                          "host_cores": None if load is None else round(load.cores, 3)})
        group.sort(key=lambda r: -(r["predicted_speedup"] or 0.0))  # a sweep: best predicted shape first
        for rank, r in enumerate(group, start=1):
            r["rank"] = rank
        rows += group
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("| method | options | cost-aware | MAT | drafted tokens per step | drafting ms per step | predicted speedup vs ar | rank |\n"
              "|---|---|---|---|---|---|---|---|")
        for r in rows:
            pred = "-" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.2f}x"
            print(f"| {r['method']} | {json.dumps(r['options'])} | {'on' if r['cost_aware'] else 'off'} | {r['mat']:.3f} "
                  f"| {r['drafted_per_step']:.1f} | {r['drafting_ms_per_step']:.2f} | {pred} | {r['rank']} |")
        busy = [r for r in rows if fixed is None and (r["host_cores"] or 0.0) >= DISTURBED_CORES]
        if busy:
            named = ", ".join(f"{r['method']} {json.dumps(r['options'])} ({r['host_cores']:.2f} cores)" for r in busy)
            print(f"\n**Host busy** during the replays of {named}: other work averaged {DISTURBED_CORES} cores or more, so "
                  "their drafting times (priced into their trees and the predicted speedups) are not the drafter's alone. "
                  "Rerun on a quiet machine, or give --drafting-ms.")
        if getattr(args, "by_category", False):
            cats = list(dict.fromkeys(categories))
            print("\n| method | options | " + " | ".join(cats) + " |\n|---|---|" + "---|" * len(cats))
            for r in rows:
                print(f"| {r['method']} | {json.dumps(r['options'])} | " + " | ".join(f"{r['mat_by_category'][c]:.3f}" for c in cats) + " |")
    return 0
