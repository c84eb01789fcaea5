"""A host-local cache of remote stores' version files, keyed by checksum.

Memory maps need local files, so a version opened from an object store reads its mapped files
(token stream, suffix array, normaliser, ...) through this cache. Owns the cache folder::

    CACHE/objects/ab/abcdef...        one file per content (the manifest's SHA-256), shared by
                                      every version and store that has it
    CACHE/views/KEY/REL               symlinks named as in the version's folder, KEY per store
                                      URI and build, so loaders open a folder as they do locally

An object is fetched once (streamed to a temporary file, hashed on the way, renamed into place
only when its hash is the manifest's), so a process never sees a partial or stale file: a
changed file has another checksum and so another key. Processes on one host share it; a
per-object lock keeps two of them from fetching the same file twice. The cache is bounded:
after a fetch, the least recently used objects are removed until it fits (a process that
already mapped a removed file keeps reading it; the next open fetches it again).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
import uuid
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

from specstore.runtime.errors import ChecksumError, SpecstoreError
from specstore.runtime.storage import Location
from specstore.schemas.manifest import FileInfo

DEFAULT_MAX_BYTES = 50 * 2**30


def default_cache_dir() -> Path:
    env = os.environ.get("SPECSTORE_FILE_CACHE")
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "specstore" / "files"


def default_max_bytes() -> int:
    env = os.environ.get("SPECSTORE_FILE_CACHE_BYTES")
    if not env:
        return DEFAULT_MAX_BYTES
    try:
        value = int(float(env))
    except ValueError:
        raise SpecstoreError(f"SPECSTORE_FILE_CACHE_BYTES={env!r} is not a number of bytes") from None
    if value <= 0:
        raise SpecstoreError(f"SPECSTORE_FILE_CACHE_BYTES must be positive, got {value}")
    return value


class FileCache:
    """``FileCache()`` (folder and bound from SPECSTORE_FILE_CACHE / SPECSTORE_FILE_CACHE_BYTES,
    default ~/.cache/specstore/files and 50 GiB) or ``FileCache(folder, max_bytes=...)``."""

    def __init__(self, root: str | os.PathLike | None = None, *, max_bytes: int | None = None):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        self.max_bytes = default_max_bytes() if max_bytes is None else int(max_bytes)
        self.fetched = 0  # objects this instance downloaded (the rest were already here)

    # ---- objects -----------------------------------------------------------------------------
    def object_path(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise ChecksumError(f"manifest checksum {sha256!r} is not a SHA-256 hex digest")
        return self.root / "objects" / sha256[:2] / sha256

    @contextmanager
    def _locked(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def fetch(self, location: Location, rel: str, info: FileInfo) -> Path:
        """The local object holding ``rel`` of ``location`` (fetched and checked if missing)."""
        path = self.object_path(info.sha256)
        if _has(path, info.num_bytes):
            _touch(path)
            return path
        with self._locked(path):
            if _has(path, info.num_bytes):  # another process fetched it meanwhile
                _touch(path)
                return path
            temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")
            digest, size = hashlib.sha256(), 0
            try:
                with location.open_input(rel) as src, open(temp, "wb") as dst:
                    while chunk := src.read(8 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
                        size += len(chunk)
                if size != info.num_bytes or digest.hexdigest() != info.sha256:
                    raise ChecksumError(f"datastore file {rel} in {location} fails its checksum (corrupted or modified)")
                os.replace(temp, path)
            except FileNotFoundError:
                raise ChecksumError(f"datastore file {rel} is missing from {location}") from None
            finally:
                temp.unlink(missing_ok=True)
            self.fetched += 1
        return path

    # ---- versions ----------------------------------------------------------------------------
    def version_dir(self, location: Location, prefix: str, files: Mapping[str, FileInfo], *, skip: tuple[str, ...] = ()) -> Path:
        """A local folder with every file of ``files`` under ``prefix`` (names relative to it),
        except names in ``skip``: what a local store's version folder holds."""
        prefix = prefix.rstrip("/") + "/"
        wanted = {rel: info for rel, info in files.items() if rel.startswith(prefix) and rel[len(prefix):] not in skip}
        key = hashlib.sha256(f"{location.uri}\n{prefix}".encode()).hexdigest()[:24]
        view = self.root / "views" / key
        used, fetched_before = [], self.fetched
        for rel, info in sorted(wanted.items()):
            target = self.fetch(location, rel, info)
            used.append(target)
            link = view / rel[len(prefix):]
            link.parent.mkdir(parents=True, exist_ok=True)
            if not (link.is_symlink() and os.readlink(link) == str(target)):
                temp = link.with_name(f".{link.name}.{uuid.uuid4().hex[:8]}")
                os.symlink(target, temp)
                os.replace(temp, link)
        if self.fetched > fetched_before:  # only a fill can push the cache past its bound
            self.evict(keep=set(used))
        return view

    def evict(self, keep: set[Path] = frozenset()) -> int:
        """Remove least recently used objects until the cache fits its bound; returns bytes freed."""
        objects = []
        for path in (self.root / "objects").glob("*/*"):
            if path.name.endswith((".lock", ".part")) or not path.is_file():
                continue
            st = path.stat()
            objects.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in objects)
        freed = 0
        for _, size, path in sorted(objects, key=lambda o: o[0]):
            if total - freed <= self.max_bytes:
                break
            if path in keep:
                continue
            with self._locked(path):
                path.unlink(missing_ok=True)
            freed += size
        return freed

    def size(self) -> int:
        return sum(p.stat().st_size for p in (self.root / "objects").glob("*/*") if p.is_file() and not p.name.endswith((".lock", ".part")))


def _has(path: Path, num_bytes: int) -> bool:
    try:
        return path.stat().st_size == num_bytes
    except FileNotFoundError:
        return False


def _touch(path: Path) -> None:
    """Mark an object as used now (its modified time orders eviction)."""
    try:
        now = time.time()
        os.utime(path, (now, now))
    except FileNotFoundError:
        pass
