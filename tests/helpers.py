"""Test helpers shared by the test modules: tiny random models that need no download."""

from __future__ import annotations

from pathlib import Path

import torch

from specstore.runtime.models import provision_default_model

CORPUS_DIR = Path(__file__).parent / "fixtures" / "corpus"
"""The fixture corpus: ``instruct.jsonl``, ``chat.jsonl``, ``notes.txt`` and a ``code/`` folder."""

BUILD_OPTIONS = dict(pca_dims=8, continuation_length=4, batch_tokens=256, max_doc_tokens=96, progress=False)
"""Small, fast ``build(...)`` options the pipeline and ops tests share (override per test with ``|``)."""


def default_tokenizer():
    """The embedded default model's tokenizer (provisioned by `make install`; no network)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(provision_default_model(quiet=True)))


def make_tiny_model(folder: Path, family: str = "llama", seed: int = 0, hidden: int = 32, layers: int = 2) -> Path:
    """Save a tiny randomly initialised causal LM of ``family`` (llama, gpt2, qwen2) with the
    default tokenizer into ``folder``; return the folder (loadable with ``--model folder``)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    tok = default_tokenizer()
    vocab = len(tok)
    common = dict(vocab_size=vocab, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "llama":
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, **common)
    elif family == "qwen2":
        cfg = Qwen2Config(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=4096, use_sliding_window=False, **common)
    elif family == "gpt2":
        cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=4096, **common)
    else:
        raise ValueError(f"unknown family {family}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # random init gives near-uniform logits; scale the output so greedy choices are not near-ties
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
