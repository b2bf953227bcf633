"""Normalisation layers shared by the attention layer and the models, and the QK-norm option.

Shape legend: C the normalised (last) dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

__all__ = ["HeadwiseNorm", "L2Norm", "QKNorm", "RMSNorm", "norm_heads", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32 and
    returned in ``x``'s dtype before the weight multiplies it: :class:`RMSNorm`'s numbers,
    and the decode step's for its float32 rows (no dtype round trip there).

    Args:
        x: ``(..., C)``.
        weight: broadcastable to ``x``, or None (no weight: :class:`L2Norm`).
        eps: added to the mean square.
    """
    xf = x if x.dtype == torch.float32 else x.float()
    normed = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True).add_(eps))
    if normed.dtype != x.dtype:
        normed = normed.to(x.dtype)
    return normed if weight is None else weight * normed


def norm_heads(
    scope: str, norm: Callable[[torch.Tensor], torch.Tensor], flat: torch.Tensor, heads: int
) -> torch.Tensor:
    """Queries or keys through their QK-norm, as :class:`QKNorm`'s ``scope`` says: over
    the heads' concatenation (``"all"``, OLMo 2) or over each head vector (``"head"``, and
    ``"each_head"`` with a weight per head). The attention layer's and the decode step's.

    Shape:
        flat ``(B, T, heads * D)`` -> ``(B, heads, T, D)``.
    """
    B, T, _ = flat.shape
    if scope == "all":
        return norm(flat).view(B, T, heads, -1).transpose(1, 2)  # (B, heads, T, D)
    return norm(flat.view(B, T, heads, -1).transpose(1, 2))  # (B, heads, T, D)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed in fp32.

    Args:
        dim: width of the last dim.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., C)."""
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class L2Norm(nn.Module):
    """``x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32, no weight (Llama 4's
    QK-norm). Without a weight it commutes with RoPE (a rotation keeps the mean square).

    Args:
        eps: added to the mean square.
    """

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., C)."""
        return rms_norm(x, None, self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


@dataclass(frozen=True)
class QKNorm:
    """Normalise queries and keys before RoPE (and before the scores), as these models do.

    Args:
        kind: ``"rms"`` (:class:`RMSNorm`: Qwen3, Gemma 3, OLMo 2), ``"layer"``
            (``torch.nn.LayerNorm`` with weight and bias: Persimmon, StableLM 2) or ``"l2"``
            (:class:`L2Norm`, RMS without a weight: Llama 4; scope ``"head"`` only).
        scope: ``"head"``: one norm of width D shared by all heads, applied to each head
            vector (Qwen3, Gemma 3); ``"all"``: one norm over all heads' concatenation,
            width ``H*D`` for queries and ``G*D`` for keys (OLMo 2); ``"each_head"``: each
            head vector normalised with its own weight (:class:`HeadwiseNorm`, StableLM 2
            12B's LayerNorm per head, no bias).
        eps: the norm's epsilon.

    Gemma's RMSNorm multiplies by ``1 + weight``: load ``weight + 1`` into this one.

    Raises:
        ValueError: unknown ``kind`` or ``scope``, non-positive ``eps``.
    """

    kind: Literal["rms", "layer", "l2"] = "rms"
    scope: Literal["head", "all", "each_head"] = "head"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.kind not in ("rms", "layer", "l2"):
            raise ValueError(f"`kind` must be 'rms', 'layer' or 'l2', got {self.kind!r}")
        if self.scope not in ("head", "all", "each_head"):
            raise ValueError(
                f"`scope` must be 'head' (per head vector), 'all' (across heads) or "
                f"'each_head' (a weight per head), got {self.scope!r}"
            )
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or self.eps <= 0:
            raise ValueError(f"`eps` must be a positive number, got {self.eps!r}")
        if self.kind == "l2" and self.scope != "head":
            raise ValueError(f"`kind` 'l2' has no weight: use scope 'head', got {self.scope!r}")

    def build(self, width: int, heads: int = 1) -> nn.Module:
        """A fresh norm over a last dim of ``width`` (``heads``: for ``"each_head"``)."""
        if self.kind == "l2":
            return L2Norm(self.eps)
        if self.scope == "each_head":
            return HeadwiseNorm(heads, width, kind=self.kind, eps=self.eps)
        if self.kind == "rms":
            return RMSNorm(width, self.eps)
        return nn.LayerNorm(width, eps=self.eps)


class HeadwiseNorm(nn.Module):
    """Each head vector normalised (LayerNorm without bias, or RMSNorm) with its own weight.

    Args:
        heads: number of heads (the weight has one row per head).
        dim: head dim D.
        kind: ``"layer"`` or ``"rms"``.
        eps: the norm's epsilon.

    Shape:
        ``(B, heads, T, D) -> (B, heads, T, D)``.
    """

    def __init__(self, heads: int, dim: int, *, kind: str = "layer", eps: float = 1e-5) -> None:
        super().__init__()
        self.kind = kind
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, heads, T, D) -> (B, heads, T, D)."""
        if self.kind == "layer":
            y = nn.functional.layer_norm(x, (x.shape[-1],), eps=self.eps)
            return y * self.weight[:, None, :]  # (B, heads, T, D)
        return rms_norm(x, self.weight[:, None, :], self.eps)  # (B, heads, T, D)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, kind={self.kind!r}, eps={self.eps}"
