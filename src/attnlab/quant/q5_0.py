"""Weight-only 5-bit codes with one scale per 32 weights: :class:`Q5Linear` (``"q5_0"``),
llama.cpp's Q5_0 as it stores it.

Shape legend: N output features, K input features, M rows of input (B*T), R weight rows
of a GGUF tensor, G blocks per row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import torch

from attnlab.quant import crossover
from attnlab.quant.base import (
    GGUFBlock,
    WeightFormat,
    fresh_copy,
    fuse_buffers,
    native_kernels,
    native_rows_dtype,
    register_format,
    tensor_version,
)
from attnlab.quant.kinds import NATIVE_Q5, NativeProduct
from attnlab.quant.q8_0 import Q8Linear

__all__ = ["Q5Linear"]

# ggml's block_q5_0: 32 weights in d (float16), qh (4 bytes of fifth bits), qs (16 bytes).
_BLOCK = GGUFBlock(values=32, nbytes=22, f16_scales=1)


def _q5_0_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) in 0..31 and float16 scales (N, K/32) as ggml's ``block_q5_0``s, one
    weight row's blocks after another: (N, G * 22) uint8 (see :class:`Q5Linear`)."""
    N, K = codes.shape
    q = codes.to(torch.uint8).view(N, K // 32, 32)  # (N, G, 32)
    qs = (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)  # (N, G, 16)
    fifth = (q >> 4).view(N, K // 32, 4, 8).to(torch.int32)  # weight 8i + j: byte i, bit j
    qh = (fifth << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)  # (N, G, 4)
    d = scales.to(torch.float16).contiguous().view(torch.uint8).view(N, K // 32, 2)
    return torch.cat([d, qh, qs], dim=-1).view(N, K // 32 * _BLOCK.nbytes)


def _q5_0_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_q5_0_blocks` undone: codes (N, K) uint8 in 0..31, scales (N, K/32) float16."""
    N, G = blocks.shape[0], blocks.shape[1] // _BLOCK.nbytes
    b = blocks.view(N, G, _BLOCK.nbytes)
    d = b[..., :2].contiguous().view(torch.float16).view(N, G)
    bits = (b[..., 2:6, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # (N, G, 4, 8)
    qs = b[..., 6:]  # (N, G, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=-1) | (bits.view(N, G, 32) << 4)  # (N, G, 32)
    return q.view(N, G * 32), d


@register_format
class Q5Linear(WeightFormat):
    """Weight-only 5-bit codes with one scale per 32 weights: llama.cpp's Q5_0, as it stores it.

    ``W[n, k] = d[n, g] * (q[n, k] - 16)`` with q in 0..31 and ``g = k // 32``, held as the
    file's blocks (ggml's ``block_q5_0``, 22 bytes per 32 weights: 0.6875 bytes a weight,
    where :class:`Q8Linear` holds 1.0625), one weight row's blocks after another: bytes 0-1
    ``d`` (float16), 2-5 ``qh`` (a little-endian uint32, bit ``j`` the fifth bit of weight
    ``j``), 6-21 ``qs`` (weight ``j < 16`` in the low nibble of ``qs[j]``, weight ``j + 16``
    in its high nibble). A GGUF Q5_0 tensor's blocks are taken as stored
    (:meth:`gguf_codes`, :meth:`from_stored`). Every ``d (q - 16)`` is exact in float32:
    :attr:`weight` is the file's values.

    A few rows of input (decoding) run attnlab's kernel for this layout
    (``attnlab/native/q5_0.h``, built by :mod:`attnlab.native`): the blocks read once, each
    weight unpacked in registers, the products and sums in float32, the result rounded to
    bfloat16 as the int kernels'. Where that build is unavailable, the codes run as a
    :class:`Q8Linear` (``q - 16`` as its 8-bit codes, the same scales), built on first use
    and kept beside the module, not in its state (a file's weight of rows that one cannot
    hold, not a multiple of 8, is dequantised for each product). From its
    crossover on (:meth:`~attnlab.quant.WeightFormat.runs_dense`; a prompt) the weight is
    dequantised for that call and run by the dense ``mm``.

    Args:
        blocks: (N, K/32 * 22) uint8, K a multiple of 32.
        bias: (N,) or None; kept in float32.
    """

    name = "q5_0"
    cli_help = "llama.cpp's Q5_0: 5 bits and a scale per 32 weights"
    gguf_blocks: ClassVar[Mapping[str, GGUFBlock]] = MappingProxyType({"Q5_0": _BLOCK})
    fallback = "int8"
    blocks: torch.Tensor
    #: The crossover without measuring (``ATTNLAB_CROSSOVER=defaults``);
    #: :mod:`attnlab.quant.crossover` measures this machine's.
    default_dense_from: ClassVar[int] = 128

    def __init__(self, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.ndim != 2 or blocks.shape[1] % _BLOCK.nbytes:
            raise ValueError(
                f"`blocks` must be a 2-D uint8 tensor of whole {_BLOCK.nbytes}-byte blocks "
                f"per row, got {blocks.dtype} of shape {tuple(blocks.shape)}"
            )
        self.out_features, self.in_features = self.weight_shape((blocks,))
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def weight_shape(cls, stored: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """(N, K) of ``(blocks,)``: 32 weights per 22 bytes."""
        (blocks,) = stored
        return blocks.shape[0], blocks.shape[1] // _BLOCK.nbytes * 32

    @classmethod
    def why_not(cls, out_features: int, in_features: int, group_size: int = 32) -> str | None:
        # The same shapes as q8_0's: without the native build the codes run as one.
        return Q8Linear.why_not(out_features, in_features, group_size)

    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Q5Linear:
        """From codes (N, K) in 0..31 and scales (N, K/32), rounded to float16.

        Raises:
            ValueError: K not a multiple of 32, or codes out of range.
        """
        N, K = codes.shape
        if K % 32 or scales.shape != (N, K // 32):
            raise ValueError(
                f"q5_0 needs codes (N, K) with K a multiple of 32 and scales (N, K/32), got "
                f"{tuple(codes.shape)} and {tuple(scales.shape)}"
            )
        if bool(((codes < 0) | (codes > 31)).any()):
            raise ValueError("q5_0 codes must be in 0..31")
        return cls(_q5_0_blocks(codes, scales), bias)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = 32
    ) -> Q5Linear:
        """Per 32 weights, as ggml's ``quantize_row_q5_0_ref``: ``d = -m / 16`` for the
        block's value ``m`` of largest magnitude (the first of them), ``q = trunc(w / d +
        16.5)`` clamped to 31 (the division by the float32 ``d``, which is then stored as
        float16). ``group_size`` is ignored: the format's groups are 32.

        Raises:
            ValueError: a shape :meth:`why_not` refuses, or a block whose scale passes
                float16's range (``max |w| > 16 * 65504``).
        """
        N, K = weight.shape
        why = cls.why_not(N, K)
        if why is not None:
            raise ValueError(f"cannot hold a q5_0 weight of shape {(N, K)}: {why}")
        w = weight.detach().float().reshape(N, K // 32, 32)  # (N, G, 32)
        largest = w.gather(-1, w.abs().argmax(-1, keepdim=True))  # (N, G, 1), signed
        d = largest / -16.0
        if not bool((d.abs() <= torch.finfo(torch.float16).max).all()):
            raise ValueError(
                "q5_0 scales are float16: a block's largest |weight| must be at most "
                f"{16 * torch.finfo(torch.float16).max:g}, got {w.abs().max().item():g}"
            )
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = torch.trunc(w * inv + 16.5).clamp_(0, 31).to(torch.uint8)  # (N, G, 32)
        return cls(_q5_0_blocks(q.view(N, K), d.view(N, K // 32).to(torch.float16)), bias)

    @classmethod
    def from_stored(
        cls, stored: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> Q5Linear:
        """From ``(blocks,)``: a GGUF Q5_0 tensor as stored (:meth:`gguf_codes`)."""
        (blocks,) = stored
        return cls(blocks, bias)

    @classmethod
    def gguf_codes(
        cls, data: np.ndarray, type_name: str, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Q5_0 blocks as stored (copied out of the file): ``(blocks,)``, (R, G * 22) uint8,
        each weight row's blocks in a row (:meth:`~attnlab.quant.WeightFormat.gguf_codes`)."""
        R = shape[0]
        blocks = fresh_copy(cls.gguf_block_rows(data, type_name, shape)).reshape(R, -1)
        return (torch.from_numpy(blocks),)

    @classmethod
    def fuse(cls, parts: Sequence[Any], bias: torch.Tensor | None) -> Q5Linear:
        """Rows stacked; the parts' blocks become views of the fused ones."""
        return fuse_buffers(cls, parts, ("blocks",), bias)  # type: ignore[no-any-return]

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes (N, K) uint8 in 0..31 and the scales (N, K/32) float16."""
        return _q5_0_fields(self.blocks)

    @property
    def weight(self) -> torch.Tensor:
        """The weight, float32 (N, K): ``d * (q - 16)``, exact."""
        q, d = self.codes()
        N, K = q.shape
        w = (q.view(N, K // 32, 32).float() - 16.0) * d.float()[..., None]  # (N, G, 32)
        return w.view(N, K)

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) bfloat16 -> (M, N)."""
        if self.runs_dense(x2.shape[0]):
            # A prompt: every d * (q - 16) (exact in float32), rounded once to bfloat16
            # for a bf16 product, exact for a float32 one.
            return crossover.dense_mm(x2, self._dense_weight(x2.dtype))
        return self.decode_kernel()(x2)

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """:attr:`weight` in ``dtype`` (N, K; bfloat16: rounded once): unpacked by the
        native build where there is one (in registers, where torch's shifts and masks write
        each step out: a fifth of a float32 prompt's time on Gemma 3 270M)."""
        ext = native_kernels()
        if ext is not None and dtype in (torch.bfloat16, torch.float32):
            w = ext.q5_0_dequant(self.blocks, dtype == torch.float32)
            return w  # type: ignore[no-any-return]
        return self.weight.to(dtype)

    def decode_dtype(self) -> torch.dtype:
        """:func:`native_rows_dtype` for attnlab's kernel, bfloat16 for the q8_0 halves
        or the dense product without it."""
        return native_rows_dtype(native_kernels())

    def decode_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        ext = native_kernels()
        if ext is not None:
            op, blocks = ext.q5_0_mm, self.blocks
            return lambda x: op(x, blocks)
        if Q8Linear.why_not(self.out_features, self.in_features) is not None:
            # A file's rows that q8_0's int4 halves cannot pack: the dense product.
            return lambda x: torch.mm(x, self.weight.to(torch.bfloat16).t())
        return self._as_q8().decode_kernel()

    def _as_q8(self) -> Q8Linear:
        """The codes as a :class:`Q8Linear` (``q - 16``, the same scales: the same weight),
        the kernel without the native build; built on first use and again when the blocks
        change."""
        key = (self.blocks.data_ptr(), tensor_version(self.blocks))
        cached = self.__dict__.get("_q8")
        if cached is not None and cached[0] == key:
            return cached[1]
        q, d = self.codes()
        as_q8 = Q8Linear((q.to(torch.int16) - 16).to(torch.int8), d)
        # In __dict__, not as an attribute: a module attribute would be a submodule, in
        # the state dict and the module tree.
        self.__dict__["_q8"] = (key, as_q8)
        return as_q8

    def native_product(self) -> NativeProduct | None:
        return NativeProduct(NATIVE_Q5, self.blocks, None, 32, self.out_features, self.bias)
