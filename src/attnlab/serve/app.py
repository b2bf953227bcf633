"""The ASGI app of ``attnlab serve`` (Starlette): the page and a small JSON API.

Routes:

- ``GET /``: the explainer page (its CSS and JS inlined, a Content-Security-Policy that
  allows no request beyond this server).
- ``GET /api/models``: the models, their load state, and the limits.
- ``POST /api/trace``: ``{"model", "text", "lang"?, "top_k"?}`` -> the page's attention
  data (the same format the static page embeds) for every layer and head.
- ``POST /api/step``: ``{"model", "text", "layer", "head", "token", "lang"?}`` -> the walk
  into one head for one query token (:mod:`attnlab.explain.steps`).
- ``POST /api/heads``: ``{"model", "text"?}`` -> every head's role scores
  (:func:`attnlab.explain.head_scores`): on the text, or without one on 32 random tokens
  (seed 0) repeated twice.
- ``POST /api/ablate``: ``{"model", "text", "heads": [[layer, head], ...], "mode"?, "k"?}``
  -> the next-token distribution at the last position with and without those heads, the
  KL divergence per position.
- ``POST /api/lens``: ``{"model", "text", "k"?}`` -> the logit lens: the top tokens after
  every block at every position.
- ``POST /api/rollout``: ``{"model", "text", "residual"?}`` -> attention rollout ``(T, T)``.
- ``POST /api/attribute``: ``{"model", "text" | "ids", "target"?, "contrast"?, "position"?,
  "by_source"?, "k"?}`` -> direct logit attribution (:func:`attnlab.explain.attribute`):
  every head's, MLP's and constant part of ``logit(target) - logit(contrast)``, and the
  top tokens at that position (for a contrast picker).
- ``POST /api/patch``: ``{"model", "clean", "corrupted", "target", "contrast", "over"?,
  "method"?}`` -> the activation-patching grid (:func:`attnlab.explain.patch`) or its
  first-order estimate (:func:`attnlab.explain.attribution_patching`).
- ``POST /api/generate``: ``{"model", "text", "max_new_tokens"?, "temperature"?,
  "top_k"?, "top_p"?, "seed"?, "layer"?, "head"?}`` -> server-sent events: the prompt's
  token ids, then one per token (the next-token distribution, the text, the attention of
  the query that predicted it), then ``done``.

Every error is JSON ``{"error": "..."}``: 400 bad JSON, 404 unknown model, 413 a limit
exceeded (the message names the limit and its flag), 422 a wrong field, 429 the work
queue is full, 500 a failure inside (the server keeps serving). Model work runs in a
bounded :class:`~attnlab.serve.pool.WorkerPool`, never on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from attnlab.serve.models import LoadedModel, ModelRegistry, UnknownModelError
from attnlab.serve.pool import BusyError, WorkerPool

__all__ = ["ApiError", "ServeLimits", "create_app"]


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for (each has a ``attnlab serve`` flag).

    Attributes:
        max_chars: characters of text (``--max-chars``).
        max_tokens: tokens of text (``--max-tokens``; also the model's context).
        max_new_tokens: tokens one generation may produce (``--max-new-tokens``).
        max_top_k: ``top_k`` of a trace or of sampling (``--max-top-k``).
    """

    max_chars: int = 20_000
    max_tokens: int = 1024
    max_new_tokens: int = 256
    max_top_k: int = 100

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")

    @property
    def max_body(self) -> int:
        """Bytes of a request body: the text at 4 UTF-8 bytes a character, plus fields."""
        return self.max_chars * 6 + 4096  # JSON may escape a character as \\uXXXX


FLAGS = {
    "max_chars": "--max-chars",
    "max_tokens": "--max-tokens",
    "max_new_tokens": "--max-new-tokens",
    "max_top_k": "--max-top-k",
}


