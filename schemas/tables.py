"""Arrow schemas of the store: the tokens table of a version and the store's catalogue tables.

One definition, used by the pipelines (writer), the runtime (reader) and the tests.
"""

from __future__ import annotations

import pyarrow as pa

DEFAULT_PCA_DIMS = 64
DEFAULT_CONTINUATION_LENGTH = 10
PAD_TOKEN = -1  # continuation padding and the document separator in the token stream

# The compact tokens table's layout (``manifest.dense.table_format``). 1: ``continuation`` a
# fixed_size_list, nothing compressed beyond Lance's defaults. 2 (what builds write): ``continuation``
# a list of exactly ``continuation_length`` tokens per row (same values and padding) whose items Lance
# compresses with zstd (Lance 2.1 compresses no fixed_size_list), and zstd on ``position``,
# ``offset`` and ``token_id``. Readers see plain Arrow either way; the metadata only steers Lance's writer.
TABLE_FORMAT = 2
ZSTD = {"lance-encoding:compression": "zstd"}
CONTINUATION_ZSTD = ZSTD | {"lance-encoding:compression-level": "9"}


def token_type(vocab_size: int | None) -> tuple[pa.DataType, str, int]:
    """The compact tables' token column type (Arrow, numpy name) and its padding value: uint16
    padded with 65535 when every id of the vocabulary is below 65535, else int32 padded with
    PAD_TOKEN (also the old form's rule, ``vocab_size`` None)."""
    if vocab_size is not None and vocab_size < 65535:
        return pa.uint16(), "uint16", 65535
    return pa.int32(), "int32", PAD_TOKEN


def tokens_schema(pca_dims: int = DEFAULT_PCA_DIMS, continuation_length: int = DEFAULT_CONTINUATION_LENGTH,
                  vocab_size: int | None = None, table_format: int = TABLE_FORMAT) -> pa.Schema:
    """One row per datastore position.

    ``offset`` indexes the version's token stream (documents joined with a PAD_TOKEN separator);
    ``embedding`` is the normalised, PCA-reduced, L2-normalised hidden state *after* the token at
    this position; ``continuation`` holds the next ``continuation_length`` tokens of the same
    document, padded with PAD_TOKEN; ``continuation_len`` counts the real ones.

    With ``vocab_size`` (the compact form, a version whose manifest has ``dense``): ``embedding``
    is int8 codes (``manifest.dense.scales`` turn them back into the vector), ``token_id`` and
    ``continuation`` are in ``token_type(vocab_size)``, padded with its padding value. Without it,
    the old form: float32 embeddings, int32 tokens padded with PAD_TOKEN. ``table_format`` (compact
    form only, see TABLE_FORMAT): 2 makes ``continuation`` a list of exactly ``continuation_length``
    tokens and adds Lance's compression metadata; 1 is the first compact layout.
    """
    compact = vocab_size is not None
    token, _, _ = token_type(vocab_size)
    if compact and table_format not in (1, 2):
        raise ValueError(f"unknown tokens table format {table_format}")
    squeezed = compact and table_format >= 2
    zstd = ZSTD if squeezed else None
    continuation = (pa.list_(pa.field("item", token, metadata=CONTINUATION_ZSTD)) if squeezed
                    else pa.list_(token, continuation_length))
    return pa.schema(
        [
            pa.field("doc_id", pa.int64(), nullable=False),
            pa.field("position", pa.int32(), nullable=False, metadata=zstd),
            pa.field("offset", pa.int64(), nullable=False, metadata=zstd),
            pa.field("token_id", token, nullable=False, metadata=zstd),
            pa.field("embedding", pa.list_(pa.int8() if compact else pa.float32(), pca_dims), nullable=False),
            pa.field("continuation", continuation, nullable=False),
            pa.field("continuation_len", pa.int8(), nullable=False),
        ]
    )


VERSIONS_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False),
        pa.field("version", pa.int64(), nullable=False),
        pa.field("build_id", pa.string(), nullable=False),
        pa.field("created_at", pa.string(), nullable=False),
        pa.field("manifest_json", pa.string(), nullable=False),
    ]
)

TAGS_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False),
        pa.field("tag", pa.string(), nullable=False),
        pa.field("version", pa.int64(), nullable=False),  # -1 = tag removed
        pa.field("set_at", pa.string(), nullable=False),
    ]
)
