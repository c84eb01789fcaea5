"""Batched model work of the build: length-bucketed batches, embedding forwards, generation,
and the staging files that carry raw hidden states from the embed stage to the writers.

Owns: packing documents into padded batches of at most ``batch_tokens`` (sorted by length to
cut padding), the embedding forward (through runtime/forward.py, the same code the runtime's
live queries use), batched greedy generation with left padding for ``--regenerate``, and the
staging file format. Pure functions over a loaded model; Beam adapts them in transforms.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specstore.runtime.forward import hidden_states


def plan_batches(lengths: list[int], batch_tokens: int, min_fill: float = 0.8) -> list[list[int]]:
    """Indices grouped into batches whose padded size (count x longest) stays within
    ``batch_tokens`` (a longer document gets a batch of its own); longest documents first.
    A batch also closes before a document shorter than ``min_fill`` x its longest, so each row
    is at least that full (padding under 1 - min_fill of a batch)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and ((len(current) + 1) * longest > batch_tokens or lengths[i] < min_fill * longest):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def length_bucket(length: int) -> int:
    """Coarse length class (powers of 2 with two steps per octave): documents of one bucket
    are batched together, so padding stays under ~40% of a batch."""
    if length <= 16:
        return 0
    octave = int(np.log2(length))
    return 2 * octave + (1 if length >= 1.5 * 2**octave else 0)


def padded(docs: list[np.ndarray], pad_id: int, *, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, T], attention_mask [B, T])`` with padding on the right (or the left)."""
    width = max(len(d) for d in docs)
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
    (bench_build: embedding / raw forward 0.58 -> see BENCHMARKS.md). Padding rows' own vectors
    are computed and dropped.
    """
    device = next(model.parameters()).device
    ids, _ = padded(docs, 0)
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