class ApiError(Exception):
    """An error answered as ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


# ------------------------------------------------------------------ request fields


async def _read_json(request: Request, limits: ServeLimits) -> dict[str, Any]:
    """The JSON object of the body, read at most ``limits.max_body`` bytes far."""
    cap = limits.max_body
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise ApiError(
            413,
            f"request body of {int(declared):,} bytes exceeds {cap:,} bytes "
            f"(--max-chars {limits.max_chars:,})",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise ApiError(
                413, f"request body exceeds {cap:,} bytes (--max-chars {limits.max_chars:,})"
            )
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"the body must be a JSON object (UTF-8): {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _int(
    body: dict[str, Any],
    name: str,
    default: int | None,
    low: int,
    high: int | None,
    limit: str | None = None,
) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(422, f"`{name}` must be an integer, got {type(value).__name__}")
    if value < low:
        raise ApiError(422, f"`{name}` must be >= {low}, got {value}")
    if high is not None and value > high:
        if limit is not None:
            raise ApiError(413, f"`{name}` = {value} exceeds the limit {high} ({FLAGS[limit]})")
        raise ApiError(422, f"`{name}` must be <= {high}, got {value}")
    return value


def _float(
    body: dict[str, Any],
    name: str,
    default: float | None,
    low: float,
    high: float,
    low_open: bool = False,
) -> float | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(422, f"`{name}` must be a finite number, got {value!r}"[:200])
    if value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ApiError(422, f"`{name}` must be in {bound}, got {value}")
    return float(value)


def _text(body: dict[str, Any], limits: ServeLimits, *, required: bool = True) -> str:
    text = body.get("text", "" if not required else None)
    if not isinstance(text, str):
        raise ApiError(422, f"`text` must be a string, got {type(text).__name__}")
    if len(text) > limits.max_chars:
        raise ApiError(
            413,
            f"`text` has {len(text):,} characters; the limit is {limits.max_chars:,} (--max-chars)",
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            422,
            "`text` contains an unpaired surrogate (invalid Unicode); "
            "send valid UTF-16 pairs or UTF-8",
        ) from None
    if required and not text.strip():
        raise ApiError(422, "`text` must not be empty")
    return text


def _lang(body: dict[str, Any]) -> str:
    from attnlab.explain.i18n import LANGS, normalize_lang

    lang = body.get("lang", "en")
    try:
        return normalize_lang(lang)
    except (TypeError, ValueError):
        raise ApiError(422, f"`lang` must be one of {', '.join(LANGS)}") from None


def _model_name(body: dict[str, Any], registry: ModelRegistry) -> str:
    name = body.get("model")
    if not isinstance(name, str):
        raise ApiError(
            422,
            f"`model` must be a string (a name from GET /api/models), got {type(name).__name__}",
        )
    try:
        registry.spec(name)
    except UnknownModelError as e:
        raise ApiError(404, str(e)) from None
    return name


# ------------------------------------------------------------------- the work (threads)


def _load(registry: ModelRegistry, name: str) -> LoadedModel:
    try:
        return registry.get(name)
    except RuntimeError as e:
        raise ApiError(500, str(e)) from None


def _encode(loaded: LoadedModel, text: str, limits: ServeLimits) -> list[int]:
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


def _trace_work(
    registry: ModelRegistry, name: str, text: str, lang: str, top_k: int | None, limits: ServeLimits
) -> dict[str, Any]:
    from attnlab.explain.html import page_data

    loaded = _load(registry, name)
    if loaded.example is not None:
        from attnlab.explain.html import walkthrough_from_renderables
        from attnlab.explain.model_trace import trace_from_walkthrough
        from attnlab.explain.text import walkthrough_renderables
        from attnlab.explain.trace import trace_example

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
    from attnlab.explain.model_trace import auto_top_k, trace_model

    ids = _encode(loaded, text, limits)
    with _user_errors():
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


def _step_work(
    registry: ModelRegistry,
    name: str,
    text: str,
    layer: int,
    head: int,
    token: int,
    lang: str,
    limits: ServeLimits,
) -> dict[str, Any]:
    loaded = _load(registry, name)
    if loaded.example is not None:
        from attnlab.examples import get_example
        from attnlab.explain.html import page_data, walkthrough_from_renderables
        from attnlab.explain.text import walkthrough_renderables
        from attnlab.explain.trace import trace_example

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
    from attnlab.explain.steps import head_steps, step_sections, step_summary

    ids = _encode(loaded, text, limits)
    with _user_errors():
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


def _causal_model(registry: ModelRegistry, name: str) -> LoadedModel:
    loaded = _load(registry, name)
    if loaded.example is not None or not loaded.causal:
        raise ApiError(
            422,
            f"model {name!r} is not a causal language model: head roles, ablation, the "
            "logit lens, rollout, attribution and patching need one",
        )
    return loaded


def _tops(loaded: LoadedModel, logits: Any, k: int) -> list[dict[str, Any]]:
    """The ``k`` most likely next tokens of one row of logits ``(V,)``."""
    from attnlab.explain.heads import top_tokens
    from attnlab.explain.model_trace import _token_texts

    probs, ids = top_tokens(logits, k)
    spelled = _token_texts(loaded.tokenizer, ids.tolist())
    return [
        {"id": int(i), "token": t, "p": float(p)}
        for i, t, p in zip(ids.tolist(), spelled, probs.tolist(), strict=True)
    ]


def _heads_work(
    registry: ModelRegistry, name: str, text: str, limits: ServeLimits
) -> dict[str, Any]:
    from attnlab.explain.heads import INDUCTION_LENGTH, INDUCTION_SEED, head_scores

    loaded = _causal_model(registry, name)
    ids = _encode(loaded, text, limits) if text.strip() else None
    if ids is not None:
        _check_dense(loaded, ids, "head scoring")
    with _user_errors():
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


def _ablate_work(
    registry: ModelRegistry,
    name: str,
    text: str,
    heads: list[tuple[int, int]],
    mode: str,
    k: int,
    limits: ServeLimits,
) -> dict[str, Any]:
    from attnlab.explain.heads import ablate, ablation_effect
    from attnlab.explain.model_trace import _token_texts

    loaded = _causal_model(registry, name)
    ids = _encode(loaded, text, limits)
    with _user_errors():
        after = ablate(loaded.model, ids, heads, mode=mode)  # type: ignore[arg-type]
    before = ablate(loaded.model, ids, [])
    effect = ablation_effect(before, after, k)
    return {
        "model": name,
        "heads": [list(h) for h in heads],
        "mode": mode,
        "tokens": _token_texts(loaded.tokenizer, ids),
        "position": len(ids) - 1,
        "before": _tops(loaded, before[0, -1], k),
        "after": _tops(loaded, after[0, -1], k),
        "kl": effect.kl[0].tolist(),
    }


def _lens_work(
    registry: ModelRegistry, name: str, text: str, k: int, limits: ServeLimits
) -> dict[str, Any]:
    from attnlab.explain.heads import logit_lens, top_tokens
    from attnlab.explain.model_trace import _token_texts

    loaded = _causal_model(registry, name)
    ids = _encode(loaded, text, limits)
    with _user_errors():
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
    from attnlab.explain.model_trace import MAX_DENSE_ELEMENTS, attention_layers

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


def _rollout_work(
    registry: ModelRegistry, name: str, text: str, residual: float, limits: ServeLimits
) -> dict[str, Any]:
    from attnlab.explain.heads import rollout
    from attnlab.explain.model_trace import trace_model

    loaded = _causal_model(registry, name)
    ids = _encode(loaded, text, limits)
    _check_dense(loaded, ids, "rollout")
    with _user_errors():
        trace = trace_model(loaded.model, ids, tokenizer=loaded.tokenizer)
    assert trace.weights is not None
    return {
        "model": name,
        "tokens": list(trace.tokens),
        "residual": residual,
        "rollout": rollout(trace.weights, residual).tolist(),
    }


def _head_pairs(body: dict[str, Any]) -> list[tuple[int, int]]:
    raw = body.get("heads")
    if not isinstance(raw, list) or len(raw) > 4096:
        raise ApiError(422, "`heads` must be a list of [layer, head] pairs (at most 4096)")
    pairs = []
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item)
        ):
            raise ApiError(
                422,
                f"`heads` must hold [layer, head] pairs of ints >= 0, got {json.dumps(item)[:60]}",
            )
        pairs.append((item[0], item[1]))
    return pairs


# ------------------------------------------------------------------ why this token

MAX_TOKEN_CHARS = 200  # a target/contrast given as text: one token is never longer
# Patching runs one forward per layer and head (or position): a prompt pair is kept short.
MAX_PATCH_TOKENS = 256


def _token_field(body: dict[str, Any], name: str) -> int | str | None:
    """A token given as an id (int >= 0) or as text that must be exactly one token."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ApiError(
            422, f"`{name}` must be a token id or the text of one token, got {type(value).__name__}"
        )
    if isinstance(value, int) and value < 0:
        raise ApiError(422, f"`{name}` must be a token id >= 0, got {value}")
    if isinstance(value, str) and not 0 < len(value) <= MAX_TOKEN_CHARS:
        raise ApiError(422, f"`{name}` must be the text of one token (1..{MAX_TOKEN_CHARS} chars)")
    return value


