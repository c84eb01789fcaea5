"""Fixtures shared by the test modules.

Names say what a fixture is: ``tiny_model_dir`` is a saved tiny random model folder (a path,
as ``--model`` takes it); ``tiny_store`` and ``own_output_store`` are small datastores written
through the build's own writers. Plain constants (the fixture corpus, the shared build options)
live in ``tests/helpers.py`` so that modules can import them; conftest is not imported.
"""

from __future__ import annotations

import pytest

from tests.datastore_helpers import own_output_datastore, tiny_datastore
from tests.helpers import make_tiny_model


@pytest.fixture(autouse=True)
def _own_calibrations(tmp_path, monkeypatch):
    """Every test keeps the calibrations that ``generate`` and ``serve`` save in a folder of its
    own: none comes from an earlier test or run, and nothing is written to the user's cache."""
    monkeypatch.setenv("SPECSTORE_CALIBRATION_DIR", str(tmp_path / "calibrations"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random llama (``make_tiny_model`` defaults, seed 0) saved once per session; the
    folder as a string, as ``build(model=...)`` and ``--model`` take it. Read-only: a test that
    needs to change a model folder makes its own."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model"))


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """``tiny_datastore``: a tiny random llama under ``<folder>/model`` and a datastore ``code``
    of ``datastore_helpers.TEXTS`` in the store ``<folder>/store``; ``(store, loaded, manifest)``.
    One per module, so a module may tag it."""
    return tiny_datastore(tmp_path_factory.mktemp("tiny-store"))


@pytest.fixture(scope="module")
def own_output_store(tmp_path_factory):
    """``own_output_datastore``: a datastore ``own`` of the tiny model's own greedy answers to
    ``datastore_helpers.PROMPTS``; ``(store, loaded, ar_outputs)``. One per module."""
    return own_output_datastore(tmp_path_factory.mktemp("own-output"))
