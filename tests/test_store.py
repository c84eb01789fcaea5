"""The store catalogue: references, version numbering, tags, checksums, CLI versions/tag."""

import json
import threading
from datetime import UTC, datetime

import pytest

from specstore.runtime.cli import main
from specstore.runtime.errors import ChecksumError, DatastoreNotFoundError, SpecstoreError
from specstore.runtime.store import Ref, Store, checksum_files, verify_files
from specstore.schemas.manifest import Manifest, ModelInfo


def manifest(name="code", num_tokens=10) -> Manifest:
    return Manifest(
        name=name,
        build_id=Store.new_build_id(),
        created_at=datetime.now(UTC),
        pipeline_version="test",
        model=ModelInfo(model_id="m", revision="r", tokenizer_hash="t", vocab_size=5, hidden_size=4),
        pca_dims=2,
        continuation_length=3,
        num_documents=1,
        num_tokens=num_tokens,
        num_rejected=0,
        sources=[],
        tokens_table="none",
    )


def test_ref_parsing():
    assert Ref.parse("code") == Ref("code")
    assert Ref.parse("code@3") == Ref("code", version=3)
    assert Ref.parse("code@prod") == Ref("code", tag="prod")
    assert str(Ref.parse("chat@2026-11-29")) == "chat@2026-11-29"
    for bad in ("", "Code", "a__b", "x@", "x@bad tag", "../x"):
        with pytest.raises(SpecstoreError):
            Ref.parse(bad)


def test_versions_are_numbered_and_resolved(tmp_path):
    store = Store(tmp_path / "s", create=True)
    with pytest.raises(DatastoreNotFoundError, match="no datastore named 'code'"):
        store.resolve("code")
    v1 = store.commit(manifest(num_tokens=10))
    v2 = store.commit(manifest(num_tokens=20))
    store.commit(manifest("chat"))
    assert (v1.version, v2.version) == (1, 2)
    assert store.names() == ["chat", "code"]
    assert store.resolve("code").manifest.num_tokens == 20
    assert store.resolve("code@1").manifest.num_tokens == 10
    with pytest.raises(DatastoreNotFoundError, match="no version 7"):
        store.resolve("code@7")
    # a fresh handle sees the same catalogue
    assert [r.version for r in Store(tmp_path / "s").versions("code")] == [1, 2]


def test_tags_point_where_set_and_move(tmp_path):
    store = Store(tmp_path, create=True)
    store.commit(manifest())
    store.commit(manifest())
    assert store.set_tag("code@1", "prod").version == 1
    assert store.resolve("code@prod").version == 1
    store.commit(manifest())
    assert store.resolve("code@prod").version == 1  # a new build does not move a tag
    store.set_tag("code@3", "prod")
    assert store.resolve("code@prod").version == 3
    assert store.versions("code")[2].tags == ("prod",)
    with pytest.raises(DatastoreNotFoundError, match="no tag 'nope'"):
        store.resolve("code@nope")


def test_concurrent_commits_get_distinct_versions(tmp_path):
    store = Store(tmp_path, create=True)
    threads = [threading.Thread(target=lambda: Store(tmp_path).commit(manifest())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.version for r in store.versions("code")] == [1, 2, 3, 4]


def test_a_catalogue_another_writer_is_creating_reads_empty_and_commits(tmp_path):
    """A concurrent first commit creates the catalogue table: for a moment its folder is there
    and its first version not yet (a commit that read it then failed with Lance's "not found",
    once in CI). Readers see no versions; a commit creates the table (or loses the race and
    retries) and goes on."""
    store = Store(tmp_path, create=True)
    (tmp_path / "specstore_versions.lance" / "_versions").mkdir(parents=True)
    assert store.versions("code") == [] and store.names() == []
    assert store.commit(manifest()).version == 1
    assert [r.version for r in Store(tmp_path).versions("code")] == [1]


def test_checksums_detect_corruption_and_missing_files(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"hello")
    files = checksum_files(tmp_path, ["a.bin"])
    verify_files(tmp_path, files)
    (tmp_path / "a.bin").write_bytes(b"hellp")
    with pytest.raises(ChecksumError, match="a.bin fails its checksum"):
        verify_files(tmp_path, files)
    (tmp_path / "a.bin").unlink()
    with pytest.raises(ChecksumError, match="missing"):
        verify_files(tmp_path, files)


def test_store_errors(tmp_path):
    with pytest.raises(DatastoreNotFoundError, match="does not exist"):
        Store(tmp_path / "missing")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SpecstoreError, match="not writable"):
        Store(blocker / "store", create=True)


def test_cli_versions_and_tag(tmp_path, capsys):
    store = Store(tmp_path, create=True)
    store.commit(manifest(num_tokens=10))
    store.commit(manifest(num_tokens=20))
    assert main(["tag", "--store", str(tmp_path), "--ref", "code@1", "--tag", "prod"]) == 0
    capsys.readouterr()
    assert main(["versions", "--store", str(tmp_path), "--name", "code", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["tags"], r["num_tokens"]) for r in rows] == [(1, ["prod"], 10), (2, [], 20)]
    assert {"version", "tags", "created_at", "num_documents", "num_tokens", "num_rejected"} <= set(rows[0])
    assert main(["versions", "--store", str(tmp_path), "--name", "code"]) == 0
    assert "prod" in capsys.readouterr().out
    assert main(["tag", "--store", str(tmp_path), "--ref", "code@9", "--tag", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no version 9" in err
    assert main(["versions", "--store", str(tmp_path / "nope"), "--name", "code"]) == 2
