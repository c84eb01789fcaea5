"""Tokens-table rows: per-position continuations and the Arrow table of one batch of documents.

Owns the row semantics of schemas/tables.py: for document d at position p, ``offset`` is the
stream index (document start + p), ``embedding`` the normalised hidden state after token p, and
``continuation`` the next L tokens of the same document padded with PAD_TOKEN. Pure functions.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from specstore.schemas.tables import PAD_TOKEN, TABLE_FORMAT, token_type, tokens_schema


def continuations(tokens: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """For every position p of one document: tokens p+1..p+length, padded at the document end.

    Returns ``(continuation int32 [T, length], continuation_len int8 [T])``.
    """
    tokens = np.asarray(tokens, dtype=np.int32)
    n = len(tokens)
    padded = np.concatenate([tokens, np.full(length, PAD_TOKEN, dtype=np.int32)])
    idx = np.arange(n)[:, None] + 1 + np.arange(length)[None, :]
    cont = padded[idx] if n else np.zeros((0, length), dtype=np.int32)
    num = np.clip(n - 1 - np.arange(n), 0, length).astype(np.int8)
    return cont, num


def rows_table(
    doc_ids: list[int],
    docs: list[np.ndarray],
    starts: list[int],
    embeddings: np.ndarray,
    continuation_length: int,
    vocab_size: int | None = None,
    table_format: int = TABLE_FORMAT,
) -> pa.Table:
    """Rows for whole documents: ``docs[i]`` int32 [T_i] starting at stream offset ``starts[i]``;
    ``embeddings`` float32 [sum T_i, D] in the same document-then-position order. With
    ``vocab_size``, the compact form (schemas/tables.py): ``embeddings`` are int8 codes, tokens
    are in ``token_type(vocab_size)`` with its padding value, laid out as ``table_format`` says."""
    dims = embeddings.shape[1]
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    total = int(lengths.sum())
    if embeddings.shape[0] != total:
        raise ValueError(f"{embeddings.shape[0]} embeddings for {total} tokens")
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths]) if total else np.zeros(0, np.int32)
    conts = [continuations(d, continuation_length) for d in docs]
    cont = np.concatenate([c for c, _ in conts]) if total else np.zeros((0, continuation_length), np.int32)
    cont_len = np.concatenate([n for _, n in conts]) if total else np.zeros(0, np.int8)
    token_ids = np.concatenate(docs).astype(np.int32) if total else np.zeros(0, np.int32)
    vectors = embeddings.astype(np.float32)
    if vocab_size is not None:
        _, dtype, pad = token_type(vocab_size)
        cont, token_ids = np.where(cont == PAD_TOKEN, pad, cont).astype(dtype), token_ids.astype(dtype)
        vectors = np.asarray(embeddings, dtype=np.int8)
    schema = tokens_schema(dims, continuation_length, vocab_size, table_format)
    cont_type = schema.field("continuation").type
    if pa.types.is_fixed_size_list(cont_type):
        cont_column = pa.FixedSizeListArray.from_arrays(pa.array(cont.ravel()), type=cont_type)
    else:  # a list of exactly continuation_length tokens per row
        row_starts = pa.array(np.arange(0, (total + 1) * continuation_length, continuation_length, dtype=np.int32))
        cont_column = pa.ListArray.from_arrays(row_starts, pa.array(cont.ravel()), type=cont_type)
    columns = {
        "doc_id": pa.array(np.repeat(np.asarray(doc_ids, dtype=np.int64), lengths)),
        "position": pa.array(positions),
        "offset": pa.array(np.repeat(np.asarray(starts, dtype=np.int64), lengths) + positions),
        "token_id": pa.array(token_ids),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), dims),
        "continuation": cont_column,
        "continuation_len": pa.array(cont_len),
    }
    return pa.table(columns, schema=schema)
