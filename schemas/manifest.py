"""The datastore manifest: what one committed version of a datastore is made of.

Owns the pydantic model written by the pipelines at commit time and validated by the
runtime on open. Does not own how versions are stored (runtime/store.py) or built
(pipelines/).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MANIFEST_FORMAT = 1
INDEX_KINDS = ("dense", "sparse")  # what a version holds besides its suffix index (Manifest.index)


class SourceInfo(BaseModel):
    """One corpus input of a build."""

    model_config = ConfigDict(frozen=True)

    path: str
    format: str
    sha256: str = Field(description="content hash of the file (or of the sorted file hashes of a directory)")
    num_records: int = 0
    num_rejected: int = 0


class FileInfo(BaseModel):
    """One file of a version, with its checksum, relative to the version's file folder."""

    model_config = ConfigDict(frozen=True)

    sha256: str
    num_bytes: int


class ModelInfo(BaseModel):
    """The target model a datastore was built with; the runtime refuses any other."""

    model_config = ConfigDict(frozen=True)

    model_id: str
    revision: str = Field(description="hash of the model's config and weights")
    tokenizer_hash: str
    vocab_size: int
    hidden_size: int
    hidden_layer: int = Field(-1, description="index into hidden_states; -1 = last layer (after final norm)")


class Lineage(BaseModel):
    """How a version relates to its parent: a full build, an append (new documents on top of
    the parent's rows, stream and normaliser) or a refit (parent corpus + new, all recomputed)."""

    model_config = ConfigDict(frozen=True)

    mode: str = Field("full", description="full | append | refit")
    added_sources: list[str] = Field(default_factory=list, description="corpus paths new in this version")
    added_documents: int = 0
    added_tokens: int = 0
    normaliser_from: str | None = Field(None, description="build_id whose normaliser was reused (None: fitted here)")


class DenseFiles(BaseModel):
    """A dense version's compact vectors (format 1): files ``dense/vectors.npy`` (int8 [num_rows,
    pca_dims], block-sorted by next token, stream order within a block), ``dense/positions.npy``
    (``positions_dtype`` [num_rows]: the stream position of each row; its continuation is the
    stream after it) and ``dense/blocks.npy`` (int64 [B, 3]: next token, first row, end row), plus
    ``dense/ann/<token>.faiss`` for every token in ``ann_blocks``. Only positions followed by a
    token of their document have a row. The tokens table's ``embedding`` column holds the same
    int8 codes in stream order. A version without this field (None) is in the old form: float32
    embeddings and int32 continuations in its tokens table, nothing else."""

    model_config = ConfigDict(frozen=True)

    format: int = 1
    scales: list[float] = Field(description="per dimension: code = clip(round(x * scale), -127, 127), x ~ code / scale")
    num_rows: int
    positions_dtype: Literal["uint32", "int64"] = "uint32"
    ann_threshold: int = Field(description="blocks of at least this many rows have an approximate index")
    ann_blocks: list[int] = Field(default_factory=list, description="next tokens whose block has dense/ann/<token>.faiss")
    ann_nprobe: int = 64  # inverted lists an index search visits
    ann_rerank: int = 8  # candidates per wanted neighbour, reranked exactly on the int8 rows
    table_format: Literal[1, 2] = Field(1, description="the tokens table's layout (schemas/tables.py TABLE_FORMAT); 1 before it was recorded")


class Manifest(BaseModel):
    """Everything a reader needs to trust and use one datastore version."""

    model_config = ConfigDict(frozen=True)

    format: int = MANIFEST_FORMAT
    name: str
    version: int = Field(0, description="assigned at commit; 0 before")
    build_id: str
    created_at: datetime
    pipeline_version: str
    model: ModelInfo
    pca_dims: int
    continuation_length: int
    num_documents: int
    num_tokens: int
    num_rejected: int
    regenerated: bool = False
    sources: list[SourceInfo]
    index: Literal["dense", "sparse"] = Field(
        "dense", description="dense: tokens table, normaliser and suffix array; sparse: token stream and suffix array only"
    )
    tokens_table: str = Field(description="LanceDB table name holding the tokens rows of this version ('' when sparse)")
    files: dict[str, FileInfo] = Field(default_factory=dict, description="file name -> checksum")
    settings: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    parent_version: int | None = None
    lineage: Lineage | None = None
    domain_centroid: list[float] | None = Field(
        None, description="mean of the version's reduced embeddings (for domain routing)"
    )
    dense: DenseFiles | None = Field(None, description="compact, memory-mapped dense files (None: old form, or sparse)")
