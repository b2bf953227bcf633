"""Types shared by every backend: the request a backend is asked to serve, its result,
and the selection of attention weights a caller may ask for.

Shape legend: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim (query/key), Dv value head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnlab.masks import AttentionMask

__all__ = [
    "AttentionRequest",
    "Backend",
    "BackendResult",
    "WeightsRequest",
    "add_sinks",
    "softcap_scores",
]


def softcap_scores(
    scores: torch.Tensor, softcap: float | None, *, inplace: bool = False
) -> torch.Tensor:
    """Gemma 2's logit soft-capping ``softcap * tanh(scores / softcap)`` of the scaled
    scores (before masks and biases); ``softcap=None`` returns ``scores`` unchanged.

    ``inplace`` overwrites ``scores`` (tiling backends, outside autograd).
    """
    if softcap is None:
        return scores
    if inplace:
        return scores.div_(softcap).tanh_().mul_(softcap)
    return torch.tanh(scores / softcap) * softcap


def add_sinks(lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The row log-sum-exp with each head's sink logit joining the denominator.

    ``log(exp(lse) + exp(sink_h))``; a row that saw nothing (``lse = -inf``) gets
    ``sink_h``, so all its mass goes to the sink and its output is 0.

    Shape:
        - lse: ``(B, H, T)``; sinks: ``(H,)``; output: ``(B, H, T)``
    """
    if sinks is None:
        return lse
    return torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])


@dataclass(frozen=True)
class WeightsRequest:
    """Which attention weights to return: a selection of heads and of query rows.

    ``need_weights=True`` means all heads and all rows. Selecting one head of a long
    sequence costs ``B x 1 x len(rows) x S`` memory, never ``B x H x T x S``.

    Args:
        heads: query-head indices (negative counts from the end), or None for all.
        rows: query positions (a sequence of ints or a slice), or None for all.
    """

    heads: tuple[int, ...] | None = None
    rows: tuple[int, ...] | slice | None = None

    def __post_init__(self) -> None:
        if self.heads is not None:
            if isinstance(self.heads, int):
                object.__setattr__(self, "heads", (self.heads,))
            object.__setattr__(self, "heads", tuple(int(h) for h in self.heads))
        if self.rows is not None and not isinstance(self.rows, slice):
            if isinstance(self.rows, int):
                object.__setattr__(self, "rows", (self.rows,))
            object.__setattr__(self, "rows", tuple(int(r) for r in self.rows))

    @staticmethod
    def from_arg(need_weights: object, name: str = "need_weights") -> WeightsRequest | None:
        """Normalise ``need_weights`` (bool or WeightsRequest) into a request or None."""
        if isinstance(need_weights, WeightsRequest):
            return need_weights
        if isinstance(need_weights, bool):
            return WeightsRequest() if need_weights else None
        raise TypeError(
            f"`{name}` must be a bool or an attnlab WeightsRequest(heads=..., rows=...), "
            f"got {type(need_weights).__name__}"
        )

    def head_index(self, H: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """Validated head indices as a long tensor (None = all heads)."""
        if self.heads is None:
            return None
        bad = [h for h in self.heads if not -H <= h < H]
        if bad or not self.heads:
            raise ValueError(
                f"`need_weights` asks for head(s) {list(self.heads)}, but the query has "
                f"H={H} heads; use indices in 0..{H - 1}"
            )
        return torch.tensor([h % H for h in self.heads], dtype=torch.long, device=device)

    def row_index(self, T: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """Validated query-row positions as a long tensor (None = all rows)."""
        if self.rows is None:
            return None
        if isinstance(self.rows, slice):
            rows = torch.arange(T)[self.rows]
            if rows.numel() == 0:
                raise ValueError(f"`need_weights` rows {self.rows} select no row of T={T}")
            return rows.to(device)
        bad = [r for r in self.rows if not -T <= r < T]
        if bad or not self.rows:
            raise ValueError(
                f"`need_weights` asks for query row(s) {list(self.rows)}, but T={T}; "
                f"use positions in 0..{T - 1}"
            )
        return torch.tensor([r % T for r in self.rows], dtype=torch.long, device=device)


@dataclass(frozen=True)
class AttentionRequest:
    """Everything a backend needs to know to say whether it can serve a call."""

    B: int
    H: int
    G: int
    T: int
    S: int
    D: int
    Dv: int
    dtype: torch.dtype
    device_type: str
    mask: AttentionMask | None
    dropout_p: float
    needs_grad: bool
    weights: WeightsRequest | None
    softcap: float | None = None
    sinks: bool = False


@dataclass(frozen=True)
class BackendResult:
    """What a backend returns.

    Attributes:
        output: ``(B, H, T, Dv)`` in the query's dtype.
        lse: per-row log-sum-exp of the scaled, masked scores ``(B, H, T)`` in fp32
            (``-inf`` for a row with nothing to attend to), when the backend has it. With
            attention sinks it includes the sink logit (it is the softmax's denominator).
        weights: the full ``(B, H, T, S)`` weights, when the backend materialised them.
    """

    output: torch.Tensor
    lse: torch.Tensor | None = None
    weights: torch.Tensor | None = None


BackendFn = Callable[..., BackendResult]


@dataclass(frozen=True)
class Backend:
    """A registered backend.

    Attributes:
        name: the name users pass as ``backend=``.
        run: ``run(query, key, value, mask, *, dropout_p, scale, softcap, sinks)
            -> BackendResult``.
        why_not: ``why_not(request) -> str | None``: None when the backend can serve the
            request, else a human-readable reason.
        why_not_auto: extra reasons to skip it under ``backend="auto"`` although it could
            serve the request (e.g. it would materialise a large dense mask).
        summary: one line for ``attnlab info``.
        last_resort: ``auto`` picks it only when no other backend can serve the request
            (the materialising reference).
        cache_decisions: whether a call's choice of this backend may be cached (see
            ``attnlab.backends.resolve_call``): True when ``why_not``/``why_not_auto``
            depend on the request alone (its shapes, dtypes, pass and mask structure), False
            when they also read state outside the call (ring: the process group).
    """

    name: str
    run: BackendFn
    why_not: Callable[[AttentionRequest], str | None]
    why_not_auto: Callable[[AttentionRequest], str | None] = field(default=lambda r: None)
    summary: str = ""
    last_resort: bool = False
    cache_decisions: bool = True


def check_weights_request(request: WeightsRequest, H: int, T: int) -> None:
    """Raise ValueError for heads/rows outside the query's range."""
    request.head_index(H)
    request.row_index(T)
