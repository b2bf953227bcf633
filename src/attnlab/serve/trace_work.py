"""The explainer's and the heads tab's work: a trace, the walk into one head, head roles,
ablation, the logit lens and rollout (run in the worker pool's threads)."""

from __future__ import annotations

import math
from typing import Any

from attnlab.examples import get_example
from attnlab.explain.heads import (
    INDUCTION_LENGTH,
    INDUCTION_SEED,
    ablate,
    ablation_effect,
    head_scores,
    logit_lens,
    rollout,
    top_tokens,
)
from attnlab.explain.html import page_data, walkthrough_from_renderables
from attnlab.explain.model_trace import (
    MAX_DENSE_ELEMENTS,
    _token_texts,
    attention_layers,
    auto_top_k,
    trace_from_walkthrough,
    trace_model,
)
from attnlab.explain.steps import head_steps, step_sections, step_summary
from attnlab.explain.text import walkthrough_renderables
from attnlab.explain.trace import trace_example
from attnlab.serve.fields import ApiError, ServeLimits, user_errors
from attnlab.serve.models import LoadedModel, ModelRegistry
from attnlab.serve.work import causal_model, encode_text, load_model, top_choices

__all__ = ["ablate_work", "heads_work", "lens_work", "rollout_work", "step_work", "trace_work"]


def trace_work(
    registry: ModelRegistry, name: str, text: str, lang: str, top_k: int | None, limits: ServeLimits
) -> dict[str, Any]:
    loaded = load_model(registry, name)
    if loaded.example is not None:
        ex = trace_example(loaded.example)
        walk = walkthrough_from_renderables(walkthrough_renderables(ex, lang))
        data = page_data(trace_from_walkthrough(ex), walk, lang=lang)
        return {
            "model": name,
            "source": data["source"],
            "attention": data["attention"],
            "walkthrough": data["walkthrough"],
            "example": True,
        }
    ids = encode_text(loaded, text, limits)
    with user_errors():
        k = auto_top_k(loaded.model, len(ids), top_k)
        trace = trace_model(
            loaded.model, ids, tokenizer=loaded.tokenizer, top_k=k, source=loaded.source
        )
        data = page_data(trace, None, lang=lang)
    return {
        "model": name,
        "source": data["source"],
        "attention": data["attention"],
        "walkthrough": None,
        "example": False,
        "token_ids": ids,
    }


def step_work(
    registry: ModelRegistry,
    name: str,
    text: str,
    layer: int,
    head: int,
    token: int,
    lang: str,
    limits: ServeLimits,
) -> dict[str, Any]:
    loaded = load_model(registry, name)
    if loaded.example is not None:
        n = len(get_example(loaded.example).tokens)
        if not 0 <= token < n:
            raise ApiError(422, f"`token` must be in 0..{n - 1} for this example, got {token}")
        ex = trace_example(loaded.example, index=token)
        walk = walkthrough_from_renderables(walkthrough_renderables(ex, lang))
        steps = page_data(None, walk, lang=lang)["walkthrough"]["steps"]
        return {
            "model": name,
            "kind": "walkthrough",
            "summary": walk.intro,
            "sections": steps,
            "weights": ex.trainable_token.weights.tolist(),
        }
    ids = encode_text(loaded, text, limits)
    with user_errors():
        walk_ = head_steps(
            loaded.model,
            ids,
            layer=layer,
            head=head,
            token=token,
            tokenizer=loaded.tokenizer,
            source=loaded.source,
        )
    return {
        "model": name,
        "kind": "head",
        "summary": step_summary(walk_, lang),
        "sections": step_sections(walk_, lang),
        "weights": walk_.weights.tolist(),
        "layer": layer,
        "head": head,
        "token": token,
        "checks": walk_.checks,
    }


