"""A draft head: guesses the token after the pending one from the target's last hidden state.

Every drafter here draws from retrieval, and in a third (code) to half (chat) of ReSpec's pool
steps no source holds the token after the pending one (BENCHMARKS.md, twentieth session): the
step then commits the bonus alone. The target cannot say that token without another forward,
but its last hidden layer ``h_t`` (the state that chose the pending token ``x_{t+1}``) together
with ``x_{t+1}`` itself says much of it. A draft head is a small network on the two:

    z = h_t + W2 silu(W1 [h_t ; e(x_{t+1})] + b1) + b2,   p(x_{t+2}) = softmax(U z)

with ``U`` the target's own output embedding rows of the head's vocabulary (the ``vocabulary``
most frequent tokens of its training text) and ``e`` an input embedding over the same tokens
(the target's rows at training start; tokens outside it get a zero row). Trained by
distillation: at every position of a corpus the target is run once, and the head learns to say
what the target says at ``t + 1`` (argmax) from ``h_t`` and the true ``x_{t+1}``
(pipelines/draft_head.py, ``specstore train-head``). EAGLE's first draft step without its
attention layer; Medusa's heads without ``x_{t+1}`` guessed a third fewer tokens here.

A head is one safetensors file, self-contained (no reference to the model's tensors, so any
drafter can load it from a path), whose metadata holds the target's fingerprint
(``ModelInfo``: revision, tokenizer hash, hidden size) and how it was trained. Loading it for a
datastore built with another model is refused with an error that names the field. Its default
place is ``cache_dir()/heads/<model revision>.safetensors`` (``default_path``), where ReSpec's
``head="auto"`` looks.

``guess`` runs on the CPU in bf16 where the hardware has it (runtime/device.py), float32
elsewhere, with packed weights (runtime/linear.py): on this project's 2-core CPU ~0.3 ms a call on
warm caches and 0.4-0.7 ms right after a verification, 2-4% of a plain bf16 step. Right after a
verification the guess mostly waits on memory for its weights, and ReSpec's pool search, the other
drafting work of a step, is Python on one core: ``guess_beside`` runs the guess on the CPU
kernel's second OpenMP thread (the worker torch's products use, still spinning after the forward)
while the pool searches (ReSpec's drafting 1.39 -> 1.06 ms a step on chat-large, 1.42 -> 1.06 on
code; BENCHMARKS.md, twenty-sixth session). In float32 (a CPU without AVX-512 BF16) the guess
costs ~0.5 ms warm and ~1.1 ms right after a forward on a 2-core Zen 3, and runs beside the
search the same way (csrc/small_gemm.c: specstore_head_beside_f32; BENCHMARKS.md, thirtieth
session). There the head holds its three weights in bf16 by default (``WEIGHTS``; every path
computes with the rounded weights, widened to float32 as read): half the bytes a guess waits
for (a call beside the search 0.92 -> 0.66 ms median on a Zen 3, thirty-sixth session; the
guesses the same, the tune splits' MAT unmoved). The guess is a draft like any other: the target
verifies it, so a wrong or damaged head costs speed, never output.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specstore.runtime.errors import SpecstoreError

FORMAT = "specstore-draft-head/1"
MAX_LOADED = 4  # heads kept loaded per process (DraftHead.cached)
WEIGHT_FORMS = ("bf16", "float32")  # how a float32 head may hold its three weights (DraftHead; module doc)
WEIGHTS = "bf16"  # ... and does by default
TENSORS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "out.weight", "embed.weight", "vocab")


def default_path(revision: str, root: Path | None = None) -> Path:
    """Where ``specstore train-head`` writes a head for the model of ``revision`` by default."""
    from specstore.runtime.models import cache_dir

    return (root or cache_dir() / "heads") / f"{revision[:32]}.safetensors"


class HeadNet(torch.nn.Module):
    """The head's parameters: ``fc1`` [inner, 2H], ``fc2`` [H, inner], ``out`` [V', H] (no
    bias), ``embed`` [V' + 1, H] (the last row, zero, for tokens outside the vocabulary)."""

    def __init__(self, hidden: int, inner: int, vocab: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(2 * hidden, inner)
        self.fc2 = torch.nn.Linear(inner, hidden)
        self.out = torch.nn.Linear(hidden, vocab, bias=False)
        self.embed = torch.nn.Embedding(vocab + 1, hidden)

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits over the head's vocabulary [N, V'] for hidden states [N, H] and the pending
        tokens' embedding rows [N] (``DraftHead.rows``)."""
        z = torch.cat([hidden, self.embed(rows)], dim=-1)
        return self.out(hidden + self.fc2(torch.nn.functional.silu(self.fc1(z))))


@dataclass(frozen=True, slots=True)
class HeadInfo:
    """What a head file says of itself: the target's fingerprint and how it was trained."""

    model: dict  # ModelInfo fields
    training: dict  # positions, documents, vocabulary, width, epochs, held-out top-1 agreement with the target


class DraftHead:
    """A loaded head: ``guess(hidden, pending, k)`` -> the ``k`` likeliest next tokens with their
    probabilities under the head (over its vocabulary)."""

    def __init__(self, net: HeadNet, vocab: np.ndarray, info: HeadInfo, vocab_size: int | None = None,
                 dtype: torch.dtype | None = None, weights: str | None = None):
        self.weights = WEIGHTS if weights is None else weights
        if self.weights not in WEIGHT_FORMS:
            raise ValueError(f"a draft head's weights are float32 or bf16, not {self.weights!r}")
        self.net = net.eval()
        self.vocab = np.asarray(vocab, dtype=np.int64)
        self.info = info
        size = int(vocab_size or info.model.get("vocab_size") or 0)
        self.rows = np.full(max(size, int(self.vocab.max()) + 1 if len(self.vocab) else 1), len(self.vocab), dtype=np.int64)
        self.rows[self.vocab] = np.arange(len(self.vocab))
        self._split(dtype)

    def _split(self, dtype: torch.dtype | None) -> None:
        """The inference form: ``W1 [h ; e(x)] + b1 = W1h h + P[x]`` with ``P = e W1e^T + b1``
        precomputed per vocabulary token (one row read a step instead of an embedding lookup, a
        concatenation and twice the product), linears in the compute dtype and packed for the
        CPU (runtime/linear.py). Right after a verification every op runs on cold caches, and
        these three were a third of a guess's time there."""
        if dtype is None:
            from specstore.runtime.device import resolve_dtype

            dtype = resolve_dtype("auto", torch.device("cpu"))
        net, hidden = self.net, self.net.fc2.out_features
        with torch.no_grad():
            w1 = net.fc1.weight.detach().float()
            pending = net.embed.weight.detach().float() @ w1[:, hidden:].T + net.fc1.bias.detach().float()
            fc1h = torch.nn.Linear(hidden, w1.shape[0], bias=False)
            fc1h.weight.copy_(w1[:, :hidden])
            self.infer = torch.nn.ModuleDict({"fc1h": fc1h, "fc2": copy.deepcopy(net.fc2), "out": copy.deepcopy(net.out)})
        self.infer = self.infer.to(dtype).eval()
        for p in self.infer.parameters():
            p.requires_grad_(False)
        names = ("fc1h", "fc2", "out")
        narrow = dtype == torch.float32 and self.weights == "bf16"
        if narrow:  # every path computes with the rounded weights
            for name in names:
                weight = self.infer[name].weight
                weight.copy_(weight.to(torch.bfloat16).float())
        self.pending_rows = pending.to(dtype)
        self.dtype = dtype
        from specstore.runtime.linear import use_packed_linears

        use_packed_linears(self.infer)
        self._kernel = None
        from specstore.runtime import gemm

        if gemm.has_head(dtype=dtype) and (dtype == torch.float32 or (hidden % 2 == 0 and w1.shape[0] % 2 == 0)):
            f = self.infer
            fc1, fc2, out = (gemm.pack(f[name].weight.to(torch.bfloat16), pairs=False) if narrow else gemm.pack(f[name].weight)
                             for name in names)
            self._kernel = (fc1, fc2, f["fc2"].bias.contiguous(), out)

    @classmethod
    def load(cls, path: str | Path, *, expect=None, dtype: torch.dtype | None = None,
             weights: str | None = None) -> DraftHead:
        """Read a head file. ``expect``: the target's ModelInfo (or a dict of its fields): a
        head trained for another model or tokenizer is refused, naming the field. ``dtype``:
        compute dtype (default: bf16 where the CPU has it natively, else float32). ``weights``:
        how a float32 head holds its three weights (``WEIGHTS`` by default)."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise SpecstoreError(f"draft head {path} does not exist (train one with `specstore train-head`)")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                missing = [n for n in TENSORS if n not in f.keys()]
                if meta.get("format") != FORMAT or missing:
                    raise SpecstoreError(f"{path} is not a specstore draft head ({FORMAT}; missing {missing or 'format'})")
                tensors = {n: f.get_tensor(n) for n in TENSORS}
                info = HeadInfo(json.loads(meta.get("model", "{}")), json.loads(meta.get("training", "{}")))
        except (SafetensorError, OSError, ValueError) as exc:
            raise SpecstoreError(f"cannot read draft head {path}: {exc}") from exc
        if expect is not None:
            check_model(info, expect, path)
        vocab = tensors.pop("vocab").numpy()
        hidden, inner, size = tensors["fc2.weight"].shape[0], tensors["fc1.weight"].shape[0], len(vocab)
        if (tensors["fc1.weight"].shape[1] != 2 * hidden or tensors["out.weight"].shape != (size, hidden)
                or tensors["embed.weight"].shape != (size + 1, hidden)):
            raise SpecstoreError(f"draft head {path} has inconsistent shapes")
        net = HeadNet(hidden, inner, size)
        net.load_state_dict(tensors)
        return cls(net, vocab, info, dtype=dtype, weights=weights)

    @classmethod
    def cached(cls, path: str | Path, *, expect=None, weights: str | None = None) -> DraftHead:
        """``load``, once per file as it is on disk (path, inode, size, modification time), form of
        its weights and process: an engine builds a drafter per request, and reading and packing a
        head takes ~0.1 s."""
        path = Path(path)
        weights = WEIGHTS if weights is None else weights
        try:
            stat = path.stat()
        except OSError:
            return cls.load(path, expect=expect, weights=weights)  # its error: the file does not exist
        key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, weights)
        head = _LOADED.get(key)
        if head is None:
            head = cls.load(path, weights=weights)
            if len(_LOADED) >= MAX_LOADED:
                _LOADED.pop(next(iter(_LOADED)))
            _LOADED[key] = head
        if expect is not None:
            check_model(head.info, expect, path)
        return head

    def save(self, path: str | Path) -> Path:
        """Write the head (float32 tensors; atomic: a temporary file renamed into place)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().float().contiguous() for k, v in self.net.state_dict().items()}
        tensors["vocab"] = torch.from_numpy(self.vocab.copy())
        meta = {"format": FORMAT, "model": json.dumps(self.info.model), "training": json.dumps(self.info.training)}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)
        return path

    @torch.inference_mode()
    def distribution(self, hidden: torch.Tensor, pending: int) -> torch.Tensor:
        """The head's probabilities [V'] (float32, over its vocabulary: ``vocab[i]`` is token
        ``i``'s id) of the token after ``pending``, from the target's last hidden state
        ``hidden`` [H] (the one that chose ``pending``)."""
        h = hidden.detach().reshape(1, -1).to(device="cpu", dtype=self.dtype)
        f = self.infer
        z = h + f["fc2"](torch.nn.functional.silu(f["fc1h"](h) + self.pending_rows[self._row(pending)]))
        return torch.softmax(f["out"](z).float()[0], 0)

    def guess_beside(self, fn, hidden: torch.Tensor, pending: int, k: int = 1, beside: bool = True):
        """``fn()`` and ``guess(hidden, pending, k)`` at once: the guess on the second thread of
        the CPU kernel's OpenMP team while this thread runs ``fn`` (in the head's dtype: bf16 on
        CPUs with AVX-512 BF16, float32 on the others; where torch runs two threads or more;
        csrc/small_gemm.c: specstore_head_beside, specstore_head_beside_f32). Right
        after a verification the guess waits on memory for its weights while ReSpec's pool
        search (``fn``) is Python: side by side, a step's drafting costs the longer of the two.
        Elsewhere, or without ``beside``, ``fn()`` and then the guess torch's way. Returns
        ``(fn's result, the distribution as numpy float32 [V'], the k likeliest [(token,
        probability)], best first)``. The kernel rounds as the torch path does but sums in its
        own order: probabilities agree to rounding, not bits (tests/test_draft_head.py)."""
        if beside and self._kernel is not None and torch.get_num_threads() >= 2:  # head_beside refuses what it cannot take
            from specstore.runtime import gemm

            h = hidden.detach().reshape(-1).to(device="cpu", dtype=self.dtype).contiguous()
            fc1, fc2, b2, out = self._kernel
            probs, top = np.empty(len(self.vocab), dtype=np.float32), np.empty(k, dtype=np.int64)
            ran, value = gemm.head_beside(fn, h, self.pending_rows[self._row(pending)], fc1, fc2, b2, out,
                                          len(self.vocab), probs, top)
            if ran:
                return value, probs, [(int(self.vocab[i]), float(probs[i])) for i in top.tolist() if i >= 0]
        value = fn()
        probs = self.distribution(hidden, pending)
        return value, probs.numpy(), self.top(probs, k)

    def top(self, probs: torch.Tensor, k: int) -> list[tuple[int, float]]:
        """The ``k`` likeliest tokens of a ``distribution`` (best first) with their probabilities."""
        top = probs.topk(min(k, len(self.vocab)))
        return [(int(self.vocab[i]), float(p)) for p, i in zip(top.values.tolist(), top.indices.tolist(), strict=True)]

    def probability(self, probs, token: int) -> float | None:
        """``token``'s probability in a ``distribution`` (the tensor or its numpy view); None for
        a token outside the head's vocabulary."""
        row = self._row(token)
        return float(probs[row]) if row < len(self.vocab) else None

    def _row(self, token: int) -> int:
        """``token``'s index in the head's vocabulary; ``len(vocab)`` for a token outside it."""
        return int(self.rows[token]) if 0 <= token < len(self.rows) else len(self.vocab)

    def guess(self, hidden: torch.Tensor, pending: int, k: int = 1) -> list[tuple[int, float]]:
        """The ``k`` likeliest tokens after ``pending`` (best first) with the head's probability,
        from the target's last hidden state ``hidden`` [H] (the one that chose ``pending``)."""
        return self.top(self.distribution(hidden, pending), k)


_LOADED: dict[tuple, DraftHead] = {}


def check_model(info: HeadInfo, expect, path) -> None:
    """Refuse a head trained for another target: the first differing fingerprint field."""
    want = expect.model_dump() if hasattr(expect, "model_dump") else dict(expect)
    for name in ("revision", "tokenizer_hash", "hidden_size", "vocab_size"):
        if name in want and name in info.model and info.model[name] != want[name]:
            raise SpecstoreError(f"draft head {path} was trained for another model: {name} is {info.model[name]!r}, "
                                 f"the target's is {want[name]!r} (train one for it with `specstore train-head`)")
