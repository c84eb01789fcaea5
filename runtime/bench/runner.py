"""`specstore bench`: every method on every question, interleaved prompt by prompt, one run.

Owns the run order (per question and turn, every method once, so machine noise hits all
methods alike; the order rotates from one prompt to the next, ``run_order``, so no method always
runs in the same place), timing, per-step drafting latency, identity to ar, transformers' own
baselines (``hf``: greedy ``model.generate``; ``hf-pld``: its prompt lookup), and the result
model (schemas/bench.py). Metrics are computed by metrics.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import shlex
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import transformers
from tqdm import tqdm

from specstore.runtime.api import generate, prompt_ids
from specstore.runtime.bench.host import HostMeter, Load
from specstore.runtime.bench.metrics import first_difference, summarise
from specstore.runtime.bench.questions import Question, load_questions
from specstore.runtime.datastore import Datastore
from specstore.runtime.device import dtype_name
from specstore.runtime.drafters.registry import (
    COST_AWARE_DEFAULT,
    check_index,
    cost_aware_methods,
    datastore_methods,
    make_drafter,
    needs_dense,
    uses_cost,
)
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.models import load_model
from specstore.schemas.bench import BenchResult, MethodResult, PromptRecord

HF_METHODS = ("hf", "hf-pld")  # transformers' own baselines, not drafters


def parse_options(items: list[str]) -> dict[str, dict]:
    """``["rest.max_nodes=32", "dresd.k=3"]`` -> ``{"rest": {"max_nodes": 32}, "dresd": {"k": 3}}``."""
    options: dict[str, dict] = defaultdict(dict)
    for item in items:
        key, eq, raw = item.partition("=")
        method, dot, name = key.partition(".")
        if not eq or not dot or not name:
            raise SpecstoreError(f"option {item!r} is not METHOD.KEY=VALUE")
        options[method][name] = parse_value(raw)
    return dict(options)


def parse_value(raw: str):
    """An option's value: JSON (``3``, ``0.5``, ``true``, ``[1, 2]``), ``inf`` / ``-inf`` as floats
    (``respec.entropy_threshold=inf``: always retrieve), anything else the text itself."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if raw.strip().lower() in ("inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"):
            return float(raw)
        return raw


class TimedDrafter:
    """Wraps a drafter to record each ``propose`` latency (the retrieval latency per step).
    ``watch``: a cost.CostModel that this method's verification steps correct online (for a
    method that does not prune by one itself: the simulator prices its steps with it)."""

    def __init__(self, inner, name: str | None = None, watch=None):
        self.inner, self.name, self.lossless = inner, name or inner.name, getattr(inner, "lossless", True)
        self.latencies_ms: list[float] = []
        self.watch = watch
        self._context = 0  # cached tokens when the step's tree was proposed (what its forward attends)

    @property
    def acceptance(self):
        """The inner drafter's own acceptance rule (None: the sampling rule)."""
        return getattr(self.inner, "acceptance", None)

    def reset(self, prompt: list[int]) -> None:
        self.latencies_ms = []
        self.inner.reset(prompt)

    def propose(self, state):
        self._context = len(state.tokens)
        start = time.perf_counter()
        tree = self.inner.propose(state)
        self.latencies_ms.append((time.perf_counter() - start) * 1000)
        return tree

    def observe(self, state, tree, result) -> None:
        if self.watch is not None and state.verify_s is not None:
            self.watch.observe(len(tree), self._context, state.verify_s)
        self.inner.observe(state, tree, result)


class ForwardCounter:
    """Counts the target's forward calls (for transformers' own generate)."""

    def __init__(self, model):
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


@dataclass(slots=True)
class Outcome:
    ids: list[int]
    text: str
    record: PromptRecord


