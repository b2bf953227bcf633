"""The "why this token" tab's work: direct logit attribution and patching (run in the
worker pool's threads)."""

from __future__ import annotations

from typing import Any

import torch

from attnlab.explain import attribute, attribution_patching, patching
from attnlab.explain.heads import _vocab_size, ablate
from attnlab.explain.model_trace import _token_texts
from attnlab.serve.fields import ApiError, ServeLimits, user_errors
from attnlab.serve.models import LoadedModel, ModelRegistry
from attnlab.serve.work import causal_model, encode_field, encode_text, top_choices

__all__ = ["MAX_PATCH_TOKENS", "attribute_work", "patch_work"]


# Patching runs one forward per layer and head (or position): a prompt pair is kept short.
MAX_PATCH_TOKENS = 256


def _check_ids(loaded: LoadedModel, ids: list[int], limits: ServeLimits) -> list[int]:
    limit, flag = limits.max_tokens, "--max-tokens"
    if loaded.context_length is not None and loaded.context_length < limit:
        limit, flag = loaded.context_length, "the model's context length"
    if len(ids) > limit:
        raise ApiError(413, f"`ids` has {len(ids):,} tokens; the limit is {limit:,} ({flag})")
    vocab = _vocab_size(loaded.model)
    bad = [i for i in ids if i >= vocab]
    if bad:
        raise ApiError(422, f"`ids` holds {bad[0]}; this model's ids are 0..{vocab - 1}")
    return ids


def _token_id(loaded: LoadedModel, value: int | str, name: str) -> int:
    """The id of a token field: an id within the vocabulary, or text of exactly one token."""
    if isinstance(value, int):
        vocab = _vocab_size(loaded.model)
        if value >= vocab:
            raise ApiError(
                422, f"`{name}` = {value} is not a token id of this model (0..{vocab - 1})"
            )
        return value
    try:
        ids = loaded.encode(value)
    except Exception as e:
        raise ApiError(422, f"`{name}` could not be tokenized: {e}"[:300]) from None
    if len(ids) != 1:
        spelled = ", ".join(repr(t) for t in _token_texts(loaded.tokenizer, ids[:8]))
        raise ApiError(
            422,
            f"`{name}` {value[:40]!r} is {len(ids)} tokens ({spelled or 'none'}); "
            "it must be exactly one token",
        )
    return int(ids[0])


def _spell(loaded: LoadedModel, token: int | None) -> dict[str, Any] | None:
    if token is None:
        return None
    return {"id": int(token), "token": _token_texts(loaded.tokenizer, [int(token)])[0]}


def _listed(value: Any) -> Any:
    return None if value is None else value.detach().float().tolist()


def attribute_work(
    registry: ModelRegistry,
    name: str,
    text: str | None,
    ids: list[int] | None,
    fields: dict[str, Any],
    limits: ServeLimits,
) -> dict[str, Any]:
    loaded = causal_model(registry, name)
    if ids is None:
        assert text is not None  # the route sends one of them
        ids = encode_text(loaded, text, limits)
    else:
        ids = _check_ids(loaded, ids, limits)
    T, position = len(ids), fields["position"]
    if not -T <= position < T:
        raise ApiError(422, f"`position` must be in {-T}..{T - 1} for {T} tokens, got {position}")
    pos = position % T
    with torch.no_grad():
        logits = ablate(loaded.model, ids, [])[0, pos]  # (V,): the model's own prediction
    target = fields["target"]
    target_id = int(logits.argmax()) if target is None else _token_id(loaded, target, "target")
    contrast = fields["contrast"]
    contrast_id = None if contrast is None else _token_id(loaded, contrast, "contrast")
    with user_errors():
        result = attribute(
            loaded.model, ids, target_id, contrast_id, pos, by_source=fields["by_source"]
        )
    return {
        "model": name,
        "ids": ids,
        "tokens": _token_texts(loaded.tokenizer, ids),
        "position": pos,
        "target": _spell(loaded, target_id),
        "contrast": _spell(loaded, contrast_id),
        "total": float(result.total),
        "logit_difference": float(result.logit_difference),
        "embedding": float(result.embedding),
        "heads": _listed(result.heads),
        "mlp": _listed(result.mlp),
        "experts": _listed(result.experts),
        "shared_experts": _listed(result.shared_experts),
        "bias": float(result.bias),
        "error": float(result.error),
        "by_source": _listed(result.by_source),
        "frozen": list(result.frozen),
        "top": top_choices(loaded, logits, fields["k"]),
    }


def patch_work(
    registry: ModelRegistry,
    name: str,
    clean: str,
    corrupted: str,
    fields: dict[str, Any],
    limits: ServeLimits,
) -> dict[str, Any]:
    loaded = causal_model(registry, name)
    clean_ids = encode_field(loaded, clean, "clean", limits)
    corrupted_ids = encode_field(loaded, corrupted, "corrupted", limits)
    if len(clean_ids) > MAX_PATCH_TOKENS:
        raise ApiError(
            413,
            f"`clean` has {len(clean_ids):,} tokens; patching runs the model once per layer "
            f"and head (or position), so it takes at most {MAX_PATCH_TOKENS} tokens",
        )
    if len(clean_ids) != len(corrupted_ids):
        raise ApiError(
            422,
            f"`clean` is {len(clean_ids)} tokens and `corrupted` is {len(corrupted_ids)}; "
            "patching needs prompts of the same token length",
        )
    target = _token_id(loaded, fields["target"], "target")
    contrast = _token_id(loaded, fields["contrast"], "contrast")
    over, method = fields["over"], fields["method"]
    with user_errors():
        if method == "attribution":
            grid = attribution_patching(loaded.model, clean_ids, corrupted_ids, target, contrast)
            m_clean, m_corrupted = (
                _metric(loaded, ids, target, contrast) for ids in (clean_ids, corrupted_ids)
            )
        else:
            run = patching(loaded.model, clean_ids, corrupted_ids, target, contrast, over=over)
            grid, m_clean, m_corrupted = run.grid, run.clean, run.corrupted
    return {
        "model": name,
        "over": over,
        "method": method,
        "tokens": _token_texts(loaded.tokenizer, clean_ids),
        "corrupted_tokens": _token_texts(loaded.tokenizer, corrupted_ids),
        "target": _spell(loaded, target),
        "contrast": _spell(loaded, contrast),
        "clean": m_clean,
        "corrupted": m_corrupted,
        "grid": _listed(grid),
    }


def _metric(loaded: LoadedModel, ids: list[int], target: int, contrast: int) -> float:
    """``logit(target) - logit(contrast)`` at the last position of the model's own run."""
    with torch.no_grad():
        logits = ablate(loaded.model, ids, [])[0, -1].double()  # (V,)
    return float(logits[target] - logits[contrast])
