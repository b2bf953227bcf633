"""Weight-only int8 with one scale per 32 weights: :class:`Q8Linear` (``"q8_0"``),
llama.cpp's Q8_0 as it stores it.

GGUF block layout (``ggml-common.h``), 32 weights, little-endian: ``d: f16``,
``qs: i8[32]``; weight ``j`` is ``qs[j] * d``.

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
from attnlab.quant.int4 import Int4Linear
from attnlab.quant.kinds import NATIVE_Q8, NativeProduct

__all__ = ["Q8Linear"]


@register_format
class Q8Linear(WeightFormat):
    """Weight-only int8 with one scale per 32 weights: llama.cpp's Q8_0, as it stores it.

    ``W[n, k] = d[n, g] * q[n, k]`` with q in -127..127 and ``g = k // 32``, held as int8
    codes (N, K) and scales (N, K/32): 1.0625 bytes a weight. A GGUF Q8_0 tensor's own
    codes and float16 scales are taken as stored (:meth:`gguf_codes`,
    :meth:`from_stored`). Every ``d * q`` is exact in float32: :attr:`weight` is the
    file's values.

    A few rows of input (decoding) run attnlab's kernel for this layout
    (``attnlab/native/q8_0.h``, built by :mod:`attnlab.native`): the codes read once, each
    32-block of the input quantised to 16-bit codes with a float scale (within 2^-16 of the
    block's largest value), integer dot products per block, their sums in float32, the
    result rounded to bfloat16 as the int kernels'. Where
    that build is unavailable (no C++ compiler), PyTorch's int4 kernel runs instead: q
    splits exactly into two 4-bit codes, ``q = 16 hi + lo`` (hi in -8..7, lo in 0..15), one
    int4 weight of 2N rows (rows ``n``: hi, scale ``16 d``; rows ``N + n``: lo, scale ``d``,
    zero ``8 d``), the product the two halves summed; built from the codes on first use and
    kept beside the module, not in its state. That path reads 1.25 bytes a weight and its
    scales are bfloat16, so its products are within bfloat16's rounding of the native ones.
    From its crossover on (:meth:`~attnlab.quant.WeightFormat.runs_dense`; a prompt) the
    weight is dequantised for that call and run by the dense ``mm``.

    The scales are float16, Q8_0's own type: a file's scales are held exactly, and
    :meth:`from_float`'s have three more significant bits than bfloat16's. A weight whose
    scales pass float16's range (``max |w| > 127 * 65504`` in a block) gets bfloat16 ones.

    Args:
        codes: (N, K) int8 codes in -127..127, K a multiple of 32.
        scales: (N, K/32) float16 or bfloat16.
        bias: (N,) or None; kept in float32.
    """

    name = "q8_0"
    cli_help = "llama.cpp's Q8_0: a scale per 32 weights"
    gguf_blocks: ClassVar[Mapping[str, GGUFBlock]] = MappingProxyType(
        {"Q8_0": GGUFBlock(values=32, nbytes=34, f16_scales=1)}  # d
    )
    fallback = "int8"
    gathers_rows = True
    codes: torch.Tensor
    scales: torch.Tensor
    #: The crossover without measuring (``ATTNLAB_CROSSOVER=defaults``; the EPYC's, where
    #: the dense product of the dequantised weight overtakes the native kernel,
    #: ``benchmarks/bench_q8_0.py --rows``); :mod:`attnlab.quant.crossover` measures this
    #: machine's.
    default_dense_from: ClassVar[int] = 20
    #: Weights dequantised at a time by the dense product (rows of that many values).
    _dense_chunk: ClassVar[int] = 1 << 22

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if codes.dtype != torch.int8 or codes.ndim != 2 or codes.shape[1] % 32:
            raise ValueError(
                f"`codes` must be a 2-D int8 tensor with a multiple of 32 columns, got "
                f"{codes.dtype} of shape {tuple(codes.shape)}"
            )
        N, K = codes.shape
        if scales.dtype not in (torch.float16, torch.bfloat16) or scales.shape != (N, K // 32):
            raise ValueError(
                f"`scales` must be float16 or bfloat16 of shape {(N, K // 32)}, got "
                f"{scales.dtype} of shape {tuple(scales.shape)}"
            )
        self.out_features, self.in_features = N, K
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def why_not(cls, out_features: int, in_features: int, group_size: int = 32) -> str | None:
        if out_features % 8:  # the int4 path's 2N rows: a multiple of 16
            return f"out_features={out_features} is not a multiple of 8"
        if in_features % 32:
            return f"in_features={in_features} is not a multiple of 32"
        return None

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = 32
    ) -> Q8Linear:
        """Per 32 weights: ``d = max|w| / 127``, ``q = round(w / d)`` (as ggml's Q8_0;
        ``group_size`` is ignored: the format's groups are 32). ``d`` is rounded up to
        float16 first (never down: the largest code stays 127 even where ``d`` is
        subnormal in float16) and the codes are taken against it; a Q8_0 tensor's values
        give back its own codes and scales (each block's largest code is 127)."""
        N, K = weight.shape
        why = cls.why_not(N, K)
        if why is not None:
            raise ValueError(f"cannot hold a q8_0 weight of shape {(N, K)}: {why}")
        w = weight.detach().float().view(N, K // 32, 32)  # (N, K/32, 32)
        d = w.abs().amax(dim=-1) / 127.0  # (N, K/32)
        fits = bool((d <= torch.finfo(torch.float16).max).all())
        scales = d.to(torch.float16 if fits else torch.bfloat16)
        up = torch.nextafter(scales, torch.full_like(scales, torch.inf))
        scales = torch.where(scales.float() < d, up, scales)
        s = scales.float()
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8).view(N, K)
        return cls(q, scales, bias)

    @classmethod
    def from_stored(
        cls, stored: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> Q8Linear:
        """From ``(codes (N, K) int8, scales (N, K/32))``: a GGUF Q8_0 tensor as stored
        (:meth:`gguf_codes`)."""
        codes, scales = stored
        return cls(codes, scales, bias)

    @classmethod
    def gguf_codes(
        cls, data: np.ndarray, type_name: str, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Q8_0 blocks as stored, not dequantised: codes (R, K) int8 and scales (R, K/32)
        float16, the blocks' own ``d`` (:meth:`~attnlab.quant.WeightFormat.gguf_codes`)."""
        R, K = shape
        blocks = cls.gguf_block_rows(data, type_name, shape)  # (R, G, 34)
        # Each block's d as a float16 element (a 34-byte block is 17 of them), not 2 bytes:
        # numpy's strided copy then moves one element per block (Gemma 3's embedding: 19
        # against 53 ms).
        scales = fresh_copy(blocks.view(np.float16)[..., 0])  # (R, G)
        codes = fresh_copy(blocks[..., 2:]).view(np.int8)  # (R, G, 32)
        return torch.from_numpy(codes).reshape(R, K), torch.from_numpy(scales).reshape(R, K // 32)

    @classmethod
    def fuse(cls, parts: Sequence[Any], bias: torch.Tensor | None) -> Q8Linear | None:
        """Rows stacked when the parts' scales share a dtype; the parts' codes and scales
        become views of the fused ones."""
        if len({m.scales.dtype for m in parts}) != 1:
            return None
        return fuse_buffers(cls, parts, ("codes", "scales"), bias)  # type: ignore[no-any-return]

    @property
    def weight(self) -> torch.Tensor:
        """The weight, float32 (N, K): ``d * q``, exact."""
        N, K = self.codes.shape
        q = self.codes.view(N, K // 32, 32).float()  # (N, K/32, 32)
        return (q * self.scales.float()[..., None]).view(N, K)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of :attr:`weight`, (..., K) float32: only those rows' codes and
        scales read, each value ``d * q`` exactly as :attr:`weight` has it."""
        K = self.in_features
        flat = ids.reshape(-1)
        q = self.codes.index_select(0, flat).view(-1, K // 32, 32).float()  # (M, K/32, 32)
        d = self.scales.index_select(0, flat).float()  # (M, K/32)
        return (q * d[..., None]).view(*ids.shape, K)

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) bfloat16 -> (M, N)."""
        if not self.runs_dense(x2.shape[0]):
            return self.decode_kernel()(x2)
        # A prompt: every d * q (exact in float32) rounded once to bfloat16, a few million
        # weights at a time: the whole of a 262144 x 640 head in float32 is 670 MB, and
        # fresh memory of that size cost more than the product.
        N, K = self.codes.shape
        step = max(8, self._dense_chunk // K)
        if step >= N:
            return crossover.dense_mm(x2, q8_0_dense(self.codes, self.scales, x2.dtype))
        y = torch.empty(x2.shape[0], N, dtype=x2.dtype, device=x2.device)  # (M, N)
        for start in range(0, N, step):
            codes, scales = self.codes[start : start + step], self.scales[start : start + step]
            w = q8_0_dense(codes, scales, x2.dtype)
            y[:, start : start + codes.shape[0]] = crossover.dense_mm(x2, w)
        return y

    def decode_dtype(self) -> torch.dtype:
        """:func:`native_rows_dtype` for attnlab's kernel, bfloat16 for the int4 halves
        without it."""
        return native_rows_dtype(native_kernels())

    def decode_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        ext = native_kernels()
        if ext is not None:
            op, codes, scales = ext.q8_0_mm, self.codes, self.scales
            return lambda x: op(x, codes, scales)
        kernel, n = self._halves().decode_kernel(), self.out_features

        def rows(x: torch.Tensor) -> torch.Tensor:
            both = kernel(x)  # (M, 2N)
            return both[:, :n] + both[:, n:]

        return rows

    def _halves(self) -> Int4Linear:
        """The (2N, K) int4 weight of the codes' 4-bit halves (the kernel without the
        native build), built on first use and again when the codes or scales change."""
        key = tuple((t.data_ptr(), tensor_version(t)) for t in (self.codes, self.scales))
        cached = self.__dict__.get("_halves_int4")
        if cached is not None and cached[0] == key:
            return cached[1]
        q = self.codes.to(torch.int32)  # (N, K)
        hi = torch.div(q, 16, rounding_mode="floor")  # (N, K) in -8..7
        lo = q - 16 * hi  # (N, K) in 0..15
        d = self.scales.float()  # (N, K/32)
        halves = Int4Linear.from_codes(
            torch.cat([hi + 8, lo]),  # (2N, K) in 0..15
            torch.cat([16 * d, d]),
            torch.cat([torch.zeros_like(d), 8 * d]),
        )
        # In __dict__, not as an attribute: a module attribute would be a submodule, in
        # the state dict and the module tree.
        self.__dict__["_halves_int4"] = (key, halves)
        return halves

    def native_product(self) -> NativeProduct | None:
        return NativeProduct(NATIVE_Q8, self.codes, self.scales, 32, self.out_features, self.bias)


def q8_0_dense(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Q8_0 codes (N, K) and scales (N, K/32) as the ``dtype`` weight: each ``d * q``
    (exact in float32), rounded once for bfloat16 (by the native build where there is
    one)."""
    ext = native_kernels()
    contiguous = codes.is_contiguous() and scales.is_contiguous()
    if dtype == torch.bfloat16 and ext is not None and contiguous:
        return ext.q8_0_dequant(codes, scales)  # type: ignore[no-any-return]
    N, K = codes.shape
    w = codes.view(N, K // 32, 32).float() * scales.float()[..., None]  # (N, K/32, 32)
    return w.view(N, K).to(dtype)
