"""The store: a LanceDB database of named datastores, their versions and tags, in a local
directory or at an object-store URI (``s3://``, ``gs://``, ``az://``; storage.py).

Owns the catalogue (which versions exist, what their manifests say, where tags point), the
single commit point that makes a version visible, and the locations of a version's files.
Does not own building a version (pipelines/) or loading one for decoding (datastore.py).

Layout::

    STORE/specstore_versions.lance   catalogue: one row per committed version (the commit point)
    STORE/specstore_tags.lance       append-only tag log; the newest row for (name, tag) wins
    STORE/NAME__BUILD.lance          tokens table of one build (LanceDB table ``NAME__BUILD``)
    STORE/_files/NAME/BUILD/         suffix array, token stream, normaliser, rejected records

A build writes its table and files under a fresh BUILD id first and then adds one row to the
catalogue. Until that row exists nothing of the build is visible; a crashed build leaves only
unreferenced files, which ``gc`` may delete.

Version numbers come from the catalogue's own commit, so they need no lock that two machines
would have to share: a commit reads the catalogue at Lance version V, writes it anew with the
next number, and commits that with ``read_version=V``; when another builder (or ``gc``)
committed in between, Lance refuses it as a conflict and the commit is read and tried again.
Two concurrent builds of one name therefore get distinct numbers and both are kept.
"""

from __future__ import annotations

import os
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import lancedb
import pyarrow as pa

from specstore.runtime.errors import ChecksumError, DatastoreNotFoundError, SpecstoreError
from specstore.runtime.hashing import file_sha256
from specstore.runtime.storage import Location
from specstore.schemas.manifest import FileInfo, Manifest
from specstore.schemas.tables import TAGS_SCHEMA, VERSIONS_SCHEMA

