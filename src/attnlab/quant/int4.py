"""Weight-only int4 in groups: :class:`Int4Linear` (``"int4"``), which also holds GGUF's
Q4_0, Q4_1 and Q4_K blocks as they are.

``w = (q - 8) * scale + zero`` per group of ``group_size`` input columns; the CPU kernel of
a few rows is attnlab's own (``attnlab/native/q4.h``, the same weights, integer products of
16-bit activation codes) where the native build is loaded and sums integer products (any
x86 CPU with AVX2), else ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (:func:`native_q4`
says which): q4.h's integer products take 0.7x the time of PyTorch's AVX-512 int4 kernel
for a decode row, and PyTorch's AVX2 one is slower than attnlab's q8_0 kernel, which reads
twice the bytes.

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

import functools
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
    native_kernels,
    nibbles,
    register_format,
    tensor_version,
)
from attnlab.quant.kinds import NATIVE_INT4, NATIVE_Q4, NativeProduct

__all__ = ["Int4Linear", "native_q4", "pack_layout", "q4_k_parts", "unpack_int4_t"]

# Packs of parts whose rows are a multiple of 64 concatenate: 64 is a multiple of the
# packing's tile on every CPU (:func:`pack_layout`).
_FUSE_ROWS = 64
QK = 32  # weights per group of the GGUF types held here (per sub-block for Q4_K)


@register_format
class Int4Linear(WeightFormat):
    """Weight-only int4 in groups: ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``.

    ``g = k // group_size``; q in 0..15. The codes are packed once by
    ``_convert_weight_to_int4pack_for_cpu`` (needs N % 16 == 0 and K % group_size == 0);
    a weight of another shape gets :attr:`fallback` (int8) instead.

    Args:
        packed: the packed codes (from :meth:`from_codes`).
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
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    #: The crossover without measuring (``ATTNLAB_CROSSOVER=defaults``; the EPYC's, in
    #: ``benchmarks/bench_int_prefill.py``); :mod:`attnlab.quant.crossover` measures this
    #: machine's.
    default_dense_from: ClassVar[int] = 128

    def __init__(
        self,
        packed: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        group_size: int,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = scales_and_zeros.shape[1]
        self.group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def why_not(cls, out_features: int, in_features: int, group_size: int = 32) -> str | None:
        """Why (N, K) cannot be packed with this group size, or None if it can."""
        if out_features % 16:
            return f"out_features={out_features} is not a multiple of 16"
        if in_features % group_size:
            return f"in_features={in_features} is not a multiple of group_size={group_size}"
        return None

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """Pack 4-bit codes with per-group scales and zeros.

        Args:
            codes: (N, K) integers in 0..15.
            scales: (N, K / group_size).
            zeros: (N, K / group_size).
            bias: (N,) or None.

        Raises:
            ValueError: shapes the CPU kernel cannot take.
        """
        N, K = codes.shape
        group_size = K // scales.shape[1]
        why = cls.why_not(N, K, group_size)
        if why is not None or group_size * scales.shape[1] != K:
            raise ValueError(f"cannot pack an int4 weight of shape {(N, K)}: {why}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 2
        )
        sz = torch.stack([scales.t(), zeros.t()], dim=-1)  # (K/gs, N, 2)
        return cls(packed, sz, group_size, K, bias)

    @classmethod
    def from_stored(
        cls, stored: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> Int4Linear:
        """From ``(codes, scales, zeros)`` as :meth:`from_codes` takes them."""
        codes, scales, zeros = stored
        return cls.from_codes(codes, scales, zeros, bias)

    @classmethod
    def gguf_codes(
        cls, data: np.ndarray, type_name: str, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Q4_0 / Q4_1 / Q4_K blocks as 4-bit codes with per-32 scale and zero, not
        dequantised (see the module): codes (R, K) uint8 in 0..15, scales and zeros
        (R, K/32) float32 (:meth:`~attnlab.quant.WeightFormat.gguf_codes`)."""
        R, K = shape
        blocks = cls.gguf_block_rows(data, type_name, shape)  # (R, G, bytes)
        flat = blocks.reshape(-1, blocks.shape[-1])  # (R*G, bytes)
        if type_name == "Q4_K":
            codes, scales, zeros = _q4_k_codes(flat)
        else:
            n_half = cls.gguf_blocks[type_name].f16_scales  # Q4_0: d; Q4_1: d, m
            codes = nibbles(flat[:, 2 * n_half :])  # (R*G, 32)
            dm = f16_columns(flat, n_half)  # (R*G, 1 or 2)
            scales = dm[:, 0]
            zeros = dm[:, 1] + 8.0 * scales if n_half == 2 else np.zeros_like(scales)
        return (
            torch.from_numpy(codes).reshape(R, K),
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
        """Packs concatenated when every part has a multiple of 64 rows (the packing's
        tile) and all share a group size; the parts keep their own packs (int4 is small)."""
        if any(m.out_features % _FUSE_ROWS for m in parts):
            return None
        if len({m.group_size for m in parts}) != 1:
            return None
        return cls(
            torch.cat([m.packed for m in parts]),
            torch.cat([m.scales_and_zeros for m in parts], dim=1),
            parts[0].group_size,
            parts[0].in_features,
            bias,
        )

    def codes_t(self) -> torch.Tensor:
        """The 4-bit codes, transposed: (K, N) uint8 in 0..15 (see :func:`unpack_int4_t`)."""
        return unpack_int4_t(self.packed, self.out_features, self.in_features)

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

    def decode_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        ext = self._native_kernel()
        if ext is not None:
            op, (codes, scale_offset) = ext.q4_mm, self._native_layout()
            return lambda x: op(x, codes, scale_offset)
        torch_op = torch.ops.aten._weight_int4pack_mm_for_cpu
        packed, gs, sz = self.packed, self.group_size, self.scales_and_zeros
        return lambda x: torch_op(x, packed, gs, sz)

    def _native_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight as ``attnlab/native/q4.h`` reads it, built on first use and again when
        the packed codes or the scales change: codes (N, K/2) uint8, per row and group of 32
        weights 16 bytes (weight ``j`` in the low nibble of byte ``j``, ``j + 16`` in its
        high one), and (N, K/32, 2) float32 pairs ``(scale, zero - 8 scale)``, the scale
        exact and the offset rounded once, as PyTorch's AVX2 kernel computes it."""
        key = tuple((t.data_ptr(), tensor_version(t)) for t in (self.packed, self.scales_and_zeros))
        cached = self.__dict__.get("_native_q4")
        if cached is not None and cached[0] == key:
            return cached[1]  # type: ignore[no-any-return]
        N, K = self.out_features, self.in_features
        q = self.codes_t().t().reshape(N, K // QK, 2, QK // 2)  # (N, K/32, 2, 16)
        codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(N, K // 2)  # (N, K/2)
        s, z = self.scales_and_zeros.float().unbind(-1)  # (K/gs, N) each
        per_group = self.group_size // QK
        s = s.t().repeat_interleave(per_group, dim=1)  # (N, K/32)
        z = z.t().repeat_interleave(per_group, dim=1)  # (N, K/32)
        scale_offset = torch.stack([s, z - 8 * s], dim=-1).contiguous()  # (N, K/32, 2)
        layout = (codes.contiguous(), scale_offset)
        # In __dict__, not as a buffer: derived from the state dict, never saved with it.
        self.__dict__["_native_q4"] = (key, layout)
        return layout

    def native_product(self) -> NativeProduct | None:
        if self._native_kernel() is not None:
            codes, scale_offset = self._native_layout()
            return NativeProduct(NATIVE_Q4, codes, scale_offset, QK, self.out_features, self.bias)
        return NativeProduct(
            NATIVE_INT4,
            self.packed,
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
    d_dmin = f16_columns(blocks, 2)  # (B, 2)
    packed = blocks[:, 4:16].reshape(n, 3, 4)  # 12 bytes of 6-bit scales and mins
    low, high, top = packed[:, 0], packed[:, 1], packed[:, 2]  # (B, 4) each
    # Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: the
    # nibbles of bytes 8-11 with those bytes' top 2 bits above them (ggml's get_scale_min_k4).
    sc = np.concatenate([low & 63, (top & 15) | ((low >> 2) & 48)], axis=1)  # (B, 8)
    mins = np.concatenate([high & 63, (top >> 4) | ((high >> 2) & 48)], axis=1)  # (B, 8)
    # 32 bytes per pair of sub-blocks: sub-block 2j the low nibbles, 2j+1 the high ones.
    codes = nibbles(blocks[:, 16:].reshape(n, 4, 32), dtype)  # (B, 4, 64)
    return codes.reshape(n, 256), d_dmin[:, :1] * sc, d_dmin[:, 1:] * mins


def _q4_k_codes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks (B, 144) -> codes (B, 256) uint8, scales and zeros (B, 8) float32:
    in the int4 convention (:func:`q4_k_parts`) ``scale = d * sc`` and
    ``zero = 8 scale - dmin * m``, up to the one rounding of the difference."""
    codes, scales, mins = q4_k_parts(blocks)
    return codes, scales, 8.0 * scales - mins


# (rows per tile T, whether a byte holds rows 2j and 2j+1 of its tile rather than j and
# T/2 + j): PyTorch's AVX-512 kernels, its AVX2 ones, and its plain ones.
_LAYOUTS = ((64, False), (32, False), (32, True))


@functools.cache
def pack_layout() -> tuple[int, bool]:
    """The layout of this process's ``_convert_weight_to_int4pack_for_cpu``: rows per
    tile, and whether a byte holds two neighbouring rows.

    PyTorch lays the packed rows out by the CPU kernels it chose: tiles of 64 rows with its
    AVX-512 kernels, 32 with its AVX2 ones, 32 in neighbouring pairs with its plain ones
    (``ATEN_CPU_CAPABILITY`` can choose any of them on one machine). Found once per process
    by packing known codes and reading them back each way; a layout no reading gives back
    is refused rather than read wrongly.

    Raises:
        RuntimeError: this PyTorch packs int4 weights in a layout attnlab does not know.
    """
    N, K = 208, 4  # three tiles of 64 and a tail of 16, or six of 32 and the same tail
    codes = torch.randint(0, 16, (N, K), generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    want = codes.t().to(torch.uint8)
    for layout in _LAYOUTS:
        if torch.equal(_unpack(packed, N, K, layout), want):
            return layout
    raise RuntimeError(
        "this PyTorch packs int4 weights (_convert_weight_to_int4pack_for_cpu) in a layout "
        f"attnlab does not know (torch {torch.__version__}, CPU kernels "
        f"{torch.backends.cpu.get_cpu_capability()}); load with --dtype int8 or bfloat16"
    )


def unpack_int4_t(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The codes that ``_convert_weight_to_int4pack_for_cpu`` packed, transposed: (K, N) uint8.

    The CPU packing takes rows in tiles of T (:func:`pack_layout`: 64 or 32): tile ``b`` is
    ``K * T / 2`` bytes, byte ``(b, k, j)`` holding row ``T b + j`` in its low nibble and
    row ``T b + T/2 + j`` in its high one (with PyTorch's plain kernels, rows ``T b + 2 j``
    and ``T b + 2 j + 1``); the last ``N % T`` rows (a multiple of 16) are ``K * r / 2``
    bytes, byte ``(k, j)`` holding rows ``2 j`` (low) and ``2 j + 1`` (high).
    Tested against the codes given to the packing (``tests/decode/test_quant.py``), under
    each of PyTorch's CPU kernel sets.
    """
    return _unpack(packed, out_features, in_features, pack_layout())


def _unpack(packed: torch.Tensor, N: int, K: int, layout: tuple[int, bool]) -> torch.Tensor:
    tile, pairs = layout
    flat = packed.reshape(-1)
    n_main = N - N % tile
    half = tile // 2
    out = torch.empty(K, N, dtype=torch.uint8, device=packed.device)  # (K, N)
    if n_main:
        tiles = flat[: n_main * K // 2].view(n_main // tile, K, half)  # (N/T, K, T/2)
        if pairs:
            dst = out[:, :n_main].view(K, n_main // tile, half, 2).transpose(0, 1)
            torch.bitwise_and(tiles, 15, out=dst[..., 0])
            torch.bitwise_right_shift(tiles, 4, out=dst[..., 1])
        else:
            dst = out[:, :n_main].view(K, n_main // tile, tile).transpose(0, 1)
            torch.bitwise_and(tiles, 15, out=dst[..., :half])
            torch.bitwise_right_shift(tiles, 4, out=dst[..., half:])
    r = N - n_main
    if r:
        tail = flat[n_main * K // 2 :].view(K, r // 2)  # (K, r/2)
        dst = out[:, n_main:].view(K, r // 2, 2)
        torch.bitwise_and(tail, 15, out=dst[..., 0])
        torch.bitwise_right_shift(tail, 4, out=dst[..., 1])
    return out
