"""Drafter registry: method name -> factory, so the CLI, the API and the benchmarks build
drafters one way.

A factory is ``create(datastore=None, **options) -> Drafter`` in the drafter's own module,
named here as ``"module:function"`` and imported only when asked for (a datastore-backed
drafter may pull in LanceDB). To add a method, add one line to ``FACTORIES`` (or call
``register``). A factory that needs a datastore raises SpecstoreError when given none.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from specstore.runtime.drafters.base import Drafter
from specstore.runtime.errors import SpecstoreError

FACTORIES: dict[str, str | Callable[..., Drafter]] = {
    "ar": "specstore.runtime.drafters.ar:create",
    "pld": "specstore.runtime.drafters.pld:create",
    "rest": "specstore.runtime.drafters.rest:create",  # retrieval side (issue 3): suffix array
    "dresd": "specstore.runtime.drafters.dresd:create",  # retrieval side (issue 3): dense index
    "respec": "specstore.runtime.drafters.respec:create",  # issue 4: entropy trigger, EMA-ranked hybrid pool
    # reference row, not a specstore method: needs the optional arctic-inference build
    "suffixdecoding": "specstore.runtime.drafters.suffixdecoding:create",
}


def register(method: str, factory: str | Callable[..., Drafter]) -> None:
    """Add or replace a method (``"module:function"`` or a callable)."""
    FACTORIES[method] = factory


def available() -> list[str]:
    return sorted(FACTORIES)


def make_drafter(method: str, datastore=None, **options) -> Drafter:
    """Build the drafter for ``method`` (ar, pld, and whatever else is registered)."""
    factory = FACTORIES.get(method)
    if factory is None:
        raise SpecstoreError(f"unknown drafting method {method!r}: choose one of {', '.join(available())}")
    if isinstance(factory, str):
        module, _, name = factory.partition(":")
        factory = getattr(importlib.import_module(module), name)
    return factory(datastore=datastore, **options)
