"""How a new build relates to the newest committed version of its datastore, decided before any
pipeline work.

Owns the three modes (*full*: the corpus as given; *append*: only the sources the parent lacks,
on top of its rows, stream and normaliser, whose mechanics are in append.py; *refit*: the
parent's corpus plus new paths, everything recomputed), what makes a build *unchanged* (its
fingerprint, the corpus content, settings and model, equals the parent's, so it would reproduce
the parent: no new version), and the corpus of a refit. Pure functions over manifests; nothing
here writes.
"""

from __future__ import annotations

from pathlib import Path

from specstore.runtime.errors import SpecstoreError
from specstore.schemas.manifest import Manifest, ModelInfo

MODES = ("full", "append", "refit")
PIPELINE_VERSION = "build-2"  # build-2: compact dense versions (int8 table, dense/ files)
# settings that change what a build produces (model_path is compared through the model's hash instead)
_IGNORED_SETTINGS = ("model_path",)


def fingerprint(manifest_or_settings: Manifest | dict, *, sources: list[tuple[str, str]] | None = None,
                model: ModelInfo | None = None, **shape) -> tuple:
    """What must be equal for two builds to produce the same version."""
    if isinstance(manifest_or_settings, Manifest):
        m = manifest_or_settings
        return fingerprint(
            dict(m.settings), sources=[(s.format, s.sha256) for s in m.sources], model=m.model,
            pipeline_version=m.pipeline_version, pca_dims=m.pca_dims, continuation_length=m.continuation_length,
            regenerated=m.regenerated, index=m.index,
        )
    settings = {k: v for k, v in manifest_or_settings.items() if k not in _IGNORED_SETTINGS}
    return (tuple(sources or ()), model.revision, model.tokenizer_hash, tuple(sorted(shape.items())), tuple(sorted(settings.items())))


def refit_paths(parent: Manifest, paths: list[str]) -> list[str]:
    """The parent's corpus paths (which must still exist) followed by the given ones not among them."""
    missing = [s.path for s in parent.sources if not Path(s.path).exists()]
    if missing:
        raise SpecstoreError(f"cannot refit {parent.name}@{parent.version}: its corpus path {missing[0]} no longer exists")
    known = {s.path for s in parent.sources}
    return [s.path for s in parent.sources] + [p for p in paths if str(Path(p).expanduser().resolve()) not in known]
