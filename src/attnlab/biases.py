"""Position biases added to the scaled scores: ALiBi (BLOOM, MPT) and T5's relative
position buckets.

Shape legend: B batch, H query heads, T query length, S key length; tq/tk the rows/keys
of one tile.

Both are :class:`attnlab.masks.AttentionMask` kinds: they combine with ``&`` (biases add
up, boolean restrictions intersect) and answer :meth:`~attnlab.masks.AttentionMask.block`
per tile from positions alone, so a tiling backend never materialises ``(T, S)``.
Positions align bottom-right like :class:`attnlab.masks.CausalMask`: query ``i`` sits at
absolute position ``i + S - T`` (the last query is the last key, as when decoding with a
KV cache).
"""

from __future__ import annotations

import math

import torch

from attnlab.masks import AttentionMask, Index, MaskBlock, _positions, _span

__all__ = ["AlibiBias", "RelativePositionBias", "alibi_slopes", "relative_position_bucket"]

# Tiles a RelativePositionBias keeps (a blockwise call uses two or three: the diagonal
# square, the tile left of it, a short last row block).
_KEPT_TILES = 4


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The standard ALiBi slopes (Press et al., 2022) for ``num_heads`` heads, fp64.

    For a power of two ``n`` the slopes are the geometric sequence
    ``2^(-8/n), 2^(-16/n), ..., 2^(-8)``. Otherwise, with ``p`` the largest power of two
    below ``n``, the ``p`` slopes of ``p`` heads are followed by every other slope of
    ``2p`` heads (``1st, 3rd, ...``) until there are ``n`` (the reference implementation's
    rule, also BLOOM's and MPT's).

    Raises:
        ValueError: ``num_heads`` is not a positive int.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"`num_heads` must be a positive int, got {num_heads!r}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 1 << (num_heads.bit_length() - 1)  # largest power of two <= num_heads
    slopes = power_of_two(p)
    if p < num_heads:
        slopes += power_of_two(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float64)


class AlibiBias(AttentionMask):
    """ALiBi: adds ``-slope_h * (i - j)`` to the score of query position i, key j.

    The bias grows with distance into the past, so it is meant for causal attention
    (combine with ``CausalMask()`` or pass ``is_causal=True``). Under a causal mask it
    gives the same softmax as BLOOM's form ``+slope_h * j`` (the two differ by
    ``slope_h * i``, constant along a row).

    Args:
        num_heads: H, for the standard slopes (:func:`alibi_slopes`).
        slopes: or a float tensor ``(H,)`` of slopes (may require grad).

    Raises:
        ValueError: neither or both given, a bad head count, slopes not ``(H,)`` floats.
    """

    kind = "alibi"

    def __init__(self, num_heads: int | None = None, *, slopes: torch.Tensor | None = None):
        if (num_heads is None) == (slopes is None):
            raise ValueError(
                "AlibiBias needs exactly one of `num_heads` (standard slopes) or `slopes` "
                f"(a (H,) tensor), got num_heads={num_heads!r} and slopes="
                f"{'a tensor' if slopes is not None else None}"
            )
        if slopes is None:
            assert num_heads is not None
            slopes = alibi_slopes(num_heads).float()
        elif not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point():
            raise ValueError(
                "`slopes` must be a float tensor (H,), got "
                f"{slopes.dtype if isinstance(slopes, torch.Tensor) else type(slopes).__name__}"
            )
        elif slopes.ndim != 1 or slopes.numel() == 0:
            raise ValueError(f"`slopes` must be 1-D (H,), got shape {tuple(slopes.shape)}")
        self.slopes = slopes

    def validate(self, B: int, H: int, T: int, S: int) -> None:
        if self.slopes.numel() != H:
            raise ValueError(
                f"`slopes` must have one slope per query head (H={H}), got "
                f"{self.slopes.numel()}; use AlibiBias({H}) for the standard slopes"
            )

    @property
    def has_bias(self) -> bool:
        return True

    def grad_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.slopes,) if self.slopes.requires_grad else ()

    def may_empty_rows(self, T: int, S: int) -> bool:
        return False

    def block_status(self, T, S, rows=None, cols=None):
        return "partial"

    def block(self, T, S, rows: Index = None, cols: Index = None, *, device=None) -> MaskBlock:
        dev = device if device is not None else self.slopes.device
        qpos = _positions(rows, T, dev) + (S - T)
        kpos = _positions(cols, S, dev)
        dist = (qpos[:, None] - kpos[None, :]).to(self.slopes.dtype)  # (tq, tk)
        slopes = self.slopes.to(dev)
        return MaskBlock("partial", bias=(-slopes[:, None, None] * dist)[None])  # (1, H, tq, tk)

    def __repr__(self) -> str:
        return f"AlibiBias(H={self.slopes.numel()})"


