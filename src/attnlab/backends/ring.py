"""The ``ring`` backend: ring attention across the ranks of a process group.

Each rank passes its shard of the sequence (query, key and value for the same positions);
the group and the layout come from :func:`attnlab.distributed.context_parallel` (default:
the default group, contiguous layout). Only asked for by name, never by ``auto``.

Shape legend: B batch, H query heads, G key/value heads, T local shard length, D head dim,
Dv value head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attnlab.backends.base import AttentionRequest, Backend, BackendResult
from attnlab.masks import AttentionMask, describe

__all__ = ["BACKEND", "ring_backend"]


def ring_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AttentionMask | None,
    *,
    dropout_p: float,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> BackendResult:
    """Run :func:`attnlab.distributed.ring_attention` with the current ring context.

    Shape:
        - query ``(B, H, T, D)``, key ``(B, G, T, D)``, value ``(B, G, T, Dv)`` (local shards)
        - output ``(B, H, T, Dv)`` (this rank's shard)
    """
    # Imported here: attnlab.distributed reuses the blockwise kernel of this package.
    from attnlab.distributed import current_ring_context, ring_attention

    why = _why_not_mask(mask, dropout_p) or _why_not_scores(softcap, sinks is not None)
    if why is not None:
        raise ValueError(why)
    ctx = current_ring_context()
    out = ring_attention(
        query,
        key,
        value,
        group=ctx.group,
        is_causal=mask is not None,
        scale=scale,
        softcap=softcap,
        layout=ctx.layout,
        timeout=ctx.timeout,
        block_size=ctx.block_size,
    )
    return BackendResult(output=out)


def _why_not_mask(mask: AttentionMask | None, dropout_p: float) -> str | None:
    if dropout_p > 0:
        return f"ring does not implement attention dropout (dropout_p={dropout_p}); use 0"
    if mask is not None and not mask.is_causal_only:
        return (
            "ring supports no mask or a causal mask (is_causal=True) over the whole "
            f"sequence, got {describe(mask)}"
        )
    return None


def _why_not_scores(softcap: float | None, sinks: bool) -> str | None:
    if sinks:
        return "ring does not implement attention sinks; use 'blockwise'"
    return None


def _why_not(request: AttentionRequest) -> str | None:
    why = _why_not_mask(request.mask, request.dropout_p) or _why_not_scores(
        request.softcap, request.sinks
    )
    if why is not None:
        return why
    if not (dist.is_available() and dist.is_initialized()):
        return (
            "ring needs a torch.distributed process group (init_process_group, torchrun or "
            "`attnlab ring-demo`), and none is initialised"
        )
    if request.T != request.S:
        return (
            "ring is self-attention over one sharded sequence (T == S), "
            f"got T={request.T}, S={request.S}"
        )
    if request.weights is not None:
        return "ring cannot return attention weights (each rank holds only its shard of keys)"
    return None


def _why_not_auto(request: AttentionRequest) -> str | None:
    return "ring runs only when asked for by name (backend='ring'), inside a process group"


BACKEND = Backend(
    name="ring",
    run=ring_backend,
    why_not=_why_not,
    why_not_auto=_why_not_auto,
    summary="ring attention over a sequence sharded across a torch.distributed process group",
    cache_decisions=False,  # capable only while a process group is initialised
)
