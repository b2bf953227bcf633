"""Normalisation layers shared by the attention layer and the models, and the QK-norm option.

Shape legend: C the normalised (last) dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

__all__ = ["HeadwiseNorm", "QKNorm", "RMSNorm"]


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
        xf = x.float()  # no copy for fp32 input
        xf = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


@dataclass(frozen=True)
class QKNorm:
    """Normalise queries and keys before RoPE (and before the scores), as these models do.

    Args:
        kind: ``"rms"`` (:class:`RMSNorm`: Qwen3, Gemma 3, OLMo 2) or ``"layer"``
            (``torch.nn.LayerNorm`` with weight and bias: Persimmon, StableLM 2).
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

    kind: Literal["rms", "layer"] = "rms"
    scope: Literal["head", "all", "each_head"] = "head"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.kind not in ("rms", "layer"):
            raise ValueError(f"`kind` must be 'rms' or 'layer', got {self.kind!r}")
        if self.scope not in ("head", "all", "each_head"):
            raise ValueError(
                f"`scope` must be 'head' (per head vector), 'all' (across heads) or "
                f"'each_head' (a weight per head), got {self.scope!r}"
            )
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or self.eps <= 0:
            raise ValueError(f"`eps` must be a positive number, got {self.eps!r}")

    def build(self, width: int, heads: int = 1) -> nn.Module:
        """A fresh norm over a last dim of ``width`` (``heads``: for ``"each_head"``)."""
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
        else:
            xf = x.float()
            y = (xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)
        return y * self.weight[:, None, :]  # (B, heads, T, D)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, kind={self.kind!r}, eps={self.eps}"
