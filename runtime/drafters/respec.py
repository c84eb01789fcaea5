"""ReSpec drafter: retrieve only when the target is confident, draft only candidates whose
feedback score earns it, and optionally accept retrieved drafts with a relaxed rule.

Owns the ReSpec algorithm on top of the hybrid candidate pool (respec_pool.py) and the relaxed
rule (relaxed.py):

1. Trigger. ``H = entropy(softmax(state.last_logits))`` in nats (the distribution that chose
   the pending token, already computed by the last verification). Retrieve when
   ``H < entropy_threshold``; otherwise, and whenever no candidate qualifies, the fallback
   drafter proposes (model-free prompt lookup by default; any Drafter, e.g. ModelDrafter).
2. Scores. Every candidate key (source + match thread, see respec_pool.py) has an EMA of the
   number of its draft tokens the target accepted when it was used:
   ``score <- (1 - ema_alpha) * score + ema_alpha * accepted``; an unseen key starts at
   ``prior_score``, or at its source's score where that is higher: the same EMA, once a step,
   of what the source's best candidate accepted (``source_prior=False``: always
   ``prior_score``), so a new match thread of a source that keeps being accepted (an answer
   copying from the prompt) drafts as long as the old ones, and a failing source's new threads
   still get the prior's try. Updated in ``observe`` from ``tree.meta["candidate_keys"]``
   (one per path), ``tree.paths`` and ``result.accepted_nodes``. Scores live for one request.
3. Selection. Candidates with ``score >= score_threshold``, best score first (ties: the pool's
   order, which interleaves context, suffix array and dense by rank), at most ``max_candidates``,
   each cut to ``ceil(length_factor x score) + 1`` tokens (a new key: its source's score), merged into one trie of
   at most ``max_nodes`` nodes. Candidates under the threshold never reach the verifier. A
   context (prompt lookup) candidate that continues a match of the pool's longest n-gram
   (``pool.max_ngram`` tokens, the pending one included) is cut to ``context_length`` instead,
   whatever its score: prompt lookup's own rule, so that a long copy from the prompt drafts
   whole from its first step and ReSpec, which holds prompt lookup, does not fall behind it.
4. Resync. After a step whose committed tokens followed a chosen candidate up to a token the
   target did not take, the next step's pool also holds that candidate's tokens after the one
   the target replaced (or after the next one, where the target's own token is that next one:
   a token the target skipped), as a ``("resync", 0)`` candidate (``resync_candidates``): a
   copy with one token changed (a renamed variable, a different number) picks up where it left
   off instead of waiting for the context's n-grams to find the copy again. Replayed on the tune
   splits, MAT +3.0% (code) and +0.7% (chat); the same with the target's token taken as an
   insertion as well lost 1.4% and 0.9% (BENCHMARKS.md, nineteenth session). The fallback's
   chains (prompt lookup) resync the same way (+0.4% / +0.3% MAT, replayed with a fixed drafting
   price). ``resync=False`` turns it off.
5. Verification. ``relaxed=False`` (default): strict, lossless. ``relaxed=True``: retrieved
   nodes (``tree.node_data["retrieved"]``) may be accepted by the relaxed top-k / ratio /
   look-ahead rule (relaxed.py), which the drafter exposes as ``acceptance`` for the decode loop
   to pass to the verifier; model-made fallback drafts stay strict; ``lossless`` is False.

Defaults: ``entropy_threshold`` 4 nats, ``max_candidates`` 3, ``length_factor`` 2,
``score_threshold`` 0.5, chosen by model-free replay of greedy references
(``benchmarks/reference_compare.py --split tune``, ``benchmarks/respec_sweep.py``);
``context_length`` 16 (BENCHMARKS.md, "A long context match drafts whole"); the relaxed
rule's ``relaxed_top_k`` 3 and ``relaxed_ratio`` 0.3 are measured by
``benchmarks/respec_relaxed.py``. Figures: BENCHMARKS.md.

Given the engine's served overlay, it is one more source of the pool (``"overlay"`` keys, their
own EMA scores like every key); nodes of overlay candidates are marked ``node_data["overlay"]``
and tallied in ``overlay_use``.

Given a draft head (runtime/draft_head.py; ``head="auto"`` finds the one trained for the
datastore's model, if any), the head's ``head_guesses`` likeliest tokens after the pending one
join the pool as one-token ``("head", rank)`` candidates in the steps that retrieve; their
probability takes the context match's place in the cost-aware signal. With ``head_signal`` (the
default) the head's probability of every first draft token, whatever its source, is that node's
prior and, binned (HEAD_SIGNAL_EDGES), part of its cell: the pruner keeps what the head agrees with.
A context candidate continuing a long match (``pool.max_ngram`` tokens) keeps its score's prior
(binned all the same): the head does not see the context, and a copy should earn its length.
Candidates whose first token the head gives less than ``head_floor`` (0.001) are not proposed at
all (long copies excepted): half the widened proposal's nodes, which the pruner almost never kept.

Cost-aware sizing (drafters/cost_aware.py, on with a cost model): each node's signal is its
best candidate's source, EMA score and context match, and how many chosen candidates pass
through it (``cost_signal="source"``: source and score only); the registry then widens the proposal (every candidate,
full length up to 16 tokens, 64 nodes: registry.py's ``cost_options``) and the pruner decides how much
of it is worth verifying, so a long context match earns its full length.

The command line's ReSpec options live in respec_cli.py.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from specstore.runtime import gemm, tree_kernel
from specstore.runtime.draft_head import WEIGHT_FORMS as HEAD_WEIGHT_FORMS
from specstore.runtime.draft_head import WEIGHTS as HEAD_WEIGHTS
from specstore.runtime.drafters.base import DecodeState, Drafter
from specstore.runtime.drafters.pld import PromptLookupDrafter
from specstore.runtime.drafters.respec_pool import POOL_SWITCHES, Candidate, CandidatePool, PoolConfig
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.overlay import OverlayUse
from specstore.runtime.relaxed import RelaxedRule
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import VerifyResult

MODEL_SOURCES = ("model",)  # drafts from these sources are always verified strictly
SOURCE_INDEX = {"context": 0, "suffix": 1, "dense": 2, "overlay": 3, "resync": 4, "head": 5}
SCORE_EDGES = (0.75, 1.5, 3.0, 6.0)  # EMA score bins of the cost-aware signal
MATCH_EDGES = (2, 4, 8, 16)  # bins of the context suffix a candidate continues (its ``match``; 16: a long copy)
# a head guess's probability takes the match's place in the signal: bins at these edges, each
# given as the match value of the same MATCH_EDGES bin
HEAD_EDGES = (0.3, 0.5, 0.7, 0.9)
HEAD_MATCH = (0, *MATCH_EDGES)
SUPPORT_CAP = 3  # candidates through a node: 1, 2, or 3 and more
# the head's probability of a first draft token (a child of the pending one) in the signal
# (ReSpecConfig.head_signal): bins at these edges, one more for a token outside the head's
# vocabulary and one for every other node (deeper, or no head this step)
HEAD_SIGNAL_EDGES = (0.01, 0.05, 0.2, 0.5)
HEAD_SIGNAL_BINS = len(HEAD_SIGNAL_EDGES) + 3
SWITCHES = ("relaxed", "source_prior", "resync", "head_signal", "head_thread")  # ReSpecConfig's on/off fields
# cost-aware buckets of fallback drafts start here, past every bucket of the pool's signal
FALLBACK_BUCKET = SUPPORT_CAP * (len(MATCH_EDGES) + 1) * (len(SOURCE_INDEX) + 1) * HEAD_SIGNAL_BINS * (len(SCORE_EDGES) + 1)


@dataclass(frozen=True, slots=True)
class ReSpecConfig:
    entropy_threshold: float = 4.0  # nats; retrieve only below it (inf = always, 0 = never)
    score_threshold: float = 0.5  # EMA accepted tokens a candidate needs to be drafted
    prior_score: float = 1.0  # EMA of a key never used before
    # a key never used before starts at its source's EMA in this request (once a step, what the
    # source's best candidate accepted; same ema_alpha) where that is above prior_score: a new
    # match thread of a source that has been drafting well (a prompt whose answer copies from it)
    # drafts like one (False: prior_score always)
    source_prior: bool = True
    ema_alpha: float = 0.5  # weight of the newest observation
    max_candidates: int = 3  # candidates merged per step
    max_nodes: int = 24  # trie size cap (CPU verification: every node must earn its place)
    draft_length: int = 8  # most tokens per candidate after the pending one
    # a candidate drafts ceil(length_factor x its score) + 1 tokens (at most draft_length):
    # keys that have been accepted for long runs draft long, new or failing ones short (0 = off)
    length_factor: float = 2.0
    # context (prompt-lookup) candidates that continue a match of the pool's longest n-gram
    # (pool.max_ngram tokens, the pending one included) draft this many tokens whatever their
    # score, as prompt lookup itself does, so that a long copy from the prompt drafts whole
    # (0: the length rule above for them too)
    context_length: int = 16
    # cost-aware signal per node (_add_signals): "full" source, score, context match and support;
    # "source" source and score only (the signal before 2026-12-02, for ablations)
    cost_signal: str = "full"
    # after a step whose committed path followed a candidate up to a token the target did not
    # take, draft what the candidate says after that token (a one-token substitution, or a
    # deletion where the target's token is the candidate's next): the "resync" source
    resync: bool = True
    # a draft head (runtime/draft_head.py) guessing the token after the pending one from the
    # target's last hidden state, as one more pool source ("head"): "auto" the head trained for
    # the datastore's model in its default place (draft_head.default_path) when there is one,
    # "off" none, or a head file's path
    head: str = "auto"
    head_guesses: int = 2  # the head's likeliest tokens drafted per step, one candidate each (2: tune splits, BENCHMARKS.md)
    # the head's probability of every first draft token (whatever its source) joins that node's
    # cost-aware signal, binned (HEAD_SIGNAL_EDGES), and is its prior: the pruner then keeps the
    # branches the head agrees with (tune splits: BENCHMARKS.md, twenty-fourth session)
    head_signal: bool = True
    # with the head's signal, a candidate whose first token the head gives less than this is not
    # proposed (a long context copy excepted): half the proposal's nodes on the tune splits,
    # pruned away almost always, cost drafting time and blurred the calibration (0: keep all;
    # 0.0001-0.003 replayed alike, BENCHMARKS.md, twenty-fourth session)
    head_floor: float = 0.001
    # the head's guess beside the pool's search, on the other core (DraftHead.guess_beside, where
    # the CPU kernel has it): right after a verification the guess waits on memory for its
    # weights while the search is Python
    head_thread: bool = True
    # how a head computing in float32 (CPUs without AVX-512 BF16) holds its three weights: "bf16"
    # (half the bytes its guess waits for right after a verification; the tune splits' MAT the
    # same, BENCHMARKS.md, thirty-sixth session) or "float32"
    head_weights: str = HEAD_WEIGHTS
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
        if self.context_length < 0:
            raise ValueError(f"context_length must be >= 0, got {self.context_length}")
        if self.head_guesses < 0:
            raise ValueError(f"head_guesses must be >= 0, got {self.head_guesses}")
        if not 0.0 <= self.head_floor < 1.0:
            raise ValueError(f"head_floor must be in [0, 1), got {self.head_floor}")
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.cost_signal not in ("full", "source"):
            raise ValueError(f"cost_signal must be full or source, got {self.cost_signal!r}")
        if self.head_weights not in HEAD_WEIGHT_FORMS:
            raise ValueError(f"head_weights must be {' or '.join(HEAD_WEIGHT_FORMS)}, got {self.head_weights!r}")


def entropy(logits: torch.Tensor) -> float:
    """Entropy in nats of softmax(``logits`` [V]). bf16 CPU logits go to the kernel's one call
    (gemm.entropy, where it has one: ~15 us against ~200 in a decoding step here). Otherwise
    ``-sum(p * log p)`` from one log-softmax (converted to float32 in the same pass) and one
    product. Every step pays it right after a forward, where each small op runs on cold caches,
    so the fewest ops win (about 130 against 185 us on this CPU). Logits of -inf (p = 0, which
    adds nothing) would make it NaN: those take the longer way, ``d = logits - max`` clamped far
    below 0 (where exp is 0), ``H = log sum exp(d) - (exp(d) . d) / sum exp(d)``."""
    flat = logits.detach().reshape(-1)
    fast = gemm.entropy(flat)
    if fast is not None and fast == fast:
        return fast
    logp = torch.log_softmax(flat, 0, dtype=torch.float32)
    h = -float(torch.dot(logp.exp(), logp))
    if h == h:
        return h
    d = flat.float()
    d = (d - d.max()).clamp_(min=-1e4)
    p = torch.exp(d)
    total = float(p.sum())
    return math.log(total) - float(torch.dot(p, d)) / total


class ReSpecDrafter:
    name = "respec"

    def __init__(self, datastore=None, config: ReSpecConfig | None = None, fallback: Drafter | None = None,
                 overlay=None):
        self.datastore = datastore
        self.config = config or ReSpecConfig()
        self.overlay = overlay
        self.pool = CandidatePool(datastore, self.config.pool, overlay)
        self.overlay_use = OverlayUse()
        self.fallback = fallback if fallback is not None else PromptLookupDrafter(num_draft_tokens=self.config.draft_length)
        self.lossless = not self.config.relaxed
        # the verifier's acceptance rule for this drafter's trees (None: the sampling rule)
        self.acceptance = RelaxedRule(self.config.relaxed_top_k, self.config.relaxed_ratio) if self.config.relaxed else None
        self.scores: dict[tuple[str, int], float] = {}
        self.source_scores: dict[str, float] = {}  # per source, the EMA of every use of its keys
        self.num_retrieved_steps = 0  # steps whose tree came from qualifying candidates
        self.num_fallback_steps = 0
        self.resync: list[Candidate] = []  # the next step's resync candidates (observe)
        self.head = load_head(self.config.head, datastore, self.config.head_weights) if self.config.head_guesses else None
        self.head_steps = self.head_accepted = 0  # steps that drafted a head guess; those that took one
        self.head_probs: np.ndarray | None = None  # the head's distribution this step (head_candidates)
        self._workspace = tree_kernel.Workspace()  # the kernel's buffers (_trie)

    def reset(self, prompt_ids: list[int]) -> None:
        self.scores, self.source_scores = {}, {}
        self.resync = []
        self.num_retrieved_steps = self.num_fallback_steps = 0
        self.head_steps = self.head_accepted = 0
        self.head_probs = None
        self.overlay_use = OverlayUse()
        self.fallback.reset(prompt_ids)

    def overlay_stats(self) -> dict | None:
        """This request's overlay tally (None without an overlay)."""
        return self.overlay_use.to_dict() if self.overlay is not None else None

    def score(self, key: tuple[str, int]) -> float:
        if key in self.scores:
            return self.scores[key]
        if self.config.source_prior:
            return max(self.source_scores.get(key[0], 0.0), self.config.prior_score)
        return self.config.prior_score

    def update(self, key: tuple[str, int], accepted: int) -> float:
        """One EMA step for ``key`` (module docstring, point 2)."""
        a = self.config.ema_alpha
        self.scores[key] = (1.0 - a) * self.score(key) + a * accepted
        return self.scores[key]

    def update_source(self, source: str, accepted: int) -> float:
        """One EMA step for ``source``: what its best candidate of a step had accepted."""
        a = self.config.ema_alpha
        self.source_scores[source] = (1.0 - a) * self.source_scores.get(source, self.config.prior_score) + a * accepted
        return self.source_scores[source]

    def draft_length_for(self, key: tuple[str, int], limit: int) -> int:
        """Tokens a candidate may draft: ``ceil(length_factor x score) + 1``, within ``limit``."""
        return max(1, min(limit, math.ceil(self.config.length_factor * self.score(key)) + 1))

    def triggers(self, state: DecodeState) -> bool:
        """Retrieve this step? True when the next-token entropy is under the threshold (or unknown)."""
        if state.last_logits is None:
            return True
        return entropy(state.last_logits) < self.config.entropy_threshold

    def propose(self, state: DecodeState) -> DraftTree:
        return self._propose(state, None)[0]

    def propose_sized(self, state: DecodeState, sizing) -> tuple[DraftTree, int | None]:
        """``propose`` for the cost-aware wrapper (cost_aware.Sizing): a retrieving step's trie,
        signals and sizing in one kernel call where the kernel is loaded (tree_kernel.respec_sized,
        the tree the wrapper's pruner would keep): ``(the kept tree, nodes proposed)``; else
        ``(the proposal, None)``, for the wrapper to size."""
        return self._propose(state, sizing)

    def _propose(self, state: DecodeState, sizing) -> tuple[DraftTree, int | None]:
        cfg = self.config
        length = min(cfg.draft_length, state.budget)
        if length <= 0:
            return DraftTree.empty(), None
        if self.triggers(state):
            want = min(max(cfg.draft_length, cfg.context_length), state.budget)
            candidates, head = self.gather_with_head(state, lambda: self.pool.gather(state, want))
            candidates += self.resync
            candidates += head
            qualified = [c for c in candidates if self.score(c.key) >= cfg.score_threshold]
            if cfg.head_floor > 0 and cfg.head_signal and self.head_probs is not None:
                qualified = [c for c in qualified if self._head_agrees(c)]
            qualified.sort(key=lambda c: -self.score(c.key))  # stable: pool order breaks ties
            chosen = qualified[: cfg.max_candidates]
            uncut = [c.tokens for c in chosen]  # before the cuts below (observe's resync)
            for c in chosen:
                if cfg.context_length and self._long_copy(c):
                    c.tokens = c.tokens[: cfg.context_length]
                elif cfg.length_factor > 0:
                    c.tokens = c.tokens[: self.draft_length_for(c.key, length)]
                else:
                    c.tokens = c.tokens[:length]
            if chosen:
                self.num_retrieved_steps += 1
                tree, proposed = self._trie(chosen, sizing)
                tree.meta["candidate_keys"] = [c.key for c in chosen]
                tree.meta["candidate_tokens"] = uncut
                tree.node_data["retrieved"] = np.ones(len(tree), dtype=bool)  # every pool source retrieves
                if self.overlay is not None:
                    served = np.zeros(len(tree), dtype=bool)
                    for c, nodes in zip(chosen, tree.paths, strict=True):
                        if c.source == "overlay":
                            served[nodes] = True
                    tree.node_data["overlay"] = served
                return tree, proposed
        self.num_fallback_steps += 1
        tree = self.fallback.propose(state)
        retrieved = getattr(self.fallback, "source", "lookup") not in MODEL_SOURCES
        tree.node_data["retrieved"] = np.full(len(tree), retrieved, dtype=bool)
        if retrieved and len(tree) and cfg.resync and bool((tree.parents == np.arange(-1, len(tree) - 1)).all()):
            tree.meta["candidate_tokens"] = [tree.tokens.tolist()]  # prompt lookup's chain: resync from it too
        # the fallback's own signal (pld: match length), in buckets apart from the pool's
        own = tree.node_data.get("bucket")
        tree.node_data["bucket"] = FALLBACK_BUCKET + (np.zeros(len(tree), dtype=np.int64) if own is None else own)
        return tree, None

    def gather_with_head(self, state: DecodeState, gather) -> tuple[list[Candidate], list[Candidate]]:
        """``gather()`` (the pool's candidates) and the head's: its ``head_guesses`` likeliest
        tokens after the pending one, one candidate of one token each (key ``("head", rank)``;
        its probability, binned by HEAD_EDGES, in the match's place); none without a head or a
        hidden state. With ``head_thread`` the guess runs beside the gather, on the other core
        (``DraftHead.guess_beside``). The head's whole distribution is kept as ``head_probs`` for
        this step's signal (numpy: its indexing is ~30x cheaper than torch's)."""
        self.head_probs = None
        if self.head is None or state.last_hidden is None or not state.tokens:
            return gather(), []
        found, self.head_probs, top = self.head.guess_beside(gather, state.last_hidden, int(state.tokens[-1]),
                                                             self.config.head_guesses, self.config.head_thread)
        return found, [Candidate(("head", rank), [token], HEAD_MATCH[bisect.bisect_right(HEAD_EDGES, p)])
                       for rank, (token, p) in enumerate(top)]

    def _long_copy(self, c: Candidate) -> bool:
        """A context (prompt lookup) candidate continuing a match of the pool's longest n-gram."""
        return c.source == "context" and c.match >= self.config.pool.max_ngram

    def _head_agrees(self, c: Candidate) -> bool:
        """False for a candidate whose first token the head gives less than ``head_floor`` (a
        long context copy excepted: the head does not see the context)."""
        if not c.tokens or self._long_copy(c):
            return True
        p = self.head.probability(self.head_probs, c.tokens[0])
        return p is None or p >= self.config.head_floor

    def _trie(self, chosen: list[Candidate], sizing=None) -> tuple[DraftTree, int | None]:
        """The chosen candidates' trie (at most ``max_nodes``) with each node's cost-aware signal
        (``_add_signals``) and, given a ``sizing`` (propose_sized), sized: one kernel call where
        it is loaded (tree_kernel.respec_sized or respec_trie: the same trees), else
        ``DraftTree.from_paths`` and ``_add_signals``, unsized. Returns ``(tree, nodes proposed
        or None where the tree is not sized)``."""
        cfg = self.config
        full = cfg.cost_signal == "full"
        head = full and cfg.head_signal and self.head_probs is not None
        args = ([list(c.tokens) for c in chosen], cfg.max_nodes, [self.score(c.key) for c in chosen],
                [SOURCE_INDEX.get(c.source, len(SOURCE_INDEX)) for c in chosen], [int(c.match) for c in chosen],
                _layout(full, cfg.pool.max_ngram), self.head_probs if head else None, self.head.rows if head else None)
        if sizing is not None:
            cal = sizing.calibrator
            for _ in range(2):
                found = tree_kernel.respec_sized(self._workspace, *args, sizing.max_depth, cal.table,
                                                 cal.weight, cal.explore, sizing.price_terms(cfg.max_nodes), sizing.extra)
                if found is not tree_kernel.OUT_OF_TABLE:
                    break
                cal.grow(FALLBACK_BUCKET - 1)  # the largest bucket of the pool's signal
            if found is not None and found is not tree_kernel.OUT_OF_TABLE:
                tokens, parents, paths, bucket, prior, proposed, self._workspace = found
                return DraftTree._built(tokens, parents, {"bucket": bucket, "prior": prior}, paths, {}), proposed
        found = tree_kernel.respec_trie(*args)
        if found is not None:
            tokens, parents, paths, bucket, prior = found
            return DraftTree._built(tokens, parents, {"bucket": bucket, "prior": prior}, paths, {}), None
        tree = DraftTree.from_paths((c.tokens for c in chosen), max_nodes=cfg.max_nodes)
        self._add_signals(tree, chosen)
        return tree, None

    def _add_signals(self, tree: DraftTree, chosen) -> None:
        """The cost-aware signal (drafters/cost_aware.py): per node, the source, EMA score and
        context match (``Candidate.match``, binned by MATCH_EDGES) of the best-scored candidate
        through it, and how many chosen candidates pass through it (agreeing sources and threads
        make a token likelier, as REST's and DReSD's shares do); ``prior`` score / (score + 1).
        In Python lists: a proposal has at most a few dozen nodes, and numpy's per-call cost
        right after a forward (cold caches) was most of this step's work."""
        n = len(tree)
        best, source, match, support = [-1.0] * n, [0] * n, [0] * n, [0] * n
        for c, path in zip(chosen, tree.paths, strict=True):
            s, src, m = self.score(c.key), SOURCE_INDEX.get(c.source, len(SOURCE_INDEX)), c.match
            for node in path:
                support[node] += 1
                if s > best[node]:
                    best[node], source[node], match[node] = s, src, m
        full = self.config.cost_signal == "full"
        heads, priors = [HEAD_SIGNAL_BINS - 1] * n, [max(b, 0.0) / (max(b, 0.0) + 1.0) for b in best]
        if full and self.config.head_signal and self.head_probs is not None:
            copy = self.config.pool.max_ngram
            for i, (token, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True)):
                if parent < 0:  # a first draft token: the head's probability says how likely it is
                    p = self.head.probability(self.head_probs, token)
                    heads[i] = HEAD_SIGNAL_BINS - 2 if p is None else bisect.bisect_right(HEAD_SIGNAL_EDGES, p)
                    if p is not None and not (source[i] == SOURCE_INDEX["context"] and match[i] >= copy):
                        priors[i] = p  # a long copy from the context keeps its own: the head does not see the context
        buckets = []
        for i in range(n):
            b = max(best[i], 0.0)
            cell = (min(max(support[i], 1), SUPPORT_CAP) - 1) * (len(MATCH_EDGES) + 1) + bisect.bisect_right(MATCH_EDGES, match[i]) if full else 0
            cell = (cell * (len(SOURCE_INDEX) + 1) + source[i]) * HEAD_SIGNAL_BINS + heads[i]
            buckets.append(cell * (len(SCORE_EDGES) + 1) + bisect.bisect_right(SCORE_EDGES, b))
        tree.node_data["bucket"] = np.array(buckets, dtype=np.int64)
        tree.node_data["prior"] = np.array(priors, dtype=float)

    def stats(self) -> dict:
        """How this request was drafted: steps that retrieved, steps that fell back, and with what."""
        out = {"retrieved_steps": self.num_retrieved_steps, "fallback_steps": self.num_fallback_steps,
               "fallback": getattr(self.fallback, "name", None)}
        if self.head is not None:
            out.update(head_steps=self.head_steps, head_accepted=self.head_accepted)
        return out

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        self.overlay_use.record(tree.node_data.get("overlay"), result.accepted_nodes)
        keys = tree.meta.get("candidate_keys")
        drafts = tree.meta.get("candidate_tokens") if self.config.resync and not result.relaxed else None
        self.resync = resync_candidates(drafts, result.accepted_tokens, result.bonus) if drafts else []
        if not keys:
            return
        accepted = set(result.accepted_nodes)
        best: dict[str, int] = {}  # per source that reached the verifier, its best candidate's accepted tokens
        for key, nodes in zip(keys, tree.paths, strict=True):
            if not nodes:  # cut by the node cap or the budget: it never reached the verifier
                continue
            count = 0
            while count < len(nodes) and nodes[count] in accepted:
                count += 1
            best[key[0]] = max(best.get(key[0], 0), count)
            self.update(key, count)
        if "head" in best:
            self.head_steps += 1
            self.head_accepted += best["head"] > 0
        for source, count in best.items():  # after every key's own step: a new key's start is the old score
            self.update_source(source, count)


