"""The registry of attention backends by name, below everything that looks a name up.

:func:`attnlab.backends.register_backend` fills it; the request checks
(:mod:`attnlab.backends.request`) and the ``auto`` choice read it.
"""

from __future__ import annotations

from attnlab.backends.base import Backend

__all__ = ["REGISTRY", "available_backends", "get_backend"]

#: Every registered backend by name, in registration order.
REGISTRY: dict[str, Backend] = {}


def available_backends() -> list[str]:
    """Names accepted as ``backend=``: ``"auto"`` and every registered backend."""
    return ["auto", *REGISTRY]


def get_backend(name: str) -> Backend:
    """The registered backend called ``name``.

    Raises:
        ValueError: unknown name.
    """
    if name not in REGISTRY:
        raise ValueError(f"`backend` must be one of {available_backends()}, got {name!r}")
    return REGISTRY[name]
