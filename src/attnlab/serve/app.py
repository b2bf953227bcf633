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

This module holds the routes; what they read is in :mod:`attnlab.serve.fields`, the work
they hand the pool in :mod:`~attnlab.serve.trace_work` (the explainer and heads tabs),
:mod:`~attnlab.serve.why_work` (why this token) and :mod:`~attnlab.serve.generate_work`
(the stream), and the page in :mod:`~attnlab.serve.page`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import asdict
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

from attnlab.explain.fonts import cjk_font_file
from attnlab.serve.fields import (
    ApiError,
    ServeLimits,
    error_response,
    float_field,
    head_pairs_field,
    ids_field,
    int_field,
    lang_field,
    model_field,
    named_text_field,
    read_body,
    text_field,
    token_field,
)
from attnlab.serve.generate_work import generate_work
from attnlab.serve.models import ModelRegistry
from attnlab.serve.page import render_page
from attnlab.serve.pool import BusyError, WorkerPool
from attnlab.serve.trace_work import (
    ablate_work,
    heads_work,
    lens_work,
    rollout_work,
    step_work,
    trace_work,
)
from attnlab.serve.why_work import attribute_work, patch_work

__all__ = ["ApiError", "ServeLimits", "create_app", "render_page"]


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
        path = cjk_font_file() if lang != "en" else None
        if path is None:
            return error_response(404, "no CJK font here (pip install 'attnlab[zh-tw]')")
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
        body = await read_body(request, limits)
        name = model_field(body, registry)
        text = text_field(body, limits, required=registry.spec(name).kind != "example")
        top_k = int_field(body, "top_k", None, 1, limits.max_top_k, "max_top_k")
        result = await pool.run(trace_work, registry, name, text, lang_field(body), top_k, limits)
        return JSONResponse(result)

    async def step(request: Request) -> Response:
        body = await read_body(request, limits)
        name = model_field(body, registry)
        text = text_field(body, limits, required=registry.spec(name).kind != "example")
        layer = int_field(body, "layer", 0, 0, None)
        head = int_field(body, "head", 0, 0, None)
        token = int_field(body, "token", None, 0, None)
        if token is None:
            raise ApiError(422, "`token` is required: the query position (from 0)")
        assert layer is not None and head is not None
        result = await pool.run(
            step_work, registry, name, text, layer, head, token, lang_field(body), limits
        )
        return JSONResponse(result)

    async def heads(request: Request) -> Response:
        body = await read_body(request, limits)
        name = model_field(body, registry)
        text = text_field(body, limits, required=False)
        return JSONResponse(await pool.run(heads_work, registry, name, text, limits))

    async def ablation(request: Request) -> Response:
        body = await read_body(request, limits)
        name = model_field(body, registry)
        text = text_field(body, limits)
        pairs = head_pairs_field(body)
        mode = body.get("mode", "zero")
        if mode not in ("zero", "mean"):
            raise ApiError(422, f"`mode` must be 'zero' or 'mean', got {str(mode)[:40]!r}")
        k = int_field(body, "k", 10, 1, limits.max_top_k, "max_top_k")
        assert k is not None
        return JSONResponse(
            await pool.run(ablate_work, registry, name, text, pairs, mode, k, limits)
        )

    async def lens(request: Request) -> Response:
        body = await read_body(request, limits)
        name = model_field(body, registry)
        text = text_field(body, limits)
        k = int_field(body, "k", 3, 1, 10, None)
        assert k is not None
        return JSONResponse(await pool.run(lens_work, registry, name, text, k, limits))

    async def rollout(request: Request) -> Response:
        body = await read_body(request, limits)
        name = model_field(body, registry)
        text = text_field(body, limits)
        residual = float_field(body, "residual", 0.5, 0.0, 1.0)
        assert residual is not None
        return JSONResponse(await pool.run(rollout_work, registry, name, text, residual, limits))

    async def attribution(request: Request) -> Response:
        body = await read_body(request, limits)
        name = model_field(body, registry)
        ids = ids_field(body, limits)
        if ids is not None and body.get("text") is not None:
            raise ApiError(422, "give `text` or `ids`, not both")
        text = text_field(body, limits) if ids is None else None
        position = int_field(body, "position", -1, -limits.max_tokens, limits.max_tokens)
        by_source = body.get("by_source", False)
        if not isinstance(by_source, bool):
            raise ApiError(422, f"`by_source` must be true or false, got {str(by_source)[:40]!r}")
        fields = {
            "target": token_field(body, "target"),
            "contrast": token_field(body, "contrast"),
            "position": position,
            "by_source": by_source,
            "k": int_field(body, "k", 10, 1, limits.max_top_k, "max_top_k"),
        }
        return JSONResponse(
            await pool.run(attribute_work, registry, name, text, ids, fields, limits)
        )

    async def patching(request: Request) -> Response:
        body = await read_body(request, limits)
        name = model_field(body, registry)
        clean = named_text_field(body, "clean", limits)
        corrupted = named_text_field(body, "corrupted", limits)
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
            fields[key] = token_field(body, key)
            if fields[key] is None:
                raise ApiError(422, f"`{key}` is required: a token id or the text of one token")
        return JSONResponse(
            await pool.run(patch_work, registry, name, clean, corrupted, fields, limits)
        )

    async def generate(request: Request) -> Response:
        body = await read_body(request, limits)
        name = model_field(body, registry)
        text = text_field(body, limits)
        params = {
            "max_new_tokens": int_field(
                body, "max_new_tokens", 20, 1, limits.max_new_tokens, "max_new_tokens"
            ),
            "temperature": float_field(body, "temperature", 0.0, 0.0, 100.0),
            "top_k": int_field(body, "top_k", None, 1, limits.max_top_k, "max_top_k"),
            "top_p": float_field(body, "top_p", None, 0.0, 1.0, low_open=True),
            "seed": int_field(body, "seed", 123, 0, 2**63 - 1),
            "layer": int_field(body, "layer", 0, 0, None),
            "head": int_field(body, "head", 0, 0, None),
            "bars": int_field(body, "bars", 10, 1, limits.max_top_k, "max_top_k"),
        }
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancel = threading.Event()

        def emit(event: str, data: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (event, data))

        def work() -> None:
            try:
                generate_work(registry, name, text, params, limits, emit, cancel)
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
        return error_response(exc.status, exc.message)

    async def on_busy(request: Request, exc: Exception) -> Response:
        return error_response(429, str(exc), **{"Retry-After": "1"})

    async def on_other(request: Request, exc: Exception) -> Response:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}"[:500])

    async def not_found(request: Request, exc: Exception) -> Response:
        code = getattr(exc, "status_code", 404)
        return error_response(
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
