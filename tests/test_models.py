"""Model provisioning and fingerprints."""

import json

import pytest

from specstore.runtime.errors import SpecstoreError
from specstore.runtime.models import (
    folder_hash,
    load_model,
    model_info,
    provision_default_model,
    resolve_model_path,
    tokenizer_hash,
)
from tests.helpers import make_tiny_model


def test_default_model_is_provisioned_and_verifies():
    folder = provision_default_model(quiet=True)
    prov = json.loads((folder / "specstore-provenance.json").read_text())
    assert prov["folder_hash"] == folder_hash(folder)
    assert len(prov["gguf_sha256"]) == 64
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg


def test_folder_hash_changes_with_weights(tmp_path):
    folder = make_tiny_model(tmp_path / "m")
    before = folder_hash(folder)
    assert folder_hash(folder) == before  # cached, stable
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert folder_hash(folder) != before


def test_model_info_and_tokenizer_hash(tmp_path):
    a = load_model(str(make_tiny_model(tmp_path / "a", seed=0)), dtype="float32")
    b = load_model(str(make_tiny_model(tmp_path / "b", seed=1)), dtype="float32")
    assert a.info.tokenizer_hash == b.info.tokenizer_hash == tokenizer_hash(b.tokenizer)
    assert a.info.revision != b.info.revision
    assert a.info.hidden_size == 32 and a.info.vocab_size == len(a.tokenizer)
    assert model_info(a.model, a.tokenizer, "x").revision != a.info.revision  # in-memory hash differs from folder hash


def test_unknown_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(SpecstoreError, match="not a local Hugging Face model folder"):
        resolve_model_path(str(tmp_path / "nothing"))
