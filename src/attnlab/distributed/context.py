"""Context parallelism: run a model whose sequence is split across ranks.

Inside ``with context_parallel(layout=...)``, every attention layer that uses
``backend="ring"`` runs :func:`ring_attention` with that group and layout. The rest of the
model works token by token, so it only needs each rank's global positions
(:func:`shard_positions`) and gradients averaged over the ranks
(:func:`all_reduce_gradients`) after ``backward()``.

Shape legend: B batch, T full sequence length, N ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from attnlab.distributed.sharding import check_layout

__all__ = ["RingContext", "all_reduce_gradients", "context_parallel", "current_ring_context"]


@dataclass(frozen=True)
class RingContext:
    """The ring that ``backend="ring"`` uses: group, layout and options."""

    group: dist.ProcessGroup | None = None
    layout: str = "contiguous"
    timeout: float | timedelta | None = None
    block_size: int | None = None


_CURRENT: ContextVar[RingContext | None] = ContextVar("attnlab_ring_context", default=None)


def current_ring_context() -> RingContext:
    """The innermost :func:`context_parallel` settings, or the defaults (default group,
    contiguous layout) outside one."""
    return _CURRENT.get() or RingContext()


@contextmanager
def context_parallel(
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    timeout: float | timedelta | None = None,
    block_size: int | None = None,
) -> Iterator[RingContext]:
    """Set the group and layout that ``backend="ring"`` attention uses in this block.

    Args:
        group: process group of the ring (default: the default group).
        layout: how the sequence is split: ``"contiguous"`` or ``"zigzag"``; shard inputs
            and position ids with the same layout.
        timeout: per-transfer timeout (default: the group's).
        block_size: tile size of the block kernel.

    Yields:
        The active :class:`RingContext`.

    Raises:
        ValueError: unknown layout.
    """
    check_layout(layout)
    token = _CURRENT.set(RingContext(group, layout, timeout, block_size))
    try:
        yield _CURRENT.get() or RingContext()
    finally:
        _CURRENT.reset(token)


def all_reduce_gradients(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average every parameter gradient over the ranks of ``group`` (in place).

    With equal shards and a per-rank mean loss, the average of the ranks' gradients is the
    gradient of the mean loss over the whole sequence. (``DistributedDataParallel`` does the
    same averaging and can be used instead.)
    """
    n = dist.get_world_size(group)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= n
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
