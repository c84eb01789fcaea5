"""The one verifier every drafter feeds: a forward of the target over a DraftTree, acceptance,
and the KV cache kept equal to plain decoding of the committed tokens.

Owns the target's KV cache for one request, the tree attention inputs (a 4D additive float
mask and explicit position ids, through the public transformers API; an SDPA model is switched
to attention.py's packed variant, the same math without copying the cache per step; a CPU
model's linears run on weights packed once, linear.py; the cache grows in place, kv_cache.py),
cache compaction to the accepted path, the batch fallback for models that cannot take a custom
4D mask, and the types a verification returns (``Prefill``, ``VerifyResult``, ``StepOutput``)
and the ``Verifier`` interface the decode loop drives (the simulator's replay verifier
implements it too).
Acceptance rules live in sampling.py (and relaxed.py); the decode loop in decode.py.

Acceptance is an argument of ``step``: ``None`` is the sampling rule (greedy or lossless
speculative sampling); a drafter with its own rule (ReSpec's relaxed mode) exposes it as its
``acceptance`` attribute and the decode loop passes it in.

Invariant: the cache holds every committed token except the last one (the *pending* token).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from specstore.runtime.attention import use_packed_attention
from specstore.runtime.forward import forward_with_hidden
from specstore.runtime.fused import use_fused_elementwise
from specstore.runtime.kernel_forward import KernelForward
from specstore.runtime.kv_cache import compact as compact_cache
from specstore.runtime.kv_cache import growing_cache
from specstore.runtime.linear import use_packed_linears
from specstore.runtime.sampling import Sampling, accept, pick
from specstore.runtime.tree import DraftTree

# (logits [1 + n, V] with row 0 the pending token, tree, sampling) -> (accepted node indices,
# bonus token, per accepted node: True where a lossy rule accepted it; empty = all strict)
AcceptanceRule = Callable[[torch.Tensor, DraftTree, Sampling], tuple[list[int], int, list[bool]]]


@dataclass(slots=True)
class VerifyResult:
    """Outcome of one verification: the accepted path (node indices into the tree), the
    accepted draft tokens, and the target's own next token after them (the bonus)."""

    accepted_nodes: list[int]
    accepted_tokens: list[int]
    bonus: int
    num_drafted: int
    # per accepted node: True where a relaxed (lossy) rule accepted it (ReSpec); empty = all strict
    relaxed: list[bool] = field(default_factory=list)


@dataclass(slots=True)
class Prefill:
    """The prompt's forward: the first generated token, and the target's last hidden layer
    ``hidden`` [H] and ``logits`` [V] at the prompt's last token (they chose ``bonus``)."""

    bonus: int
    hidden: torch.Tensor | None
    logits: torch.Tensor | None


@dataclass(slots=True)
class StepOutput:
    """A verification's result plus what the target computed at the last accepted position
    (the last token it processed before the bonus): ``hidden`` [H] and ``logits`` [V]."""

    result: VerifyResult
    hidden: torch.Tensor | None
    logits: torch.Tensor | None


class Verifier(Protocol):
    """What the decode loop drives: ``prefill`` once per request, then ``step`` per draft tree."""

    def prefill(self, prompt_ids: list[int]) -> Prefill: ...

    def step(self, pending: int, tree: DraftTree, acceptance: AcceptanceRule | None = None) -> StepOutput: ...


def ancestor_matrix(tree: DraftTree) -> np.ndarray:
    """[1 + n, 1 + n] bool: row i may attend to column j (j is i's ancestor or i itself).
    Index 0 is the pending token (the root), index ``k + 1`` is node k."""
    q = len(tree) + 1
    anc = np.zeros((q, q), dtype=bool)
    anc[0, 0] = True
    for node, parent in enumerate(tree.parents.tolist()):
        anc[node + 1] = anc[parent + 1]
        anc[node + 1, node + 1] = True
    return anc


