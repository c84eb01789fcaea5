"""ReSpec drafter: retrieve only when the target is confident, draft only candidates whose
feedback score earns it, and optionally accept retrieved drafts with a relaxed rule.

Owns the ReSpec algorithm on top of the hybrid pool (respec_pool.py) and the relaxed rule
(relaxed.py):

1. Trigger. ``H = entropy(softmax(state.last_logits))`` in nats (the distribution that chose
   the pending token, already computed by the last verification). Retrieve when
   ``H < entropy_threshold``; otherwise, and whenever no candidate qualifies, the fallback
   drafter proposes (model-free prompt lookup by default; any Drafter, e.g. ModelDrafter).
2. Scores. Every candidate key (source + match thread, see respec_pool.py) has an EMA of the
   number of its draft tokens the target accepted when it was used:
   ``score <- (1 - ema_alpha) * score + ema_alpha * accepted``; an unseen key starts at
   ``prior_score``. Updated in ``observe`` from ``tree.meta["candidate_keys"]`` (one per
   path), ``tree.paths`` and ``result.accepted_nodes``. Scores live for one request.
3. Selection. Candidates with ``score >= score_threshold``, best score first (ties: the pool's
   order, which interleaves context, suffix array and dense by rank), at most ``max_candidates``,
   each cut to ``ceil(length_factor x score) + 1`` tokens (a new key: 3), merged into one trie of
   at most ``max_nodes`` nodes. Candidates under the threshold never reach the verifier.
4. Verification. ``relaxed=False`` (default): strict, lossless. ``relaxed=True``: retrieved
   nodes (``tree.node_data["retrieved"]``) may be accepted by the relaxed top-k / ratio /
   look-ahead rule (relaxed.py), which the drafter exposes as ``acceptance`` for the decode loop
   to pass to the verifier; model-made fallback drafts stay strict; ``lossless`` is False.

Defaults (``entropy_threshold`` 4 nats, ``max_candidates`` 3, ``length_factor`` 2,
``score_threshold`` 0.5) were chosen with ``benchmarks/reference_compare.py --split tune``:
model-free replay of the default model's float32 greedy answers (128 tokens) to the *tune*
questions (CodeAlpaca records 1960-1989, MT-Bench questions 5-8 of each category; the *eval*
split reported in BENCHMARKS.md played no part in the choice) on four datastores: code-full (0.93M tokens),
chat-large (1.04M), code-ood (69k) and chat-ood (100k). Cells: MAT / draft nodes per step /
estimated CPU speedup = MAT / verification cost of that many nodes (FINDINGS: 1.1x a 1-token
step at 8 nodes, 1.3x at 16, 2.4x at 64, linear in between):

| entropy / candidates / length_factor | code-full | chat-large | code-ood | chat-ood |
|---|---|---|---|---|
| 0.75 / 2 / 0 (previous defaults) | 1.85 / 8.2 / 1.67 | 1.56 / 6.6 / 1.45 | 1.66 / 8.0 / 1.51 | 1.51 / 6.5 / 1.40 |
| inf / 2 / 0 | 2.19 / 13.7 / 1.77 | 1.79 / 14.2 / 1.42 | 1.80 / 12.8 / 1.48 | 1.63 / 12.8 / 1.33 |
| inf / 3 / 0 | 2.32 / 19.3 / 1.69 | 1.87 / 20.3 / 1.34 | 1.86 / 17.9 / 1.39 | 1.71 / 18.1 / 1.27 |
| 0.75 / 3 / 2 | - | - | 1.66 / 5.2 / 1.56 | 1.52 / 4.7 / 1.43 |
| 1.5 / 3 / 2 | 1.99 / 6.0 / 1.85 | 1.63 / 5.4 / 1.53 | - | - |
| 2.5 / 3 / 2 | 2.08 / 6.6 / 1.92 | 1.70 / 6.2 / 1.57 | - | - |
| **4 / 3 / 2 (defaults)** | 2.14 / 7.1 / 1.97 | 1.78 / 7.1 / 1.63 | - | - |
| inf / 3 / 2 | 2.16 / 7.2 / 1.98 | 1.81 / 7.5 / 1.66 | 1.79 / 6.8 / 1.65 | 1.67 / 6.9 / 1.53 |
| inf / 3 / 3 | 2.23 / 9.7 / 1.96 | 1.83 / 10.2 / 1.58 | - | - |
| SuffixDecoding, for reference | 1.77 / 3.0 / 1.71 | 1.60 / 2.3 / 1.55 | 1.57 / 2.0 / 1.53 | 1.50 / 1.8 / 1.47 |

With a fixed draft length, retrieving more often raised MAT but grew the tree faster (the
previous defaults came from that trade-off on a 37k-token datastore). Letting each candidate
draft only as far as its score has earned (``length_factor``) keeps trees at ~7 nodes, and then
retrieving at almost every step is best on every datastore: the estimated speedup rises with the
entropy threshold up to ~4 nats and is flat beyond (inf is within 1.5%). 4 nats keeps the
trigger for near-uniform steps. ``score_threshold`` 0, 0.3 and 0.5 gave identical results in the
earlier sweep (``benchmarks/respec_sweep.py``). ``relaxed_top_k`` 3 and ``relaxed_ratio`` 0.3
were not swept (relaxed acceptance cannot be replayed without the target's logits off the
reference); see ``benchmarks/respec_relaxed.py`` for their measured effect.

The figures below were measured with the previous defaults (0.75 / 2 / 0):

Measured end to end (``specstore bench``, same datastore, CodeAlpaca questions 1900-1909, 128
tokens, CPU, one thread): bfloat16 MAT / speedup over ar: pld 1.41 / 1.21x, rest 1.30 / 1.08x,
dresd 1.55 / 1.00x, respec 1.68 / 1.58x (7.6 draft nodes per step; dresd drafts 45). float32:
every method identical to ar; MAT pld 1.48, rest 1.35, dresd 1.63, respec 1.62, but all slower
than ar (respec 0.93x): one-thread float32 verification of 4 tokens costs ~1.7x a 1-token step,
bfloat16 ~1.2x. Relaxed on (float32, top-k 3, ratio 0.3): 18 relaxed tokens in 970, 3/10 outputs
identical to ar, token similarity 0.77; top-k 2, ratio 0.5: 13 in 959, 4/10, 0.85.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from specstore.runtime.drafters.base import DecodeState, Drafter
from specstore.runtime.drafters.pld import PromptLookupDrafter
from specstore.runtime.drafters.respec_pool import PoolConfig, gather
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.relaxed import RelaxedRule
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import VerifyResult

MODEL_SOURCES = ("model",)  # drafts from these sources are always verified strictly


@dataclass(frozen=True, slots=True)
class ReSpecConfig:
    entropy_threshold: float = 4.0  # nats; retrieve only below it (inf = always, 0 = never)
    score_threshold: float = 0.5  # EMA accepted tokens a candidate needs to be drafted
    prior_score: float = 1.0  # EMA of a key never used before
    ema_alpha: float = 0.5  # weight of the newest observation
    max_candidates: int = 3  # candidates merged per step
    max_nodes: int = 24  # trie size cap (CPU verification: every node must earn its place)
    draft_length: int = 8  # most tokens per candidate after the pending one
    # a candidate drafts ceil(length_factor x its score) + 1 tokens (at most draft_length):
    # keys that have been accepted for long runs draft long, new or failing ones short (0 = off)
    length_factor: float = 2.0
    relaxed: bool = False  # lossy relaxed verification of retrieved drafts
    relaxed_top_k: int = 3
    relaxed_ratio: float = 0.3
    pool: PoolConfig = field(default_factory=PoolConfig)

    def __post_init__(self) -> None:
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.length_factor < 0:
            raise ValueError(f"length_factor must be >= 0, got {self.length_factor}")
        if self.max_candidates < 1 or self.max_nodes < 1 or self.draft_length < 1:
            raise ValueError("max_candidates, max_nodes and draft_length must be >= 1")


def entropy(logits: torch.Tensor) -> float:
    """Entropy in nats of softmax(``logits`` [V])."""
    logp = torch.log_softmax(logits.detach().float().reshape(-1), dim=-1)
    return float(-(logp.exp() * logp).sum())


class ReSpecDrafter:
    name = "respec"

    def __init__(self, datastore=None, config: ReSpecConfig | None = None, fallback: Drafter | None = None):
        self.datastore = datastore
        self.config = config or ReSpecConfig()
        self.fallback = fallback if fallback is not None else PromptLookupDrafter(num_draft_tokens=self.config.draft_length)
        self.lossless = not self.config.relaxed
        # the verifier's acceptance rule for this drafter's trees (None: the sampling rule)
        self.acceptance = RelaxedRule(self.config.relaxed_top_k, self.config.relaxed_ratio) if self.config.relaxed else None
        self.scores: dict[tuple[str, int], float] = {}
        self.num_retrieved_steps = 0  # steps whose tree came from qualifying candidates
        self.num_fallback_steps = 0

    def reset(self, prompt_ids: list[int]) -> None:
        self.scores = {}
        self.num_retrieved_steps = self.num_fallback_steps = 0
        self.fallback.reset(prompt_ids)

    def score(self, key: tuple[str, int]) -> float:
        return self.scores.get(key, self.config.prior_score)

    def update(self, key: tuple[str, int], accepted: int) -> float:
        """One EMA step for ``key`` (module docstring, point 2)."""
        a = self.config.ema_alpha
        self.scores[key] = (1.0 - a) * self.score(key) + a * accepted
        return self.scores[key]

    def draft_length_for(self, key: tuple[str, int], limit: int) -> int:
        """Tokens a candidate may draft: ``ceil(length_factor x score) + 1``, within ``limit``."""
        return max(1, min(limit, math.ceil(self.config.length_factor * self.score(key)) + 1))

    def triggers(self, state: DecodeState) -> bool:
        """Retrieve this step? True when the next-token entropy is under the threshold (or unknown)."""
        if state.last_logits is None:
            return True
        return entropy(state.last_logits) < self.config.entropy_threshold

    def propose(self, state: DecodeState) -> DraftTree:
        cfg = self.config
        length = min(cfg.draft_length, state.budget)
        if length <= 0:
            return DraftTree.empty()
        if self.triggers(state):
            candidates = gather(self.datastore, state, length, cfg.pool)
            qualified = [c for c in candidates if self.score(c.key) >= cfg.score_threshold]
            qualified.sort(key=lambda c: -self.score(c.key))  # stable: pool order breaks ties
            chosen = qualified[: cfg.max_candidates]
            if cfg.length_factor > 0:
                for c in chosen:
                    c.tokens = c.tokens[: self.draft_length_for(c.key, length)]
            if chosen:
                self.num_retrieved_steps += 1
                tree = DraftTree.from_paths((c.tokens for c in chosen), max_nodes=cfg.max_nodes)
                tree.meta["candidate_keys"] = [c.key for c in chosen]
                tree.node_data["retrieved"] = np.ones(len(tree), dtype=bool)  # every pool source retrieves
                return tree
        self.num_fallback_steps += 1
        tree = self.fallback.propose(state)
        retrieved = getattr(self.fallback, "source", "lookup") not in MODEL_SOURCES
        tree.node_data["retrieved"] = np.full(len(tree), retrieved, dtype=bool)
        return tree

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        keys = tree.meta.get("candidate_keys")
        if not keys:
            return
        accepted = set(result.accepted_nodes)
        for key, nodes in zip(keys, tree.paths, strict=True):
            if not nodes:  # cut by the node cap or the budget: it never reached the verifier
                continue
            count = 0
            while count < len(nodes) and nodes[count] in accepted:
                count += 1
            self.update(key, count)


def create(datastore=None, fallback=None, draft_model=None, pool: dict | None = None, **options) -> ReSpecDrafter:
    """Registry factory: ``options`` are ReSpecConfig fields, ``pool`` PoolConfig fields;
    ``fallback`` a Drafter, or ``draft_model`` (a loaded causal LM or a folder) for ModelDrafter."""
    if datastore is None:
        raise SpecstoreError("method 'respec' needs a datastore (--datastore NAME[@VERSION|@TAG])")
    if isinstance(options.get("relaxed"), str):
        options["relaxed"] = _on_off(options["relaxed"])
    pool_options = dict(pool or {})
    for name in PoolConfig.__dataclass_fields__:  # bench's --option respec.num_dense=5 lands here
        if name in options:
            pool_options[name] = options.pop(name)
    known = set(ReSpecConfig.__dataclass_fields__) | set(PoolConfig.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise SpecstoreError(f"unknown respec option {unknown[0]!r}: choose from {', '.join(sorted(known - {'pool'}))}")
    config = ReSpecConfig(**options, pool=PoolConfig(**pool_options))
    if fallback is None and draft_model is not None:
        from specstore.runtime.drafters.model import create as create_model_drafter

        fallback = create_model_drafter(model=draft_model, num_draft_tokens=min(config.draft_length, 4))
    return ReSpecDrafter(datastore, config, fallback)


def _on_off(value: str) -> bool:
    if value.lower() in ("on", "true", "1", "yes"):
        return True
    if value.lower() in ("off", "false", "0", "no"):
        return False
    raise SpecstoreError(f"relaxed must be on or off, got {value!r}")
