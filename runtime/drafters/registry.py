"""Drafter registry: method name -> how to build it and what it needs, declared once for the
CLI, the API, the bench and the simulator.

A method is a ``Method``: its factory ``create(datastore=None, **options) -> Drafter`` in the
drafter's own module, named as ``"module:function"`` and imported only when asked for (a
datastore-backed drafter may pull in LanceDB); what it reads (a datastore's suffix array, its
dense index, the target's hidden state or logits, the engine's served overlay); whether it still
works on a sparse version (no dense index: ``sparse_ok``, respec skips its dense source) or
refuses one (``check_index``, one clear error); and optionally a light module (no torch) with
its ``generate`` command-line options. A method that reads the overlay takes it as the
factory's ``overlay`` keyword (only an engine with one passes it). To add a method, add one
entry to ``METHODS`` (or
call ``register``). A factory that needs a datastore raises SpecstoreError when given none.

A CLI module defines ``add_cli_options(parser)`` (an argument group), ``given(args) -> list of
flags the user set`` and ``options_from_args(args, target) -> factory keyword arguments``
(``target``: the loaded target model, for options that load models beside it).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from specstore.runtime.errors import SpecstoreError

if TYPE_CHECKING:
    from specstore.runtime.drafters.base import Drafter


@dataclass(frozen=True, slots=True)
class Method:
    factory: str | Callable[..., Drafter]
    suffix: bool = False  # reads a datastore's suffix array
    dense: bool = False  # reads its dense index (opening then loads the tokens table)
    states: bool = False  # reads the target's hidden state or logits (the simulator computes them)
    cli: str | None = None  # module with the method's own `generate` options
    sparse_ok: bool = False  # reads the dense index only when the version has one (a sparse version has none)
    overlay: bool = False  # searches the engine's served overlay (factory keyword ``overlay``)
    # None: no cost-aware sizing; else the factory options it proposes with (the pruner cuts)
    cost_options: dict | None = None
    cost_default: bool = False  # cost-aware under --cost-aware auto (the default)

    @property
    def datastore(self) -> bool:
        return self.suffix or self.dense


# cost-aware tree sizing (cost_aware.py): "on" for every method that supports it, "off" for none,
# "auto" for those whose ``cost_default`` is set (where it measured faster: BENCHMARKS.md)
COST_AWARE_MODES = ("auto", "on", "off")
COST_AWARE_DEFAULT = "auto"
COST_AWARE_HELP = ("size each draft tree by expected committed tokens per second under this machine's measured "
                   "verification cost (runtime/cost.py; pld, rest, dresd, respec); off: the methods' fixed caps; "
                   "auto: on for pld, rest, dresd and respec, where it measured or replayed faster")

_D = "specstore.runtime.drafters."
METHODS: dict[str, Method] = {
    "ar": Method(_D + "ar:create"),
    # pld cost-aware since the thirty-third session: 4-5% faster on both tune splits, and fewer prompts below ar
    "pld": Method(_D + "pld:create", overlay=True, cost_options={"num_draft_tokens": 16}, cost_default=True),
    "rest": Method(_D + "rest:create", suffix=True, overlay=True, cost_options={}, cost_default=True),
    "dresd": Method(_D + "dresd:create", dense=True, states=True, cost_options={}, cost_default=True),
    "respec": Method(_D + "respec:create", suffix=True, dense=True, states=True, cli=_D + "respec_cli", sparse_ok=True,
                     overlay=True, cost_options={"length_factor": 0.0, "context_length": 0, "score_threshold": 0.0, "max_candidates": 8,
                                                 "max_nodes": 64, "draft_length": 16}, cost_default=True),
    # reference row, not a specstore method: needs the optional arctic-inference build
    "suffixdecoding": Method(_D + "suffixdecoding:create", suffix=True),
}


def register(method: str, factory: str | Callable[..., Drafter], *, suffix: bool = False, dense: bool = False,
             states: bool = False, cli: str | None = None, sparse_ok: bool = False, overlay: bool = False,
             cost_options: dict | None = None, cost_default: bool = False) -> None:
    """Add or replace a method (``factory``: ``"module:function"`` or a callable)."""
    METHODS[method] = Method(factory, suffix, dense, states, cli, sparse_ok, overlay, cost_options, cost_default)


def available() -> list[str]:
    return sorted(METHODS)


def method_info(method: str) -> Method:
    found = METHODS.get(method)
    if found is None:
        raise SpecstoreError(f"unknown drafting method {method!r}: choose one of {', '.join(available())}")
    return found


def datastore_methods(methods: Iterable[str]) -> list[str]:
    """The registered methods among ``methods`` that read a datastore, in order."""
    return [m for m in methods if m in METHODS and METHODS[m].datastore]


def needs_dense(methods: Iterable[str]) -> bool:
    """True when any registered method among ``methods`` reads the dense index."""
    return any(m in METHODS and METHODS[m].dense for m in methods)


def check_index(methods: Iterable[str], manifest, ref: str | None = None) -> None:
    """Raise SpecstoreError (one line) when a method among ``methods`` needs a dense index and
    the version of ``manifest`` is sparse (built with ``--index sparse``)."""
    if getattr(manifest, "index", "dense") != "sparse":
        return
    for m in methods:
        spec = METHODS.get(m)
        if spec is not None and spec.dense and not spec.sparse_ok:
            ref = ref or f"{manifest.name}@{manifest.version}"
            usable = ", ".join(k for k, v in METHODS.items() if not v.dense or v.sparse_ok)
            raise SpecstoreError(f"method '{m}' needs a dense index, and datastore {ref} is sparse (built with --index sparse): "
                                 f"rebuild it with --index dense, or use one of {usable}")


def needs_states(methods: Iterable[str]) -> bool:
    """True when any registered method among ``methods`` reads the target's hidden state or logits."""
    return any(m in METHODS and METHODS[m].states for m in methods)


