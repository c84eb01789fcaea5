"""specstore's runtime: load a datastore version, draft, verify, decode.

The public API is re-exported lazily (PEP 562) so that ``import specstore.runtime.errors``
(the CLI's first import) does not pull in torch and transformers.
"""

from __future__ import annotations

_EXPORTS = {
    "generate": "specstore.runtime.api",
    "custom_generate": "specstore.runtime.api",
    "GenerateResult": "specstore.runtime.api",
    "DecodeStats": "specstore.runtime.decode",
    "make_drafter": "specstore.runtime.drafters.registry",
    "Engine": "specstore.runtime.engine",
    "ServedResult": "specstore.runtime.engine",
    "RequestCancelled": "specstore.runtime.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specstore.runtime' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