def _ids_field(body: dict[str, Any], limits: ServeLimits) -> list[int] | None:
    """Token ids sent instead of text (e.g. a prompt and the tokens generated after it)."""
    raw = body.get("ids")
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise ApiError(422, "`ids` must be a non-empty list of token ids")
    if len(raw) > limits.max_tokens:
        raise ApiError(
            413, f"`ids` has {len(raw):,} tokens; the limit is {limits.max_tokens:,} (--max-tokens)"
        )
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in raw):
        raise ApiError(422, "`ids` must hold token ids (ints >= 0)")
    return list(raw)


def _check_ids(loaded: LoadedModel, ids: list[int], limits: ServeLimits) -> list[int]:
    from attnlab.explain.heads import _vocab_size

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
    from attnlab.explain.heads import _vocab_size
    from attnlab.explain.model_trace import _token_texts

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
    from attnlab.explain.model_trace import _token_texts

    if token is None:
        return None
    return {"id": int(token), "token": _token_texts(loaded.tokenizer, [int(token)])[0]}


def _listed(value: Any) -> Any:
    return None if value is None else value.detach().float().tolist()


def _attribute_work(
    registry: ModelRegistry,
    name: str,
    text: str | None,
    ids: list[int] | None,
    fields: dict[str, Any],
    limits: ServeLimits,
) -> dict[str, Any]:
    import torch

    from attnlab.explain import attribute
    from attnlab.explain.heads import ablate
    from attnlab.explain.model_trace import _token_texts

    loaded = _causal_model(registry, name)
    if ids is None:
        assert text is not None  # the route sends one of them
        ids = _encode(loaded, text, limits)
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
    with _user_errors():
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
        "top": _tops(loaded, logits, fields["k"]),
    }


