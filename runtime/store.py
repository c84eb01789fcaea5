"""The store: a directory (a LanceDB database) of named datastores, their versions and tags.

Owns the catalogue (which versions exist, what their manifests say, where tags point), the
single commit point that makes a version visible, and the locations of a version's files.
Does not own building a version (pipelines/) or loading one for decoding (datastore.py).

Layout::

    STORE/specstore_versions.lance   catalogue: one row per committed version (the commit point)
    STORE/specstore_tags.lance       append-only tag log; the newest row for (name, tag) wins
    STORE/NAME__BUILD.lance          tokens table of one build (LanceDB table ``NAME__BUILD``)
    STORE/_files/NAME/BUILD/         suffix array, token stream, normaliser, rejected records

A build writes its table and files under a fresh BUILD id first and then appends one row to
the catalogue. Until that row exists nothing of the build is visible; a crashed build leaves
only unreferenced files, which ``gc`` may delete.
"""

from __future__ import annotations

import fcntl
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import lancedb
import pyarrow as pa

from specstore.runtime.errors import ChecksumError, DatastoreNotFoundError, SpecstoreError
from specstore.runtime.hashing import file_sha256
from specstore.schemas.manifest import FileInfo, Manifest
from specstore.schemas.tables import TAGS_SCHEMA, VERSIONS_SCHEMA

VERSIONS_TABLE = "specstore_versions"
TAGS_TABLE = "specstore_tags"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def validate_name(name: str) -> str:
    if not _NAME_RE.match(name) or "__" in name:
        raise SpecstoreError(
            f"invalid datastore name {name!r}: use lower-case letters, digits, '-' and '_' (no '__'), at most 63"
        )
    return name


def validate_tag(tag: str) -> str:
    if not _TAG_RE.match(tag) or tag.isdigit():
        raise SpecstoreError(f"invalid tag {tag!r}: letters, digits, '.', '-', '_', not all digits, at most 63")
    return tag


@dataclass(frozen=True, slots=True)
class Ref:
    """A parsed reference: ``NAME``, ``NAME@VERSION`` or ``NAME@TAG``."""

    name: str
    version: int | None = None
    tag: str | None = None

    @classmethod
    def parse(cls, text: str) -> Ref:
        name, at, selector = text.strip().partition("@")
        validate_name(name)
        if not at:
            return cls(name)
        if not selector:
            raise SpecstoreError(f"invalid reference {text!r}: nothing after '@' (use NAME, NAME@VERSION or NAME@TAG)")
        if selector.isdigit():
            return cls(name, version=int(selector))
        return cls(name, tag=validate_tag(selector))

    def __str__(self) -> str:
        if self.version is not None:
            return f"{self.name}@{self.version}"
        return f"{self.name}@{self.tag}" if self.tag else self.name


