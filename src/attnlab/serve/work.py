"""The steps every model request's work shares (it runs in the worker pool's threads):
the model loaded, the text encoded within the limits, a causal model required, the top
next tokens spelled."""

from __future__ import annotations

from typing import Any

from attnlab.explain.heads import top_tokens
from attnlab.explain.model_trace import _token_texts
from attnlab.serve.fields import ApiError, ServeLimits
from attnlab.serve.models import LoadedModel, ModelRegistry

__all__ = ["causal_model", "encode_field", "encode_text", "load_model", "top_choices"]


def load_model(registry: ModelRegistry, name: str) -> LoadedModel:
    try:
        return registry.get(name)
    except RuntimeError as e:
        raise ApiError(500, str(e)) from None


def encode_text(loaded: LoadedModel, text: str, limits: ServeLimits) -> list[int]:
    try:
        ids = loaded.encode(text)
    except Exception as e:  # a tokenizer refusing odd text is the text's problem
        raise ApiError(422, f"`text` could not be tokenized: {e}"[:300]) from None
    limit, flag = limits.max_tokens, "--max-tokens"
    if loaded.context_length is not None and loaded.context_length < limit:
        limit, flag = loaded.context_length, "the model's context length"
    if len(ids) > limit:
        raise ApiError(413, f"`text` has {len(ids):,} tokens; the limit is {limit:,} ({flag})")
    if not ids:
        raise ApiError(422, "`text` gave no tokens")
    return ids


def encode_field(loaded: LoadedModel, text: str, name: str, limits: ServeLimits) -> list[int]:
    """``encode_text`` for a text field other than ``text``: its errors name the field."""
    try:
        return encode_text(loaded, text, limits)
    except ApiError as e:
        raise ApiError(e.status, e.message.replace("`text`", f"`{name}`")) from None


def causal_model(registry: ModelRegistry, name: str) -> LoadedModel:
    loaded = load_model(registry, name)
    if loaded.example is not None or not loaded.causal:
        raise ApiError(
            422,
            f"model {name!r} is not a causal language model: head roles, ablation, the "
            "logit lens, rollout, attribution and patching need one",
        )
    return loaded


def top_choices(loaded: LoadedModel, logits: Any, k: int) -> list[dict[str, Any]]:
    """The ``k`` most likely next tokens of one row of logits ``(V,)``."""
    probs, ids = top_tokens(logits, k)
    spelled = _token_texts(loaded.tokenizer, ids.tolist())
    return [
        {"id": int(i), "token": t, "p": float(p)}
        for i, t, p in zip(ids.tolist(), spelled, probs.tolist(), strict=True)
    ]
