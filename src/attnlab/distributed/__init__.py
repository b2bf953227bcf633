"""Ring attention over torch.distributed: exact attention on a sequence split across ranks.

See :func:`ring_attention` and the README's "Ring attention" section. The process side of
data-parallel training (joining the process group, launching the workers of
``attnlab train --nproc``) is :mod:`attnlab.distributed.training`.
"""

from __future__ import annotations

from attnlab.distributed.context import (
    RingContext,
    all_reduce_gradients,
    context_parallel,
    current_ring_context,
)
from attnlab.distributed.ring import RingAttentionError, RingStats, ring_attention
from attnlab.distributed.sharding import (
    LAYOUTS,
    gather_sequence,
    shard_positions,
    shard_sequence,
)

__all__ = [
    "LAYOUTS",
    "RingAttentionError",
    "RingContext",
    "RingStats",
    "all_reduce_gradients",
    "context_parallel",
    "current_ring_context",
    "gather_sequence",
    "ring_attention",
    "shard_positions",
    "shard_sequence",
]
