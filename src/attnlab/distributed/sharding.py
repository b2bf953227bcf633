"""Which positions of a sequence each rank holds, and moving between full and sharded.

Two layouts split a sequence of ``T`` positions over ``N`` ranks:

- ``"contiguous"``: rank ``r`` holds positions ``[r*T/N, (r+1)*T/N)``. Simple, but under a
  causal mask rank ``N-1`` does ~2x the mean work and rank 0 almost none.
- ``"zigzag"``: the sequence is cut into ``2N`` chunks and rank ``r`` holds chunk ``r`` and
  chunk ``2N-1-r`` (one from the front, one from the back), so every rank does the same
  causal work.

Shape legend: B batch, H heads, T sequence length, D head dim; ``dim`` names the sequence axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

__all__ = [
    "LAYOUTS",
    "Layout",
    "Segment",
    "gather_sequence",
    "local_segments",
    "shard_positions",
    "shard_sequence",
]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    """A run of consecutive positions inside one rank's shard."""

    local_start: int  # offset inside the shard
    global_start: int  # position in the full sequence
    length: int


def check_layout(layout: object) -> str:
    """Return ``layout`` if it is a known layout name, else raise ``ValueError``."""
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}")
    return str(layout)


def chunks_per_rank(layout: str) -> int:
    """How many equal chunks of the sequence each rank holds under ``layout``."""
    return 2 if check_layout(layout) == "zigzag" else 1


def local_segments(local_len: int, rank: int, world_size: int, layout: str) -> list[Segment]:
    """The runs of global positions held by ``rank`` whose shard has ``local_len`` positions."""
    if chunks_per_rank(layout) == 1:
        return [Segment(0, rank * local_len, local_len)]
    c = local_len // 2
    return [Segment(0, rank * c, c), Segment(c, (2 * world_size - 1 - rank) * c, c)]


def check_divisible(seq_len: int, world_size: int, layout: str, what: str = "the sequence") -> None:
    """Raise ``ValueError`` unless ``seq_len`` splits into equal chunks for ``layout``."""
    need = world_size * chunks_per_rank(layout)
    if seq_len % need:
        padded = -(-seq_len // need) * need
        raise ValueError(
            f"{what} has length {seq_len}, which layout={layout!r} cannot split over "
            f"{world_size} ranks: it needs a multiple of {need}; pad it to {padded} "
            f"positions" + (" or use layout='contiguous'" if layout == "zigzag" else "")
        )


def shard_positions(
    seq_len: int, rank: int, world_size: int, layout: str = "contiguous"
) -> torch.Tensor:
    """Global positions (long, in shard order) that ``rank`` holds.

    Use it to give a model its position ids under context parallelism.

    Args:
        seq_len: length ``T`` of the full sequence.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of ranks ``N``.
        layout: ``"contiguous"`` or ``"zigzag"``.

    Returns:
        A ``(T/N,)`` long tensor of positions.

    Raises:
        ValueError: unknown layout, bad rank, or ``T`` not divisible as the layout needs.
    """
    check_layout(layout)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"`rank` must be in [0, {world_size}), got {rank}")
    check_divisible(seq_len, world_size, layout)
    local_len = seq_len // world_size
    parts = [
        torch.arange(s.global_start, s.global_start + s.length)
        for s in local_segments(local_len, rank, world_size, layout)
    ]
    return torch.cat(parts)  # (T/N,)


def _rank_and_size(
    group: dist.ProcessGroup | None, rank: int | None, world_size: int | None
) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "no torch.distributed process group: pass rank= and world_size=, or call "
            "torch.distributed.init_process_group(...) first"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(
    x: torch.Tensor,
    *,
    dim: int = -2,
    layout: str = "contiguous",
    group: dist.ProcessGroup | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.Tensor:
    """This rank's shard of a full sequence (a copy, positions in shard order).

    Args:
        x: the full tensor, e.g. query ``(B, H, T, D)`` (``dim=-2``) or token ids
            ``(B, T)`` (``dim=-1``).
        dim: the sequence axis.
        layout: ``"contiguous"`` or ``"zigzag"``.
        group: process group giving rank and world size (default: the default group).
        rank, world_size: give both to shard without a process group.

    Returns:
        ``x`` restricted to :func:`shard_positions` along ``dim``.

    Shape:
        ``(..., T, ...)`` -> ``(..., T/N, ...)``

    Raises:
        ValueError: ``T`` not divisible as the layout needs, or unknown layout.
        RuntimeError: no process group and no explicit rank/world_size.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`x` must be a torch.Tensor, got {type(x).__name__}")
    r, n = _rank_and_size(group, rank, world_size)
    check_layout(layout)
    check_divisible(x.shape[dim], n, layout, what=f"`x` along dim {dim}")
    pos = shard_positions(x.shape[dim], r, n, layout).to(x.device)
    return x.index_select(dim, pos).contiguous()


def gather_sequence(
    shard: torch.Tensor,
    *,
    dim: int = -2,
    layout: str = "contiguous",
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Reassemble the full sequence from every rank's shard (inverse of :func:`shard_sequence`).

    A collective: every rank of ``group`` must call it with an equal-shaped shard. Not
    differentiable (use it to inspect outputs and gradients, not inside a loss).

    Shape:
        ``(..., T/N, ...)`` -> ``(..., T, ...)``

    Raises:
        RuntimeError: no process group.
    """
    _, n = _rank_and_size(group, None, None)
    check_layout(layout)
    parts = [torch.empty_like(shard) for _ in range(n)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    local_len = shard.shape[dim]
    seq_len = local_len * n
    out_shape = list(shard.shape)
    out_shape[dim] = seq_len
    full = shard.new_empty(out_shape)
    for r, part in enumerate(parts):
        pos = shard_positions(seq_len, r, n, layout).to(shard.device)
        full.index_copy_(dim % shard.ndim, pos, part)
    return full
