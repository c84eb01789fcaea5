"""``specstore generate``: decode one prompt with one drafting method, streaming accepted text.

Owns the command's flow: check the arguments and resolve the datastore references first (an
unknown name, version or tag fails before the model loads), load the model, open an Engine over
it and the references (mismatches and checksum failures raise SpecstoreError, which cli.py
prints as one line; a method's own flags become its drafter options through the registry), say
where routing among several datastores sent the prompt, and serve the one request. Does not own
decoding, drafting, routing or any one method's options.
"""

from __future__ import annotations

import argparse
import json
import sys

from specstore.runtime.errors import SpecstoreError


def run_generate(args: argparse.Namespace) -> int:
    from specstore.runtime.device import dtype_name
    from specstore.runtime.drafters import registry
    from specstore.runtime.engine import Engine
    from specstore.runtime.models import load_model

    method = registry.method_info(args.method)
    registry.check_cli_options(args.method, args)
    store, refs = _resolve(args) if method.datastore else (None, [])
    if args.max_new_tokens < 0:
        raise SpecstoreError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SpecstoreError(f"need --temperature >= 0 and 0 < --top-p <= 1, got {args.temperature}, {args.top_p}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the terminal shows the answer, not weight-loading bars
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    options = registry.options_from_args(args.method, args, loaded)
    cost = registry.cost_model_for(loaded, [args.method], args.cost_aware, refresh=args.refresh_cost, quiet=args.json,
                                   online=args.cost_online == "on")
    engine = Engine(loaded, store, refs, method=args.method, drafter_options={args.method: options}, dense=method.dense,
                    refresh_seconds=None, cost=cost, cost_aware=args.cost_aware, calibration=args.calibration == "on")
    reference, scores = engine.route(args.prompt) if refs else (None, None)
    if scores is not None and not args.json:
        chosen = engine.datastores[reference]
        print(f"[route] {chosen} ({', '.join(f'{r} {v:.3f}' for r, v in scores.items())})", file=sys.stderr)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = engine.generate(args.prompt, datastore=reference, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                             stream=None if args.json else stream)
    drafter, lossless = result.drafter, result.lossless
    if args.json:
        own = {args.method: drafter.stats()} if callable(getattr(drafter, "stats", None)) else {}
        answer = {k: v for k, v in result.to_dict().items() if k in ("text", "token_ids", "stats", "stop_reason")}
        dtype = dtype_name(next(loaded.model.parameters()).dtype)  # --dtype auto resolved
        print(json.dumps({"method": args.method, "dtype": dtype, **own, "datastore": result.datastore, "routing": scores,
                          "lossless": lossless, **answer}))
        return 0
    stats = result.stats
    print()
    print(f"[{args.method}] {len(result.token_ids)} tokens in {stats.steps} steps, MAT {stats.mat:.2f}, "
          f"drafting {stats.drafting_s:.3f} s, verifying {stats.verifying_s:.3f} s, stop: {result.stop_reason}",
          file=sys.stderr)
    if not lossless:
        print(f"[{args.method}] LOSSY: relaxed verification, {stats.num_relaxed} tokens accepted by the relaxed rule; "
              "the output may differ from plain decoding", file=sys.stderr)
    return 0


def _resolve(args: argparse.Namespace):
    """``(store, refs)``: the references of ``--datastore`` (a comma list routes per prompt),
    each resolved in the store so that a wrong one fails before the model loads."""
    from specstore.runtime.store import Store

    if not args.datastore:
        raise SpecstoreError(f"method '{args.method}' needs --datastore NAME[@VERSION|@TAG]")
    refs = [r.strip() for r in args.datastore.split(",") if r.strip()]
    if not refs:
        raise SpecstoreError(f"--datastore {args.datastore!r} names no datastore")
    from specstore.runtime.drafters import registry

    store = Store.from_args(args)
    for ref in refs:
        record = store.resolve(ref)
        registry.check_index([args.method], record.manifest, f"{record.name}@{record.version}")
    return store, refs
