"""Stores on object storage, against a local S3-compatible server (moto) the tests start on
127.0.0.1: the catalogue, tags, gc, verify and decoding through the host's file cache, version
numbers from the catalogue's conditional commit (concurrent commits on S3 and locally), and the
cache's checks and bound. A store built locally is copied to the bucket as ``aws s3 sync`` would."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from specstore.runtime.api import generate
from specstore.runtime.cli import main
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.errors import ChecksumError, SpecstoreError
from specstore.runtime.file_cache import FileCache
from specstore.runtime.storage import Location, options_from_env, parse_storage_options
from specstore.runtime.store import Store
from specstore.schemas.manifest import Manifest
from tests.datastore_helpers import PROMPTS, own_output_datastore
from tests.s3_helpers import s3_server, upload_tree

N = 24


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    folder = tmp_path_factory.mktemp("own")
    store, loaded, outputs = own_output_datastore(folder, max_new_tokens=N)
    store.set_tag("own@1", "prod")
    return store, loaded, outputs


def _remote_copy(s3, own) -> Store:
    local, _, _ = own
    uri = s3.uri()
    upload_tree(local.root, Location.of(uri, s3.options))
    return Store(uri, storage_options=s3.options)


def _clone(store: Store, manifest: Manifest, build_id: str) -> Manifest:
    """A copy of a version's files and tokens table under another build id, as a manifest to commit."""
    moves = {Store.files_rel(manifest.name, manifest.build_id): Store.files_rel(manifest.name, build_id),
             f"{manifest.tokens_table}.lance": f"{Store.table_name(manifest.name, build_id)}.lance"}
    for old, new in moves.items():
        for rel, is_file, _, _ in list(store.location.walk(old)):
            if is_file:
                store.location.copy(rel, new + rel[len(old):])
    files = {}
    for rel, info in manifest.files.items():
        old = next((o for o in moves if rel.startswith(o + "/")), None)
        files[moves[old] + rel[len(old):] if old else rel] = info
    return manifest.model_copy(update={"build_id": build_id, "files": files, "tokens_table": Store.table_name(manifest.name, build_id)})