def _patch_work(
    registry: ModelRegistry,
    name: str,
    clean: str,
    corrupted: str,
    fields: dict[str, Any],
    limits: ServeLimits,
) -> dict[str, Any]:
    from attnlab.explain import attribution_patching, patching
    from attnlab.explain.model_trace import _token_texts

    loaded = _causal_model(registry, name)
    clean_ids = _encode_field(loaded, clean, "clean", limits)
    corrupted_ids = _encode_field(loaded, corrupted, "corrupted", limits)
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
    with _user_errors():
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
    import torch

    from attnlab.explain.heads import ablate

    with torch.no_grad():
        logits = ablate(loaded.model, ids, [])[0, -1].double()  # (V,)
    return float(logits[target] - logits[contrast])


def _encode_field(loaded: LoadedModel, text: str, name: str, limits: ServeLimits) -> list[int]:
    """``_encode`` for a text field other than ``text``: its errors name the field."""
    try:
        return _encode(loaded, text, limits)
    except ApiError as e:
        raise ApiError(e.status, e.message.replace("`text`", f"`{name}`")) from None


def _text_field(body: dict[str, Any], name: str, limits: ServeLimits) -> str:
    """A required text field other than ``text``, bounded as ``text`` is."""
    try:
        return _text({"text": body.get(name)}, limits)
    except ApiError as e:
        raise ApiError(e.status, e.message.replace("`text`", f"`{name}`")) from None


