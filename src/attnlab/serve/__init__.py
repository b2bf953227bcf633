"""``attnlab serve``: the live explainer, a local web app over the explain data.

:func:`create_app` builds the Starlette app over a :class:`ModelRegistry` (the fixed list
of models, loaded lazily, LRU-bounded) with a bounded :class:`WorkerPool`;
:func:`serve` runs it with uvicorn on 127.0.0.1 unless told otherwise. Needs the
``serve`` extra (``pip install 'attnlab[serve]'``).
"""

from __future__ import annotations

from attnlab.serve.app import ApiError, ServeLimits, create_app, render_page
from attnlab.serve.models import (
    LoadedModel,
    ModelRegistry,
    ModelSpec,
    UnknownModelError,
    checkpoint_spec,
    default_specs,
    example_spec,
    model_spec,
    pretrained_spec,
    spec_for,
    store_spec,
)
from attnlab.serve.pool import BusyError, WorkerPool
from attnlab.serve.server import is_loopback, serve

__all__ = [
    "ApiError",
    "BusyError",
    "LoadedModel",
    "ModelRegistry",
    "ModelSpec",
    "ServeLimits",
    "UnknownModelError",
    "WorkerPool",
    "checkpoint_spec",
    "create_app",
    "default_specs",
    "example_spec",
    "is_loopback",
    "model_spec",
    "pretrained_spec",
    "render_page",
    "serve",
    "spec_for",
    "store_spec",
]
