"""A build's files in its store, local or remote, through the runtime's filesystem layer.

Owns how the build's steps write and read the files of the version they make (and of an
append's parent): ``output`` hands a step a local path (or folder) to write with numpy as
usual, in place in a local store, or in a temporary folder uploaded to the object store when
the step is done; ``local_copy`` gives a step a local path of a store file to read; the staging
summary goes through ``write_summary``/``read_summary``. A worker needs only the plan (store
URI and storage options) to reach them: nothing passes through the driver's disk or memory.
Does not own what the files hold (writers.py, embed.py, summary.py) or the commit (commit.py).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from specstore.runtime.storage import Location, is_remote, split_uri

if TYPE_CHECKING:
    from specstore.pipelines.plan import BuildPlan
    from specstore.pipelines.summary import BuildSummary


def version_rel(plan: BuildPlan, name: str = "") -> str:
    """``name`` in the version's files folder, relative to the store's root."""
    return f"{plan.files_rel}/{name}".rstrip("/") if name else plan.files_rel


@contextmanager
def output(plan: BuildPlan, name: str, *, folder: bool = False) -> Iterator[Path]:
    """A local path to write the version's file ``name`` (or, with ``folder``, a folder whose
    files become ``name/...``; ``name`` "" is the version folder itself)."""
    if not plan.remote:
        path = Path(plan.files_dir, name) if name else Path(plan.files_dir)
        (path if folder else path.parent).mkdir(parents=True, exist_ok=True)
        yield path
        return
    location = plan.location
    with tempfile.TemporaryDirectory(prefix="specstore-out-") as tmp:
        path = Path(tmp) / (Path(name).name or "version")
        if folder:
            path.mkdir()
        yield path
        if folder:
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                location.upload(file, version_rel(plan, f"{name}/{file.relative_to(path).as_posix()}".lstrip("/")))
        else:
            location.upload(path, version_rel(plan, name))


@contextmanager
def local_copy(uri_or_path: str, storage_options: dict[str, str] | None = None) -> Iterator[Path]:
    """A local path holding the file at ``uri_or_path`` (itself when it is local)."""
    if not is_remote(uri_or_path):
        yield Path(uri_or_path)
        return
    scheme, rest = split_uri(uri_or_path)
    bucket, _, key = rest.partition("/")
    location = Location.of(f"{scheme}://{bucket}", storage_options)
    with tempfile.TemporaryDirectory(prefix="specstore-in-") as tmp:
        path = Path(tmp) / Path(key).name
        location.download(key, path)
        yield path


def write_summary(plan: BuildPlan, summary: BuildSummary) -> None:
    if plan.remote:
        plan.location.write_bytes(version_rel(plan, f"{plan.staging_name}/{plan.summary_name}"), summary.to_json().encode())
    else:
        summary.write(plan.summary_path)


def read_summary(plan: BuildPlan) -> BuildSummary | None:
    """The staging summary, None when the pipeline did not get to write it."""
    from specstore.pipelines.summary import BuildSummary

    if plan.remote:
        rel = version_rel(plan, f"{plan.staging_name}/{plan.summary_name}")
        return BuildSummary.from_json(plan.location.read_bytes(rel).decode()) if plan.location.is_file(rel) else None
    return BuildSummary.read(plan.summary_path) if plan.summary_path.is_file() else None


def remove_staging(plan: BuildPlan) -> None:
    if plan.remote:
        plan.location.delete_dir(version_rel(plan, plan.staging_name))
    else:
        import shutil

        shutil.rmtree(plan.staging_dir, ignore_errors=True)
