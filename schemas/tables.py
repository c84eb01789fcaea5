"""Arrow schemas of the store: the tokens table of a version and the store's catalogue tables.

One definition, used by the pipelines (writer), the runtime (reader) and the tests.
"""

from __future__ import annotations

import pyarrow as pa

DEFAULT_PCA_DIMS = 64
DEFAULT_CONTINUATION_LENGTH = 10
PAD_TOKEN = -1  # continuation padding and the document separator in the token stream


def token_type(vocab_size: int | None) -> tuple[pa.DataType, str, int]:
    """The compact tables' token column type (Arrow, numpy name) and its padding value: uint16
    padded with 65535 when every id of the vocabulary is below 65535, else int32 padded with
    PAD_TOKEN (also the old form's rule, ``vocab_size`` None)."""
    if vocab_size is not None and vocab_size < 65535:
        return pa.uint16(), "uint16", 65535
    return pa.int32(), "int32", PAD_TOKEN


def tokens_schema(pca_dims: int = DEFAULT_PCA_DIMS, continuation_length: int = DEFAULT_CONTINUATION_LENGTH,
                  vocab_size: int | None = None) -> pa.Schema:
    """One row per datastore position.

    ``offset`` indexes the version's token stream (documents joined with a PAD_TOKEN separator);
    ``embedding`` is the normalised, PCA-reduced, L2-normalised hidden state *after* the token at
    this position; ``continuation`` holds the next ``continuation_length`` tokens of the same
    document, padded with PAD_TOKEN; ``continuation_len`` counts the real ones.

    With ``vocab_size`` (the compact form, a version whose manifest has ``dense``): ``embedding``
    is int8 codes (``manifest.dense.scales`` turn them back into the vector), ``token_id`` and
    ``continuation`` are in ``token_type(vocab_size)``, padded with its padding value. Without it,
    the old form: float32 embeddings, int32 tokens padded with PAD_TOKEN.
    """
    compact = vocab_size is not None
    token, _, _ = token_type(vocab_size)
    return pa.schema(
        [
            pa.field("doc_id", pa.int64(), nullable=False),
            pa.field("position", pa.int32(), nullable=False),
            pa.field("offset", pa.int64(), nullable=False),
            pa.field("token_id", token, nullable=False),
            pa.field("embedding", pa.list_(pa.int8() if compact else pa.float32(), pca_dims), nullable=False),
            pa.field("continuation", pa.list_(token, continuation_length), nullable=False),
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
