"""Batched model work of the build: length-bucketed batches, embedding forwards, generation,
and the staging files that carry raw hidden states from the embed stage to the writers.

Owns: packing documents into padded batches of at most ``batch_tokens`` (widths from a fixed
grid, so padding stays small and the set of batch shapes bounded), the embedding forward
(through runtime/forward.py, the same code the runtime's live queries use), batched greedy
generation with left padding for ``--regenerate``, and the staging file format. Pure functions
over a loaded model; the DoFns of steps.py adapt them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specstore.runtime.forward import hidden_states


def padded_width(length: int) -> int:
    """The width a batch holding a document of ``length`` tokens is padded to: a multiple of 16
    up to 64, then 8 widths per octave (72, 80, ..., 128, 144, ...), each under 12.5% above the
    lengths it holds.

    The embedding forwards only ever see these widths, and full batches of one width always have
    the same number of rows, so a build meets a bounded set of tensor shapes however large its
    corpus. That bounds memory: torch keeps kernels and buffers for every shape it has run, so
    resident memory grows with the number of distinct shapes."""
    if length <= 64:
        return max(16, -(-length // 16) * 16)
    step = 1 << ((length - 1).bit_length() - 4)  # 2^floor(log2(length - 1)) / 8
    return -(-length // step) * step


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of one padded width each (longest widths first, longest
    documents first within a width): ``max(1, batch_tokens // width)`` documents per batch, so
    every batch of a width but its last has the same shape and stays within ``batch_tokens``
    (a document longer than that gets a batch of its own)."""
    by_width: dict[int, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        by_width.setdefault(padded_width(lengths[i]), []).append(i)
    batches = []
    for width in sorted(by_width, reverse=True):
        members, rows = by_width[width], max(1, batch_tokens // width)
        batches += [members[start : start + rows] for start in range(0, len(members), rows)]
    return batches


def padded(docs: list[np.ndarray], pad_id: int, *, left: bool = False, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, T], attention_mask [B, T])`` with padding on the right (or the left);
    T is ``width`` if given (at least the longest document), else the longest document."""
    width = max([len(d) for d in docs] + [width or 0])
    ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(docs), width), dtype=torch.long)
    for row, d in enumerate(docs):
        span = slice(width - len(d), width) if left else slice(0, len(d))
        ids[row, span] = torch.as_tensor(np.asarray(d, dtype=np.int64))
        mask[row, span] = 1
    return ids, mask


def embed_documents(model, docs: list[np.ndarray]) -> list[np.ndarray]:
    """Last hidden layer for every token of each document: list of float32 [T_i, H].

    Right padding: real tokens never attend to padding under the causal mask, so each row's
    vectors equal a forward of that document alone (to float noise), and no padding mask is
    needed: without one the attention runs its plain causal kernel, which with a mask it cannot
    (much faster). Padding rows' own vectors are computed and dropped.
    """
    device = next(model.parameters()).device
    ids, _ = padded(docs, 0, width=padded_width(max(len(d) for d in docs)))
    hidden = hidden_states(model, ids.to(device)).cpu().numpy()
    return [hidden[row, : len(d)] for row, d in enumerate(docs)]


@torch.inference_mode()
def generate_responses(model, prompts: list[np.ndarray], *, max_new_tokens: int, pad_id: int, eos_ids: set[int]) -> list[np.ndarray]:
    """Greedy continuations of a batch of prompts (left padded): each returned document is the
    prompt followed by the generated tokens up to and including the first end-of-turn token."""
    device = next(model.parameters()).device
    ids, mask = padded(prompts, pad_id, left=True)
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=pad_id, eos_token_id=sorted(eos_ids),
    )
    generated = out[:, ids.shape[1] :].cpu().numpy()
    docs = []
    for prompt, new in zip(prompts, generated, strict=True):
        stop = next((i for i, t in enumerate(new) if int(t) in eos_ids), None)
        new = new if stop is None else new[: stop + 1]
        docs.append(np.concatenate([np.asarray(prompt, dtype=np.int32), new.astype(np.int32)]))
    return docs


@dataclass(frozen=True, slots=True)
class StagedBatch:
    """Reference to one staging file of embedded documents (what flows between stages)."""

    path: str
    doc_ids: tuple[int, ...]
    num_tokens: int


def save_staged(folder: Path, name: str, doc_ids: list[int], docs: list[np.ndarray], hidden: list[np.ndarray], dtype: str) -> StagedBatch:
    """Write one batch's tokens and raw hidden states (atomically: temp file, then rename)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.npz"
    tmp = folder / f".{name}.tmp.npz"
    np.savez(
        tmp, doc_ids=np.asarray(doc_ids, dtype=np.int64), lengths=np.asarray([len(d) for d in docs], dtype=np.int64),
        tokens=np.concatenate(docs).astype(np.int32), hidden=np.concatenate(hidden).astype(dtype),
    )
    os.replace(tmp, path)
    return StagedBatch(str(path), tuple(int(d) for d in doc_ids), int(sum(len(d) for d in docs)))


def load_staged(path: str) -> tuple[list[int], list[np.ndarray], np.ndarray]:
    """``(doc_ids, docs [int32 [T_i]], hidden float32 [sum T_i, H])`` of a staging file."""
    with np.load(path) as data:
        lengths = data["lengths"]
        docs = np.split(data["tokens"], np.cumsum(lengths)[:-1])
        return [int(d) for d in data["doc_ids"]], docs, data["hidden"].astype(np.float32)
