"""``specstore generate``: decode one prompt with one drafting method, streaming accepted text.

Owns the command's flow: check the arguments and resolve the datastore references first (an
unknown name, version or tag fails before the model loads), load the model, open the datastore
version against that model (mismatches and checksum failures raise SpecstoreError, which cli.py
prints as one line), route among several datastores, build the drafter through the registry
(which also turns a method's own flags into its options) and call ``api.generate``. Does not own
decoding, drafting or any one method's options.
"""

from __future__ import annotations

import argparse
import json
import sys

from specstore.runtime.errors import SpecstoreError


def run_generate(args: argparse.Namespace) -> int:
    from specstore.runtime.api import generate
    from specstore.runtime.drafters import registry
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
    datastore, route = _open(args, store, refs, loaded, dense=method.dense) if refs else (None, None)
    options = registry.options_from_args(args.method, args, loaded)
    cost = None
    if registry.uses_cost(args.method, args.cost_aware):
        from specstore.runtime.cost import load_cost_model

        cost = load_cost_model(loaded.model, loaded.info, refresh=args.refresh_cost, quiet=args.json)
    drafter = registry.make_drafter(args.method, datastore, cost=cost, **options)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = generate(loaded.model, loaded.tokenizer, args.prompt, drafter=drafter, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_p=args.top_p, seed=args.seed, stream=None if args.json else stream)
    lossless = bool(getattr(drafter, "lossless", True))
    if args.json:
        own = {args.method: drafter.stats()} if callable(getattr(drafter, "stats", None)) else {}
        print(json.dumps({"method": args.method, **own, "datastore": datastore.ref if datastore is not None else None,
                          "routing": route.scores if route is not None else None, "lossless": lossless,
                          **result.to_dict()}))
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
    store = Store(args.store)
    for ref in refs:
        store.resolve(ref)
    return store, refs


def _open(args: argparse.Namespace, store, refs: list[str], loaded, *, dense: bool):
    """``(datastore, route)``: the one datastore named, or the one the router picks for the
    prompt among several (route None when there was no choice)."""
    from specstore.runtime.datastore import Datastore

    device = next(loaded.model.parameters()).device
    opened = [Datastore.open(store, ref, loaded.info, dense=dense, device=device) for ref in refs]
    if len(opened) == 1:
        return opened[0], None
    from specstore.runtime.api import prompt_ids
    from specstore.runtime.router import Router

    route = Router(opened).route(loaded.model, prompt_ids(loaded.tokenizer, args.prompt), prompt_ids(loaded.tokenizer, ""))
    datastore = opened[route.index]
    if not args.json:
        print(f"[route] {datastore.ref} ({', '.join(f'{r} {v:.3f}' for r, v in route.scores.items())})", file=sys.stderr)
    return datastore, route
