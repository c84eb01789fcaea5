"""Helpers for the decoding tests: cached tiny models per family, random prompts, and an oracle
drafter that proposes trees with partly correct tokens (deep acceptance, branching tries)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import torch

from specstore.runtime.tree import DraftTree
from tests.helpers import make_tiny_model

FAMILIES = ("llama", "gpt2", "qwen2")
_ROOT = Path(tempfile.mkdtemp(prefix="specstore-tiny-"))


@functools.cache
def tiny_lm(family: str = "llama", attn: str = "sdpa", **config_overrides):
    """(model, tokenizer) in memory: a tiny random ``family`` model in float32, built once per process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _ROOT / family
    if not (folder / "config.json").is_file():
        make_tiny_model(folder, family)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn, **config_overrides)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def random_prompt(rng: np.random.Generator, vocab: int, length: int, repeat: bool = True) -> list[int]:
    """Random ids; with ``repeat`` some spans recur so that prompt lookup finds matches."""
    ids = rng.integers(3, vocab, size=length).tolist()
    if repeat and length >= 8:
        start = int(rng.integers(0, length - 4))
        ids += ids[start : start + int(rng.integers(2, 6))]
    return ids


class OracleDrafter:
    """Knows the reference continuation; proposes a trie of ``num_paths`` paths where each path
    follows the reference for a random number of tokens, then goes astray. The correct path is
    not always first, so acceptance must walk the trie and the cache be re-indexed."""

    name = "oracle"
    lossless = True

    def __init__(self, reference: list[int], vocab: int, seed: int = 0, num_paths: int = 3, depth: int = 6):
        self.reference, self.vocab, self.rng = reference, vocab, np.random.default_rng(seed)
        self.num_paths, self.depth = num_paths, depth
        self.num_prompt = 0

    def reset(self, prompt_ids):
        self.num_prompt = len(prompt_ids)

    def propose(self, state):
        done = len(state.tokens) - self.num_prompt
        truth = self.reference[done : done + min(self.depth, state.budget)]
        paths = []
        for _ in range(self.num_paths):
            keep = int(self.rng.integers(0, len(truth) + 1))
            wrong = self.rng.integers(3, self.vocab, size=int(self.rng.integers(0, 3))).tolist()
            paths.append(truth[:keep] + wrong)
        self.rng.shuffle(paths)
        return DraftTree.from_paths([p for p in paths if p])

    def observe(self, state, tree, result):
        pass


def alternate_steps(verifier, prompt: list[int], tree: DraftTree, steps: int = 10) -> tuple[torch.Tensor, list[int]]:
    """Prefill ``prompt``, then ``steps`` verifications alternating plain steps and ``tree``:
    the float32 logits of each step's last accepted row [steps, V] and every committed token."""
    pending = verifier.prefill(prompt).bonus
    logits, tokens = [], []
    for i in range(steps):
        row = verifier.step(pending, tree if i % 2 else DraftTree.empty())
        logits.append(row.logits.float())
        tokens += row.result.accepted_tokens + [row.result.bonus]
        pending = row.result.bonus
    return torch.stack(logits), tokens
