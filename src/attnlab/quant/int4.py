"""Weight-only int4 in groups: :class:`Int4Linear` (``"int4"``), which also holds GGUF's
Q4_0, Q4_1 and Q4_K blocks as they are.

``w = (q - 8) * scale + zero`` per group of ``group_size`` input columns; the CPU kernel of
a few rows is attnlab's own (``attnlab/native/q4.h``, the same weights, integer products of
16-bit activation codes) where the native build is loaded and sums integer products (any
x86 CPU with AVX2), else ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (:func:`native_q4`
says which): q4.h's integer products take 0.7x the time of PyTorch's AVX-512 int4 kernel
for a decode row, and PyTorch's AVX2 one is slower than attnlab's q8_0 kernel, which reads
twice the bytes.

The codes are held as q4.h reads them, which is GGUF's own Q4_0 / Q4_1 layout: per row and
32-weight block 16 bytes, weight ``j`` in the low nibble of byte ``j`` and ``j + 16`` in its
high one. A GGUF file's Q4_0 and Q4_1 codes are taken byte for byte and Q4_K's are
regrouped with byte operations, never unpacked; PyTorch's packing
(``_convert_weight_to_int4pack_for_cpu``, whose tile layout depends on the CPU kernels
PyTorch chose) is made from them only where PyTorch's kernel runs (:meth:`Int4Linear.torch_packed`).
SmolLM2's Q4_1 file loaded at int4 in half the time it took when every code was unpacked
and packed twice (docs/guides/generation.md, "Time to the first token").

GGUF's Q4_0 and Q4_1 blocks are this format with groups of 32 (Q4_0: ``zero = 0``; Q4_1:
``w = q*d + m``, so ``zero = m + 8d``), and so is each 32-weight sub-block of a Q4_K
super-block (``w = d sc q - dmin m``: ``scale = d sc``, ``zero = 8 d sc - dmin m``); they
are taken as they are, codes unchanged (:meth:`Int4Linear.gguf_codes`), the scales and
zeros rounded to bfloat16.

GGUF block layouts (``ggml-common.h``), little-endian, weights ``0..15`` of a 32-weight
block in the low nibbles of ``qs[0..15]`` and ``16..31`` in the high ones:

- ``Q4_0``: ``d: f16``, ``qs: u8[16]``; weight ``j`` is ``(nibble_j - 8) * d``.
- ``Q4_1``: ``d: f16``, ``m: f16``, ``qs: u8[16]``; weight ``j`` is ``nibble_j * d + m``.
- ``Q4_K``: 256 weights: ``d, dmin: f16``, 12 bytes of 6-bit scales and mins, ``qs:
  u8[128]`` (sub-blocks ``2j`` and ``2j + 1`` the low and high nibbles of bytes
  ``32j..32j+31``).

Shape legend: N output features, K input features, M rows of input (B*T), R weight rows
of a GGUF tensor, G blocks.
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
    f16_columns,
    fresh,
    fresh_copy,
    native_kernels,
    native_rows_dtype,
    nibbles,
    register_format,
    tensor_version,
)
from attnlab.quant.kinds import NATIVE_INT4, NATIVE_Q4, NativeProduct

__all__ = ["Int4Linear", "native_q4", "pack_nibbles", "q4_k_parts", "unpack_nibbles"]

QK = 32  # weights per block of the codes' layout (a GGUF Q4_0 / Q4_1 block, a Q4_K sub-block)


@register_format
class Int4Linear(WeightFormat):
    """Weight-only int4 in groups: ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``.

    ``g = k // group_size``; q in 0..15, held two a byte in the layout of the module's
    docstring (:func:`pack_nibbles`). PyTorch's kernel, where it runs, needs N % 16 == 0;
    the layout needs K % 32 == 0 and K % group_size == 0; a weight of another shape gets
    :attr:`fallback` (int8) instead.

    Args:
        codes: (N, K / 2) uint8, the codes two a byte (from :func:`pack_nibbles`).
        scales_and_zeros: (K / group_size, N, 2) bfloat16.
        group_size: input columns per group (32, 64, 128, ...).
        in_features: K.
        bias: (N,) or None; kept in float32.
    """

    name = "int4"
    cli_help = "groups of 32, GGUF Q4_0/Q4_1/Q4_K as stored"
    gguf_blocks: ClassVar[Mapping[str, GGUFBlock]] = MappingProxyType(
        {
            "Q4_0": GGUFBlock(values=32, nbytes=18, f16_scales=1),  # d
            "Q4_1": GGUFBlock(values=32, nbytes=20, f16_scales=2),  # d, m
            "Q4_K": GGUFBlock(values=256, nbytes=144, f16_scales=2),  # d, dmin
        }
    )
    # The 5-, 6- and 8-bit types have more levels than 4 bits: as int4 they would be
    # quantised again. q5_0 and q8_0 hold Q5_0's and Q8_0's blocks as they are; q8_0 holds
    # the other 5- and 6-bit types' values to 8 bits per 32 weights (at most 1/254 of a
    # block's largest value off, plus the scale's float16 rounding; bf16 itself rounds each
    # value by up to 1/256 of it), at 1.0625 bytes a weight where bf16 reads 2. int8 (one
    # scale per row) loses more: ``benchmarks/bench_llama_cpp.py``'s agreement,
    # docs/guides/llama-cpp.md.
    gguf_instead: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"Q5_0": "q5_0", **{t: "q8_0" for t in ("Q5_1", "Q5_K", "Q6_K", "Q8_0")}}
    )
    fallback = "int8"
    codes: torch.Tensor
    scales_and_zeros: torch.Tensor
    #: The crossover without measuring (``ATTNLAB_CROSSOVER=defaults``; the EPYC's, in
    #: ``benchmarks/bench_int_prefill.py``); :mod:`attnlab.quant.crossover` measures this
    #: machine's.
    default_dense_from: ClassVar[int] = 128

    def __init__(
        self,
        codes: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        group_size: int,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        N = scales_and_zeros.shape[1]
        if codes.dtype != torch.uint8 or tuple(codes.shape) != (N, in_features // 2):
            raise ValueError(
                f"`codes` must be ({N}, {in_features // 2}) uint8 (two codes a byte), got "
                f"{codes.dtype} of shape {tuple(codes.shape)}"
            )
        self.in_features = in_features
        self.out_features = N
        self.group_size = group_size
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def why_not(cls, out_features: int, in_features: int, group_size: int = 32) -> str | None:
        """Why (N, K) cannot be packed with this group size, or None if it can."""
        if out_features % 16:
            return f"out_features={out_features} is not a multiple of 16"
        if in_features % group_size:
            return f"in_features={in_features} is not a multiple of group_size={group_size}"
        if in_features % QK:
            return f"in_features={in_features} is not a multiple of {QK}"
        return None

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """Hold 4-bit codes with per-group scales and zeros.

        Args:
            codes: (N, K) integers in 0..15.
            scales: (N, K / group_size).
            zeros: (N, K / group_size).
            bias: (N,) or None.

        Raises:
            ValueError: shapes the kernels cannot take, or codes outside 0..15.
        """
        N, K = codes.shape
        cls._group_size(N, K, scales, zeros)  # the shape, before the codes are packed
        if codes.numel() and not (int(codes.min()) >= 0 and int(codes.max()) <= 15):
            raise ValueError(
                f"int4 codes must be in 0..15, got {int(codes.min())}..{int(codes.max())}"
            )
        return cls.from_stored((pack_nibbles(codes), scales, zeros), bias)

    @classmethod
    def from_stored(
        cls, stored: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> Int4Linear:
        """From ``(codes, scales, zeros)``: the codes two a byte (N, K/2) uint8 as
        :func:`pack_nibbles` lays them out, scales and zeros (N, K / group_size).

        Raises:
            ValueError: shapes the kernels cannot take.
        """
        codes, scales, zeros = stored
        N, K = cls.weight_shape(stored)
        group_size = cls._group_size(N, K, scales, zeros)
        sz = torch.stack([scales.t(), zeros.t()], dim=-1)  # (K/gs, N, 2)
        return cls(codes, sz, group_size, K, bias)  # checks the codes' dtype and shape

    @classmethod
    def _group_size(cls, N: int, K: int, scales: torch.Tensor, zeros: torch.Tensor) -> int:
        """The group size that (N, K) weights with these scales and zeros have.

        Raises:
            ValueError: scales and zeros that are not (N, groups) alike, groups that do not
                divide K, or a shape the kernels cannot take (:meth:`why_not`).
        """
        if scales.ndim != 2 or scales.shape[0] != N or zeros.shape != scales.shape:
            raise ValueError(
                f"int4 needs scales and zeros of one shape (N={N}, groups), got "
                f"{tuple(scales.shape)} and {tuple(zeros.shape)}"
            )
        group_size = K // max(scales.shape[1], 1)
        why = cls.why_not(N, K, group_size)
        if why is not None or group_size * scales.shape[1] != K:
            raise ValueError(f"cannot hold an int4 weight of shape {(N, K)}: {why}")
        return group_size

    @classmethod
    def weight_shape(cls, stored: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """(N, K) of ``(codes, scales, zeros)``: two codes a byte."""
        codes = stored[0]
        return codes.shape[0], 2 * codes.shape[1]

    @classmethod
    def gguf_codes(
        cls, data: np.ndarray, type_name: str, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Q4_0 / Q4_1 / Q4_K blocks as 4-bit codes with per-32 scale and zero, not
        dequantised (see the module): codes (R, K/2) uint8 two a byte (Q4_0's and Q4_1's
        bytes as stored, Q4_K's regrouped), scales and zeros (R, K/32) float32
        (:meth:`~attnlab.quant.WeightFormat.gguf_codes`)."""
        R, K = shape
        blocks = cls.gguf_block_rows(data, type_name, shape)  # (R, G, bytes)
        flat = blocks.reshape(-1, blocks.shape[-1])  # (R*G, bytes)
        if type_name == "Q4_K":
            codes, scales, zeros = _q4_k_codes(flat)
        else:
            n_half = cls.gguf_blocks[type_name].f16_scales  # Q4_0: d; Q4_1: d, m
            codes = fresh_copy(flat[:, 2 * n_half :])  # (R*G, 16): the layout already
            dm = f16_columns(flat, n_half)  # (R*G, 1 or 2)
            scales = dm[:, 0]
            zeros = dm[:, 1] + 8.0 * scales if n_half == 2 else np.zeros_like(scales)
        return (
            torch.from_numpy(codes).reshape(R, K // 2),
            torch.from_numpy(np.ascontiguousarray(scales)).reshape(R, K // QK),
            torch.from_numpy(np.ascontiguousarray(zeros)).reshape(R, K // QK),
        )

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = 32
    ) -> Int4Linear:
        """Quantise a float (N, K) weight per group: min/max over each group onto 0..15."""
        N, K = weight.shape
        why = cls.why_not(N, K, group_size)
        if why is not None:
            raise ValueError(f"cannot pack an int4 weight of shape {(N, K)}: {why}")
        w = weight.detach().float().view(N, K // group_size, group_size)  # (N, K/gs, gs)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # (N, K/gs)
        scales = ((hi - lo) / 15.0).clamp_min(1e-12).to(torch.bfloat16).float()
        zeros = (lo + 8.0 * scales).to(torch.bfloat16).float()
        q = torch.round((w - zeros[..., None]) / scales[..., None] + 8.0).clamp_(0, 15)
        return cls.from_codes(q.view(N, K), scales, zeros, bias)

    @classmethod
    def fuse(cls, parts: Sequence[Any], bias: torch.Tensor | None) -> Int4Linear | None:
        """Codes and scales concatenated when all parts share a group size; the parts keep
        their own (int4 is small)."""
        if len({m.group_size for m in parts}) != 1:
            return None
        return cls(
            torch.cat([m.codes for m in parts]),
            torch.cat([m.scales_and_zeros for m in parts], dim=1),
            parts[0].group_size,
            parts[0].in_features,
            bias,
        )

    def codes_t(self) -> torch.Tensor:
        """The 4-bit codes, transposed: (K, N) uint8 in 0..15, contiguous (what a
        prompt's dequantisation reads; written in one strided pass per nibble, a third of
        the time of unpacking and then transposing)."""
        N, K = self.out_features, self.in_features
        src = self.codes.view(N, K // QK, QK // 2).permute(1, 2, 0)  # (K/32, 16, N)
        out = torch.empty(K // QK, QK, N, dtype=torch.uint8, device=self.codes.device)
        torch.bitwise_and(src, 15, out=out[:, : QK // 2])  # weights j < 16 of each block
        torch.bitwise_right_shift(src, 4, out=out[:, QK // 2 :])  # weights j + 16
        return out.view(K, N)

    def torch_packed(self) -> torch.Tensor:
        """The codes as ``_convert_weight_to_int4pack_for_cpu`` packs them for PyTorch's
        int4 kernel (its layout depends on the CPU kernels PyTorch chose), made on first
        use and again when the codes change; kept beside the module, never in its state."""
        key = (self.codes.data_ptr(), tensor_version(self.codes))
        cached = self.__dict__.get("_torch_packed")
        if cached is not None and cached[0] == key:
            return cached[1]  # type: ignore[no-any-return]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            unpack_nibbles(self.codes).to(torch.int32), 2
        )
        self.__dict__["_torch_packed"] = (key, packed)
        return packed

    def _dequantized_t(self, dtype: torch.dtype) -> torch.Tensor:
        """``Wᵀ`` (K, N) in ``dtype``: ``q * scale + (zero - 8 scale)`` per group."""
        K, N, gs = self.in_features, self.out_features, self.group_size
        q = self.codes_t().view(K // gs, gs, N).to(dtype)  # (K/gs, gs, N)
        s, z = self.scales_and_zeros.to(dtype).unbind(-1)  # (K/gs, N) each
        # Contiguous operands: addcmul broadcasts strided ones slowly (bench_int_prefill.py).
        zero = (z - 8 * s).unsqueeze(1)  # (K/gs, 1, N)
        return torch.addcmul(zero, q, s.contiguous().unsqueeze(1)).view(K, N)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight, float32 (N, K), as the kernel computes it."""
        return self._dequantized_t(torch.float32).t()

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) bfloat16 -> (M, N); from its crossover on (:meth:`runs_dense`), dense in
        ``x2``'s dtype."""
        if self.runs_dense(x2.shape[0]):
            return crossover.dense_mm(x2, self._dequantized_t(x2.dtype).t())
        return self.decode_kernel()(x2)

    def _native_kernel(self) -> Any:
        """attnlab's int4 kernel module where it is the one to use (:func:`native_q4`) and
        the groups are whole 32-weight groups, else None."""
        if self.group_size % QK:
            return None
        ext = native_kernels()
        return ext if native_q4(ext) else None

    def decode_dtype(self) -> torch.dtype:
        """:func:`native_rows_dtype` for attnlab's kernel, bfloat16 for PyTorch's
        (``_weight_int4pack_mm_for_cpu`` takes nothing else)."""
        return native_rows_dtype(self._native_kernel())

    def decode_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        ext = self._native_kernel()
        if ext is not None:
            op, (codes, scale_offset) = ext.q4_mm, self._native_layout()
            return lambda x: op(x, codes, scale_offset)
        torch_op = torch.ops.aten._weight_int4pack_mm_for_cpu
        packed, gs, sz = self.torch_packed(), self.group_size, self.scales_and_zeros
        return lambda x: torch_op(x, packed, gs, sz)

    def _native_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight as ``attnlab/native/q4.h`` reads it: the codes as held (N, K/2), and
        (N, K/32, 2) float32 pairs ``(scale, zero - 8 scale)``, the scale exact and the
        offset rounded once, as PyTorch's AVX2 kernel computes it; the pairs are built on
        first use and again when the codes or the scales change."""
        key = tuple((t.data_ptr(), tensor_version(t)) for t in (self.codes, self.scales_and_zeros))
        cached = self.__dict__.get("_native_q4")
        if cached is not None and cached[0] == key:
            return cached[1]  # type: ignore[no-any-return]
        s, z = self.scales_and_zeros.float().unbind(-1)  # (K/gs, N) each
        per_group = self.group_size // QK
        s = s.t().repeat_interleave(per_group, dim=1)  # (N, K/32)
        z = z.t().repeat_interleave(per_group, dim=1)  # (N, K/32)
        scale_offset = torch.stack([s, z - 8 * s], dim=-1).contiguous()  # (N, K/32, 2)
        layout = (self.codes, scale_offset)
        # In __dict__, not as a buffer: derived from the state dict, never saved with it.
        self.__dict__["_native_q4"] = (key, layout)
        return layout

    def native_product(self) -> NativeProduct | None:
        if self._native_kernel() is not None:
            codes, scale_offset = self._native_layout()
            return NativeProduct(NATIVE_Q4, codes, scale_offset, QK, self.out_features, self.bias)
        return NativeProduct(
            NATIVE_INT4,
            self.torch_packed(),
            self.scales_and_zeros,
            self.group_size,
            self.out_features,
            self.bias,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


def native_q4(ext: Any) -> bool:
    """Whether an int4 product of a few rows runs attnlab's q4 kernel from ``ext`` (the
    native module, or None) rather than PyTorch's: where the build sums integer products
    (``Q4_INTEGER``: any build with AVX2, AVX-512 ones included), or where PyTorch's int4
    kernels are not its AVX-512 ones (its AVX2 and plain ones are slow for a decode row)."""
    if ext is None:
        return False
    if getattr(ext, "Q4_INTEGER", False):
        return True
    return torch.backends.cpu.get_cpu_capability() != "AVX512"


def q4_k_parts(
    blocks: np.ndarray, dtype: type = np.uint8
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks (B, 144) -> codes (B, 256) in 0..15 as ``dtype``, and the
    sub-blocks' ``d * sc`` and ``dmin * m`` (B, 8) float32.

    Sub-block ``s`` (32 weights) is ``w = d * sc[s] * q - dmin * m[s]``; both products are
    exact in float32 (an 11-bit significand times a 6-bit integer).
    """
    n = blocks.shape[0]
    # 32 bytes per pair of sub-blocks: sub-block 2j the low nibbles, 2j+1 the high ones.
    codes = nibbles(blocks[:, 16:].reshape(n, 4, 32), dtype)  # (B, 4, 64)
    return (codes.reshape(n, 256), *_q4_k_scales(blocks))


def _q4_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sub-blocks' ``d * sc`` and ``dmin * m`` (B, 8) float32 of Q4_K super-blocks."""
    n = blocks.shape[0]
    d_dmin = f16_columns(blocks, 2)  # (B, 2)
    packed = blocks[:, 4:16].reshape(n, 3, 4)  # 12 bytes of 6-bit scales and mins
    low, high, top = packed[:, 0], packed[:, 1], packed[:, 2]  # (B, 4) each
    # Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: the
    # nibbles of bytes 8-11 with those bytes' top 2 bits above them (ggml's get_scale_min_k4).
    sc = np.concatenate([low & 63, (top & 15) | ((low >> 2) & 48)], axis=1)  # (B, 8)
    mins = np.concatenate([high & 63, (top >> 4) | ((high >> 2) & 48)], axis=1)  # (B, 8)
    return d_dmin[:, :1] * sc, d_dmin[:, 1:] * mins


def _q4_k_codes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks (B, 144) -> codes (B, 128) uint8 two a byte in this format's
    layout, scales and zeros (B, 8) float32: in the int4 convention (:func:`q4_k_parts`)
    ``scale = d * sc`` and ``zero = 8 scale - dmin * m``, up to the one rounding of the
    difference.

    A pair of sub-blocks is 32 bytes, sub-block ``2j`` in their low nibbles and ``2j + 1``
    in their high ones; the layout wants each sub-block's weights ``i`` and ``i + 16`` in
    one byte, so byte ``i`` of sub-block ``2j`` takes the low nibbles of bytes ``i`` and
    ``i + 16``, and that of ``2j + 1`` their high nibbles.
    """
    n = blocks.shape[0]
    qs = blocks[:, 16:].reshape(n, 4, 2, 16)  # (B, pairs, halves, 16)
    first, second = qs[:, :, 0], qs[:, :, 1]  # bytes i and i + 16 of each pair
    codes = fresh((n, 4, 2, 16), np.uint8)
    np.bitwise_or(first & 0x0F, (second & 0x0F) << 4, out=codes[:, :, 0])  # sub-block 2j
    np.bitwise_or(first >> 4, second & 0xF0, out=codes[:, :, 1])  # sub-block 2j + 1
    scales, mins = _q4_k_scales(blocks)
    return codes.reshape(n, 128), scales, 8.0 * scales - mins


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in 0..15 -> (N, K/2) uint8 two a byte, per 32-weight block 16 bytes:
    weight ``j`` in the low nibble of byte ``j``, weight ``j + 16`` in its high one (GGUF's
    Q4_0 / Q4_1 layout, and ``attnlab/native/q4.h``'s); K a multiple of 32."""
    N, K = codes.shape
    q = codes.to(torch.uint8).reshape(N, K // QK, 2, QK // 2)  # (N, K/32, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(N, K // 2)  # (N, K/2)


def unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """:func:`pack_nibbles` undone: (N, K/2) uint8 -> (N, K) uint8 in 0..15."""
    N, half = codes.shape
    blocks = codes.reshape(N, half // (QK // 2), QK // 2)  # (N, K/32, 16)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(N, 2 * half)  # (N, K)
