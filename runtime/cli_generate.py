"""``specstore generate``: decode one prompt with one drafting method, streaming accepted text.

Owns the command's flow: resolve the datastore reference first (an unknown name, version or tag
fails before the model loads), load the model, open the datastore version against that model
(mismatches and checksum failures raise SpecstoreError, which cli.py prints as one line), build
the drafter through the registry and call ``api.generate``. Does not own decoding or drafting.
"""

from __future__ import annotations

import argparse
import json
import sys

from specstore.runtime.errors import SpecstoreError

DATASTORE_METHODS = ("rest", "dresd", "respec")
DENSE_METHODS = ("dresd", "respec")


def run_generate(args: argparse.Namespace) -> int:
    from specstore.runtime.api import generate
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.drafters.registry import make_drafter
    from specstore.runtime.models import load_model
    from specstore.runtime.store import Store

    datastore = route = None
    if args.method in DATASTORE_METHODS:
        if not args.datastore:
            raise SpecstoreError(f"method '{args.method}' needs --datastore NAME[@VERSION|@TAG]")
        store = Store(args.store)
        refs = [r.strip() for r in args.datastore.split(",") if r.strip()]  # several: routed per prompt
        if not refs:
            raise SpecstoreError(f"--datastore {args.datastore!r} names no datastore")
        for ref in refs:
            store.resolve(ref)  # fail fast, before the model loads
    if args.max_new_tokens < 0:
        raise SpecstoreError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SpecstoreError(f"need --temperature >= 0 and 0 < --top-p <= 1, got {args.temperature}, {args.top_p}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the terminal shows the answer, not weight-loading bars
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.method in DATASTORE_METHODS:
        device = next(loaded.model.parameters()).device
        opened = [Datastore.open(store, ref, loaded.info, dense=args.method in DENSE_METHODS, device=device) for ref in refs]
        datastore = opened[0]
        if len(opened) > 1:
            from specstore.runtime.api import prompt_ids
            from specstore.runtime.router import Router

            route = Router(opened).route(loaded.model, prompt_ids(loaded.tokenizer, args.prompt), prompt_ids(loaded.tokenizer, ""))
            datastore = opened[route.index]
            if not args.json:
                print(f"[route] {datastore.ref} ({', '.join(f'{r} {v:.3f}' for r, v in route.scores.items())})", file=sys.stderr)
    extra = {}
    if getattr(args, "draft_model", None):
        extra["fallback"] = draft_model_fallback(args, loaded)
    drafter = make_drafter(args.method, datastore, **respec_options(args), **extra)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = generate(
        loaded.model,
        loaded.tokenizer,
        args.prompt,
        drafter=drafter,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stream=None if args.json else stream,
    )
    stats = result.stats.to_dict()
    if args.json:
        out = {
            "method": args.method,
            **({"respec": respec_stats(drafter)} if args.method == "respec" else {}),
            "datastore": datastore.ref if datastore is not None else None,
            "routing": route.scores if route is not None else None,
            "lossless": bool(getattr(drafter, "lossless", True)),
            **result.to_dict(),
        }
        print(json.dumps(out))
        return 0
    print()
    print(
        f"[{args.method}] {len(result.token_ids)} tokens in {stats['steps']} steps, MAT {stats['mat']:.2f}, "
        f"drafting {stats['drafting_s']:.3f} s, verifying {stats['verifying_s']:.3f} s, stop: {result.stop_reason}",
        file=sys.stderr,
    )
    if not getattr(drafter, "lossless", True):
        print(f"[{args.method}] LOSSY: relaxed verification, {stats.get('num_relaxed', 0)} tokens accepted by the relaxed rule; "
              "the output may differ from plain decoding", file=sys.stderr)
    return 0


def draft_model_fallback(args: argparse.Namespace, target):
    """ReSpec's fallback from ``--draft-model``: loaded like the target (dtype, device); its
    tokenizer must be the target's, since draft ids go to the target unchanged."""
    from specstore.runtime.drafters.model import ModelDrafter
    from specstore.runtime.models import load_model

    if args.method != "respec":
        raise SpecstoreError(f"--draft-model is ReSpec's fallback drafter; method '{args.method}' does not use one")
    if args.draft_tokens < 1:
        raise SpecstoreError(f"--draft-tokens must be >= 1, got {args.draft_tokens}")
    draft = load_model(args.draft_model, dtype=args.dtype, device=args.device)
    if draft.info.tokenizer_hash != target.info.tokenizer_hash:
        raise SpecstoreError(
            f"--draft-model {args.draft_model}: its tokenizer differs from the target's "
            f"(hash {draft.info.tokenizer_hash[:12]} vs {target.info.tokenizer_hash[:12]}); a draft model must share the tokenizer"
        )
    return ModelDrafter(draft.model, num_draft_tokens=args.draft_tokens)


def respec_stats(drafter) -> dict:
    """How ReSpec drafted: steps that retrieved, steps that fell back, and with what."""
    fallback = getattr(drafter, "fallback", None)
    return {
        "retrieved_steps": int(getattr(drafter, "num_retrieved_steps", 0)),
        "fallback_steps": int(getattr(drafter, "num_fallback_steps", 0)),
        "fallback": getattr(fallback, "name", None),
    }


RESPEC_FLAGS = ("entropy_threshold", "score_threshold", "max_candidates", "length_factor", "relaxed", "relaxed_top_k", "relaxed_ratio")


def respec_options(args: argparse.Namespace) -> dict:
    """The respec thresholds given on the command line (others keep ReSpecConfig's defaults)."""
    if args.method != "respec":
        return {}
    out = {k: getattr(args, k) for k in RESPEC_FLAGS if getattr(args, k, None) is not None}
    if "relaxed" in out:
        out["relaxed"] = out["relaxed"] == "on"
    return out
