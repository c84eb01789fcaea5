"""Training a draft head (runtime/draft_head.py) for a target model from a corpus.

``specstore train-head``: the corpus is read and rendered as a build reads it (any format
``specstore build`` takes: chat records through the model's chat template, text, code); the
target runs once over every document (``collect``), giving at each position ``t`` its last
hidden state ``h_t``, the true next token ``x_{t+1}`` and the target's own choice at ``t + 1``
(argmax), which the head learns to say from the first two (``train``: distillation, so the text
need not be the model's own). The documents of the last ``holdout`` share are kept out of
training and score the head: ``agreement``, how often its first guess is the target's token.

Not a Beam pipeline: one process, the forward in the target's dtype, the head's training in
float32 with bf16 products where the CPU has them. On this project's 2-core CPU the forward runs
at ~600 tokens/s in bf16 and an epoch over 520k positions takes 35 s (the default shape) to 70 s
(vocabulary 8192, width 1728).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specstore.runtime.draft_head import DraftHead, HeadInfo, HeadNet
from specstore.runtime.errors import SpecstoreError


@dataclass(frozen=True, slots=True)
class HeadTraining:
    # output tokens: the most frequent targets of the training positions (4096: 94% of them on
    # the bench's corpora; 8192 and an inner width of 3 x hidden replayed no better and took 1.0
    # against 0.7 ms a guess right after a forward: BENCHMARKS.md, twenty-first session)
    vocabulary: int = 4096
    inner: int = 0  # the MLP's width (0: the hidden size)
    epochs: int = 6
    batch: int = 512
    lr: float = 2e-3
    weight_decay: float = 0.01
    holdout: float = 0.05  # share of the documents (the last ones) kept out to score the head
    max_tokens: int = 2_000_000  # positions collected at most
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocabulary < 1 or self.epochs < 1 or self.batch < 1 or self.max_tokens < 1:
            raise SpecstoreError("vocabulary, epochs, batch and max_tokens must be >= 1")
        if not 0.0 <= self.holdout < 1.0:
            raise SpecstoreError(f"holdout must be in [0, 1), got {self.holdout}")


def corpus_documents(paths: list[str], tokenizer, *, max_docs: int | None = None, max_doc_tokens: int = 1024,
                     fmt: str = "auto") -> Iterator[np.ndarray]:
    """Token ids of each document of the corpus files, rendered as ``specstore build`` renders
    them (records it would reject are skipped); at most ``max_docs`` records in all."""
    from specstore.pipelines.corpus import read_records, resolve_sources

    sources = resolve_sources(paths, fmt)
    formats = {s.index: s.format for s in sources}
    left = max_docs
    for source in sources:
        if left is not None and left <= 0:
            return
        batch = []
        for record in read_records(source, left):
            batch.append(record)
            if left is not None:
                left -= 1
            if len(batch) == 64:
                yield from _documents(batch, formats, tokenizer, max_doc_tokens)
                batch = []
        yield from _documents(batch, formats, tokenizer, max_doc_tokens)


def _documents(records, formats, tokenizer, max_doc_tokens) -> Iterator[np.ndarray]:
    from specstore.pipelines.render import Document, prepare_batch

    if records:
        yield from (d.tokens for d in prepare_batch(records, formats.get, tokenizer, max_doc_tokens=max_doc_tokens)
                    if isinstance(d, Document))


@torch.inference_mode()
def collect(model, documents: Iterable[np.ndarray], *, max_tokens: int, progress=None) -> dict[str, torch.Tensor]:
    """Run the target over each document: ``hidden`` [N, H] (its dtype), ``pending`` [N]
    (``x_{t+1}``), ``target`` [N] (the target's argmax at ``t + 1``), ``doc`` [N] (document
    index), for every ``t`` with a ``t + 1`` inside the document; at most ``max_tokens`` rows."""
    from specstore.runtime.forward import forward_with_hidden

    device = next(model.parameters()).device
    hidden, pending, target, doc = [], [], [], []
    n = 0
    for i, ids in enumerate(documents):
        if n >= max_tokens:
            break
        if len(ids) < 3:
            continue
        x = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=device)[None]
        logits, h, _ = forward_with_hidden(model, input_ids=x, use_cache=False)
        choice = logits[0].argmax(-1)
        t = torch.arange(0, len(ids) - 2, device=device)[: max_tokens - n]
        hidden.append(h[0, t].cpu())
        pending.append(x[0, t + 1].cpu())
        target.append(choice[t + 1].cpu())
        doc.append(torch.full((len(t),), i, dtype=torch.int64))
        n += len(t)
        if progress is not None:
            progress(len(ids), n)
    if not hidden:
        raise SpecstoreError("the corpus gave no document of 3 tokens or more to train a draft head on")
    return {"hidden": torch.cat(hidden), "pending": torch.cat(pending), "target": torch.cat(target), "doc": torch.cat(doc)}


def train(model, info, data: dict[str, torch.Tensor], config: HeadTraining | None = None, *, log=None) -> DraftHead:
    """Train a head on ``collect``'s rows for the target ``model`` (``info``: its ModelInfo);
    the returned head's ``info.training`` holds the held-out agreement and the counts."""
    cfg = config or HeadTraining()
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    docs = data["doc"]
    cut = int(math.floor(float(docs.max()) * (1.0 - cfg.holdout)))
    held = docs >= cut if cfg.holdout > 0 and cut > 0 else torch.zeros_like(docs, dtype=torch.bool)
    train_idx, held_idx = torch.nonzero(~held)[:, 0], torch.nonzero(held)[:, 0]
    if len(train_idx) == 0:
        raise SpecstoreError("no training positions left after the holdout: give more documents")
    ids, counts = torch.unique(data["target"][train_idx], return_counts=True)
    vocab = ids[counts.argsort(descending=True, stable=True)[: cfg.vocabulary]].sort().values
    vocab_size = int(model.config.vocab_size)
    index = torch.full((max(vocab_size, int(data["target"].max()) + 1, int(data["pending"].max()) + 1),), len(vocab),
                       dtype=torch.int64)
    index[vocab] = torch.arange(len(vocab))
    out_rows = model.get_output_embeddings().weight.detach().float().cpu()[vocab]
    in_rows = model.get_input_embeddings().weight.detach().float().cpu()[vocab]
    hidden_size = out_rows.shape[1]
    net = HeadNet(hidden_size, cfg.inner or hidden_size, len(vocab))
    with torch.no_grad():
        net.out.weight.copy_(out_rows)
        net.embed.weight.zero_()
        net.embed.weight[: len(vocab)].copy_(in_rows)
        net.fc2.weight.zero_()
        net.fc2.bias.zero_()
    net.out.weight.requires_grad_(False)  # the target's own output rows: the head speaks its language
    net.embed.weight.requires_grad_(False)  # and its input rows (fewer weights to fit: less overfitting)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = max(1, len(train_idx) // cfg.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=cfg.epochs * per_epoch)
    h_all = data["hidden"]
    rows_all, y_all = index[data["pending"]], index[data["target"]]
    y_all = torch.where(y_all == len(vocab), torch.full_like(y_all, -100), y_all)  # outside the vocabulary: no loss
    autocast = _bf16_autocast()
    start = time.perf_counter()
    net.train()
    for epoch in range(cfg.epochs):
        order = train_idx[torch.randperm(len(train_idx), generator=gen)]
        total, seen = 0.0, 0
        for k in range(per_epoch):
            b = order[k * cfg.batch : (k + 1) * cfg.batch]
            with autocast:
                logits = net(h_all[b].float(), rows_all[b])
            loss = torch.nn.functional.cross_entropy(logits.float(), y_all[b], ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total, seen = total + float(loss.detach()) * len(b), seen + len(b)
        if log is not None:
            log(f"epoch {epoch + 1}/{cfg.epochs}: loss {total / max(seen, 1):.3f} ({time.perf_counter() - start:.0f} s)")
    net.eval()
    agreement = _agreement(net, h_all, rows_all, data["target"], vocab, held_idx) if len(held_idx) else None
    training = {"positions": int(len(train_idx)), "held_out_positions": int(len(held_idx)),
                "documents": int(docs.max()) + 1, "vocabulary": int(len(vocab)), "inner": net.fc1.out_features,
                "epochs": cfg.epochs, "agreement": agreement, "seconds": round(time.perf_counter() - start, 1)}
    model_fields = info.model_dump() if hasattr(info, "model_dump") else dict(info)
    return DraftHead(net, vocab.numpy(), HeadInfo(model_fields, training), vocab_size)


@torch.no_grad()
def _agreement(net, hidden, rows, target, vocab, idx) -> float:
    """Share of held-out positions where the head's first guess is the target's token."""
    right = 0
    for k in range(0, len(idx), 4096):
        b = idx[k : k + 4096]
        guess = vocab[net(hidden[b].float(), rows[b]).argmax(-1)]
        right += int((guess == target[b]).sum())
    return round(right / len(idx), 4)


def _bf16_autocast():
    from specstore.runtime.device import resolve_dtype

    if resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def run_from_args(args) -> int:
    """``specstore train-head``: collect, train, write, and say how good the head is."""
    from tqdm import tqdm

    from specstore.pipelines.corpus import resolve_sources
    from specstore.runtime.draft_head import default_path
    from specstore.runtime.models import load_model

    config = HeadTraining(vocabulary=args.vocabulary, epochs=args.epochs, holdout=args.holdout, max_tokens=args.max_tokens)
    resolve_sources(args.corpus, args.format)  # a missing corpus: one error line before the model loads
    loaded = load_model(args.model, dtype=args.dtype)
    out = Path(args.out) if args.out else default_path(loaded.info.revision)
    docs = corpus_documents(args.corpus, loaded.tokenizer, max_docs=args.max_docs, max_doc_tokens=args.max_doc_tokens,
                            fmt=args.format)
    with tqdm(desc="forward", unit="tok", unit_scale=True, dynamic_ncols=True, total=args.max_tokens) as bar:
        data = collect(loaded.model, docs, max_tokens=args.max_tokens, progress=lambda _, n: bar.update(n - bar.n))
    print(f"train-head: {len(data['target'])} positions from {int(data['doc'].max()) + 1} documents", flush=True)
    head = train(loaded.model, loaded.info, data, config, log=lambda line: print("train-head:", line, flush=True))
    head.save(out)
    t = head.info.training
    agreement = "no held-out documents" if t["agreement"] is None else f"held-out agreement with the model {t['agreement']:.1%}"
    print(f"train-head: wrote {out} ({t['positions']} positions, vocabulary {t['vocabulary']}; {agreement})")
    return 0
