"""What the pipeline hands the driver: written fragments and the build summary.

Owns ``WrittenFragment`` (one staging file's rows, written as Lance fragments not yet committed),
``BuildSummary`` (everything the commit needs: counts, every fragment in stream order, per-source
record counts and the domain centroid), ``summarise``, the pure function that makes the one from
the others, and the summary's explicit JSON form: ``_staging/summary.json`` is how it crosses from
the pipeline's last step to the driver (commit.py), possibly on another machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from specstore.pipelines.append import BaseVersion
    from specstore.pipelines.layout import StreamLayout


@dataclass(frozen=True)
class WrittenFragment:
    first_offset: int  # stream offset of the first row, to order fragments as the stream
    fragments: tuple[str, ...]  # Lance FragmentMetadata, as JSON
    num_rows: int
    embedding_sum: tuple[float, ...]  # sum of the rows' embeddings (float64), for the domain centroid
    dense_path: str | None = None  # compact build: its staged int8 rows for the dense files (writers.write_dense)


@dataclass(frozen=True)
class SourceCounts:
    num_records: int  # records read, rejected ones included
    num_rejected: int


@dataclass(frozen=True)
class BuildSummary:
    num_documents: int  # the whole version's, an append's parent included
    num_tokens: int
    num_new_documents: int
    num_new_tokens: int
    num_rows: int  # table rows, the parent's included (must equal num_tokens)
    num_rejected: int  # this build's
    fragments: tuple[str, ...]  # the new fragments' Lance FragmentMetadata (JSON), in stream order
    domain_centroid: tuple[float, ...] | None  # mean embedding of every row
    sources: dict[int, SourceCounts]  # per source index of this build
    dense: dict | None = None  # compact build: schemas.manifest.DenseFiles fields (writers.write_dense)

    def to_json(self) -> str:
        return json.dumps({
            "num_documents": self.num_documents, "num_tokens": self.num_tokens, "num_new_documents": self.num_new_documents,
            "num_new_tokens": self.num_new_tokens, "num_rows": self.num_rows, "num_rejected": self.num_rejected,
            "fragments": list(self.fragments),
            "domain_centroid": None if self.domain_centroid is None else list(self.domain_centroid),
            "sources": {str(i): {"num_records": c.num_records, "num_rejected": c.num_rejected} for i, c in self.sources.items()},
            "dense": self.dense,
        })

    @classmethod
    def from_json(cls, text: str) -> BuildSummary:
        d = json.loads(text)
        centroid = d["domain_centroid"]
        return cls(
            num_documents=d["num_documents"], num_tokens=d["num_tokens"], num_new_documents=d["num_new_documents"],
            num_new_tokens=d["num_new_tokens"], num_rows=d["num_rows"], num_rejected=d["num_rejected"],
            fragments=tuple(d["fragments"]), domain_centroid=None if centroid is None else tuple(centroid),
            sources={int(i): SourceCounts(c["num_records"], c["num_rejected"]) for i, c in d["sources"].items()},
            dense=d.get("dense"),
        )

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def read(cls, path: Path) -> BuildSummary:
        return cls.from_json(path.read_text())


def summarise(
    written: list[WrittenFragment], layout: StreamLayout, base: BaseVersion | None, *, num_rejected: int,
    source_indices: list[int], read_counts: dict[int, int], rejected_counts: dict[int, int], dense: dict | None = None,
) -> BuildSummary:
    """The summary of a build from its written fragments and layout (an append's parent's rows
    and embedding sum included) and the records read and rejected per source."""
    written = sorted(written, key=lambda f: f.first_offset)
    num_rows = sum(f.num_rows for f in written) + (base.num_rows if base else 0)
    sums = [list(f.embedding_sum) for f in written] + ([list(base.embedding_sum)] if base and base.embedding_sum else [])
    emb_sum = np.sum(sums, axis=0) if sums else None
    return BuildSummary(
        num_documents=layout.num_documents, num_tokens=layout.num_tokens, num_new_documents=layout.num_new_documents,
        num_new_tokens=layout.num_new_tokens, num_rows=num_rows, num_rejected=num_rejected,
        fragments=tuple(frag for f in written for frag in f.fragments),
        domain_centroid=tuple((emb_sum / num_rows).tolist()) if num_rows else None,
        sources={
            i: SourceCounts(int(read_counts.get(i, 0)), int(rejected_counts.get(i, 0))) for i in source_indices
        },
        dense=dense,
    )
