"""Resuming a build that was killed: its embedded batches are reused, not embedded again.

Embedding is almost all of a dense build's time (a 10M-token build is hours on a CPU), and a
killed or crashed build has already written most of it: every Embed batch is a complete,
atomically renamed staging file (embed.save_staged) holding its documents' ids, tokens and raw
hidden states. ``specstore build --resume`` picks those up.

Owns the *resume record* (``_staging/resume.json``: what the build's plan would produce, its
fingerprint, and an append's parent; written by the driver before the pipeline runs), finding
the unfinished build that a new plan may resume (same datastore, no catalogue row, a record
equal to the new plan's: same corpus content, settings, model and parent, so every staged
document's tokens and hidden states are what this build would compute), listing its complete
staging files, and moving one into the new build's staging. The new build embeds only the
documents no reused file holds; everything after embedding (normaliser fit, fragments, dense
files, suffix array) runs as in any build, and the old build's folder goes once the new version
is committed. A resumed build gives the version an uninterrupted one gives (to float noise in
the normaliser's sums, whose order follows the batches).

Not safe against the old build still running: a build folder has no owner to ask, so the user
says it is dead by asking for ``--resume``. Does not own planning (plan.py) or the steps
(steps.py ``ResumeFn``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specstore.runtime.errors import SpecstoreError
from specstore.runtime.store import Store

if TYPE_CHECKING:
    from specstore.pipelines.plan import BuildPlan

RESUME_FILE = "resume.json"
_BUILD_ID = re.compile(r"^\d{8}T\d{6}-[0-9a-f]{8}$")
_STAGED = re.compile(r"^embed-\d+-[0-9a-f]{8}\.npz$")  # embed.save_staged's names (temp files start with a dot)


@dataclass(frozen=True)
class ResumedBatch:
    """One complete staging file of the build being resumed."""

    rel: str  # relative to the store's root, in the old build's staging folder
    doc_ids: tuple[int, ...]
    num_tokens: int


def record(plan: BuildPlan) -> str:
    """The resume record of ``plan``: equal text for two plans means the same staged batches."""
    return json.dumps({"fingerprint": plan.fingerprint(), "base": plan.base.build_id if plan.base else None}, sort_keys=True, default=str)


def record_rel(plan: BuildPlan) -> str:
    return f"{plan.files_rel}/{plan.staging_name}/{RESUME_FILE}"


def write_record(plan: BuildPlan) -> None:
    """Written by the driver before the pipeline starts, so that a killed build can be resumed."""
    plan.location.write_bytes(record_rel(plan), record(plan).encode())


def find(store: Store, plan: BuildPlan) -> tuple[tuple[str, ...], tuple[ResumedBatch, ...]]:
    """The unfinished builds of ``plan.name`` whose resume record equals ``plan``'s (newest first:
    a build resumed and killed again leaves two) and their complete staging files, each document
    taken once; a SpecstoreError saying why when there is none."""
    location = store.location
    live = {r.build_id for r in store.versions(plan.name)}
    unfinished = sorted((e for e, _ in location.list_dir(f"_files/{plan.name}") if _BUILD_ID.match(e) and e not in live and e != plan.build_id),
                        reverse=True)  # build ids begin with their UTC start time: newest first
    if not unfinished:
        raise SpecstoreError(f"--resume: no unfinished build of '{plan.name}' in {store.root} (nothing to resume)")
    wanted = record(plan)
    differs, matching, batches, seen = [], [], [], set()
    for build_id in unfinished:
        staging = f"{Store.files_rel(plan.name, build_id)}/{plan.staging_name}"
        rel = f"{staging}/{RESUME_FILE}"
        if not location.is_file(rel):
            differs.append(f"{build_id} (no {RESUME_FILE})")
        elif location.read_bytes(rel).decode() != wanted:
            differs.append(f"{build_id} (another corpus, settings, model or parent)")
        else:
            matching.append(build_id)
            batches += _complete_batches(store, staging, seen)
    if not matching:
        raise SpecstoreError(
            f"--resume: no unfinished build of '{plan.name}' was made from the same corpus, settings and model: "
            + "; ".join(differs) + ". Build without --resume (or with the old build's options)"
        )
    return tuple(matching), tuple(batches)


def _complete_batches(store: Store, staging: str, seen: set[int]) -> list[ResumedBatch]:
    """The staging files under ``staging`` that read back whole (a file cut short is embedded
    again) and hold no document in ``seen`` (which they are added to)."""
    import zipfile

    import numpy as np

    batches = []
    for name, _ in sorted(store.location.list_dir(staging)):
        if not _STAGED.match(name):
            continue
        rel = f"{staging}/{name}"
        try:
            with store.location.open_seekable(rel) as f, np.load(f) as data:
                doc_ids = tuple(int(d) for d in data["doc_ids"])
                num_tokens = int(data["lengths"].sum())
                if len(data["tokens"]) != num_tokens:
                    continue
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            continue
        if not doc_ids or seen.intersection(doc_ids):
            continue
        seen.update(doc_ids)
        batches.append(ResumedBatch(rel, doc_ids, num_tokens))
    return batches


def remove_resumed(plan: BuildPlan) -> None:
    """After the commit: the resumed builds' folders and tables (their batches now live in this one's)."""
    location = plan.location
    for build_id in plan.resumed_from:
        location.delete_dir(Store.files_rel(plan.name, build_id))
        location.delete_dir(f"{Store.table_name(plan.name, build_id)}.lance")