def relative_position_bucket(
    relative_position: torch.Tensor,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> torch.Tensor:
    """T5's bucket of each relative position ``key - query``.

    Distances below ``max_exact = n // 2`` (``n`` = buckets per direction) get their own
    bucket; larger ones share log-spaced buckets up to ``max_distance``, beyond which all
    fall in the last bucket. Bidirectional: half the buckets for keys after the query.
    Unidirectional: keys after the query all land in bucket 0 (they are masked anyway).

    Shape:
        - relative_position: any integer shape; output: the same, long.
    """
    n = num_buckets
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        n //= 2
        buckets += (relative_position > 0).long() * n
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp_min(0)
    max_exact = n // 2
    large = (
        max_exact
        + (
            torch.log(distance.float().clamp_min(1) / max_exact)
            / math.log(max_distance / max_exact)
            * (n - max_exact)
        ).long()
    )
    large = large.clamp_max(n - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class RelativePositionBias(AttentionMask):
    """T5's relative position bias: a learned scalar per head and distance bucket.

    Adds ``table[bucket(j - i), h]`` to the score of query position i, key j, head h,
    with :func:`relative_position_bucket`. Computed per tile from the bucket ids of the
    tile's distinct distances; gradients reach ``table`` on every backend that serves it.

    Args:
        table: float tensor ``(num_buckets, H)`` (an ``nn.Embedding``'s weight in T5).
        bidirectional: encoder (True) or decoder (False) bucketing.
        num_buckets: buckets in total (T5: 32).
        max_distance: distance from which every position shares the last bucket (T5: 128).

    Raises:
        ValueError: a table that is not ``(num_buckets, H)`` floats, a bucket count too
            small for the bucketing, ``max_distance`` not above the exact range.
    """

    kind = "relative_position"

    def __init__(
        self,
        table: torch.Tensor,
        *,
        bidirectional: bool = True,
        num_buckets: int = 32,
        max_distance: int = 128,
    ) -> None:
        if not isinstance(bidirectional, bool):
            raise ValueError(f"`bidirectional` must be a bool, got {bidirectional!r}")
        per_side = 4 if bidirectional else 2
        if isinstance(num_buckets, bool) or not isinstance(num_buckets, int):
            raise ValueError(f"`num_buckets` must be an int, got {num_buckets!r}")
        if num_buckets < per_side:
            raise ValueError(
                f"`num_buckets` must be >= {per_side} for bidirectional={bidirectional} "
                f"(T5 uses 32), got {num_buckets}"
            )
        max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
        if (
            isinstance(max_distance, bool)
            or not isinstance(max_distance, int)
            or max_distance <= max_exact
        ):
            raise ValueError(
                f"`max_distance` must be an int above the exact range ({max_exact}) "
                f"(T5 uses 128), got {max_distance!r}"
            )
        if not isinstance(table, torch.Tensor) or not table.is_floating_point():
            raise ValueError(
                "`table` must be a float tensor (num_buckets, H), got "
                f"{table.dtype if isinstance(table, torch.Tensor) else type(table).__name__}"
            )
        if table.ndim != 2 or table.shape[0] != num_buckets or table.shape[1] == 0:
            raise ValueError(
                f"`table` must have shape (num_buckets, H) = ({num_buckets}, H), got "
                f"{tuple(table.shape)}; pass num_buckets= to match the table"
            )
        self.table = table
        self._tiles: dict[tuple, torch.Tensor] = {}  # see _toeplitz
        self._near: list[int] | None = None  # see _bucket_of
        self.bidirectional = bidirectional
        self.num_buckets = num_buckets
        self.max_distance = max_distance

    def validate(self, B: int, H: int, T: int, S: int) -> None:
        if self.table.shape[1] != H:
            raise ValueError(
                f"`table` must have one column per query head (num_buckets, H={H}), got "
                f"shape {tuple(self.table.shape)}"
            )

    @property
    def has_bias(self) -> bool:
        return True

    def grad_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.table,) if self.table.requires_grad else ()

    def may_empty_rows(self, T: int, S: int) -> bool:
        return False

    def block_status(self, T, S, rows=None, cols=None):
        return "partial"

    def block(self, T, S, rows: Index = None, cols: Index = None, *, device=None) -> MaskBlock:
        dev = device if device is not None else self.table.device
        rs, cs = _span(rows, T), _span(cols, S)
        if rs is not None and cs is not None and rs[1] > rs[0] and cs[1] > cs[0]:
            # A contiguous tile is a Toeplitz matrix: key - query runs over tq + tk - 1
            # distances; bucket those, then lay the rows out as sliding windows.
            (q0, q1), (k0, k1) = rs, cs
            lo = k0 - (q1 - 1 + S - T)  # the smallest key - query of the tile
            return MaskBlock("partial", bias=self._toeplitz(lo, q1 - q0, k1 - k0, dev))
        qpos = _positions(rows, T, dev) + (S - T)
        kpos = _positions(cols, S, dev)
        rel = kpos[None, :] - qpos[:, None]  # (tq, tk) key - query
        lo = int(rel.min()) if rel.numel() else 0
        hi = int(rel.max()) if rel.numel() else 0
        per_distance = self._per_distance(torch.arange(lo, hi + 1, device=dev), dev)
        return MaskBlock("partial", bias=per_distance[:, rel - lo][None])  # (1, H, tq, tk)

    def _toeplitz(self, lo: int, tq: int, tk: int, dev: torch.device | str) -> torch.Tensor:
        """The bias of a contiguous ``(tq, tk)`` tile whose smallest key - query is ``lo``,
        ``(1, H, tq, tk)``: it depends on nothing else, so the tiles along a diagonal of a
        blockwise call are one tensor, built once (kept while the table is unchanged and
        outside autograd; a few per mask; the caller must not write to it)."""
        try:  # an inference tensor has no version counter: then nothing is kept
            version = self.table._version
        except RuntimeError:
            version = None
        keep = version is not None and not (self.table.requires_grad and torch.is_grad_enabled())
        key = (lo, tq, tk, str(dev), self.table.dtype, version)
        if keep and (hit := self._tiles.get(key)) is not None:
            return hit
        per_distance = self._per_distance(torch.arange(lo, lo + tq + tk - 1, device=dev), dev)
        # window m holds distances lo + m .. lo + m + tk - 1: row i is window tq-1-i
        bias = per_distance.unfold(1, tk, 1).flip(1)[None]  # (1, H, tq, tk)
        if keep:
            if len(self._tiles) >= _KEPT_TILES:
                self._tiles.clear()
            self._tiles[key] = bias
        return bias

    def constant_bias(self, T, S, rows, cols, *, device=None):
        rs, cs = _span(rows, T), _span(cols, S)
        if rs is None or cs is None or rs[1] <= rs[0] or cs[1] <= cs[0]:
            return None
        (q0, q1), (k0, k1) = rs, cs
        lo = k0 - (q1 - 1 + S - T)  # the smallest and largest key - query of the tile
        hi = k1 - 1 - (q0 + S - T)
        if self.bidirectional and (lo > 0) != (hi > 0):
            return None
        # The bucket is monotone in key - query on each side of 0, so equal buckets at both
        # ends mean one bucket for the whole tile (far from the diagonal: the last one).
        dev = device if device is not None else self.table.device
        bucket = self._bucket_of(lo)
        if bucket != self._bucket_of(hi):
            return None
        return self.table.to(dev)[bucket][None, :, None, None]  # (1, H, 1, 1)

    def _bucket_of(self, distance: int) -> int:
        """:func:`relative_position_bucket` of one key - query, without a tensor op (a
        blockwise plan asks for two per tile): looked up in the buckets of
        ``-max_distance..max_distance``, beyond which the bucket no longer changes."""
        if self._near is None:
            m = self.max_distance
            self._near = self._buckets(torch.arange(-m, m + 1)).tolist()
        m = self.max_distance
        return self._near[min(max(distance, -m), m) + m]

    def _buckets(self, distances: torch.Tensor) -> torch.Tensor:
        return relative_position_bucket(
            distances,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )

    def _per_distance(self, distances: torch.Tensor, dev: torch.device | str) -> torch.Tensor:
        """The bias of each distance (key - query) per head, ``(H, len(distances))``."""
        return self.table.to(dev).t()[:, self._buckets(distances)]

    def __repr__(self) -> str:
        return (
            f"RelativePositionBias(num_buckets={self.num_buckets}, H={self.table.shape[1]}, "
            f"bidirectional={self.bidirectional}, max_distance={self.max_distance})"
        )