VERSIONS_TABLE = "specstore_versions"
TAGS_TABLE = "specstore_tags"
COMMIT_ATTEMPTS = 50
REJECTED_FILE = "rejected.jsonl"  # a build's rejected records, in its files folder (never read by decoding)
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
    """``Store(path_or_uri)`` opens an existing store; ``create=True`` makes one.
    ``storage_options``: Lance's option names (``aws_endpoint``, ``aws_region``, ...), over
    what the environment gives (storage.py). ``root``: the directory (a Path) of a local store,
    the URI (a str) of a remote one; ``location``: either, with the filesystem that reaches it."""

    def __init__(self, root: str | os.PathLike | Location, *, create: bool = False,
                 storage_options: Mapping[str, str] | None = None):
        self.location = Location.of(root, storage_options)
        self.root = self.location.uri if self.location.remote else self.location.local_root
        if self.location.remote:
            try:
                if create:
                    probe = f".write-probe-{uuid.uuid4().hex}"
                    self.location.write_bytes(probe, b"")
                    self.location.delete_file(probe)
                else:
                    self.location.list_dir("")
            except OSError as exc:
                verb = "writable" if create else "reachable"
                raise SpecstoreError(f"store {self.root} is not {verb}: {exc}") from None
        elif create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                probe = self.root / f".write-probe-{uuid.uuid4().hex}"
                probe.touch()
                probe.unlink()
            except OSError as exc:
                raise SpecstoreError(f"store {self.root} is not writable: {exc.strerror or exc}") from None
        elif not self.root.is_dir():
            raise DatastoreNotFoundError(f"store {self.root} does not exist")
        self._db = lancedb.connect(self.location.uri, storage_options=self.location.options or None)

    @classmethod
    def from_args(cls, args, *, create: bool = False) -> Store:
        """The store of a command's ``--store`` and repeated ``--storage-option KEY=VALUE``."""
        from specstore.runtime.storage import parse_storage_options

        return cls(args.store, create=create, storage_options=parse_storage_options(getattr(args, "storage_option", None)))

    @property
    def storage_options(self) -> dict[str, str]:
        """The options Lance gets for this store (environment and given ones)."""
        return self.location.options

    # ---- locations -------------------------------------------------------------------------
    @staticmethod
    def new_build_id() -> str:
        return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]

    @staticmethod
    def table_name(name: str, build_id: str) -> str:
        return f"{name}__{build_id.replace('-', '_')}"

    def table_uri(self, table_name: str) -> str:
        return self.location.child(f"{table_name}.lance")

    @staticmethod
    def files_rel(name: str, build_id: str) -> str:
        """A build's files folder relative to the store's root."""
        return f"_files/{name}/{build_id}"

    def files_dir(self, name: str, build_id: str) -> Path:
        """A build's files folder in a local store (a remote store's: ``files_rel``)."""
        return self.location.local_root / self.files_rel(name, build_id)

    def open_table(self, table_name: str):
        """The LanceDB table of a version's tokens."""
        return self._db.open_table(table_name)

    # ---- catalogue ---------------------------------------------------------------------------
    def _catalogue(self, table: str, schema: pa.Schema):
        return self._db.create_table(table, schema=schema, exist_ok=True)

    def _read(self, table: str):
        """``(rows, Lance version)`` of a catalogue table; ``([], None)`` before it exists."""
        import lance

        uri = self.table_uri(table)
        if not self.location.exists(f"{table}.lance/_versions"):
            return [], None
        try:
            dataset = lance.dataset(uri, storage_options=self.location.options or None)
        except (OSError, ValueError) as exc:
            # another writer is creating the table: its folder is there, its first version not yet
            if "not found" not in str(exc).lower():
                raise
            return [], None
        return dataset.to_table().to_pylist(), dataset.version

    def _rows(self, table: str, schema: pa.Schema) -> list[dict]:
        return self._read(table)[0]

    def _rewrite(self, table: str, schema: pa.Schema, change: Callable[[list[dict]], tuple[list[dict], object]]):
        """Replace a catalogue table's rows by ``change(rows)[0]`` in one conditional commit on
        the version read (retried on a conflict); returns ``change(rows)[1]`` of the attempt
        that committed."""
        import lance

        uri, options = self.table_uri(table), self.location.options or None
        for attempt in range(COMMIT_ATTEMPTS):
            rows, read_version = self._read(table)
            try:
                if read_version is None:  # an empty table first: concurrent creates of it are all alike
                    lance.write_dataset(schema.empty_table(), uri, schema=schema, mode="create", storage_options=options)
                    continue
                new_rows, result = change(rows)
                data = pa.Table.from_pylist(new_rows, schema=schema)
                fragments = lance.fragment.write_fragments(data, uri, schema=schema, storage_options=options)
                lance.LanceDataset.commit(uri, lance.LanceOperation.Overwrite(schema, fragments),
                                          read_version=read_version, storage_options=options)
                return result
            except (OSError, ValueError) as exc:  # lance: CommitConflictError (an OSError), or "already exists" on create
                if not _conflict(exc):
                    raise
            time.sleep(min(2.0, 0.02 * 2**min(attempt, 6)) * (0.5 + random.random()))
        raise SpecstoreError(f"could not commit to {uri}: {COMMIT_ATTEMPTS} attempts met concurrent commits")

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
        return self._records(name, self._rows(VERSIONS_TABLE, VERSIONS_SCHEMA))

    def _records(self, name: str, rows: list[dict]) -> list[VersionRecord]:
        tags_by_version: dict[int, list[str]] = {}
        for tag, version in sorted(self.tags(name).items()):
            tags_by_version.setdefault(version, []).append(tag)
        records = [
            VersionRecord(
                name=name, version=row["version"], build_id=row["build_id"], created_at=row["created_at"],
                manifest=Manifest.model_validate_json(row["manifest_json"]),
                tags=tuple(tags_by_version.get(row["version"], ())),
            )
            for row in rows
            if row["name"] == name
        ]
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
        """Make a fully written build visible as the next version of its datastore (one
        conditional commit of the catalogue; see the module doc)."""
        validate_name(manifest.name)

        def add(rows: list[dict]):
            versions = [r["version"] for r in rows if r["name"] == manifest.name]
            # numbers keep increasing past removed versions: gc never removes the newest
            version = max(versions, default=0) + 1
            committed = manifest.model_copy(update={"version": version})
            row = {"name": committed.name, "version": version, "build_id": committed.build_id,
                   "created_at": committed.created_at.isoformat(), "manifest_json": committed.model_dump_json()}
            return rows + [row], committed

        return self._rewrite(VERSIONS_TABLE, VERSIONS_SCHEMA, add)

    def delete_versions(self, name: str, choose: Callable[[list[VersionRecord], dict[str, int]], list[int]]) -> list[int]:
        """Remove the catalogue rows of the versions ``choose(records, tags)`` names, deciding
        on the catalogue as read by the commit that removes them (so a version committed
        meanwhile is seen); returns the removed version numbers."""
        validate_name(name)

        def remove(rows: list[dict]):
            records = self._records(name, rows)
            doomed = set(choose(records, self.tags(name)))
            if records and records[-1].version in doomed:
                raise SpecstoreError(f"internal: the newest version of {name} cannot be removed")
            return [r for r in rows if not (r["name"] == name and r["version"] in doomed)], sorted(doomed)

        return self._rewrite(VERSIONS_TABLE, VERSIONS_SCHEMA, remove)

    def set_tag(self, ref: str | Ref, tag: str) -> VersionRecord:
        """Point ``tag`` at the version ``ref`` resolves to (moving it if it pointed elsewhere)."""
        record = self.resolve(ref)
        validate_tag(tag)
        row = {"name": record.name, "tag": tag, "version": record.version, "set_at": now_iso()}
        self._catalogue(TAGS_TABLE, TAGS_SCHEMA).add(pa.Table.from_pylist([row], schema=TAGS_SCHEMA))  # appends never conflict
        return self.resolve(Ref(record.name, tag=tag))


def _conflict(exc: Exception) -> bool:
    """A commit that lost a race: Lance's CommitConflictError, or a create that found the table made."""
    if type(exc).__name__ == "CommitConflictError":
        return True
    text = str(exc).lower()
    return "conflict" in text or "already exists" in text


def checksum_files(folder: Path, names: list[str]) -> dict[str, FileInfo]:
    """Checksums of the named files (paths relative to ``folder``)."""
    return {n: FileInfo(sha256=file_sha256(folder / n), num_bytes=(folder / n).stat().st_size) for n in names}


def location_sha256(location: Location, rel: str) -> str:
    """SHA-256 of a file of a store (streamed)."""
    import hashlib

    digest = hashlib.sha256()
    with location.open_input(rel) as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify_files(root: Path | Location, files: dict[str, FileInfo], *, full: bool = True) -> None:
    """Raise ChecksumError naming the first file that is missing or differs from the manifest.
    ``root``: a local store's directory or a store's Location."""
    location = root if isinstance(root, Location) else Location.of(root)
    for rel, info in sorted(files.items()):
        size = location.size(rel)
        if size is None:
            raise ChecksumError(f"datastore file {rel} is missing from {location}")
        if size != info.num_bytes:
            raise ChecksumError(f"datastore file {rel} has {size} bytes, manifest says {info.num_bytes}")
        if full and (file_sha256(Path(location.child(rel))) if not location.remote else location_sha256(location, rel)) != info.sha256:
            raise ChecksumError(f"datastore file {rel} fails its checksum (corrupted or modified)")
