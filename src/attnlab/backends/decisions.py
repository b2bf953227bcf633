"""The decision cache of :func:`attnlab.backends.resolve_call`: validation and selection
decisions by call signature, so that a call repeated with equal shapes, dtypes and mask
structure skips both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.backends.base import Backend, WeightsRequest
from attnlab.masks import AttentionMask

__all__ = ["DispatchCacheInfo", "clear_dispatch_cache", "dispatch_cache_info"]

# The cached decision: (backend, mask, scale, weights, softcap); the mask only when the call
# had no attn_mask (None or a CausalMask: no tensors), so the cache never keeps a tensor alive.
_Decision = tuple[Backend, AttentionMask | None, float, WeightsRequest | None, float | None]


@dataclass(frozen=True)
class DispatchCacheInfo:
    """Counts of the decision cache (see :func:`dispatch_cache_info`)."""

    hits: int
    misses: int
    size: int


class _DecisionCache:
    """Validation and selection decisions by call signature (see :func:`_call_key`), with
    their hit and miss counts; emptied whole when it reaches ``limit`` entries."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: dict[tuple, _Decision] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple) -> _Decision | None:
        """The decision cached for ``key`` (counted as a hit), or None.

        Raises:
            TypeError: ``key`` is unhashable.
        """
        hit = self._entries.get(key)
        if hit is not None:
            self.hits += 1
        return hit

    def put(self, key: tuple, decision: _Decision) -> None:
        """Cache a decision just made (counted as a miss)."""
        self.misses += 1
        if len(self._entries) >= self.limit:
            self._entries.clear()
        self._entries[key] = decision

    def clear(self) -> None:
        self._entries.clear()
        self.hits = self.misses = 0

    def info(self) -> DispatchCacheInfo:
        return DispatchCacheInfo(hits=self.hits, misses=self.misses, size=len(self._entries))


#: The decisions of every call through :func:`resolve_call` in this process.
_DECISIONS = _DecisionCache(limit=4096)


def dispatch_cache_info() -> DispatchCacheInfo:
    """How often a call's decision came from the cache, and how many are cached."""
    return _DECISIONS.info()


def clear_dispatch_cache() -> None:
    """Forget every cached decision (done whenever the registry or the table changes)."""
    _DECISIONS.clear()


class _UncacheableError(Exception):
    pass


_SCALARS = (bool, int, float, str, type(None))


def _value_key(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return (v.shape, v.dtype, v.device, v.requires_grad)
    if isinstance(v, AttentionMask):
        try:
            fields = vars(v)
        except TypeError:  # __slots__: no way to see its structure
            raise _UncacheableError from None
        return (type(v), tuple((k, _value_key(x)) for k, x in fields.items()))
    if type(v) in _SCALARS:
        return (type(v), v)
    if isinstance(v, tuple):
        return tuple(_value_key(x) for x in v)
    raise _UncacheableError


def _call_key(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    backend: object,
    need_weights: object,
    softcap: object,
) -> tuple | None:
    """Everything validation and selection depend on, or None when a call is not cached.

    A backend's ``why_not``/``why_not_auto`` and a mask's ``validate`` look at the mask's
    structure (its type, scalar fields, tensors' shapes, dtypes, devices and whether they
    require grad), never at tensor values, so calls with equal keys get equal decisions.
    """
    if not (
        isinstance(query, torch.Tensor)
        and isinstance(key, torch.Tensor)
        and isinstance(value, torch.Tensor)
        and type(is_causal) is bool
        and type(need_weights) is bool
        and type(backend) is str
    ):
        return None  # validation will say what is wrong, or the call is uncommon
    try:
        mask_key = None if attn_mask is None else _value_key(attn_mask)
    except _UncacheableError:
        return None
    grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    return (
        query.shape,
        key.shape,
        value.shape,
        query.dtype,
        key.dtype,
        value.dtype,
        query.device,
        key.device,
        value.device,
        grad,
        mask_key,
        is_causal,
        type(dropout_p),
        dropout_p,
        type(scale),
        scale,
        backend,
        need_weights,
        type(softcap),
        softcap,
    )
