"""Constant-time open and `specstore verify` (issue 12): opening checks sizes and headers, never
hashes; `verify` hashes every file and names the first damaged or missing one (exit 2)."""

from __future__ import annotations

import numpy as np
import pytest

from specstore.runtime import hashing
from specstore.runtime import store as store_module
from specstore.runtime.cli import main
from specstore.runtime.datastore import Datastore
from specstore.runtime.errors import ChecksumError
from tests.datastore_helpers import tiny_datastore


def _no_hashing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("opening hashed a file")

    monkeypatch.setattr(hashing, "file_sha256", refuse)
    monkeypatch.setattr(store_module, "file_sha256", refuse)


def _flip_tail(path, count: int = 16) -> None:
    """Damage the last ``count`` bytes (the data, not the .npy header), keeping the size."""
    data = bytearray(path.read_bytes())
    for i in range(1, count + 1):
        data[-i] ^= 0xA5
    path.write_bytes(bytes(data))


def test_verify_a_good_version_exits_0_with_one_line(tiny_store, capsys):
    store, _, manifest = tiny_store
    assert main(["verify", "--store", str(store.root), "--ref", f"code@{manifest.version}"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"code@{manifest.version}: {len(manifest.files)} files")


def test_open_reads_headers_only_and_verify_names_the_damaged_file(tmp_path, monkeypatch, capsys):
    store, loaded, manifest = tiny_datastore(tmp_path)
    files = store.files_dir("code", manifest.build_id)
    _flip_tail(files / "suffix_array.npy")  # same size, right header, wrong content
    _no_hashing(monkeypatch)
    ds = Datastore.open(store, "code", loaded.info, dense=False)
    assert len(ds.suffix) == manifest.num_tokens + manifest.num_documents
    assert isinstance(ds.suffix.sa, np.memmap) and isinstance(ds.suffix.stream, np.memmap)  # mapped, not read
    assert not ds.suffix._cache  # nothing searched or gathered yet
    monkeypatch.undo()
    with pytest.raises(ChecksumError, match="suffix_array.npy fails its checksum"):
        Datastore.open(store, "code", loaded.info, verify=True, dense=False)  # verify=True: full hashes
    capsys.readouterr()
    code = main(["verify", "--store", str(store.root), "--ref", "code@1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("specstore: error: datastore file ") and "suffix_array.npy fails its checksum" in err[0]


def test_verify_names_a_missing_file(tmp_path, capsys):
    store, _, manifest = tiny_datastore(tmp_path)
    (store.files_dir("code", manifest.build_id) / "normaliser.npz").unlink()
    capsys.readouterr()
    assert main(["verify", "--store", str(store.root), "--ref", "code"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "normaliser.npz is missing" in err[0]


def test_open_checks_sizes_and_npy_headers(tmp_path, monkeypatch):
    store, loaded, manifest = tiny_datastore(tmp_path)
    folder = store.files_dir("code", manifest.build_id)
    stream_path, sa_path = folder / "stream.npy", folder / "suffix_array.npy"
    stream, sa = np.load(stream_path), np.load(sa_path)
    sizes = stream_path.stat().st_size, sa_path.stat().st_size
    # the same bytes behind headers that disagree with the manifest (int16, twice the entries)
    np.save(stream_path, stream.view(np.int16))
    np.save(sa_path, sa.view(np.int16))
    assert (stream_path.stat().st_size, sa_path.stat().st_size) == sizes  # so only the header check can see it
    _no_hashing(monkeypatch)
    with pytest.raises(ChecksumError, match="dtype int16"):
        Datastore.open(store, "code", loaded.info, dense=False)
    np.save(sa_path, sa)
    np.save(stream_path, stream[:-1])  # one entry short: the size check names it
    with pytest.raises(ChecksumError, match="stream.npy has .* bytes, manifest says"):
        Datastore.open(store, "code", loaded.info, dense=False)