def heads_work(
    registry: ModelRegistry, name: str, text: str, limits: ServeLimits
) -> dict[str, Any]:
    loaded = causal_model(registry, name)
    ids = encode_text(loaded, text, limits) if text.strip() else None
    if ids is not None:
        _check_dense(loaded, ids, "head scoring")
    with user_errors():
        scores = head_scores(loaded.model, ids)
    L, H = next(iter(scores.values())).shape
    about = f"{INDUCTION_LENGTH} random tokens (seed {INDUCTION_SEED}) repeated twice"
    if ids is not None:
        about = f"{len(ids)} tokens of the text"
    return {
        "model": name,
        "layers": int(L),
        "heads": int(H),
        "input": about,
        "roles": list(scores),
        "scores": {r: v.tolist() for r, v in scores.items()},
    }


def ablate_work(
    registry: ModelRegistry,
    name: str,
    text: str,
    heads: list[tuple[int, int]],
    mode: str,
    k: int,
    limits: ServeLimits,
) -> dict[str, Any]:
    loaded = causal_model(registry, name)
    ids = encode_text(loaded, text, limits)
    with user_errors():
        after = ablate(loaded.model, ids, heads, mode=mode)  # type: ignore[arg-type]
    before = ablate(loaded.model, ids, [])
    effect = ablation_effect(before, after, k)
    return {
        "model": name,
        "heads": [list(h) for h in heads],
        "mode": mode,
        "tokens": _token_texts(loaded.tokenizer, ids),
        "position": len(ids) - 1,
        "before": top_choices(loaded, before[0, -1], k),
        "after": top_choices(loaded, after[0, -1], k),
        "kl": effect.kl[0].tolist(),
    }


def lens_work(
    registry: ModelRegistry, name: str, text: str, k: int, limits: ServeLimits
) -> dict[str, Any]:
    loaded = causal_model(registry, name)
    ids = encode_text(loaded, text, limits)
    with user_errors():
        lens = logit_lens(loaded.model, ids)  # (L, 1, T, V)
    probs, top = top_tokens(lens[:, 0], k)  # (L, T, k)
    flat = sorted(set(top.flatten().tolist()))
    spelled = dict(zip(flat, _token_texts(loaded.tokenizer, flat), strict=True))
    return {
        "model": name,
        "tokens": _token_texts(loaded.tokenizer, ids),
        "layers": int(lens.shape[0]),
        "top": [
            [
                [
                    {"id": int(i), "token": spelled[int(i)], "p": float(p)}
                    for i, p in zip(top[l_, t].tolist(), probs[l_, t].tolist(), strict=True)
                ]
                for t in range(top.shape[1])
            ]
            for l_ in range(top.shape[0])
        ],
    }


def _check_dense(loaded: LoadedModel, ids: list[int], what: str) -> None:
    """Refuse (413, naming ``text``) a text too long for every layer's full (T, T) weights.

    Checked here because trace_model's own refusal suggests ``top_k``, which the endpoints
    that need dense weights (head scores, rollout) do not have.
    """
    layers = attention_layers(loaded.model)
    L, H = len(layers), int(layers[0].num_heads)
    most = math.isqrt(MAX_DENSE_ELEMENTS // (L * H))
    if len(ids) > most:
        raise ApiError(
            413,
            f"`text` has {len(ids):,} tokens; {what} keeps all {L} layers x {H} heads of "
            f"T x T attention weights, so for this model it takes at most {most:,} tokens; "
            "send a shorter text",
        )


def rollout_work(
    registry: ModelRegistry, name: str, text: str, residual: float, limits: ServeLimits
) -> dict[str, Any]:
    loaded = causal_model(registry, name)
    ids = encode_text(loaded, text, limits)
    _check_dense(loaded, ids, "rollout")
    with user_errors():
        trace = trace_model(loaded.model, ids, tokenizer=loaded.tokenizer)
    assert trace.weights is not None
    return {
        "model": name,
        "tokens": list(trace.tokens),
        "residual": residual,
        "rollout": rollout(trace.weights, residual).tolist(),
    }