@contextmanager
def _user_errors() -> Iterator[None]:
    """Library ValueError/TypeError (checked arguments) -> 422."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise ApiError(422, str(e)[:500]) from e


def _generate_work(
    registry: ModelRegistry,
    name: str,
    text: str,
    params: dict[str, Any],
    limits: ServeLimits,
    emit: Any,
    cancel: threading.Event,
) -> None:
    import torch

    from attnlab.attention import record_attention
    from attnlab.backends import WeightsRequest
    from attnlab.explain.model_trace import _token_texts, attention_layers
    from attnlab.generation import TextStream, generate_stream

    loaded = _load(registry, name)
    if not loaded.causal:
        raise ApiError(422, f"model {name!r} cannot generate (not a causal language model)")
    ids = _encode(loaded, text, limits)
    blocks = attention_layers(loaded.model)
    layer, head = params["layer"], params["head"]
    if not 0 <= layer < len(blocks) or not 0 <= head < int(blocks[layer].num_heads):
        raise ApiError(
            422,
            f"`layer`/`head` must be in 0..{len(blocks) - 1} / "
            f"0..{int(blocks[0].num_heads) - 1}, got {layer}/{head}",
        )
    block = blocks[layer]
    rows: list[list[float]] = []

    class LastRow:
        def request(self, layer_: Any) -> Any:
            return WeightsRequest(heads=(head,), rows=(-1,)) if layer_ is block else None

        def record(self, call: Any) -> None:
            rows.append(call.weights[0, 0, 0].float().cpu().tolist())

    last: list[torch.Tensor] = []  # this step's next-token logits (V,), for the bars

    def keep_logits(logits: torch.Tensor) -> None:
        last[:] = [logits[0].float().clone()]

    stream = TextStream(loaded.tokenizer, ids[-1:])
    temperature, top_k, top_p = params["temperature"], params["top_k"], params["top_p"]
    gen = torch.Generator().manual_seed(params["seed"])
    reason = "length"
    all_ids = list(ids)
    emit("prompt", {"ids": list(ids)})  # what a generated token's attribution runs on
    with torch.no_grad(), record_attention(LastRow()), _user_errors():
        for i, nxt in enumerate(
            generate_stream(
                loaded.model,
                torch.tensor([ids]),
                params["max_new_tokens"],
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_id=loaded.eos_id,
                generator=gen,
                on_logits=keep_logits,
            )
        ):
            token = int(nxt[0, 0])
            logits = last[0] / (temperature if temperature > 0 else 1.0)
            probs = torch.softmax(logits, dim=-1)
            p, idx = torch.topk(probs, min(params["bars"], probs.shape[-1]))
            spelled = _token_texts(loaded.tokenizer, idx.tolist())
            query_pos = len(all_ids) - 1  # the query whose attention predicted this token
            all_ids.append(token)
            eos = loaded.eos_id is not None and token == loaded.eos_id
            emit(
                "token",
                {
                    "index": i,
                    "id": token,
                    "text": "" if eos else stream.push(token),
                    "token": _token_texts(loaded.tokenizer, [token])[0],
                    "p": float(probs[token]),
                    "top": [
                        {"id": int(j), "token": t, "p": float(q)}
                        for j, q, t in zip(idx.tolist(), p.tolist(), spelled, strict=True)
                    ],
                    "attention": {
                        "layer": layer,
                        "head": head,
                        "query": query_pos,
                        "weights": rows[-1] if rows else None,
                    },
                },
            )
            if eos:
                reason = "eos"
                break
            if cancel.is_set():
                reason = "cancelled"
                break
    emit("done", {"reason": reason, "text": stream.flush(), "tokens": len(all_ids) - len(ids)})


# ------------------------------------------------------------------------- the page


def _asset(package: str, name: str) -> str:
    return resources.files(package).joinpath(name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


def render_page(lang: str = "en") -> tuple[str, str]:
    """The server's page and its Content-Security-Policy."""
    from html import escape

    from attnlab.explain.fonts import cjk_font_file
    from attnlab.explain.html import STRINGS

    css = _asset("attnlab.explain", "page.css") + _asset("attnlab.serve", "serve.css")
    if lang != "en" and cjk_font_file() is not None:
        # The zh-tw extra's Noto Sans TC, from this server: Chinese shows on machines
        # without a CJK system font.
        css += (
            '\n@font-face { font-family: "attnlab CJK"; src: url("/font/cjk.otf") '
            'format("opentype"); }\n:root { font-family: system-ui, -apple-system, '
            '"Segoe UI", "Noto Sans", "Noto Sans CJK TC", "attnlab CJK", sans-serif; }\n'
        )
    page_js = _asset("attnlab.explain", "page.js")
    serve_js = _asset("attnlab.serve", "serve.js")
    for text in (css, page_js, serve_js):
        if "</" in text:  # pragma: no cover - guards the package files
            raise RuntimeError("page assets must not contain '</'")
    csp = (
        "default-src 'none'; "
        f"script-src 'sha256-{_sha256(page_js)}' 'sha256-{_sha256(serve_js)}'; "
        f"style-src 'sha256-{_sha256(css)}'; "
        "connect-src 'self'; img-src data:; font-src 'self'; base-uri 'none'; "
        "form-action 'none'; "
        "frame-ancestors 'none'"
    )
    strings = json.dumps({"lang": lang, "strings": STRINGS[lang]}, ensure_ascii=True)
    strings = strings.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    page = (
        "<!DOCTYPE html>\n"
        f'<html lang="{lang}">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<link rel="icon" href="data:,">\n'
        f"<title>{escape(STRINGS[lang]['title'])}</title>\n"
        f"<style>{css}</style>\n</head>\n<body>\n"
        '<header><h1 id="title"></h1><p class="sub" id="source"></p></header>\n'
        '<section id="serve-controls" aria-label="input"></section>\n'
        '<nav role="tablist" id="tabs"></nav>\n'
        '<section role="tabpanel" id="panel-head" aria-labelledby="tab-head" hidden></section>\n'
        '<section role="tabpanel" id="panel-model" aria-labelledby="tab-model" hidden></section>\n'
        '<section role="tabpanel" id="panel-walk" aria-labelledby="tab-walk" hidden></section>\n'
        '<section id="panel-step" aria-live="polite" hidden></section>\n'
        '<section id="panel-heads" aria-label="heads" hidden></section>\n'
        '<section id="panel-generate" aria-label="generate"></section>\n'
        '<section id="panel-why" aria-label="why this token" hidden></section>\n'
        f'<script type="application/json" id="attnlab-serve">{strings}</script>\n'
        f"<script>{page_js}</script>\n<script>{serve_js}</script>\n</body>\n</html>\n"
    )
    return page, csp