def test_remote_version_decodes_like_the_local_one_through_the_cache(s3, own, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTORE_FILE_CACHE", str(tmp_path / "cache"))
    local, loaded, outputs = own
    store = _remote_copy(s3, own)
    assert isinstance(store.root, str) and store.root.startswith("s3://")
    assert [v.version for v in store.versions("own")] == [1] and store.resolve("own@prod").version == 1
    ds = Datastore.open(store, "own@prod", loaded.info)
    assert ds.ref == "own@1" and ds.dense is not None
    for method in ("pld", "rest", "dresd", "respec"):
        for prompt in PROMPTS:
            out = generate(loaded.model, loaded.tokenizer, prompt, make_drafter(method, datastore=ds), max_new_tokens=N)
            assert out.token_ids == outputs[prompt], (method, prompt)
    # the mapped files came from the cache, each fetched once; a second open fetches nothing
    cached = sorted((tmp_path / "cache" / "objects").glob("*/*"))
    expected = {i.sha256 for rel, i in ds.manifest.files.items() if rel.startswith("_files/") and not rel.endswith(".jsonl")}
    assert {p.name for p in cached if not p.name.endswith(".lock")} == expected
    cache = FileCache()
    cache.version_dir(store.location, Store.files_rel("own", ds.manifest.build_id), ds.manifest.files, skip=("rejected.jsonl",))
    assert cache.fetched == 0
    local_ds = Datastore.open(local, "own@1", loaded.info, dense=False)
    assert np.array_equal(np.asarray(ds.suffix.stream), np.asarray(local_ds.suffix.stream))


def test_cli_round_trip_on_s3(s3, own, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECSTORE_FILE_CACHE", str(tmp_path / "cache"))
    _, loaded, outputs = own
    store = _remote_copy(s3, own)
    opts = s3.cli()
    first = store.resolve("own@1").manifest
    store.commit(_clone(store, first, "20261201T000000-0000abcd"))  # a second version with files of its own

    capsys.readouterr()
    assert main(["versions", "--store", store.root, *opts, "--name", "own", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [v["version"] for v in listed] == [1, 2] and listed[0]["tags"] == ["prod"]
    assert main(["verify", "--store", store.root, *opts, "--ref", "own@2"]) == 0
    assert "every checksum matches" in capsys.readouterr().out
    model = str(own[0].root.parent / "model")
    argv = ["generate", "--store", store.root, *opts, "--datastore", "own@2", "--method", "rest", "--model", model,
            "--dtype", "float32", "--prompt", PROMPTS[0], "--max-new-tokens", str(N), "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == outputs[PROMPTS[0]]
    assert main(["tag", "--store", store.root, *opts, "--ref", "own@2", "--tag", "prod"]) == 0
    assert main(["gc", "--store", store.root, *opts, "--name", "own", "--keep", "1", "--grace-seconds", "0"]) == 0
    assert "removed versions 1" in capsys.readouterr().out
    assert [v.version for v in store.versions("own")] == [2]
    assert not store.location.exists(Store.files_rel("own", first.build_id))
    assert not list(store.location.walk(f"{first.tokens_table}.lance"))
    # a damaged file: verify names it, exit 2
    rel = next(r for r in store.resolve("own@2").manifest.files if r.endswith("suffix_array.npy"))
    data = bytearray(store.location.read_bytes(rel))
    data[-1] ^= 0xFF
    store.location.write_bytes(rel, bytes(data))
    assert main(["verify", "--store", store.root, *opts, "--ref", "own@2"]) == 2
    assert rel in capsys.readouterr().err


@pytest.mark.parametrize("where", ["s3", "local"])
def test_concurrent_commits_get_distinct_versions_and_lose_nothing(s3, own, where, tmp_path):
    manifest = own[0].resolve("own@1").manifest.model_copy(update={"name": "race"})
    if where == "s3":
        uri, options = s3.uri(), s3.options
    else:
        uri, options = str(tmp_path / "store"), None
    Store(uri, create=True, storage_options=options)

    def commit(i: int) -> int:
        store = Store(uri, storage_options=options)  # each builder its own connection, as on its own machine
        return store.commit(manifest.model_copy(update={"build_id": f"20261201T00000{i}-0000000{i}"})).version

    with ThreadPoolExecutor(6) as pool:
        versions = list(pool.map(commit, range(6)))
    assert sorted(versions) == [1, 2, 3, 4, 5, 6]
    records = Store(uri, storage_options=options).versions("race")
    assert sorted(r.build_id for r in records) == sorted(f"20261201T00000{i}-0000000{i}" for i in range(6))
    assert {r.build_id: r.version for r in records} == {f"20261201T00000{i}-0000000{i}": v for i, v in enumerate(versions)}


def test_the_cache_refuses_a_file_that_does_not_match_its_checksum(s3, own, tmp_path):
    store = _remote_copy(s3, own)
    manifest = store.resolve("own@1").manifest
    rel = next(r for r in manifest.files if r.endswith("stream.npy"))
    data = bytearray(store.location.read_bytes(rel))
    data[200] ^= 0x01  # same size, other content
    store.location.write_bytes(rel, bytes(data))
    cache = FileCache(tmp_path / "cache")
    with pytest.raises(ChecksumError, match="stream.npy .*fails its checksum"):
        cache.version_dir(store.location, Store.files_rel("own", manifest.build_id), manifest.files)
    assert not (tmp_path / "cache" / "objects" / manifest.files[rel].sha256[:2] / manifest.files[rel].sha256).exists()
    assert not [p for p in (tmp_path / "cache").rglob("*.part")]


def test_the_cache_stays_within_its_bound(s3, own, tmp_path):
    store = _remote_copy(s3, own)
    first = store.resolve("own@1").manifest
    second = _clone(store, first, "20261201T000000-0000beef")
    # make the clone's files differ, so that they are other objects
    changed = [r for r in second.files if r.startswith(Store.files_rel("own", second.build_id)) and r.endswith(".npy")]
    for rel in changed:
        data = store.location.read_bytes(rel) + b"\0" * 64
        store.location.write_bytes(rel, data)
        import hashlib

        second.files[rel] = second.files[rel].model_copy(update={"sha256": hashlib.sha256(data).hexdigest(), "num_bytes": len(data)})
    one = sum(i.num_bytes for r, i in first.files.items() if r.startswith("_files/") and not r.endswith(".jsonl"))
    cache = FileCache(tmp_path / "cache", max_bytes=one + 16)
    cache.version_dir(store.location, Store.files_rel("own", first.build_id), first.files, skip=("rejected.jsonl",))
    assert cache.size() == one
    view = cache.version_dir(store.location, Store.files_rel("own", second.build_id), second.files, skip=("rejected.jsonl",))
    assert cache.size() <= one + 16 + 64 * len(changed)  # the first version's objects went, the second's stayed
    assert all(p.exists() for p in view.rglob("*") if p.is_symlink())


def test_storage_options_and_environment(monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    assert parse_storage_options(["aws_region=eu-west-1", "allow_http=true", "aws_region=us-east-1"]) == {
        "aws_region": "us-east-1", "allow_http": "true"}
    with pytest.raises(SpecstoreError, match="not KEY=VALUE"):
        parse_storage_options(["aws_region"])
    env = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "http://h:1"}
    assert options_from_env("s3", env) == {"aws_access_key_id": "k", "aws_secret_access_key": "s", "aws_region": "eu-west-1",
                                           "aws_endpoint": "http://h:1"}
    assert options_from_env("gs", env) == {}
    with pytest.raises(SpecstoreError, match="unsupported store URI"):
        Location.of("ftp://host/x")
    with pytest.raises(SpecstoreError, match="azure_storage_account_name"):
        _ = Location.of("az://container/x").fs
    azure = Location.of("az://container/x", {"azure_storage_account_name": "acct", "azure_storage_account_key": "a2V5"})
    assert type(azure.fs).__name__ == "AzureFileSystem" and azure._path("a/b") == "container/x/a/b"
    with pytest.raises(SpecstoreError, match="allow_http=true"):
        _ = Location.of("s3://bucket/x", {"aws_endpoint": "http://127.0.0.1:1"}).fs