def cost_aware_methods(methods: Iterable[str]) -> list[str]:
    """The registered methods among ``methods`` that size their trees by cost when asked to."""
    return [m for m in methods if m in METHODS and METHODS[m].cost_options is not None]


def uses_cost(method: str, mode: str = COST_AWARE_DEFAULT) -> bool:
    """Whether ``method`` sizes its trees by cost under ``--cost-aware mode`` (auto, on, off)."""
    if mode not in COST_AWARE_MODES:
        raise SpecstoreError(f"cost-aware must be one of {', '.join(COST_AWARE_MODES)}, got {mode!r}")
    spec = METHODS.get(method)
    if spec is None or spec.cost_options is None or mode == "off":
        return False
    return mode == "on" or spec.cost_default


def cost_model_for(loaded, methods: Iterable[str], mode: str = COST_AWARE_DEFAULT, *, refresh: bool = False,
                   quiet: bool = True, online: bool = True):
    """The verification cost model of ``loaded`` (load_model's result; cached, measured when
    missing or on ``refresh``: cost.load_cost_model) when any of ``methods`` sizes its trees by
    cost under ``--cost-aware mode``; None, with nothing measured, when none does. ``online``:
    whether decoding corrects it (``CostModel.observe``; the CLI's ``--cost-online``)."""
    if not any(uses_cost(m, mode) for m in methods):
        return None
    from specstore.runtime.cost import load_cost_model

    cost = load_cost_model(loaded.model, loaded.info, refresh=refresh, quiet=quiet)
    cost.online = online
    return cost


def make_drafter(method: str, datastore=None, *, cost=None, **options) -> Drafter:
    """Build the drafter for ``method`` (ar, pld, and whatever else is registered). ``cost``: a
    cost.CostModel: a method that supports it proposes with its ``cost_options`` (options given
    here win) and is wrapped in cost_aware.CostAwareDrafter, which prunes each tree to what is
    expected to pay for its verification; None: the method's fixed caps."""
    spec = method_info(method)
    aware = cost is not None and spec.cost_options is not None
    if aware:
        options = {**spec.cost_options, **options}
    factory = spec.factory
    if datastore is not None and hasattr(datastore, "manifest"):
        check_index([method], datastore.manifest, getattr(datastore, "ref", None))
    if isinstance(factory, str):
        module, _, name = factory.partition(":")
        factory = getattr(importlib.import_module(module), name)
    drafter = factory(datastore=datastore, **options)
    if aware:
        from specstore.runtime.drafters.cost_aware import CostAwareDrafter

        drafter = CostAwareDrafter(drafter, cost)
    return drafter


def _cli_modules() -> list[tuple[str, ModuleType]]:
    return [(m, importlib.import_module(spec.cli)) for m, spec in METHODS.items() if spec.cli]


def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """Every method's own ``generate`` options, one argument group each."""
    for _, module in _cli_modules():
        module.add_cli_options(parser)


def check_cli_options(method: str, args: argparse.Namespace) -> None:
    """Raise SpecstoreError naming a flag given for another method than ``method``."""
    for owner, module in _cli_modules():
        if owner != method and (flags := module.given(args)):
            raise SpecstoreError(f"{flags[0]} is an option of method '{owner}': method '{method}' does not use one")


def options_from_args(method: str, args: argparse.Namespace, target=None) -> dict:
    """``method``'s factory options from its own command-line flags (none without a CLI module)."""
    cli = method_info(method).cli
    return importlib.import_module(cli).options_from_args(args, target) if cli else {}
