"""bfloat16 weights: :class:`BF16Linear` (``"bfloat16"``).

Shape legend: N output features, K input features, M rows of input (B*T).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from attnlab.quant import crossover
from attnlab.quant.base import WeightFormat, fuse_buffers, register_format
from attnlab.quant.kinds import NATIVE_LINEAR, NativeProduct

__all__ = ["BF16Linear"]


@register_format
class BF16Linear(WeightFormat):
    """``y = x Wᵀ + b`` with ``W`` stored in bfloat16 (the product in bf16, fp32 accumulation).

    Args:
        weight: (N, K) float weight, rounded to bfloat16.
        bias: (N,) or None; kept in float32.
    """

    name = "bfloat16"
    cli_help = "the weight rounded"
    weight_bf16: torch.Tensor
    # Its decode kernel and its dense product are one mm: only the prompt's dtype changes
    # (:mod:`attnlab.quant.arith`), from 16 rows on; nothing to measure.
    dense_from_tokens = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_bf16", weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = 32
    ) -> BF16Linear:
        """The weight rounded to bfloat16 (``group_size`` is not used)."""
        return cls(weight, bias)

    @classmethod
    def from_stored(
        cls, stored: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> BF16Linear:
        """From ``(weight,)``: a bf16 weight's codes are its values."""
        (weight,) = stored
        return cls(weight, bias)

    @classmethod
    def fuse(cls, parts: Sequence[Any], bias: torch.Tensor | None) -> BF16Linear:
        """Rows stacked; the parts' weights become views of the fused one (no second copy)."""
        return fuse_buffers(cls, parts, ("weight_bf16",), bias)  # type: ignore[no-any-return]

    @property
    def weight(self) -> torch.Tensor:
        """The stored weight as float32 (N, K)."""
        return self.weight_bf16.float()

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) bfloat16 -> (M, N); float32 rows (a prompt where bf16 products are slow,
        :mod:`attnlab.quant.arith`) against the weight's exact float32 values."""
        return crossover.dense_mm(x2, self.weight_bf16.to(x2.dtype))

    def decode_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        wt = self.weight_bf16.t()
        return lambda x: torch.mm(x, wt)

    def native_product(self) -> NativeProduct | None:
        return NativeProduct(NATIVE_LINEAR, self.weight_bf16, None, 0, self.out_features, self.bias)
