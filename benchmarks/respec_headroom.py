"""Where ReSpec's accepted tokens are lost: its pool, its choice of candidates, or its pruning.

    python benchmarks/respec_headroom.py --references ref_code_tune.json --store /work/bench_store \\
        --datastore code-id --drafting-ms 0.95

Replays the bench result's ``ar`` references with cost-aware ``respec`` (as ``specstore simulate
--methods respec``: greedy verification, MAT from the text alone) and, at every step that drew on
the pool, compares what the target went on to write with

- every candidate the pool offered (resync ones included), uncut: the most tokens any one of them
  would have had accepted (the *pool oracle*);
- the candidates ReSpec chose (``max_candidates``, best EMA score first), uncut (*chosen oracle*);
- the pruned tree the verifier got (*accepted*).

Also: in how many steps some candidate had the first token right against how many accepted a
token (the first token is what most steps miss), which source held the best candidate, and two
checks of the pruner's inputs: its calibrated acceptance probability against how often the nodes
were accepted (every node whose parent was accepted is one trial), and, for dense candidates, how
often the first token was right by the neighbour's similarity (a signal the pruner does not bin)
and by how many other candidates agreed on it. ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

import numpy as np

SIMILARITY_BINS = (0.5, 0.65, 0.8, 0.9)  # cosine similarity bins of the dense table
PROBABILITY_BINS = (0.2, 0.4, 0.6, 0.8)  # the calibration table's bins of predicted probability


def common_prefix(a, b) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):  # to the shorter one
        if x != y:
            break
        n += 1
    return n


def summarise(steps: list[dict]) -> dict:
    """Figures over per-step records: ``accepted`` (tokens the tree had accepted), and for steps
    that drew on the pool ``pool`` (each candidate as (source, tokens right)) and ``chosen``
    (tokens right of each chosen candidate, uncut)."""
    pooled = [s for s in steps if s.get("pool")]
    out = {"steps": len(steps), "pool_steps": len(pooled)}
    if not pooled:
        return out
    best = [max(n for _, n in s["pool"]) for s in pooled]
    chosen = [max(s["chosen"], default=0) for s in pooled]
    accepted = [s["accepted"] for s in pooled]
    out.update({
        "accepted": float(np.mean(accepted)),
        "chosen_oracle": float(np.mean(chosen)),
        "pool_oracle": float(np.mean(best)),
        "first_covered": float(np.mean([b > 0 for b in best])),
        "first_accepted": float(np.mean([a > 0 for a in accepted])),
        # the chosen candidates held more than the tree got: its first token missing from the tree,
        # or the tree cut before the candidate's last right token
        "lost_missing": float(np.sum([c - a for c, a in zip(chosen, accepted, strict=True) if c > a and a == 0]) / len(pooled)),
        "lost_cut": float(np.sum([c - a for c, a in zip(chosen, accepted, strict=True) if c > a > 0]) / len(pooled)),
    })
    sources: Counter = Counter()
    for s, b in zip(pooled, best, strict=True):
        if b > 0:
            sources.update({src for src, n in s["pool"] if n == b})
    out["best_source"] = dict(sources.most_common())
    return out


def binned(pairs, edges) -> list[dict]:
    """(value, outcome) pairs: per bin of ``value`` its count, mean value and mean outcome."""
    rows = defaultdict(list)
    for value, outcome in pairs:
        rows[int(np.searchsorted(edges, value, side="right"))].append((value, outcome))
    bounds = (-np.inf, *edges, np.inf)
    return [{"bin": [float(bounds[b]), float(bounds[b + 1])], "n": len(v), "mean": float(np.mean([x for x, _ in v])),
             "rate": float(np.mean([y for _, y in v]))} for b, v in sorted(rows.items())]


def print_table(header: list[str], rows: list[list]) -> None:
    """A markdown table after a blank line."""
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--references", required=True, help="a bench result JSON with ar references")
    p.add_argument("--store", required=True)
    p.add_argument("--datastore", required=True)
    p.add_argument("--model", default=None, help="the target (default: the embedded default model)")
    p.add_argument("--drafting-ms", type=float, default=None,
                   help="price every step's drafting at this (simulate's --drafting-ms; default: as the replay measures it)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="a respec option (repeatable)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from specstore.runtime import retrieval
    from specstore.runtime.bench import simulate
    from specstore.runtime.bench.report import load_result
    from specstore.runtime.bench.runner import parse_value
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.decode import context_limit
    from specstore.runtime.drafters import cost_aware, respec, respec_pool
    from specstore.runtime.drafters.registry import make_drafter
    from specstore.runtime.models import load_model
    from specstore.runtime.store import Store

    bench = load_result(args.references)
    refs = simulate.references_from(bench)
    lm = load_model(args.model, dtype="float32")
    datastore = Datastore.open(Store(args.store), args.datastore, model_info=lm.info, dense=True)
    table = simulate.bench_cost_model(bench, argparse.Namespace(refresh_cost=False, model=None, dtype=None, device=None, json=True))
    cost = simulate.method_cost_model(bench, "respec", table)
    options = {k: parse_value(v) for k, _, v in (o.partition("=") for o in args.option)}

    step: dict = {}
    steps: list[dict] = []
    trials: list[tuple[float, int, int]] = []  # (predicted probability, depth, accepted)
    dense: list[tuple[float, int, int]] = []  # (similarity, other candidates with its first token, first token right)
    similarity: dict[int, float] = {}  # a dense draft's start offset -> its neighbour's similarity, this step

    drafts = retrieval.DenseSource.drafts

    def dense_drafts(self, found, length):
        out = drafts(self, found, length)
        scores = dict(zip(found.rows.tolist(), found.scores.tolist(), strict=True))
        past = 1 if isinstance(self.continuations, np.ndarray) else 2  # a draft starts this far past its row
        similarity.clear()
        for c in out:
            similarity[c.offset] = scores.get(c.offset - past, float("nan"))
        return out

    gather = respec_pool.CandidatePool.gather

    def pool_gather(self, state, length):
        found = gather(self, state, length)
        step["gathered"] = list(found)  # a copy: propose then adds the resync candidates to the list it got
        return found

    propose = respec.ReSpecDrafter._propose  # propose and propose_sized (the cost-aware wrapper's) both call it

    def respec_propose(self, state, sizing):
        similarity.clear()
        step.pop("gathered", None)
        resync = list(self.resync)  # propose adds them to what the pool gives, when it asks the pool
        tree, proposed = propose(self, state, sizing)
        gathered = step.pop("gathered", None)
        size = len(state.tokens)
        step["pool"] = None if gathered is None else [
            (c.source, list(c.tokens), similarity.get(c.key[1] + size) if c.source == "dense" else None)
            for c in gathered + resync]
        step["chosen"] = tree.meta.get("candidate_tokens") if tree.meta.get("candidate_keys") else None
        return tree, proposed

    verify = simulate.ReplayVerifier.step

    def replay_step(self, pending, tree, acceptance=None):
        truth = self.full[self.num_done :]
        out = verify(self, pending, tree, acceptance)
        record = {"accepted": len(out.result.accepted_nodes)}
        pool, chosen = step.pop("pool", None), step.pop("chosen", None)
        if pool and chosen:
            record["pool"] = [(src, common_prefix(tokens, truth)) for src, tokens, _ in pool]
            record["chosen"] = [common_prefix(tokens, truth) for tokens in chosen]
            firsts = Counter(tokens[0] for _, tokens, _ in pool if tokens)
            for src, tokens, sim in pool:
                if src == "dense" and tokens and sim is not None and np.isfinite(sim):
                    dense.append((sim, firsts[tokens[0]] - 1, int(tokens[0] == truth[0]) if truth else 0))
        steps.append(record)
        return out

    observe = cost_aware.CostAwareDrafter.observe

    def wrapped_observe(self, state, tree, result):
        if len(tree):
            prob, accepted, depth = self.calibrator.probabilities(tree), set(result.accepted_nodes), tree.depth_list()
            for i, parent in enumerate(tree.parents.tolist()):
                if parent < 0 or parent in accepted:
                    trials.append((float(prob[i]), depth[i], int(i in accepted)))
        return observe(self, state, tree, result)

    retrieval.DenseSource.drafts, respec_pool.CandidatePool.gather = dense_drafts, pool_gather
    respec.ReSpecDrafter._propose = respec_propose
    simulate.ReplayVerifier.step = replay_step
    cost_aware.CostAwareDrafter.observe = wrapped_observe
    fixed = None if args.drafting_ms is None else args.drafting_ms / 1e3
    try:
        replays = simulate.replay(
            lambda: simulate.fixed_drafting(make_drafter("respec", datastore=datastore, cost=cost, **options), fixed),
            refs, bench.max_new_tokens, lm.model, context_limit(lm.model))
    finally:  # the classes as they were (a caller in the same process replays unobserved)
        retrieval.DenseSource.drafts, respec_pool.CandidatePool.gather = drafts, gather
        respec.ReSpecDrafter._propose = propose
        simulate.ReplayVerifier.step, cost_aware.CostAwareDrafter.observe = verify, observe
    tokens, total = sum(r.stats.num_tokens for r in replays), sum(r.stats.steps for r in replays)
    report = {"mat": tokens / total, "drafted_per_step": sum(r.stats.num_drafted for r in replays) / total,
              **summarise(steps),
              "calibration": binned([(pr, a) for pr, _, a in trials], PROBABILITY_BINS),
              "calibration_by_depth": binned([(d, a) for _, d, a in trials], (1.5, 2.5, 4.5)),
              "calibration_predicted_by_depth": binned([(d, pr) for pr, d, _ in trials], (1.5, 2.5, 4.5)),
              "dense_by_similarity": binned([(s, right) for s, _, right in dense], SIMILARITY_BINS),
              "dense_by_agreement": binned([(min(agree, 2), right) for _, agree, right in dense], (0.5, 1.5))}
    print(f"MAT {report['mat']:.3f}, {report['drafted_per_step']:.1f} nodes a step; {report['steps']} steps, "
          f"{report.get('pool_steps', 0)} drew on the pool")
    if report.get("pool_steps"):
        print(f"tokens accepted a pool step: tree {report['accepted']:.3f}, chosen oracle {report['chosen_oracle']:.3f}, "
              f"pool oracle {report['pool_oracle']:.3f}")
        print(f"first token: some candidate right in {report['first_covered']:.1%} of pool steps, accepted in "
              f"{report['first_accepted']:.1%}")
        print(f"chosen oracle minus tree, a pool step: {report['lost_missing']:.3f} where the tree accepted nothing, "
              f"{report['lost_cut']:.3f} where it stopped short")
        print("source of the best candidate:", report["best_source"])
    pred = {tuple(r["bin"]): r for r in report["calibration_predicted_by_depth"]}

    def span(r: dict) -> str:
        return f"{r['bin'][0]:g} .. {r['bin'][1]:g}"

    print_table(["calibrated probability", "trials", "predicted", "accepted"],
                [[span(r), r["n"], f"{r['mean']:.3f}", f"{r['rate']:.3f}"] for r in report["calibration"]])
    print_table(["depth", "trials", "predicted", "accepted"],
                [[span(r), r["n"], f"{pred[tuple(r['bin'])]['rate']:.3f}", f"{r['rate']:.3f}"]
                 for r in report["calibration_by_depth"]])
    print_table(["dense similarity", "candidates", "first token right"],
                [[span(r), r["n"], f"{r['rate']:.3f}"] for r in report["dense_by_similarity"]])
    print_table(["other candidates with its first token", "dense candidates", "first token right"],
                [[f"{int(r['mean'])}{'+' if r['mean'] >= 2 else ''}", r["n"], f"{r['rate']:.3f}"]
                 for r in report["dense_by_agreement"]])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **report}, f, indent=1)
    return report


if __name__ == "__main__":
    main()
