"""Reference drafter: SuffixDecoding from Snowflake's ``arctic-inference`` (an optional extra).

Not a specstore method: the strongest existing retrieval drafter, wrapped in the drafter
contract so the bench and the simulator can put it beside rest, dresd and respec on the same
datastore, prompts and verifier. Its suffix trees hold the datastore's documents (one cached
"response" each, in the global tree), the prompt and the response so far (the request's local
tree); each step asks ``speculate`` for a draft of at most ``max_spec_tokens`` tokens (always
passed: without it the library drafts up to the tree depth) and the verifier checks it like any
other tree, so the method stays lossless. Responses of earlier prompts are evicted when the next
prompt starts, so prompts do not help each other (as for every specstore method without the
served overlay); with ``learn=True`` they stay in the global tree, as SuffixDecoding does when it
serves (the anchor for the overlay in ``benchmarks/served_stream.py``, which keeps one drafter
for the whole stream).

Install (CPU, no vLLM): ``make install-suffixdecoding`` (pip ``--no-build-isolation --no-deps``
after torch, nanobind 2.9.2, cmake and ninja).
"""

from __future__ import annotations

import numpy as np

from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.tree import DraftTree
from specstore.runtime.verify import VerifyResult

INSTALL_HINT = "SuffixDecoding needs the optional arctic-inference build: run `make install-suffixdecoding`"


def datastore_documents(datastore) -> list[np.ndarray]:
    """The datastore's documents, from its token stream (documents end with a -1 separator)."""
    suffix = datastore.suffix
    parts = getattr(suffix, "shards", None) or [suffix]
    stream = np.concatenate([np.asarray(p.stream) for p in parts])
    ends = np.flatnonzero(stream < 0)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [stream[a:b].astype(np.int32) for a, b in zip(starts, ends, strict=True) if b > a]


class SuffixDecodingDrafter:
    name = "suffixdecoding"
    lossless = True

    def __init__(self, datastore, *, max_spec_tokens: int = 16, max_tree_depth: int = 64, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1, use_tree_spec: bool = False,
                 learn: bool = False):
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError:
            raise SpecstoreError(INSTALL_HINT) from None
        if max_spec_tokens <= 0 or max_tree_depth <= 0:
            raise SpecstoreError("suffixdecoding: max_spec_tokens and max_tree_depth must be positive")
        self.max_spec_tokens = int(max_spec_tokens)
        self.max_tree_depth = int(max_tree_depth)
        self.learn = bool(learn)
        self.options = dict(max_spec_factor=float(max_spec_factor), max_spec_offset=float(max_spec_offset),
                            min_token_prob=float(min_token_prob), use_tree_spec=bool(use_tree_spec))
        self.cache = SuffixDecodingCache(max_tree_depth=self.max_tree_depth, max_cached_requests=-1)
        for i, doc in enumerate(datastore_documents(datastore)):
            key = ("datastore", i)
            self.cache.start_request(key, np.zeros(0, dtype=np.int32))
            self.cache.add_active_response(key, doc)
            self.cache.stop_request(key)
        self._request = None
        self._requests = 0
        self._fed = 0

    def reset(self, prompt_ids: list[int]) -> None:
        self._end_request()
        self._requests += 1
        self._request = ("request", self._requests)
        self.cache.start_request(self._request, np.asarray(prompt_ids, dtype=np.int32))
        self._fed = len(prompt_ids)

    def _end_request(self) -> None:
        if self._request is not None:
            self.cache.stop_request(self._request)
            if not self.learn and self._request in self.cache.cached_requests:
                self.cache.evict_cached_response(self._request)
            self._request = None

    def propose(self, state: DecodeState) -> DraftTree:
        if self._request is None:
            self.reset(state.tokens[: state.num_prompt])
        new = state.tokens[self._fed :]
        if new:  # committed tokens (the pending one included) join the response so far
            self.cache.add_active_response(self._request, np.asarray(new, dtype=np.int32))
            self._fed = len(state.tokens)
        limit = min(self.max_spec_tokens, state.budget)
        if limit <= 0:
            return DraftTree.empty()
        context = np.asarray(state.tokens[-self.max_tree_depth :], dtype=np.int32)
        draft = self.cache.speculate(self._request, context, max_spec_tokens=limit, **self.options)
        if not draft.token_ids:
            return DraftTree.empty()
        return DraftTree(np.asarray(draft.token_ids), np.asarray(draft.parents))

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult) -> None:
        pass  # the next propose() feeds the newly committed tokens


def create(datastore=None, **options) -> SuffixDecodingDrafter:
    if datastore is None:
        raise SpecstoreError("suffixdecoding needs a datastore (--datastore NAME[@VERSION|@TAG])")
    return SuffixDecodingDrafter(datastore, **options)
