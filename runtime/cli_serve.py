"""``specstore serve``: an OpenAI-compatible server over one Engine until interrupted.

Owns the command's flow: check the options and resolve the datastore references first (an unknown
name, version or tag fails before the model loads), load the model, open the engine (drafter
options from the ReSpec flags, the served-request log, the served overlay), build the app and run
uvicorn. Does not
own the HTTP layer (serve.py) or serving (engine.py).
"""

from __future__ import annotations

import argparse
import signal
import sys

from specstore.runtime.errors import SpecstoreError


def check_args(args: argparse.Namespace) -> None:
    if args.max_queue < 1:
        raise SpecstoreError(f"--max-queue must be >= 1, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise SpecstoreError(f"--port must be in 0..65535, got {args.port}")
    if args.max_new_tokens < 0:
        raise SpecstoreError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SpecstoreError(f"need --temperature >= 0 and 0 < --top-p <= 1, got {args.temperature}, {args.top_p}")
    if args.refresh_seconds <= 0:
        raise SpecstoreError(f"--refresh-seconds must be > 0, got {args.refresh_seconds}")
    if args.overlay_tokens < 1:
        raise SpecstoreError(f"--overlay-tokens must be >= 1, got {args.overlay_tokens}")
    if args.overlay == "off" and (args.overlay_prompts or args.overlay_tokens != 65536):
        raise SpecstoreError("--overlay-tokens and --overlay-prompts need --overlay on")


def run_serve(args: argparse.Namespace) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise SpecstoreError("specstore serve needs the 'serve' extra: pip install 'specstore[serve]'") from None
    from specstore.runtime.drafters import registry
    from specstore.runtime.engine import Engine, split_references
    from specstore.runtime.models import load_model
    from specstore.runtime.overlay import ServedOverlay
    from specstore.runtime.serve import Defaults, create_app, model_name, uvicorn_server
    from specstore.runtime.store import Store

    check_args(args)
    refs = split_references(args.datastore)
    if registry.datastore_methods([args.method]) and not refs:
        raise SpecstoreError(f"method '{args.method}' needs --datastore NAME[@VERSION|@TAG]")
    store = Store.from_args(args) if refs else None
    for ref in refs:
        record = store.resolve(ref)  # fail fast, before the model loads
        registry.check_index([args.method], record.manifest, f"{record.name}@{record.version}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    # each method's own flags (ReSpec's thresholds, its draft model) apply whenever a request uses it
    options = {m: registry.options_from_args(m, args, loaded) for m in registry.available()}
    overlay = ServedOverlay(args.overlay_tokens, prompts=args.overlay_prompts) if args.overlay == "on" else None
    cost = registry.cost_model_for(loaded, registry.available(), args.cost_aware, refresh=args.refresh_cost, quiet=False,
                                   online=args.cost_online == "on")
    engine = Engine(loaded, store, refs, method=args.method, drafter_options=options, prefetch=True,
                    refresh_seconds=args.refresh_seconds, log=args.log, overlay=overlay, cost=cost, cost_aware=args.cost_aware,
                    calibration=args.calibration == "on")
    defaults = Defaults(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    app = create_app(engine, max_queue=args.max_queue, defaults=defaults, idle_refresh_seconds=args.refresh_seconds)
    served = ", ".join(f"{k} ({v})" for k, v in engine.datastores.items()) or "no datastore"
    print(f"specstore serve: {model_name(engine)}, method {args.method}, {served}; http://{args.host}:{args.port}/v1"
          + (f"; logging served requests to {args.log}" if args.log else "")
          + (f"; overlay on ({args.overlay_tokens} tokens{', prompts too' if args.overlay_prompts else ''})"
             if overlay is not None else ""), file=sys.stderr)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        uvicorn_server(app, args.host, args.port, log_level="info").run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal it stopped on, after its graceful shutdown
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("specstore serve: stopped", file=sys.stderr)
    return 0


def _interrupt(signum, frame) -> None:
    """SIGTERM (a process manager's stop) ends the command like Ctrl-C: status 0 after shutdown."""
    raise KeyboardInterrupt