@dataclass(frozen=True, slots=True)
class VersionRecord:
    name: str
    version: int
    build_id: str
    created_at: str
    manifest: Manifest
    tags: tuple[str, ...] = field(default=())


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class Store:
    """A local store directory. ``Store(path)`` opens an existing store; ``create=True`` makes one."""

    def __init__(self, root: str | os.PathLike, *, create: bool = False):
        self.root = Path(root).expanduser().resolve()
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                probe = self.root / f".write-probe-{uuid.uuid4().hex}"
                probe.touch()
                probe.unlink()
            except OSError as exc:
                raise SpecstoreError(f"store {self.root} is not writable: {exc.strerror or exc}") from None
        elif not self.root.is_dir():
            raise DatastoreNotFoundError(f"store {self.root} does not exist")
        self._db = lancedb.connect(str(self.root))

    # ---- locations -------------------------------------------------------------------------
    @staticmethod
    def new_build_id() -> str:
        return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]

    @staticmethod
    def table_name(name: str, build_id: str) -> str:
        return f"{name}__{build_id.replace('-', '_')}"

    def table_uri(self, table_name: str) -> str:
        return str(self.root / f"{table_name}.lance")

    def files_dir(self, name: str, build_id: str) -> Path:
        return self.root / "_files" / name / build_id

    def open_table(self, table_name: str):
        """The LanceDB table of a version's tokens."""
        return self._db.open_table(table_name)

    # ---- catalogue ---------------------------------------------------------------------------
    def _catalogue(self, table: str, schema: pa.Schema):
        return self._db.create_table(table, schema=schema, exist_ok=True)

    def _rows(self, table: str, schema: pa.Schema) -> list[dict]:
        if not (self.root / f"{table}.lance").is_dir():
            return []
        return self._db.open_table(table).to_arrow().to_pylist()

    @contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """An exclusive lock per datastore name, held while assigning a version number."""
        lock_path = self.root / f".lock-{name}"
        with open(lock_path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def names(self) -> list[str]:
        return sorted({row["name"] for row in self._rows(VERSIONS_TABLE, VERSIONS_SCHEMA)})

    def tags(self, name: str) -> dict[str, int]:
        """Current tag -> version for one datastore."""
        current: dict[str, tuple[str, int]] = {}
        for row in self._rows(TAGS_TABLE, TAGS_SCHEMA):
            if row["name"] == name:
                previous = current.get(row["tag"])
                if previous is None or row["set_at"] >= previous[0]:
                    current[row["tag"]] = (row["set_at"], row["version"])
        return {tag: version for tag, (_, version) in current.items() if version >= 0}

    def versions(self, name: str) -> list[VersionRecord]:
        """All committed versions of ``name``, oldest first, with their tags."""
        tags_by_version: dict[int, list[str]] = {}
        for tag, version in sorted(self.tags(name).items()):
            tags_by_version.setdefault(version, []).append(tag)
        records = []
        for row in self._rows(VERSIONS_TABLE, VERSIONS_SCHEMA):
            if row["name"] != name:
                continue
            records.append(
                VersionRecord(
                    name=name,
                    version=row["version"],
                    build_id=row["build_id"],
                    created_at=row["created_at"],
                    manifest=Manifest.model_validate_json(row["manifest_json"]),
                    tags=tuple(tags_by_version.get(row["version"], ())),
                )
            )
        return sorted(records, key=lambda r: r.version)

    def resolve(self, ref: str | Ref) -> VersionRecord:
        """The committed version a reference points to; a bare name means the newest version."""
        ref = Ref.parse(ref) if isinstance(ref, str) else ref
        records = self.versions(ref.name)
        if not records:
            known = ", ".join(self.names()) or "none"
            raise DatastoreNotFoundError(f"no datastore named '{ref.name}' in store {self.root} (known: {known})")
        if ref.tag is not None:
            tags = self.tags(ref.name)
            if ref.tag not in tags:
                raise DatastoreNotFoundError(
                    f"datastore '{ref.name}' has no tag '{ref.tag}' (tags: {', '.join(sorted(tags)) or 'none'})"
                )
            wanted = tags[ref.tag]
        elif ref.version is not None:
            wanted = ref.version
        else:
            return records[-1]
        for record in records:
            if record.version == wanted:
                return record
        raise DatastoreNotFoundError(
            f"datastore '{ref.name}' has no version {wanted} (versions: {', '.join(str(r.version) for r in records)})"
        )

    # ---- writes ------------------------------------------------------------------------------
    def commit(self, manifest: Manifest) -> Manifest:
        """Make a fully written build visible as the next version of its datastore (one atomic append)."""
        validate_name(manifest.name)
        with self.lock(manifest.name):
            existing = self.versions(manifest.name)
            version = (existing[-1].version + 1) if existing else 1
            committed = manifest.model_copy(update={"version": version})
            row = {
                "name": committed.name,
                "version": version,
                "build_id": committed.build_id,
                "created_at": committed.created_at.isoformat(),
                "manifest_json": committed.model_dump_json(),
            }
            self._catalogue(VERSIONS_TABLE, VERSIONS_SCHEMA).add(pa.Table.from_pylist([row], schema=VERSIONS_SCHEMA))
        return committed

    def delete_versions(self, name: str, versions: list[int]) -> None:
        """Remove catalogue rows (one atomic Lance delete); the caller holds ``lock(name)`` and
        never removes the newest version, so version numbers keep increasing."""
        if versions:
            wanted = ", ".join(str(int(v)) for v in versions)
            self._catalogue(VERSIONS_TABLE, VERSIONS_SCHEMA).delete(f"name = '{validate_name(name)}' AND version IN ({wanted})")

    def set_tag(self, ref: str | Ref, tag: str) -> VersionRecord:
        """Point ``tag`` at the version ``ref`` resolves to (moving it if it pointed elsewhere)."""
        record = self.resolve(ref)
        validate_tag(tag)
        row = {"name": record.name, "tag": tag, "version": record.version, "set_at": now_iso()}
        with self.lock(record.name):
            self._catalogue(TAGS_TABLE, TAGS_SCHEMA).add(pa.Table.from_pylist([row], schema=TAGS_SCHEMA))
        return self.resolve(Ref(record.name, tag=tag))


def checksum_files(folder: Path, names: list[str]) -> dict[str, FileInfo]:
    """Checksums of the named files (paths relative to ``folder``)."""
    return {n: FileInfo(sha256=file_sha256(folder / n), num_bytes=(folder / n).stat().st_size) for n in names}


def verify_files(folder: Path, files: dict[str, FileInfo], *, full: bool = True) -> None:
    """Raise ChecksumError naming the first file that is missing or differs from the manifest."""
    for rel, info in sorted(files.items()):
        path = folder / rel
        if not path.is_file():
            raise ChecksumError(f"datastore file {rel} is missing from {folder}")
        if path.stat().st_size != info.num_bytes:
            raise ChecksumError(f"datastore file {rel} has {path.stat().st_size} bytes, manifest says {info.num_bytes}")
        if full and file_sha256(path) != info.sha256:
            raise ChecksumError(f"datastore file {rel} fails its checksum (corrupted or modified)")
