"""Attention backends: one signature, a registry, the ``auto`` choice and its reasons.

Every backend computes the same function (see ``attnlab.backends.math`` for the
readable reference) from query ``(B, H, T, D)``, key ``(B, G, S, D)`` and value
``(B, G, S, Dv)`` with an attnlab mask. ``auto`` walks :data:`AUTO_ORDER` (fastest
first) and picks the first backend that can serve the request; :func:`explain_dispatch`
gives, for every backend, why it was or was not chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.backends import blockwise as _blockwise
from attnlab.backends import math as _math
from attnlab.backends import ring as _ring
from attnlab.backends import sdpa as _sdpa
from attnlab.backends.base import AttentionRequest, Backend, BackendResult, WeightsRequest
from attnlab.backends.request import PreparedCall, prepare_call
from attnlab.backends.weights import exact_weights, select_weights
from attnlab.masks import AttentionMask

__all__ = [
    "AUTO_ORDER",
    "AttentionRequest",
    "Backend",
    "BackendResult",
    "DispatchExplanation",
    "PreparedCall",
    "WeightsRequest",
    "available_backends",
    "exact_weights",
    "explain_dispatch",
    "get_backend",
    "prepare_call",
    "register_backend",
    "select_backend",
    "select_weights",
    "variant_support",
]

_REGISTRY: dict[str, Backend] = {}
#: The order ``auto`` tries backends in: fastest first.
AUTO_ORDER: list[str] = []


def register_backend(backend: Backend, *, auto_rank: int | None = None) -> None:
    """Register a backend under ``backend.name``.

    Args:
        backend: the backend.
        auto_rank: position in :data:`AUTO_ORDER` (0 = tried first); None keeps it out
            of ``auto`` (it can still be asked for by name).
    """
    _REGISTRY[backend.name] = backend
    if backend.name in AUTO_ORDER:
        AUTO_ORDER.remove(backend.name)
    if auto_rank is not None:
        AUTO_ORDER.insert(auto_rank, backend.name)


def available_backends() -> list[str]:
    """Names accepted as ``backend=``: ``"auto"`` and every registered backend."""
    return ["auto", *_REGISTRY]


def get_backend(name: str) -> Backend:
    """The registered backend called ``name``.

    Raises:
        ValueError: unknown name.
    """
    if name not in _REGISTRY:
        raise ValueError(f"`backend` must be one of {available_backends()}, got {name!r}")
    return _REGISTRY[name]


def _reasons(request: AttentionRequest, for_auto: bool) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, be in _REGISTRY.items():
        why = be.why_not(request)
        if why is None and for_auto:
            why = be.why_not_auto(request)
        out[name] = why
    return out


def select_backend(name: str, request: AttentionRequest) -> Backend:
    """The backend that serves ``request``: ``name``, or the first capable one for auto.

    Raises:
        ValueError: unknown name, or the named backend cannot serve the request (the
            message gives its reason).
    """
    if not isinstance(name, str):
        raise TypeError(f"`backend` must be a str, got {type(name).__name__}")
    if name == "auto":
        capable = [
            _REGISTRY[n]
            for n in AUTO_ORDER
            if not _REGISTRY[n].last_resort and _REGISTRY[n].why_not(request) is None
        ]
        for be in capable:  # fastest first, unless it has a reason to step aside ...
            if be.why_not_auto(request) is None:
                return be
        if capable:  # ... which it does not when only slower backends are left
            return capable[0]
        return _REGISTRY["math"]  # the reference serves every request
    be = get_backend(name)
    why = be.why_not(request)
    if why is not None:
        raise ValueError(f"backend={name!r} cannot serve this call: {why}")
    return be


@dataclass(frozen=True)
class DispatchExplanation:
    """Which backend a call would run on, and why every other one was not chosen.

    Attributes:
        requested: the ``backend`` argument.
        chosen: the backend that would run.
        reasons: ``(name, reason)`` for every registered backend; reason is None for the
            chosen one, else a human-readable sentence.
    """

    requested: str
    chosen: str
    reasons: tuple[tuple[str, str | None], ...]

    def __str__(self) -> str:
        lines = [f"backend={self.requested!r} -> {self.chosen}"]
        for name, why in self.reasons:
            lines.append(f"  {name}: {'chosen' if why is None else why}")
        return "\n".join(lines)


def explain(request: AttentionRequest, backend: str = "auto") -> DispatchExplanation:
    """Explain dispatch for an already-built request."""
    chosen = select_backend(backend, request)  # raises with the reason if it cannot serve
    raw = _reasons(request, for_auto=backend == "auto")
    ranked = AUTO_ORDER.index
    reasons: list[tuple[str, str | None]] = []
    for name in _REGISTRY:
        if name == chosen.name:
            reasons.append((name, None))
        elif raw[name] is not None:
            reasons.append((name, f"not chosen: {raw[name]}"))
        elif backend != "auto":
            reasons.append((name, f"capable, but backend={backend!r} was asked for"))
        elif (
            name in AUTO_ORDER and chosen.name in AUTO_ORDER and ranked(name) > ranked(chosen.name)
        ):
            reasons.append((name, f"capable, but {chosen.name} is faster and ranks first"))
        else:
            reasons.append((name, "capable, but slower; chosen only when nothing else can"))
    return DispatchExplanation(requested=backend, chosen=chosen.name, reasons=tuple(reasons))


def explain_dispatch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: AttentionMask | torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    backend: str = "auto",
    need_weights: bool | WeightsRequest = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> DispatchExplanation:
    """Say which backend ``scaled_dot_product_attention`` would run, and why not the others.

    Takes the same arguments as :func:`attnlab.functional.scaled_dot_product_attention`
    and validates them the same way; computes nothing.

    Returns:
        A :class:`DispatchExplanation`; ``str()`` of it is a readable report.

    Raises:
        ValueError, TypeError: the same as ``scaled_dot_product_attention``.
    """
    call = prepare_call(
        query, key, value, attn_mask, dropout_p, is_causal, scale, backend, need_weights,
        softcap=softcap, sinks=sinks,
    )  # fmt: skip
    request = call.request
    return explain(request, backend)


def _variant_calls() -> list[tuple[str, dict[str, object]]]:
    from attnlab.biases import AlibiBias, RelativePositionBias
    from attnlab.masks import CausalMask, DocumentMask, PaddingMask, SlidingWindowMask

    H, T = 2, 4
    ids = torch.tensor([[0, 0, 1, 1]])
    return [
        ("causal", {"is_causal": True}),
        ("PaddingMask", {"attn_mask": PaddingMask(torch.ones(1, T).bool())}),
        ("SlidingWindowMask", {"attn_mask": SlidingWindowMask(2)}),
        ("AlibiBias (ALiBi)", {"attn_mask": AlibiBias(H), "is_causal": True}),
        (
            "RelativePositionBias (T5), learned",
            {"attn_mask": RelativePositionBias(torch.zeros(32, H, requires_grad=True))},
        ),
        (
            "DocumentMask & CausalMask",
            {"attn_mask": DocumentMask(ids) & CausalMask()},
        ),
        ("softcap= (Gemma 2)", {"softcap": 30.0, "is_causal": True}),
        ("sinks= (gpt-oss)", {"sinks": torch.zeros(H), "is_causal": True}),
    ]


def variant_support() -> list[tuple[str, dict[str, str | None]]]:
    """Which backend serves which attention variant: ``(variant, {backend: reason})``,
    reason None where the backend serves it (for ``attnlab info`` and the README)."""
    rows = []
    for label, kwargs in _variant_calls():
        x = torch.zeros(1, 2, 4, 8, requires_grad=True)
        with torch.enable_grad():
            call = prepare_call(
                x, x, x, kwargs.get("attn_mask"), 0.0, kwargs.get("is_causal", False), None,
                "auto", False, softcap=kwargs.get("softcap"), sinks=kwargs.get("sinks"),
            )  # fmt: skip
        rows.append((label, {n: be.why_not(call.request) for n, be in _REGISTRY.items()}))
    return rows


register_backend(_sdpa.BACKEND, auto_rank=0)
register_backend(_blockwise.BACKEND, auto_rank=1)
register_backend(_math.BACKEND, auto_rank=2)
register_backend(_ring.BACKEND)  # by name only, never chosen by auto
