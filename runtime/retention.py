"""Retention (``specstore gc``): remove old untagged versions of a datastore and the files of
builds that never committed.

Owns which versions go (all but the newest ``keep``, never one a tag points at), removing their
catalogue rows (one conditional commit of the catalogue, decided on the rows that commit read,
so the catalogue stays the single commit point) and then their files (tokens table folder and
``_files/NAME/BUILD``, through the store's filesystem layer, local or remote), and finding
*orphans*: build folders and tables that no catalogue row names, left by crashed or killed
builds. An orphan is removed only once nothing in it changed for ``grace_seconds``, so a build
still running is not hit. Does not own building (pipelines/) or reading versions (datastore.py).

A reader that already opened a version keeps working after gc removes it: the suffix array and
stream are memory maps (an unlinked file stays readable while mapped, on Linux), so are a compact
version's dense files (an approximate index first wanted after its file went is skipped: that
block is scanned exactly), and an old-form version's rows are loaded into memory on open
(``dense=True``). Opening a removed version fails cleanly.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import timedelta

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


def _build_folders(store: Store, name: str) -> dict[str, list[str]]:
    """Every build id found in the store for ``name`` -> its folders (files dir, tokens table),
    relative to the store's root."""
    found: dict[str, list[str]] = {}
    for entry, _ in store.location.list_dir(f"_files/{name}"):
        if _BUILD_ID.match(entry):
            found.setdefault(entry, []).append(Store.files_rel(name, entry))
    prefix = f"{name}__"
    for entry, _ in store.location.list_dir(""):
        if not (entry.startswith(prefix) and entry.endswith(".lance")):
            continue
        rest = entry[len(prefix) : -len(".lance")]
        build_id = rest[:15] + "-" + rest[16:] if len(rest) == 24 and rest[15] == "_" else ""
        if _BUILD_ID.match(build_id) and Store.table_name(name, build_id) == entry[: -len(".lance")]:
            found.setdefault(build_id, []).append(entry)
    return found


def _usage(store: Store, folders: list[str]) -> tuple[int, float | None]:
    """Bytes under ``folders`` and the newest modified time of anything in them."""
    size, newest = 0, None
    for folder in folders:
        for _, _, num_bytes, mtime in store.location.walk(folder):
            size += num_bytes
            if mtime is not None:
                newest = mtime if newest is None else max(newest, mtime)
    return size, newest


def collect(store: Store, name: str, *, keep: int, grace_seconds: float = DEFAULT_GRACE_SECONDS, dry_run: bool = False) -> GcReport:
    """Keep the newest ``keep`` versions and every tagged one; remove the rest and orphans."""
    validate_name(name)
    if keep < 1:
        raise SpecstoreError(f"--keep must be at least 1 (the newest version is always kept), got {keep}")
    if grace_seconds < 0:
        raise SpecstoreError(f"--grace-seconds must be >= 0, got {grace_seconds}")
    report = GcReport(name)

    def choose(records, tags) -> list[int]:
        tagged = set(tags.values())
        return [r.version for r in records[:-keep] if r.version not in tagged]

    before = store.versions(name)
    if dry_run:
        removed = choose(before, store.tags(name))
    else:  # from here on, no reader can resolve them
        removed = store.delete_versions(name, choose)
    doomed = {r.build_id for r in before if r.version in removed}
    records = [r for r in store.versions(name) if r.version not in removed]  # read again: builds committed meanwhile are live
    report.removed_versions = sorted(removed)
    report.kept = [r.version for r in records]
    live = {r.build_id for r in records}
    now = time.time()
    for build_id, folders in sorted(_build_folders(store, name).items()):
        if build_id in live:
            continue
        size, newest = _usage(store, folders)
        if build_id not in doomed:
            if newest is None or now - newest < grace_seconds:
                continue  # maybe a build still running (an object store without times: never guessed old)
            report.orphan_builds.append(build_id)
        else:
            report.removed_builds.append(build_id)
        report.num_bytes += size
        if not dry_run:
            for folder in folders:
                store.location.delete_dir(folder)
    if not dry_run and report.removed_versions:
        _prune_catalogue_history(store, grace_seconds)
    return report


def _prune_catalogue_history(store: Store, grace_seconds: float) -> None:
    """Drop Lance versions of the catalogue older than the grace period (they still hold the
    removed rows); a reader that read the catalogue within the grace period is unaffected."""
    import lance

    dataset = lance.dataset(store.table_uri(VERSIONS_TABLE), storage_options=store.storage_options or None)
    dataset.cleanup_old_versions(older_than=timedelta(seconds=max(grace_seconds, 1.0)))


def run_gc_command(args) -> int:
    """The CLI handler of ``specstore gc``."""
    store = Store.from_args(args)
    report = collect(store, args.name, keep=args.keep, grace_seconds=args.grace_seconds, dry_run=args.dry_run)
    print(report.summary(args.dry_run))
    return 0