def _run_hf(method: str, model, tokenizer, ids: list[int], max_new_tokens: int, meta: dict) -> Outcome:
    inputs = torch.tensor([ids], device=next(model.parameters()).device)
    kwargs = {"prompt_lookup_num_tokens": 10} if method == "hf-pld" else {}
    counter = ForwardCounter(model)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **kwargs)
    finally:
        counter.close()
    wall = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    steps = max(counter.count, 1)
    # transformers does not expose per-step acceptance; MAT = tokens / forwards still holds
    record = PromptRecord(method=method, num_tokens=len(new), steps=steps, accepted_per_step=_spread(len(new), steps),
                          num_drafted=0, num_accepted=0, wall_s=wall, drafting_s=0.0, verifying_s=wall, **meta)
    return Outcome(new, tokenizer.decode(new, skip_special_tokens=True), record)


def _spread(tokens: int, steps: int) -> list[int]:
    """An even split of ``tokens`` over ``steps`` (only the sum and count are meaningful)."""
    base, extra = divmod(tokens, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


COST_AWARE_MODES = ("auto", "on", "off", "both")
COST_SUFFIX = "+cost"  # with --cost-aware both: the cost-aware variant's label
VARIANT = ":"  # METHOD:NAME, a second run of METHOD with its own options (--option METHOD:NAME.KEY=VALUE)


def base_method(label: str) -> str:
    """The registered method of a label: ``respec:nohead+cost`` -> ``respec``."""
    return label.removesuffix(COST_SUFFIX).partition(VARIANT)[0]


def drafter_labels(methods: list[str], cost_aware: str) -> dict[str, tuple[str, bool]]:
    """Label -> (method, cost-aware?) in run order (auto/on/off: registry.uses_cost); ``both``
    runs each method that supports it twice, as ``METHOD`` (fixed caps) and ``METHOD+cost``.
    A method given as ``METHOD:NAME`` runs under that label, as METHOD with the options of
    ``--option METHOD:NAME.KEY=VALUE`` over METHOD's own: one method two ways, side by side."""
    if cost_aware not in COST_AWARE_MODES:
        raise SpecstoreError(f"--cost-aware must be one of {', '.join(COST_AWARE_MODES)}, got {cost_aware!r}")
    aware = set(cost_aware_methods(base_method(m) for m in methods))
    labels: dict[str, tuple[str, bool]] = {}
    for m in methods:
        base = base_method(m)
        if VARIANT in m and (base in HF_METHODS or not m.partition(VARIANT)[2]):
            raise SpecstoreError(f"method {m!r}: a variant is METHOD:NAME of a drafting method (e.g. respec:nohead)")
        if cost_aware != "both":
            labels[m] = (base, uses_cost(base, cost_aware))
        elif base not in aware:
            labels[m] = (base, False)
        else:
            labels[m] = (base, False)
            labels[m + COST_SUFFIX] = (base, True)
    return labels


def variant_options(options: dict, label: str) -> dict:
    """A label's drafter options: its method's, then its variant's over them."""
    return {**options.get(base_method(label), {}), **options.get(label.removesuffix(COST_SUFFIX), {})}


def _record_load(out: Outcome, load: Load | None) -> None:
    """Put the other work on the host during a run (host.py; None: not measured) in its record."""
    if load is not None:
        out.record = out.record.model_copy(update={"host_other_s": round(load.other_s, 4), "host_steal_s": round(load.steal_s, 4)})


def _run_method(drafter: TimedDrafter, model, tokenizer, ids, max_new_tokens, temperature, seed, meta) -> Outcome:
    start = time.perf_counter()
    res = generate(model, tokenizer, ids, drafter=drafter, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    wall = time.perf_counter() - start
    s = res.stats
    record = PromptRecord(method=drafter.name, num_tokens=len(res.token_ids), steps=s.steps,
                          accepted_per_step=list(s.accepted_per_step), num_drafted=s.num_drafted,
                          num_accepted=s.num_accepted, num_relaxed=getattr(s, "num_relaxed", 0), wall_s=wall,
                          drafting_s=s.drafting_s, verifying_s=s.verifying_s,
                          retrieval_ms=[round(x, 4) for x in drafter.latencies_ms], **meta)
    return Outcome(res.token_ids, res.text, record)


def run_bench(*, store, datastore: str | None, questions: str, methods: list[str], limit=None, skip=0,
              turns: int = 1, max_new_tokens: int = 128, temperature: float = 0.0, model: str | None = None,
              dtype: str = "auto", device: str = "auto", options: dict | None = None,
              progress: bool = True, command: str = "", cost_aware: str = COST_AWARE_DEFAULT, refresh_cost: bool = False,
              cost=None, cost_online: bool = True) -> BenchResult:
    """``cost_aware``: on, off or both (module cost_aware.py; ``both`` runs each cost-aware method
    with and without, side by side); ``cost``: a ready cost.CostModel (else the cached one of the
    loaded model, measured when missing or ``refresh_cost``; ``cost_online``: whether decoding
    corrects it, cost.CostModel.observe). Each cost-aware method gets its own copy, corrected from
    its own steps only, and so does every other method (ar included: a copy nothing prunes with,
    which the simulator prices with); the result stores the model as loaded (``cost_model``) and
    each method's copy as it ended (``cost_models``)."""
    options = options or {}
    methods = list(dict.fromkeys(["ar", *methods]))  # ar always runs: it is the reference
    qs: list[Question] = load_questions(questions, limit=limit, skip=skip)
    if not qs:
        raise SpecstoreError(f"no questions selected from {questions}")
    bases = list(dict.fromkeys(base_method(m) for m in methods))
    with_datastore = datastore_methods(bases)
    if with_datastore and datastore is None:
        raise SpecstoreError(f"methods {', '.join(with_datastore)} need --datastore")
    if with_datastore:  # a method the version cannot serve (dresd on a sparse one) fails before the model loads
        from specstore.runtime.store import Store

        record = (store if isinstance(store, Store) else Store(store)).resolve(datastore)
        check_index(bases, record.manifest, f"{record.name}@{record.version}")
    lm = load_model(model, dtype=dtype, device=device)
    ds = None
    if with_datastore:
        # prefetched, and the prefetch waited for, before any timing: a first search that faults in
        # the index's pages or reads a block's approximate index from disk (~0.1 s for the largest)
        # is a cold start, not decoding speed (the warm-up below), and SuffixDecoding's reference
        # builds its whole tree before the first prompt as well
        ds = Datastore.open(store, datastore, model_info=lm.info, dense=needs_dense(bases),
                            device=next(lm.model.parameters()).device, prefetch=True)
        for thread in ds.prefetching:
            thread.join()
    labels = drafter_labels(methods, cost_aware)
    if cost is None and any(aware for _, aware in labels.values()):
        from specstore.runtime.cost import load_cost_model

        cost = load_cost_model(lm.model, lm.info, refresh=refresh_cost, quiet=not progress)
        cost.online = cost_online
    # each cost-aware method corrects its own copy of the cost model online, from its own steps,
    # as it would serving alone: one shared copy learnt every method's steps (a tree of the same
    # size cost more after some drafters than after others), and priced respec's trees by a slope
    # 1.56x the table's in a code-ID run where respec alone learnt 0.99x (BENCHMARKS.md)
    costs = {label: copy.deepcopy(cost) for label, (_, aware) in labels.items() if aware}
    # every other method (ar included) corrects a copy too, from its own steps, that nothing
    # prunes with: the simulator prices each side of a predicted speedup with the copy of the
    # method that ran it (the table alone, measured before the run, priced ar's steps 12% above
    # what they took in a code-ID run; BENCHMARKS.md, seventeenth session)
    watched = {label: copy.deepcopy(cost) for label, (m, aware) in labels.items()
               if not aware and m not in HF_METHODS} if cost is not None else {}
    drafters = {label: TimedDrafter(make_drafter(m, datastore=ds, cost=costs.get(label), **variant_options(options, label)), label,
                                    watch=watched.get(label))
                for label, (m, aware) in labels.items() if m not in HF_METHODS}
    methods = list(labels)
    lossless = {m: (True if m in HF_METHODS else bool(getattr(drafters[m], "lossless", True))) for m in methods}

    # warm-up: first calls pay one-off costs (allocations, lazy imports) that are not decoding speed
    generate(lm.model, lm.tokenizer, "Hello", drafter="ar", max_new_tokens=4)

    records: list[PromptRecord] = []
    meter = HostMeter()  # what else the cores did during each run (nothing where the host does not say)
    bar = tqdm(total=len(qs) * turns, desc="bench", disable=not progress, dynamic_ncols=True)
    for q in qs:
        history: list[dict] = []
        for turn, text in enumerate(q.turns[:turns], start=1):
            history.append({"role": "user", "content": text})
            if q.raw_prompt:
                ids = lm.tokenizer(text)["input_ids"]
            else:
                ids = prompt_ids(lm.tokenizer, history)
            meta = {"prompt_id": q.question_id, "category": q.category, "turn": turn}
            outs = {}
            for m in run_order(methods, len(records) // len(methods)):
                sample = meter.start()
                if m in HF_METHODS:
                    outs[m] = _run_hf(m, lm.model, lm.tokenizer, ids, max_new_tokens, meta)
                else:
                    outs[m] = _run_method(drafters[m], lm.model, lm.tokenizer, ids, max_new_tokens, temperature, 0, meta)
                _record_load(outs[m], meter.stop(sample))
            ar_out = outs["ar"]
            for m in methods:
                out = outs[m]
                if m == "ar":
                    out.record = out.record.model_copy(update={"prompt_ids": ids, "output_ids": out.ids})
                elif temperature <= 0:
                    diff = first_difference(ar_out.ids, out.ids)
                    out.record = out.record.model_copy(update={"identical_to_ar": diff is None, "first_diff": diff})
                records.append(out.record)
            history.append({"role": "assistant", "content": ar_out.text})
            bar.update(1)
            bar.set_postfix_str(" ".join(f"{m}={_running_mat(records, m):.2f}" for m in methods))
    bar.close()

    by_method: dict[str, list[PromptRecord]] = defaultdict(list)
    for r in records:
        by_method[r.method].append(r)
    results = {}
    for m in methods:
        recs = by_method[m]
        overall = summarise(recs, by_method["ar"])
        per_cat = {}
        for cat in sorted({r.category for r in recs}):
            cat_recs = [r for r in recs if r.category == cat]
            per_cat[cat] = summarise(cat_recs, [r for r in by_method["ar"] if r.category == cat])
        results[m] = MethodResult(**overall.model_dump(), lossless=lossless[m], per_category=per_cat)
    dev = next(lm.model.parameters()).device
    return BenchResult(
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command=command,
        machine={"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                 "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                 "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None},
        device=str(dev),
        dtype=dtype_name(next(lm.model.parameters()).dtype),  # what ran (``auto`` resolved)
        model=lm.info.model_id,
        datastore=ds.ref if ds is not None else None,
        manifest_sha256=hashlib.sha256(ds.manifest.model_dump_json().encode()).hexdigest() if ds is not None else None,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        questions=str(questions),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        methods=results,
        prompts=records,
        cost_model=cost.to_json() if costs else None,
        cost_models={label: (costs.get(label) or watched[label]).to_json() for label in labels
                     if label in costs or label in watched},
    )


def run_order(methods: list[str], k: int) -> list[str]:
    """The order the ``k``-th prompt (from 0) runs ``methods`` in: rotated by ``k`` places, so
    that over the run every method takes every place equally often (a place after a new prompt
    or after a given method would otherwise favour or slow the same method at every prompt)."""
    k %= len(methods)
    return methods[k:] + methods[:k]


def _running_mat(records: list[PromptRecord], method: str) -> float:
    recs = [r for r in records if r.method == method]
    steps = sum(r.steps for r in recs)
    return sum(r.num_tokens for r in recs) / steps if steps else 0.0


def run_bench_command(args) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    from specstore.runtime.store import Store

    result = run_bench(store=Store.from_args(args), datastore=args.datastore, questions=args.questions, methods=methods,
                       limit=args.limit, skip=args.skip, turns=args.turns, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, model=args.model, dtype=args.dtype, device=args.device,
                       options=parse_options(args.option), progress=True, cost_aware=args.cost_aware,
                       refresh_cost=args.refresh_cost, cost_online=getattr(args, "cost_online", "on") == "on", command="specstore " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    from specstore.runtime.bench.report import markdown_table

    print(markdown_table(result, "bench"))
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(result.model_dump_json(indent=1))
        print(f"wrote {args.out}")
    return 0
