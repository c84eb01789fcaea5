"""Retention (``specstore gc``): remove old untagged versions of a datastore and the files of
builds that never committed.

Owns which versions go (all but the newest ``keep``, never one a tag points at), removing their
catalogue rows (one Lance delete under the datastore's lock, so the catalogue stays the single
commit point) and then their files (tokens table folder and ``_files/NAME/BUILD``), and finding
*orphans*: build folders and tables that no catalogue row names, left by crashed or killed
builds. An orphan is removed only once nothing in it changed for ``grace_seconds``, so a build
still running is not hit. Does not own building (pipelines/) or reading versions (datastore.py).

A reader that already opened a version keeps working after gc removes it: the suffix array and
stream are memory maps (an unlinked file stays readable while mapped, on Linux) and the rows it
uses are loaded into memory on open (``dense=True``). Opening a removed version fails cleanly.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from specstore.runtime.errors import SpecstoreError
from specstore.runtime.store import VERSIONS_TABLE, Store, validate_name

DEFAULT_GRACE_SECONDS = 6 * 3600
_BUILD_ID = re.compile(r"^\d{8}T\d{6}-[0-9a-f]{8}$")


@dataclass
class GcReport:
    name: str
    kept: list[int] = field(default_factory=list)
    removed_versions: list[int] = field(default_factory=list)
    removed_builds: list[str] = field(default_factory=list)  # committed builds whose files went
    orphan_builds: list[str] = field(default_factory=list)  # never-committed builds whose files went
    num_bytes: int = 0

    def summary(self, dry_run: bool = False) -> str:
        verb = "would remove" if dry_run else "removed"
        versions = ", ".join(map(str, self.removed_versions)) or "none"
        return (
            f"gc {self.name}: {verb} versions {versions} (kept {', '.join(map(str, self.kept)) or 'none'}), "
            f"{len(self.orphan_builds)} unfinished builds, {self.num_bytes / 2**20:.1f} MiB"
        )


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    for folder, dirs, files in os.walk(path):
        for entry in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(folder, entry)).st_mtime)
            except FileNotFoundError:  # removed while we walk (a build cleaning its staging files)
                pass
    return newest


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _build_files(store: Store, name: str) -> dict[str, list[Path]]:
    """Every build id found on disk for ``name`` -> its folders (files dir, tokens table)."""
    found: dict[str, list[Path]] = {}
    files_root = store.root / "_files" / name
    if files_root.is_dir():
        for folder in files_root.iterdir():
            if _BUILD_ID.match(folder.name):
                found.setdefault(folder.name, []).append(folder)
    prefix = f"{name}__"
    for table in store.root.glob(f"{prefix}*.lance"):
        rest = table.name[len(prefix) : -len(".lance")]
        build_id = rest[:15] + "-" + rest[16:] if len(rest) == 24 and rest[15] == "_" else ""
        if _BUILD_ID.match(build_id) and Store.table_name(name, build_id) == table.name[: -len(".lance")]:
            found.setdefault(build_id, []).append(table)
    return found


def collect(store: Store, name: str, *, keep: int, grace_seconds: float = DEFAULT_GRACE_SECONDS, dry_run: bool = False) -> GcReport:
    """Keep the newest ``keep`` versions and every tagged one; remove the rest and orphans."""
    validate_name(name)
    if keep < 1:
        raise SpecstoreError(f"--keep must be at least 1 (the newest version is always kept), got {keep}")
    if grace_seconds < 0:
        raise SpecstoreError(f"--grace-seconds must be >= 0, got {grace_seconds}")
    report = GcReport(name)
    with store.lock(name):  # no commit or tag of this datastore interleaves with the decision
        records = store.versions(name)
        tagged = set(store.tags(name).values())
        doomed = [r for r in records[:-keep] if r.version not in tagged]
        report.removed_versions = [r.version for r in doomed]
        report.kept = [r.version for r in records if r not in doomed]
        if not dry_run:
            store.delete_versions(name, report.removed_versions)  # from here on, no reader can resolve them
        live = {r.build_id for r in records if r not in doomed}
        on_disk = _build_files(store, name)
        now = time.time()
        for build_id, paths in sorted(on_disk.items()):
            if build_id in live:
                continue
            if build_id not in {r.build_id for r in doomed}:
                if any(now - _newest_mtime(p) < grace_seconds for p in paths):
                    continue  # maybe a build still running
                report.orphan_builds.append(build_id)
            else:
                report.removed_builds.append(build_id)
            report.num_bytes += sum(_size(p) for p in paths)
            if not dry_run:
                for p in paths:
                    shutil.rmtree(p, ignore_errors=True)
    if not dry_run and report.removed_versions:
        _prune_catalogue_history(store, grace_seconds)
    return report


def _prune_catalogue_history(store: Store, grace_seconds: float) -> None:
    """Drop Lance versions of the catalogue older than the grace period (they still hold the
    removed rows); a reader that read the catalogue within the grace period is unaffected."""
    table = store.open_table(VERSIONS_TABLE)
    table.to_lance().cleanup_old_versions(older_than=timedelta(seconds=max(grace_seconds, 1.0)))


def run_gc_command(args) -> int:
    """The CLI handler of ``specstore gc``."""
    store = Store(args.store)
    report = collect(store, args.name, keep=args.keep, grace_seconds=args.grace_seconds, dry_run=args.dry_run)
    print(report.summary(args.dry_run))
    return 0