def tree_attention_inputs(
    tree: DraftTree, num_cached: int, dtype: torch.dtype, device: torch.device, pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [1, 1 + n + pad] (cached length + depth) and the additive mask
    [1, 1, 1 + n + pad, num_cached + 1 + n + pad] (0 where allowed, ``finfo(dtype).min``
    elsewhere). ``pad`` rows after the tree attend to themselves only and nothing attends to
    them (their results are dropped).

    Additive float, not bool: transformers' eager attention adds a bool mask as 0/1 and gives
    wrong logits without an error.
    """
    depth = np.concatenate([[0], tree.depths(), np.ones(pad, dtype=np.int64)])
    positions = torch.as_tensor(num_cached + depth, device=device).unsqueeze(0)
    anc = ancestor_matrix(tree)
    if pad:
        anc = np.pad(anc, ((0, pad), (0, pad)))
        anc[-pad:, -pad:] = np.eye(pad, dtype=bool)
    allowed = torch.as_tensor(anc, device=device)
    q = allowed.shape[0]
    mask = torch.zeros((1, 1, q, num_cached + q), dtype=dtype, device=device)
    mask[0, 0, :, num_cached:].masked_fill_(~allowed, torch.finfo(dtype).min)
    return positions, mask


def supports_tree_attention(model, cache) -> bool:
    """False where a custom 4D mask cannot be given: sliding-window cache layers keep a shorter
    cache than the mask describes, and flash-attention kernels take no arbitrary mask."""
    impl = str(getattr(model.config, "_attn_implementation", "") or "")
    if "flash" in impl:
        return False
    return not any(getattr(layer, "is_sliding", False) for layer in cache.layers)


def _vocab_size(model) -> int | None:
    """Token ids the target takes: its input embedding's rows (the config's vocab_size when the
    model has no embedding module), never more than its output logits."""
    sizes = [getattr(model.config, "vocab_size", None)]
    try:
        sizes.append(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError):
        pass
    sizes = [int(v) for v in sizes if v]
    return min(sizes) if sizes else None


class TreeVerifier:
    """Holds the target's cache for one request; ``prefill`` once, then ``step`` per draft tree."""

    def __init__(self, model, sampling: Sampling | None = None):
        self.model = model
        use_packed_attention(model)  # trees attend to the cache without copying it (attention.py)
        use_packed_linears(model)  # CPU projections on weights packed once (linear.py)
        use_fused_elementwise(model)  # bf16 CPU norms and MLP middles in one kernel call each (fused.py)
        self.sampling = sampling or Sampling()
        self.cache = growing_cache(model.config)  # appends in place (kv_cache.py)
        self.kernel_forward = KernelForward.of(model)  # float32 CPU steps in one kernel call (kernel_forward.py); None: modules
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype  # the mask's dtype, asked once (each ask walks the modules)
        self.vocab_size = _vocab_size(model)  # the decode loop drops drafted ids outside it
        self.tree_attention = supports_tree_attention(model, self.cache)
        if not self.tree_attention:
            warnings.warn(
                f"{type(model).__name__} cannot take a tree attention mask here (sliding-window cache or "
                "flash attention): verifying drafts as a batch of paths, one extra forward per step",
                stacklevel=2,
            )

    @property
    def num_cached(self) -> int:
        return self.cache.get_seq_length()

    def _forward(self, input_ids: torch.Tensor, cache, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden, _ = forward_with_hidden(self.model, input_ids=input_ids, cache=cache, use_cache=True, **kwargs)
        return logits, hidden

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> Prefill:
        """Run the prompt; its last token's logits choose the first generated token (the bonus)."""
        assert self.num_cached == 0, "prefill runs once per request"
        done = self.kernel_forward.prefill(prompt_ids, self.cache) if self.kernel_forward is not None else None
        if done is not None:  # in kernel calls (kernel_forward.py)
            last, hidden = done
            return Prefill(pick(last, self.sampling), hidden, last)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        logits, hidden = self._forward(ids, self.cache, logits_to_keep=1)
        last = logits[0, -1]
        return Prefill(pick(last, self.sampling), hidden[0, -1], last)

    @torch.inference_mode()
    def tree_logits(self, pending: int, tree: DraftTree, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over [pending] + tree nodes (+ ``pad`` masked rows, where the cost model
        found a larger forward cheaper): logits [1 + n, V] and hidden [1 + n, H]. The cache
        grows by 1 + n entries (``pad`` more, which are cropped again); ``compact`` must follow."""
        pad = max(int(pad), 0) if len(tree) else 0
        tokens = [pending, *tree.tokens.tolist(), *[pending] * pad]
        kernel = self.kernel_forward is not None and self.kernel_forward.takes(self.cache, len(tokens))
        if len(tree) == 0:  # plain decoding: the model's own causal mask and positions
            if kernel:
                return self.kernel_forward(tokens, self.cache)
            logits, hidden = self._forward(torch.tensor([tokens], dtype=torch.long, device=self.device), self.cache)
            return logits[0], hidden[0]
        positions, mask = tree_attention_inputs(tree, self.num_cached, self.dtype, self.device, pad)
        if kernel:
            logits, hidden = self.kernel_forward(tokens, self.cache, positions, mask)
        else:
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
            logits, hidden = self._forward(ids, self.cache, attention_mask=mask, position_ids=positions)
            logits, hidden = logits[0], hidden[0]
        if pad:
            self.cache.crop(-pad)  # transformers 5.x: negative = tokens to remove
            return logits[:-pad], hidden[:-pad]
        return logits, hidden

    def compact(self, num_before: int, tree: DraftTree, accepted: list[int]) -> None:
        """Keep the cache entries of the pending token and the accepted path, drop the rest.
        When the path is the tree's first nodes in order (always so for a chain) a crop suffices."""
        num_nodes, kept, start = len(tree), len(accepted), num_before + 1
        prefix = accepted == list(range(kept))
        if prefix and num_nodes == kept:  # a plain step, or a chain accepted whole: nothing to do
            return
        if compact_cache(self.cache, start, accepted, start + kept):  # one kernel call (kv_cache.compact)
            return
        if not prefix:
            # the accepted entries move up to follow the pending token's, in place (no copy of
            # the whole cache per layer); the crop below drops the tail
            keep = torch.tensor([start + i for i in accepted], device=self.device)
            for layer in self.cache.layers:
                for name in ("keys", "values"):
                    full = getattr(layer, name)
                    full[..., start : start + kept, :] = full.index_select(-2, keep)
        if num_nodes > kept:
            self.cache.crop(-(num_nodes - kept))  # transformers 5.x: negative = tokens to remove

    @torch.inference_mode()
    def step(self, pending: int, tree: DraftTree, acceptance: AcceptanceRule | None = None) -> StepOutput:
        """Verify ``tree`` after the pending token with ``acceptance`` (None: the sampling rule);
        the cache ends holding pending + accepted."""
        if len(tree) and not self.tree_attention:
            return self._step_batched(pending, tree, acceptance)
        num_before = self.num_cached
        pad = max(int(tree.meta.get("verify_as", len(tree))) - len(tree), 0)  # set by cost-aware drafting
        logits, hidden = self.tree_logits(pending, tree, pad)
        accepted, bonus, relaxed = self._accept(logits, tree, acceptance)
        self.compact(num_before, tree, accepted)
        row = accepted[-1] + 1 if accepted else 0
        tokens = tree.tokens[accepted].tolist()
        return StepOutput(VerifyResult(accepted, tokens, bonus, len(tree), relaxed), hidden[row], logits[row])

    def _accept(self, logits: torch.Tensor, tree: DraftTree, acceptance: AcceptanceRule | None) -> tuple[list[int], int, list[bool]]:
        if acceptance is None:
            accepted, bonus = accept(logits, tree, self.sampling)
            return accepted, bonus, []
        return acceptance(logits, tree, self.sampling)

    def _step_batched(self, pending: int, tree: DraftTree, acceptance: AcceptanceRule | None) -> StepOutput:
        """Fallback without tree attention: every root-to-leaf path is one row of a batch over a
        copy of the cache (right-padded, so the causal mask alone is right), then the accepted
        tokens are run once more on the real cache. Costs one extra forward of 1 + accepted
        tokens per step; used only where ``supports_tree_attention`` is False."""
        children = [0] * len(tree)
        for p in tree.parents.tolist():
            if p >= 0:
                children[p] += 1
        leaves = [i for i in range(len(tree)) if children[i] == 0]
        paths = [tree.path_to(leaf) for leaf in leaves]
        width = 1 + max(len(p) for p in paths)
        tok = tree.tokens.tolist()
        rows = [[pending, *(tok[i] for i in p)] + [pending] * (width - 1 - len(p)) for p in paths]
        batch_cache = copy.deepcopy(self.cache)
        batch_cache.batch_repeat_interleave(len(rows))
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits, hidden = self._forward(ids, batch_cache)
        where = [(0, 0)] * (len(tree) + 1)  # row of the batch and column holding each node
        for b, path in enumerate(paths):
            for depth, node in enumerate(path, start=1):
                where[node + 1] = (b, depth)
        index_b = torch.tensor([w[0] for w in where], device=self.device)
        index_t = torch.tensor([w[1] for w in where], device=self.device)
        node_logits, node_hidden = logits[index_b, index_t], hidden[index_b, index_t]
        accepted, bonus, relaxed = self._accept(node_logits, tree, acceptance)
        tokens = tree.tokens[accepted].tolist()
        self._forward(torch.tensor([[pending, *tokens]], dtype=torch.long, device=self.device), self.cache)
        row = accepted[-1] + 1 if accepted else 0
        return StepOutput(VerifyResult(accepted, tokens, bonus, len(tree), relaxed), node_hidden[row], node_logits[row])
