"""The public Python API: ``generate`` for a prompt or chat messages, and ``custom_generate`` for
transformers users (``model.generate(..., custom_generate=custom_generate)``).

Owns prompt preparation (a string is one user message through the chat template, when the
tokenizer has one), EOS ids, seeding, and incremental detokenisation for streaming. ``generate``
is an engine (engine.py) over the given model serving one request; the loop itself is decode.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from specstore.runtime.decode import DecodeStats, decode
from specstore.runtime.drafters.base import Drafter
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.sampling import Sampling


@dataclass(slots=True)
class GenerateResult:
    text: str
    token_ids: list[int]  # generated ids only
    stats: DecodeStats
    stop_reason: str  # "eos" | "length" | "context"
    prompt_ids: list[int]

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict(), "stop_reason": self.stop_reason}


def prompt_ids(tokenizer, prompt_or_messages: str | Sequence) -> list[int]:
    """Token ids for a string (sent as one user message), a list of chat messages
    (``{"role", "content"}`` dicts), or a list of token ids (used as given)."""
    item = prompt_or_messages
    if isinstance(item, Sequence) and not isinstance(item, str) and all(isinstance(t, Integral) for t in item):
        return list(item)
    messages = [{"role": "user", "content": item}] if isinstance(item, str) else list(item)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if not isinstance(item, str):
        raise TypeError("chat messages need a tokenizer with a chat template; pass a string instead")
    return tokenizer(item)["input_ids"]


def eos_ids(model, tokenizer=None) -> set[int]:
    """The tokens that end generation: the model's generation config and the tokenizer's EOS."""
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    for source in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else [int(t) for t in source])
    return ids


class TextStream:
    """Turns committed ids into new text for a callback; holds back an incomplete UTF-8 tail."""

    def __init__(self, tokenizer, callback: Callable[[str], None]):
        self.tokenizer, self.callback = tokenizer, callback
        self.ids: list[int] = []
        self.emitted = ""

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return  # wait for the rest of a multi-byte character
        if len(text) > len(self.emitted):
            self.callback(text[len(self.emitted) :])
            self.emitted = text

    def flush(self, final_text: str) -> None:
        if final_text.startswith(self.emitted) and len(final_text) > len(self.emitted):
            self.callback(final_text[len(self.emitted) :])
            self.emitted = final_text


def _drafter(drafter: Drafter | str | None) -> Drafter:
    if drafter is None:
        return make_drafter("ar")
    return make_drafter(drafter) if isinstance(drafter, str) else drafter


def generate(
    model,
    tokenizer,
    prompt_or_messages: str | Sequence,
    drafter: Drafter | str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stream: Callable[[str], None] | None = None,
) -> GenerateResult:
    """Decode with ``drafter`` (a Drafter, a registered method name, or None for ``ar``).

    ``temperature`` 0 is greedy; otherwise sampling (with ``top_p``) is lossless: the output
    distribution is that of plain sampling. ``stream`` receives newly committed text.
    """
    from specstore.runtime.engine import Engine  # engine.py builds on this module's helpers

    served = Engine.for_model(model, tokenizer).generate(
        prompt_or_messages, drafter=_drafter(drafter), max_new_tokens=max_new_tokens, temperature=temperature,
        top_p=top_p, seed=seed, stream=stream)
    return GenerateResult(served.text, served.token_ids, served.stats, served.stop_reason, served.prompt_ids)


def custom_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    drafter: Drafter | str | None = None,
    **model_kwargs,
) -> torch.LongTensor:
    """``model.generate(input_ids, custom_generate=custom_generate, drafter="pld", max_new_tokens=N)``.

    transformers (5.24) calls this after its input preparation, passing extra keyword arguments
    named in this signature (``drafter``) through. Reads ``max_new_tokens``, ``do_sample``,
    ``temperature``, ``top_p`` and ``eos_token_id`` from the generation config; other logits
    processors and stopping criteria are not applied (a lossless drafter must not change the
    distribution). Batch size 1, no padding. Returns [1, prompt + generated] like ``generate``.
    """
    if input_ids.shape[0] != 1:
        raise ValueError(f"specstore decodes one sequence at a time, got a batch of {input_ids.shape[0]}")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("padded inputs are not supported: pass one unpadded sequence")
    config = generation_config or model.generation_config
    max_new = config.max_new_tokens
    if max_new is None:
        max_new = max(0, int(config.max_length) - input_ids.shape[1])
    # torch.manual_seed governs sampling here, as in transformers own generate
    sampling = Sampling(config.temperature or 1.0, config.top_p or 1.0) if config.do_sample else Sampling()
    eos = config.eos_token_id
    eos_set = set() if eos is None else {int(eos)} if isinstance(eos, int) else {int(t) for t in eos}
    out = decode(model, input_ids[0].tolist(), _drafter(drafter), int(max_new), sampling, eos_set)
    new = torch.tensor([out.token_ids], dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, new], dim=-1)
