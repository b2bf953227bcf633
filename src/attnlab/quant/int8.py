"""Weight-only int8 with one scale per row: :class:`Int8Linear` (``"int8"``).

Shape legend: N output features, K input features, M rows of input (B*T).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from attnlab.quant import crossover
from attnlab.quant.base import WeightFormat, fuse_buffers, register_format
from attnlab.quant.kinds import NATIVE_INT8, NativeProduct

__all__ = ["Int8Linear"]


@register_format
class Int8Linear(WeightFormat):
    """Weight-only int8: ``W = q * scale[row]``, q in [-127, 127], one bf16 scale per row.

    Args:
        qweight: (N, K) int8 codes.
        scales: (N,) bfloat16 scales.
        bias: (N,) or None; kept in float32.
    """

    name = "int8"
    cli_help = "one scale per row"
    qweight: torch.Tensor
    scales: torch.Tensor
    #: The crossover without measuring (``ATTNLAB_CROSSOVER=defaults``; the EPYC's, in
    #: ``benchmarks/bench_int_prefill.py``); :mod:`attnlab.quant.crossover` measures this
    #: machine's.
    default_dense_from: ClassVar[int] = 16

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.ndim != 2:
            raise TypeError(f"`qweight` must be a 2-D int8 tensor, got {qweight.dtype}")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = 32
    ) -> Int8Linear:
        """Quantise a float (N, K) weight: scale = max|row| / 127, rounded to bf16 first
        (``group_size`` is not used: one scale per row)."""
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)  # (N,)
        # Codes from the bf16 scale the kernel will use, so the scale's rounding is absorbed.
        q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, bias)

    @classmethod
    def from_stored(
        cls, stored: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> Int8Linear:
        """From ``(qweight (N, K) int8, scales (N,))``."""
        qweight, scales = stored
        return cls(qweight, scales, bias)

    @classmethod
    def fuse(cls, parts: Sequence[Any], bias: torch.Tensor | None) -> Int8Linear:
        """Rows stacked; the parts' codes and scales become views of the fused ones."""
        return fuse_buffers(cls, parts, ("qweight", "scales"), bias)  # type: ignore[no-any-return]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight, float32 (N, K)."""
        return self.qweight.float() * self.scales.float()[:, None]

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) bfloat16 -> (M, N)."""
        # torch's int8 kernel (torch 2.13 CPU) needs K a multiple of 16: otherwise it returns
        # wrong numbers for one row (K=24) or crashes for several (K=24, 40); dense then
        if self.runs_dense(x2.shape[0]) or self.in_features % 16:
            # Codes in [-127, 127] are exact in bf16; W = diag(scale) q, so scale the columns.
            return crossover.dense_mm(x2, self.qweight.to(x2.dtype)).mul_(self.scales)
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)

    def decode_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.in_features % 16:  # the kernel's wrong widths (see product)
            return self.product
        op, q, s = torch.ops.aten._weight_int8pack_mm, self.qweight, self.scales
        return lambda x: op(x, q, s)

    def native_product(self) -> NativeProduct | None:
        if self.in_features % 16:  # the kernel's wrong widths (see product)
            return None
        return NativeProduct(
            NATIVE_INT8, self.qweight, self.scales, 0, self.out_features, self.bias
        )
