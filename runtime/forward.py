"""Forward passes that return the last hidden layer, shared by the pipelines (datastore
embeddings) and the runtime (live DReSD queries), so both see the same vectors."""

from __future__ import annotations

import torch


def _plain_head(model) -> bool:
    """True when logits are exactly ``lm_head(last_hidden_state)`` (no soft-capping or scaling)."""
    cfg = model.config
    return not any(getattr(cfg, a, None) for a in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


@torch.inference_mode()
def hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Last hidden layer (after the final norm) for every position: [B, T] -> [B, T, H] in float32."""
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state.float()


def forward_with_hidden(model, logits_to_keep: int = 0, **kwargs) -> tuple[torch.Tensor, torch.Tensor, object]:
    """One forward returning ``(logits [B, T', V], last hidden [B, T, H], past cache)``.

    Runs the base model and the output head separately where that is exactly what the model's
    own forward does, so the hidden state comes free; otherwise asks for all hidden states.
    ``logits_to_keep`` > 0 computes logits for the last that many positions only (T' = it; a
    long prompt's prefill needs one row, not T x V); 0 keeps all (T' = T).
    """
    if _plain_head(model):
        out = model.base_model(**kwargs)
        hidden = out.last_hidden_state
        logits = model.get_output_embeddings()(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        return logits, hidden, _cache_of(out)
    out = model(**kwargs, output_hidden_states=True, logits_to_keep=logits_to_keep)
    return out.logits, out.hidden_states[-1], _cache_of(out)


def _cache_of(out) -> object:
    """transformers 5.x names the returned cache ``cache``; ``past_key_values`` is deprecated."""
    return out["cache"] if "cache" in out else getattr(out, "past_key_values", None)