_LAYOUTS: dict[tuple[bool, int], tree_kernel.TrieLayout] = {}


def _layout(full: bool, copy: int) -> tree_kernel.TrieLayout:
    """The signal's bins above for the kernel's trie (packed once per signal kind and long-copy match)."""
    layout = _LAYOUTS.get((full, copy))
    if layout is None:
        layout = _LAYOUTS[(full, copy)] = tree_kernel.TrieLayout(
            full, SUPPORT_CAP, len(SOURCE_INDEX) + 1, HEAD_SIGNAL_BINS, SOURCE_INDEX["context"], copy, MATCH_EDGES,
            SCORE_EDGES, HEAD_SIGNAL_EDGES)
    return layout


def resync_candidates(drafts, committed: list[int], bonus: int) -> list[Candidate]:
    """The "resync" source (ReSpecConfig.resync): a step committed ``committed`` and the
    target's own ``bonus`` after them. A draft (a chosen candidate's tokens, before any cut) that
    holds ``committed`` and then a token other than ``bonus`` goes on, after that token, as
    what the target may write next: its tokens after the one the target replaced (a
    substitution), or after the next one where that is ``bonus`` (the target skipped a token).
    One candidate per distinct continuation, drafts in order; its key ``("resync", 0)``."""
    n, out, seen = len(committed), [], set()
    for tokens in drafts:
        if len(tokens) <= n + 1 or tokens[n] == bonus or list(tokens[:n]) != committed:
            continue
        rest = list(tokens[n + 2:] if tokens[n + 1] == bonus else tokens[n + 1:])
        if rest and tuple(rest) not in seen:
            seen.add(tuple(rest))
            out.append(Candidate(("resync", 0), rest))
    return out


