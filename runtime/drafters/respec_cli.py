"""ReSpec's command-line face: its ``generate`` options, and turning them into drafter options.

Owns the argument group (thresholds, relaxed verification, a draft model as the fallback), which
flags were given (the generic handler refuses them for other methods) and the options handed to
``respec.create``, including loading the draft model beside the target. Kept apart from
respec.py so that building the parser imports no torch (registry.py names this module).
"""

from __future__ import annotations

import argparse

from specstore.runtime.errors import SpecstoreError

# argparse dest -> flag, for the options that go to ReSpecConfig unchanged
CONFIG_FLAGS = {
    "entropy_threshold": "--entropy-threshold",
    "max_candidates": "--max-candidates",
    "length_factor": "--length-factor",
    "context_length": "--context-length",
    "score_threshold": "--score-threshold",
    "relaxed_top_k": "--relaxed-top-k",
    "relaxed_ratio": "--relaxed-ratio",
    "head": "--head",
    "head_guesses": "--head-guesses",
    "head_signal": "--head-signal",
    "head_weights": "--head-weights",
}
OTHER_FLAGS = {"relaxed": "--relaxed", "draft_model": "--draft-model", "draft_tokens": "--draft-tokens"}
DEFAULT_DRAFT_TOKENS = 4


def add_cli_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("respec", "ReSpec options (defaults and how they were chosen: runtime/drafters/respec.py)")
    g.add_argument("--entropy-threshold", type=float, default=None, metavar="NATS", help="retrieve only when the next-token entropy is below this (default 4.0)")
    g.add_argument("--max-candidates", type=int, default=None, metavar="N", help="retrieved candidates merged into one draft tree per step (default 3)")
    g.add_argument("--length-factor", type=float, default=None, metavar="F",
                   help="a candidate drafts ceil(F x its score) + 1 tokens, at most 8 (default 2; 0 = always 8)")
    g.add_argument("--context-length", type=int, default=None, metavar="N",
                   help="a prompt-lookup candidate that continues a 4-token match of the context drafts N tokens "
                   "whatever its score, as prompt lookup does (default 16; 0 = the score rule for it too)")
    g.add_argument("--score-threshold", type=float, default=None, metavar="TOKENS", help="draft only candidates whose EMA of accepted tokens reaches this (default 0.5)")
    g.add_argument("--head", default=None, metavar="auto|off|FILE",
                   help="draft head (specstore train-head) whose guesses of the next token join the candidates: auto (default) "
                   "the one trained for the datastore's model, if any; off; or a head file")
    g.add_argument("--head-guesses", type=int, default=None, metavar="N", help="the head's likeliest tokens drafted per step (default 2)")
    g.add_argument("--head-signal", default=None, choices=["on", "off"],
                   help="the head's probability of every first draft token guides the cost-aware pruning (default on; "
                   "off: only its own guesses use it)")
    g.add_argument("--head-weights", default=None, choices=["bf16", "float32"],
                   help="how a head computing in float32 (CPUs without AVX-512 BF16) holds its weights: bf16 (default; half "
                   "the bytes each guess reads, the same guesses but for rounding) or float32")
    g.add_argument("--relaxed", default=None, choices=["on", "off"], help="relaxed verification of retrieved drafts (on is lossy; default off)")
    g.add_argument("--relaxed-top-k", type=int, default=None, metavar="K", help="a relaxed token must be in the target's top K (default 3)")
    g.add_argument("--relaxed-ratio", type=float, default=None, metavar="R", help="and have probability >= R x the top token's (default 0.3)")
    g.add_argument("--draft-model", default=None, metavar="FOLDER",
                   help="fallback drafter: a small Hugging Face model with the target's tokenizer (default: prompt lookup, model-free); "
                   "its drafts are always verified strictly")
    g.add_argument("--draft-tokens", type=int, default=None, metavar="N",
                   help=f"tokens the draft model proposes per step (default {DEFAULT_DRAFT_TOKENS})")


def given(args: argparse.Namespace) -> list[str]:
    """The ReSpec flags set on the command line."""
    return [flag for dest, flag in (CONFIG_FLAGS | OTHER_FLAGS).items() if getattr(args, dest, None) is not None]


def options_from_args(args: argparse.Namespace, target=None) -> dict:
    """Options for ``respec.create``: the thresholds given (others keep ReSpecConfig's defaults)
    and, with ``--draft-model``, a ModelDrafter fallback loaded like ``target`` (dtype, device)."""
    options = {dest: getattr(args, dest) for dest in CONFIG_FLAGS if getattr(args, dest, None) is not None}
    if getattr(args, "relaxed", None) is not None:
        options["relaxed"] = args.relaxed == "on"
    if getattr(args, "draft_model", None):
        options["fallback"] = draft_model_fallback(args, target)
    elif getattr(args, "draft_tokens", None) is not None:
        raise SpecstoreError("--draft-tokens sets the draft model's tokens per step: give --draft-model too")
    return options


def draft_model_fallback(args: argparse.Namespace, target):
    """ReSpec's fallback from ``--draft-model``: loaded like the target; its tokenizer must be the
    target's, since draft ids go to the target unchanged."""
    from specstore.runtime.drafters.model import ModelDrafter
    from specstore.runtime.models import load_model

    num_tokens = DEFAULT_DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens
    if num_tokens < 1:
        raise SpecstoreError(f"--draft-tokens must be >= 1, got {num_tokens}")
    draft = load_model(args.draft_model, dtype=args.dtype, device=args.device)
    if target is not None and draft.info.tokenizer_hash != target.info.tokenizer_hash:
        raise SpecstoreError(
            f"--draft-model {args.draft_model}: its tokenizer differs from the target's "
            f"(hash {draft.info.tokenizer_hash[:12]} vs {target.info.tokenizer_hash[:12]}); a draft model must share the tokenizer"
        )
    return ModelDrafter(draft.model, num_draft_tokens=num_tokens)
