"""The build plan: every setting and location of one build, fixed before the pipeline runs.

Owns one frozen, picklable record that the driver makes once and every Beam step receives
(no globals), plus the staging locations inside the version's (not yet visible) file folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specstore.pipelines.corpus import Source
from specstore.pipelines.lineage import BaseVersion

STAGING_DIR = "_staging"
SUMMARY_FILE = "summary.json"
REJECTED_FILE = "rejected.jsonl"


@dataclass(frozen=True)
class BuildPlan:
    name: str
    build_id: str
    store_root: str
    table_uri: str
    files_dir: str
    sources: tuple[Source, ...]
    model_path: str
    dtype: str = "float32"
    regenerate: bool = False
    max_docs: int | None = None
    max_doc_tokens: int = 2048
    max_new_tokens: int = 256
    pca_dims: int = 64
    continuation_length: int = 10
    batch_tokens: int = 4096
    generate_batch: int = 16
    fit_rows_per_batch: int | None = 1024
    spill_dtype: str = "float32"
    progress: bool = True
    progress_totals: bool = True  # bars know their stage's total (one process runs every step)
    base: BaseVersion | None = None  # append: the parent version whose rows and stream come first
    normaliser_path: str | None = None  # a normaliser to reuse instead of fitting one
    sa_shard_tokens: int | None = None  # build the suffix array in shards of at most this many tokens

    @property
    def staging_dir(self) -> Path:
        return Path(self.files_dir) / STAGING_DIR

    @property
    def summary_path(self) -> Path:
        return self.staging_dir / SUMMARY_FILE

    def source(self, index: int) -> Source:
        """The source numbered ``index`` (an append numbers its sources after the parent's)."""
        for s in self.sources:
            if s.index == index:
                return s
        raise KeyError(index)

    def source_path(self, index: int) -> str:
        return self.source(index).path

    def source_format(self, index: int) -> str:
        return self.source(index).format