def load_head(head: str, datastore, weights: str | None = None):
    """The draft head ReSpecConfig.head names, checked against the datastore's model; None for
    "off", or for "auto" where no head was trained for that model. ``weights``: how a float32
    head holds its weights (ReSpecConfig.head_weights; None: draft_head.WEIGHTS)."""
    from specstore.runtime.draft_head import DraftHead, default_path

    if head in ("off", "none", ""):
        return None
    model = getattr(getattr(datastore, "manifest", None), "model", None)
    if head == "auto":
        if model is None:
            return None
        path = default_path(model.revision)
        return DraftHead.cached(path, expect=model, weights=weights) if path.is_file() else None
    return DraftHead.cached(head, expect=model, weights=weights)


def create(datastore=None, fallback=None, draft_model=None, pool: dict | None = None, overlay=None,
           **options) -> ReSpecDrafter:
    """Registry factory: ``options`` are ReSpecConfig fields, ``pool`` PoolConfig fields;
    ``fallback`` a Drafter, or ``draft_model`` (a loaded causal LM or a folder) for ModelDrafter;
    ``overlay``: a served overlay, one more pool source."""
    if datastore is None:
        raise SpecstoreError("method 'respec' needs a datastore (--datastore NAME[@VERSION|@TAG])")
    pool_options = dict(pool or {})
    for name in PoolConfig.__dataclass_fields__:  # bench's --option respec.num_dense=5 lands here
        if name in options:
            pool_options[name] = options.pop(name)
    _text_switches(options, SWITCHES)
    _text_switches(pool_options, POOL_SWITCHES)
    known = set(ReSpecConfig.__dataclass_fields__) | set(PoolConfig.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise SpecstoreError(f"unknown respec option {unknown[0]!r}: choose from {', '.join(sorted(known - {'pool'}))}")
    config = ReSpecConfig(**options, pool=PoolConfig(**pool_options))
    if fallback is None and draft_model is not None:
        from specstore.runtime.drafters.model import create as create_model_drafter

        fallback = create_model_drafter(model=draft_model, num_draft_tokens=min(config.draft_length, 4))
    return ReSpecDrafter(datastore, config, fallback, overlay)


def _text_switches(options: dict, names) -> None:
    """On/off switches given as text or 0/1 (the command line's ``--option``), as booleans."""
    for name in names:
        if isinstance(options.get(name), (str, int)) and not isinstance(options[name], bool):
            options[name] = _on_off(name, str(options[name]))


def _on_off(name: str, value: str) -> bool:
    if value.lower() in ("on", "true", "1", "yes"):
        return True
    if value.lower() in ("off", "false", "0", "no"):
        return False
    raise SpecstoreError(f"{name} must be on or off, got {value!r}")