# -------------------------------------------------------------------------- the app


def create_app(
    registry: ModelRegistry,
    *,
    limits: ServeLimits | None = None,
    pool: WorkerPool | None = None,
    lang: str = "en",
) -> Starlette:
    """The Starlette app serving ``registry``'s models.

    Args:
        registry: the fixed list of models.
        limits: request limits (default :class:`ServeLimits`).
        pool: the worker pool (default 2 workers, 16 queued).
        lang: the page's language, ``"en"`` or ``"zh-TW"``.

    Returns:
        The ASGI app; ``app.state.pool`` and ``app.state.registry`` are the pool and
        registry.
    """
    limits = limits or ServeLimits()
    pool = pool or WorkerPool()
    page, csp = render_page(lang)
    headers = {
        "Content-Security-Policy": csp,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }

    async def index(request: Request) -> Response:
        return HTMLResponse(page, headers=headers)

    async def font(request: Request) -> Response:
        from attnlab.explain.fonts import cjk_font_file

        path = cjk_font_file() if lang != "en" else None
        if path is None:
            return _error(404, "no CJK font here (pip install 'attnlab[zh-tw]')")
        return FileResponse(path, media_type="font/otf", headers={"Cache-Control": "max-age=86400"})

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "models": registry.status(),
                "limits": asdict(limits),
                "pool": {"workers": pool.workers, "queue": pool.queue, "busy": pool.busy},
            }
        )

    async def trace(request: Request) -> Response:
        body = await _read_json(request, limits)
        name = _model_name(body, registry)
        text = _text(body, limits, required=registry.spec(name).kind != "example")
        top_k = _int(body, "top_k", None, 1, limits.max_top_k, "max_top_k")
        result = await pool.run(_trace_work, registry, name, text, _lang(body), top_k, limits)
        return JSONResponse(result)

    async def step(request: Request) -> Response:
        body = await _read_json(request, limits)
        name = _model_name(body, registry)
        text = _text(body, limits, required=registry.spec(name).kind != "example")
        layer = _int(body, "layer", 0, 0, None)
        head = _int(body, "head", 0, 0, None)
        token = _int(body, "token", None, 0, None)
        if token is None:
            raise ApiError(422, "`token` is required: the query position (from 0)")
        assert layer is not None and head is not None
        result = await pool.run(
            _step_work, registry, name, text, layer, head, token, _lang(body), limits
        )
        return JSONResponse(result)

    async def heads(request: Request) -> Response:
        body = await _read_json(request, limits)
        name = _model_name(body, registry)
        text = _text(body, limits, required=False)
        return JSONResponse(await pool.run(_heads_work, registry, name, text, limits))

    async def ablation(request: Request) -> Response:
        body = await _read_json(request, limits)
        name = _model_name(body, registry)
        text = _text(body, limits)
        pairs = _head_pairs(body)
        mode = body.get("mode", "zero")
        if mode not in ("zero", "mean"):
            raise ApiError(422, f"`mode` must be 'zero' or 'mean', got {str(mode)[:40]!r}")
        k = _int(body, "k", 10, 1, limits.max_top_k, "max_top_k")
        assert k is not None
        return JSONResponse(
            await pool.run(_ablate_work, registry, name, text, pairs, mode, k, limits)
        )

    async def lens(request: Request) -> Response:
        body = await _read_json(request, limits)
        name = _model_name(body, registry)
        text = _text(body, limits)
        k = _int(body, "k", 3, 1, 10, None)
        assert k is not None
        return JSONResponse(await pool.run(_lens_work, registry, name, text, k, limits))

    async def rollout(request: Request) -> Response:
        body = await _read_json(request, limits)
        name = _model_name(body, registry)
        text = _text(body, limits)
        residual = _float(body, "residual", 0.5, 0.0, 1.0)
        assert residual is not None
        return JSONResponse(await pool.run(_rollout_work, registry, name, text, residual, limits))

    async def attribution(request: Request) -> Response:
        body = await _read_json(request, limits)
        name = _model_name(body, registry)
        ids = _ids_field(body, limits)
        if ids is not None and body.get("text") is not None:
            raise ApiError(422, "give `text` or `ids`, not both")
        text = _text(body, limits) if ids is None else None
        position = _int(body, "position", -1, -limits.max_tokens, limits.max_tokens)
        by_source = body.get("by_source", False)
        if not isinstance(by_source, bool):
            raise ApiError(422, f"`by_source` must be true or false, got {str(by_source)[:40]!r}")
        fields = {
            "target": _token_field(body, "target"),
            "contrast": _token_field(body, "contrast"),
            "position": position,
            "by_source": by_source,
            "k": _int(body, "k", 10, 1, limits.max_top_k, "max_top_k"),
        }
        return JSONResponse(
            await pool.run(_attribute_work, registry, name, text, ids, fields, limits)
        )

    async def patching(request: Request) -> Response:
        body = await _read_json(request, limits)
        name = _model_name(body, registry)
        clean = _text_field(body, "clean", limits)
        corrupted = _text_field(body, "corrupted", limits)
        over = body.get("over", "heads")
        if over not in ("heads", "residual", "mlp"):
            raise ApiError(
                422, f"`over` must be 'heads', 'residual' or 'mlp', got {str(over)[:40]!r}"
            )
        method = body.get("method", "activation")
        if method not in ("activation", "attribution"):
            raise ApiError(
                422, f"`method` must be 'activation' or 'attribution', got {str(method)[:40]!r}"
            )
        if method == "attribution" and over != "heads":
            raise ApiError(422, "`method` 'attribution' estimates heads only: send `over` 'heads'")
        fields = {"over": over, "method": method}
        for key in ("target", "contrast"):
            fields[key] = _token_field(body, key)
            if fields[key] is None:
                raise ApiError(422, f"`{key}` is required: a token id or the text of one token")
        return JSONResponse(
            await pool.run(_patch_work, registry, name, clean, corrupted, fields, limits)
        )

    async def generate(request: Request) -> Response:
        body = await _read_json(request, limits)
        name = _model_name(body, registry)
        text = _text(body, limits)
        params = {
            "max_new_tokens": _int(
                body, "max_new_tokens", 20, 1, limits.max_new_tokens, "max_new_tokens"
            ),
            "temperature": _float(body, "temperature", 0.0, 0.0, 100.0),
            "top_k": _int(body, "top_k", None, 1, limits.max_top_k, "max_top_k"),
            "top_p": _float(body, "top_p", None, 0.0, 1.0, low_open=True),
            "seed": _int(body, "seed", 123, 0, 2**63 - 1),
            "layer": _int(body, "layer", 0, 0, None),
            "head": _int(body, "head", 0, 0, None),
            "bars": _int(body, "bars", 10, 1, limits.max_top_k, "max_top_k"),
        }
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancel = threading.Event()

        def emit(event: str, data: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (event, data))

        def work() -> None:
            try:
                _generate_work(registry, name, text, params, limits, emit, cancel)
            except ApiError as e:
                emit("error", {"error": e.message, "status": e.status})
            except Exception as e:  # keep serving; tell the client
                emit("error", {"error": f"{type(e).__name__}: {e}"[:500], "status": 500})
            finally:
                emit("end", None)

        future = pool.submit(work)  # BusyError -> 429 before the stream starts

        async def events() -> AsyncIterator[str]:
            try:
                while True:
                    event, data = await queue.get()
                    if event == "end":
                        return
                    yield f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
            finally:
                cancel.set()  # the client left (or the stream ended): stop generating
                await asyncio.wrap_future(future)

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error(exc.status, exc.message)

    async def on_busy(request: Request, exc: Exception) -> Response:
        return _error(429, str(exc), **{"Retry-After": "1"})

    async def on_other(request: Request, exc: Exception) -> Response:
        return _error(500, f"internal error: {type(exc).__name__}: {exc}"[:500])

    async def not_found(request: Request, exc: Exception) -> Response:
        code = getattr(exc, "status_code", 404)
        return _error(
            code,
            f"{request.method} {request.url.path[:100]}: "
            f"{'not found' if code == 404 else 'not allowed'}",
        )

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/api/models", models),
            Route("/font/cjk.otf", font),
            Route("/api/trace", trace, methods=["POST"]),
            Route("/api/step", step, methods=["POST"]),
            Route("/api/generate", generate, methods=["POST"]),
            Route("/api/heads", heads, methods=["POST"]),
            Route("/api/ablate", ablation, methods=["POST"]),
            Route("/api/lens", lens, methods=["POST"]),
            Route("/api/rollout", rollout, methods=["POST"]),
            Route("/api/attribute", attribution, methods=["POST"]),
            Route("/api/patch", patching, methods=["POST"]),
        ],
        exception_handlers={
            ApiError: on_api_error,
            BusyError: on_busy,
            Exception: on_other,
            404: not_found,
            405: not_found,
        },
    )
    app.state.pool = pool
    app.state.registry = registry
    app.state.limits = limits
    return app
