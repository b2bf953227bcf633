"""Weight precision for inference: bf16 and weight-only int8 / int4 linear layers.

Each format is a class (:class:`WeightFormat`), registered by name in
:data:`WEIGHT_FORMATS`, that builds itself from a float weight or from its own codes (a
GGUF file's blocks as stored, for the types it names), fuses with its siblings into one
product, and is a drop-in for ``nn.Linear`` in a model that only runs forward: it takes
and returns the input's dtype (fp32 activations stay fp32), runs the product in bfloat16
against its stored weights, and exposes ``weight`` (dequantised, float32) so that readers
of the weights (the explainer) see a plain matrix.

- :class:`BF16Linear` (``"bfloat16"``): the weight rounded to bfloat16.
- :class:`Int8Linear` (``"int8"``): one int8 per weight and one scale per output row
  (symmetric), ``torch.ops.aten._weight_int8pack_mm``.
- :class:`Int4Linear` (``"int4"``): 4-bit codes in groups of ``group_size`` input
  columns, each group with a scale and a zero, ``w = (q - 8) * scale + zero``; the CPU
  kernel ``torch.ops.aten._weight_int4pack_mm_for_cpu``. GGUF's Q4_0 and Q4_1 blocks are
  this format with groups of 32 (Q4_0: ``zero = 0``; Q4_1: ``w = q*d + m``, so
  ``zero = m + 8d``), and so is each 32-weight sub-block of a Q4_K super-block
  (``w = d sc q - dmin m``: ``scale = d sc``, ``zero = 8 d sc - dmin m``); they are taken
  as they are, codes unchanged (:meth:`Int4Linear.from_codes`), the scales and zeros
  rounded to bfloat16. GGUF's 5-, 6- and 8-bit types go to :class:`Q5Linear` (Q5_0) and
  :class:`Q8Linear` (the others) instead (:attr:`WeightFormat.gguf_instead`).
- :class:`Q8Linear` (``"q8_0"``): int8 codes with one float16 scale per 32 weights
  (llama.cpp's Q8_0, a Q8_0 file's blocks as stored), run by attnlab's own kernel
  (:mod:`attnlab.native`) or, without it, as two int4 halves by PyTorch's.
- :class:`Q5Linear` (``"q5_0"``): 5-bit codes with one float16 scale per 32 weights
  (llama.cpp's Q5_0, a Q5_0 file's blocks as stored), run by attnlab's own kernel or,
  without it, as a :class:`Q8Linear`.

Both int kernels need bfloat16 activations, scales and zeros on the CPU (they accept fp32
inputs, but their fast path is bf16's). They are made for a few rows (decoding): from
``dense_from_rows`` rows of input on (a prompt), the int layers instead dequantise their
weight to bfloat16 for that one call and run the regular bf16 ``mm`` (int8: the codes
converted, the per-row scale applied to the product's columns; int4: the packed codes
unpacked, ``q * scale + (zero - 8 scale)`` per group); nothing is kept, so memory stays
that of the codes. ``benchmarks/bench_int_prefill.py`` finds the crossover. Products of
rows stacked together (one QKV product) are built by :func:`fuse_rows`.

Shape legend: N output features (rows), K input features, M rows of input (B*T).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = [
    "WEIGHT_DTYPES",
    "WEIGHT_FORMATS",
    "BF16Linear",
    "Int4Linear",
    "Int8Linear",
    "Q5Linear",
    "WeightFormat",
    "column_major",
    "fuse_rows",
    "holding",
    "quantize_linear",
    "quantize_model",
    "register_format",
    "unpack_int4_t",
    "weight_format",
]

_PACK_TILE = 64  # rows per tile of the CPU int4 packing: packs of 64-row parts concatenate


def _as_2d(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k).to(torch.bfloat16)  # (M, K)


def _row_slices(parts: Sequence[Any]) -> list[slice]:
    """The rows of each part in their stacked product."""
    out, start = [], 0
    for m in parts:
        out.append(slice(start, start + m.out_features))
        start += m.out_features
    return out


def _stacked(
    cls: Any, parts: Sequence[Any], names: Sequence[str], bias: torch.Tensor | None
) -> Any:
    """``cls`` built from the parts' buffers ``names`` (its constructor's arguments, in
    order) each concatenated over the rows, ``bias`` last; each part's buffers then become
    views of the fused ones (no second copy)."""
    fused = cls(*(torch.cat([getattr(m, name) for m in parts]) for name in names), bias)
    for m, rows in zip(parts, _row_slices(parts), strict=True):
        for name in names:
            setattr(m, name, getattr(fused, name)[rows])
    return fused


# Product kinds of the native decode step (``attnlab/native/decode_step.cpp``'s ``Kind``).
NATIVE_INT4, NATIVE_INT8, NATIVE_LINEAR, NATIVE_Q8, NATIVE_Q5 = 0, 2, 3, 4, 5


class NativeProduct(NamedTuple):
    """One product as the native decode step calls it (``Product`` in its source):
    ``kind`` picks the kernel, ``a`` and ``b`` are its weight tensors, ``n`` the output
    columns, ``bias`` (float32) added after it."""

    kind: int
    a: torch.Tensor
    b: torch.Tensor | None
    group_size: int
    n: int
    bias: torch.Tensor | None


class WeightFormat(nn.Module):
    """A linear layer's weight in one stored format; the base of the formats here.

    A format is registered under its :attr:`name` (:data:`WEIGHT_FORMATS`,
    :func:`register_format`) and builds itself from a float weight (:meth:`from_float`)
    or from its own codes (:meth:`from_rows`: tensors whose first dimension is the
    weight's rows, so that a loader's renames, head permutations and row splits apply to
    them as to a weight; a GGUF tensor of a type in :attr:`gguf_types` is read into them
    as stored, ``attnlab.pretrained.gguf_file.block_codes``), and stacks the rows of
    siblings that read the same input into one product (:meth:`fuse`). Its forward takes
    and returns the input's dtype and runs :meth:`product` on bfloat16 rows.
    """

    #: The registry key, e.g. ``"int4"``.
    name: ClassVar[str]
    #: GGUF tensor types whose blocks this format holds as stored (codes unchanged).
    gguf_types: ClassVar[frozenset[str]] = frozenset()
    #: GGUF types this format would hold only by quantising their values again, by the
    #: format that holds them with less loss (a loader stores such tensors in that one).
    gguf_instead: ClassVar[Mapping[str, str]] = MappingProxyType({})
    #: The format a weight gets when this one cannot hold its shape (:meth:`why_not`).
    fallback: ClassVar[str | None] = None

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    @classmethod
    def why_not(cls, out_features: int, in_features: int, group_size: int = 32) -> str | None:
        """Why an (N, K) weight cannot be held in this format, or None if it can."""
        return None

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = 32
    ) -> WeightFormat:
        """Quantise a float (N, K) weight (``group_size``: for formats with groups)."""
        raise NotImplementedError

    @classmethod
    def from_rows(
        cls, rows: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> WeightFormat:
        """Build from the format's codes, each tensor (N, ...) (see the class).

        Raises:
            ValueError: codes of a shape this format cannot take.
        """
        raise NotImplementedError

    @classmethod
    def rows_shape(cls, rows: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """The (N, K) weight that codes ``rows`` (as :meth:`from_rows` takes them) hold:
        the first tensor's shape, unless the format packs several weights a byte."""
        return tuple(rows[0].shape)

    @classmethod
    def fuse(cls, parts: Sequence[Any], bias: torch.Tensor | None) -> WeightFormat | None:
        """One module for ``parts`` (same class and input width) with their rows stacked,
        or None when they cannot be stacked; ``bias`` is theirs concatenated."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The weight as the product uses it, float32 (N, K)."""
        raise NotImplementedError

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) bfloat16 -> (M, N)."""
        raise NotImplementedError

    def row_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The bare product of a few bfloat16 rows (fewer than the format's dense
        crossover), bias not added: what the decode step calls (:func:`row_product`)."""
        return self.product

    def native_product(self) -> NativeProduct | None:
        """What the native decode step (:mod:`attnlab.native`) calls for :meth:`row_kernel`:
        the same kernel on the same tensors; None when it has no such call."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) -> (..., N), in ``x``'s dtype."""
        y = self.product(_as_2d(x, self.in_features)).to(x.dtype)  # (M, N)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.name}"


#: Weight formats by name (:func:`register_format`); ``"float32"`` is ``nn.Linear`` itself.
WEIGHT_FORMATS: dict[str, type[WeightFormat]] = {}


def register_format(cls: type[WeightFormat]) -> type[WeightFormat]:
    """Class decorator: make ``cls`` a weight precision by its ``name``.

    Raises:
        ValueError: the name is taken (or is ``"float32"``, the unquantised layer).
    """
    if cls.name == "float32" or cls.name in WEIGHT_FORMATS:
        raise ValueError(f"weight format name {cls.name!r} is already taken")
    WEIGHT_FORMATS[cls.name] = cls
    return cls


@register_format
class BF16Linear(WeightFormat):
    """``y = x Wᵀ + b`` with ``W`` stored in bfloat16 (the product in bf16, fp32 accumulation).

    Args:
        weight: (N, K) float weight, rounded to bfloat16.
        bias: (N,) or None; kept in float32.
    """

    name = "bfloat16"
    weight_bf16: torch.Tensor

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
    def from_rows(
        cls, rows: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> BF16Linear:
        """From ``(weight,)``: a bf16 weight's codes are its values."""
        (weight,) = rows
        return cls(weight, bias)

    @classmethod
    def fuse(cls, parts: Sequence[Any], bias: torch.Tensor | None) -> BF16Linear:
        """Rows stacked; the parts' weights become views of the fused one (no second copy)."""
        return _stacked(cls, parts, ("weight_bf16",), bias)

    @property
    def weight(self) -> torch.Tensor:
        """The stored weight as float32 (N, K)."""
        return self.weight_bf16.float()

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) bfloat16 -> (M, N)."""
        return torch.mm(x2, self.weight_bf16.t())

    def row_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        wt = self.weight_bf16.t()
        return lambda x: torch.mm(x, wt)

    def native_product(self) -> NativeProduct | None:
        return NativeProduct(NATIVE_LINEAR, self.weight_bf16, None, 0, self.out_features, self.bias)


@register_format
class Int8Linear(WeightFormat):
    """Weight-only int8: ``W = q * scale[row]``, q in [-127, 127], one bf16 scale per row.

    Args:
        qweight: (N, K) int8 codes.
        scales: (N,) bfloat16 scales.
        bias: (N,) or None; kept in float32.
    """

    name = "int8"
    qweight: torch.Tensor
    scales: torch.Tensor
    #: From this many rows of input on, dequantise and use bf16 ``mm`` (the crossover in
    #: ``benchmarks/bench_int_prefill.py``).
    dense_from_rows: int = 16

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
    def from_rows(
        cls, rows: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> Int8Linear:
        """From ``(qweight (N, K) int8, scales (N,))``."""
        qweight, scales = rows
        return cls(qweight, scales, bias)

    @classmethod
    def fuse(cls, parts: Sequence[Any], bias: torch.Tensor | None) -> Int8Linear:
        """Rows stacked; the parts' codes and scales become views of the fused ones."""
        return _stacked(cls, parts, ("qweight", "scales"), bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight, float32 (N, K)."""
        return self.qweight.float() * self.scales.float()[:, None]

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) bfloat16 -> (M, N)."""
        # torch's int8 kernel (torch 2.13 CPU) needs K a multiple of 16: otherwise it returns
        # wrong numbers for one row (K=24) or crashes for several (K=24, 40); dense then
        if x2.shape[0] >= self.dense_from_rows or self.in_features % 16:
            # Codes in [-127, 127] are exact in bf16; W = diag(scale) q, so scale the columns.
            return torch.mm(x2, self.qweight.to(torch.bfloat16).t()).mul_(self.scales)
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)

    def row_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
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
    gguf_types = frozenset({"Q4_0", "Q4_1", "Q4_K"})
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
    #: From this many rows of input on, dequantise and use bf16 ``mm`` (the crossover in
    #: ``benchmarks/bench_int_prefill.py``).
    dense_from_rows: int = 128

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
    def from_rows(
        cls, rows: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> Int4Linear:
        """From ``(codes, scales, zeros)`` as :meth:`from_codes` takes them."""
        codes, scales, zeros = rows
        return cls.from_codes(codes, scales, zeros, bias)

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
        if any(m.out_features % _PACK_TILE for m in parts):
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
        """(M, K) bfloat16 -> (M, N)."""
        if x2.shape[0] >= self.dense_from_rows:
            return torch.mm(x2, self._dequantized_t(torch.bfloat16))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.packed, self.group_size, self.scales_and_zeros
        )

    def row_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        op = torch.ops.aten._weight_int4pack_mm_for_cpu
        packed, gs, sz = self.packed, self.group_size, self.scales_and_zeros
        return lambda x: op(x, packed, gs, sz)

    def native_product(self) -> NativeProduct | None:
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


@register_format
class Q8Linear(WeightFormat):
    """Weight-only int8 with one scale per 32 weights: llama.cpp's Q8_0, as it stores it.

    ``W[n, k] = d[n, g] * q[n, k]`` with q in -127..127 and ``g = k // 32``, held as int8
    codes (N, K) and scales (N, K/32): 1.0625 bytes a weight. A GGUF Q8_0 tensor's own
    codes and float16 scales are taken as stored (:meth:`from_rows`). Every ``d * q`` is
    exact in float32: :attr:`weight` is the file's values.

    A few rows of input (decoding) run attnlab's kernel for this layout
    (``attnlab/native/q8_0.h``, built by :mod:`attnlab.native`): the codes read once, the
    products and sums in float32, the result rounded to bfloat16 as the int kernels'. Where
    that build is unavailable (no C++ compiler), PyTorch's int4 kernel runs instead: q
    splits exactly into two 4-bit codes, ``q = 16 hi + lo`` (hi in -8..7, lo in 0..15), one
    int4 weight of 2N rows (rows ``n``: hi, scale ``16 d``; rows ``N + n``: lo, scale ``d``,
    zero ``8 d``), the product the two halves summed; built from the codes on first use and
    kept beside the module, not in its state. That path reads 1.25 bytes a weight and its
    scales are bfloat16, so its products are within bfloat16's rounding of the native ones.
    From :attr:`dense_from_rows` rows on (a prompt) the weight is dequantised to bfloat16
    for that call and run by the dense ``mm``.

    The scales are float16, Q8_0's own type: a file's scales are held exactly, and
    :meth:`from_float`'s have three more significant bits than bfloat16's. A weight whose
    scales pass float16's range (``max |w| > 127 * 65504`` in a block) gets bfloat16 ones.

    Args:
        codes: (N, K) int8 codes in -127..127, K a multiple of 32.
        scales: (N, K/32) float16 or bfloat16.
        bias: (N,) or None; kept in float32.
    """

    name = "q8_0"
    gguf_types = frozenset({"Q8_0"})
    fallback = "int8"
    codes: torch.Tensor
    scales: torch.Tensor
    #: From this many rows of input on, dequantise and use bf16 ``mm``: the native kernel
    #: (float32 FMAs) is faster below about 20 rows, the dense product of the dequantised
    #: weight from about 24 (``benchmarks/bench_q8_0.py --rows``).
    dense_from_rows: int = 20
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
    def from_rows(cls, rows: Sequence[torch.Tensor], bias: torch.Tensor | None = None) -> Q8Linear:
        """From ``(codes (N, K) int8, scales (N, K/32))``: a GGUF Q8_0 tensor as stored
        (``attnlab.pretrained.gguf_file.q8_0_codes``)."""
        codes, scales = rows
        return cls(codes, scales, bias)

    @classmethod
    def fuse(cls, parts: Sequence[Any], bias: torch.Tensor | None) -> Q8Linear | None:
        """Rows stacked when the parts' scales share a dtype; the parts' codes and scales
        become views of the fused ones."""
        if len({m.scales.dtype for m in parts}) != 1:
            return None
        return _stacked(cls, parts, ("codes", "scales"), bias)

    @property
    def weight(self) -> torch.Tensor:
        """The weight, float32 (N, K): ``d * q``, exact."""
        N, K = self.codes.shape
        q = self.codes.view(N, K // 32, 32).float()  # (N, K/32, 32)
        return (q * self.scales.float()[..., None]).view(N, K)

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) bfloat16 -> (M, N)."""
        if x2.shape[0] < self.dense_from_rows:
            return self.row_kernel()(x2)
        # A prompt: every d * q (exact in float32) rounded once to bfloat16, a few million
        # weights at a time: the whole of a 262144 x 640 head in float32 is 670 MB, and
        # fresh memory of that size cost more than the product.
        N, K = self.codes.shape
        step = max(8, self._dense_chunk // K)
        if step >= N:
            return torch.mm(x2, _q8_0_bf16(self.codes, self.scales).t())
        y = torch.empty(x2.shape[0], N, dtype=torch.bfloat16, device=x2.device)  # (M, N)
        for start in range(0, N, step):
            codes, scales = self.codes[start : start + step], self.scales[start : start + step]
            y[:, start : start + codes.shape[0]] = torch.mm(x2, _q8_0_bf16(codes, scales).t())
        return y

    def row_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        from attnlab import native

        ext = native.loaded()
        if ext is not None:
            op, codes, scales = ext.q8_0_mm, self.codes, self.scales
            return lambda x: op(x, codes, scales)
        kernel, n = self._halves().row_kernel(), self.out_features

        def rows(x: torch.Tensor) -> torch.Tensor:
            both = kernel(x)  # (M, 2N)
            return both[:, :n] + both[:, n:]

        return rows

    def _halves(self) -> Int4Linear:
        """The (2N, K) int4 weight of the codes' 4-bit halves (the kernel without the
        native build), built on first use and again when the codes or scales change."""
        key = tuple((t.data_ptr(), _version(t)) for t in (self.codes, self.scales))
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


_Q5_BLOCK_BYTES = 22  # per 32 weights: d (float16), qh (4 bytes of fifth bits), qs (16)


def _q5_0_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) in 0..31 and float16 scales (N, K/32) as ggml's ``block_q5_0``s, one
    weight row's blocks after another: (N, K/32 * 22) uint8 (see :class:`Q5Linear`)."""
    N, K = codes.shape
    q = codes.to(torch.uint8).view(N, K // 32, 32)  # (N, G, 32)
    qs = (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)  # (N, G, 16)
    fifth = (q >> 4).view(N, K // 32, 4, 8).to(torch.int32)  # weight 8i + j: byte i, bit j
    qh = (fifth << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)  # (N, G, 4)
    d = scales.to(torch.float16).contiguous().view(torch.uint8).view(N, K // 32, 2)
    return torch.cat([d, qh, qs], dim=-1).view(N, K // 32 * _Q5_BLOCK_BYTES)


def _q5_0_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_q5_0_blocks` undone: codes (N, K) uint8 in 0..31, scales (N, K/32) float16."""
    N, G = blocks.shape[0], blocks.shape[1] // _Q5_BLOCK_BYTES
    b = blocks.view(N, G, _Q5_BLOCK_BYTES)
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
    (:meth:`from_rows`). Every ``d (q - 16)`` is exact in float32: :attr:`weight` is the
    file's values.

    A few rows of input (decoding) run attnlab's kernel for this layout
    (``attnlab/native/q5_0.h``, built by :mod:`attnlab.native`): the blocks read once, each
    weight unpacked in registers, the products and sums in float32, the result rounded to
    bfloat16 as the int kernels'. Where that build is unavailable, the codes run as a
    :class:`Q8Linear` (``q - 16`` as its 8-bit codes, the same scales), built on first use
    and kept beside the module, not in its state (a file's weight of rows that one cannot
    hold, not a multiple of 8, is dequantised for each product). From
    :attr:`dense_from_rows` rows on (a prompt) the weight is dequantised to bfloat16 for
    that call and run by the dense ``mm``.

    Args:
        blocks: (N, K/32 * 22) uint8, K a multiple of 32.
        bias: (N,) or None; kept in float32.
    """

    name = "q5_0"
    gguf_types = frozenset({"Q5_0"})
    fallback = "int8"
    blocks: torch.Tensor
    #: From this many rows of input on, dequantise and use bf16 ``mm``.
    dense_from_rows: int = 128

    def __init__(self, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.ndim != 2 or blocks.shape[1] % _Q5_BLOCK_BYTES:
            raise ValueError(
                f"`blocks` must be a 2-D uint8 tensor of whole {_Q5_BLOCK_BYTES}-byte blocks "
                f"per row, got {blocks.dtype} of shape {tuple(blocks.shape)}"
            )
        self.out_features, self.in_features = self.rows_shape((blocks,))
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def rows_shape(cls, rows: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """(N, K) of ``(blocks,)``: 32 weights per 22 bytes."""
        (blocks,) = rows
        return blocks.shape[0], blocks.shape[1] // _Q5_BLOCK_BYTES * 32

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
    def from_rows(cls, rows: Sequence[torch.Tensor], bias: torch.Tensor | None = None) -> Q5Linear:
        """From ``(blocks,)``: a GGUF Q5_0 tensor as stored
        (``attnlab.pretrained.gguf_file.q5_0_codes``)."""
        (blocks,) = rows
        return cls(blocks, bias)

    @classmethod
    def fuse(cls, parts: Sequence[Any], bias: torch.Tensor | None) -> Q5Linear:
        """Rows stacked; the parts' blocks become views of the fused ones."""
        return _stacked(cls, parts, ("blocks",), bias)

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
        if x2.shape[0] >= self.dense_from_rows:
            # A prompt: every d * (q - 16) (exact in float32) rounded once to bfloat16.
            return torch.mm(x2, self._bf16_weight().t())
        return self.row_kernel()(x2)

    def _bf16_weight(self) -> torch.Tensor:
        """:attr:`weight` rounded to bfloat16 (N, K): unpacked by the native build where
        there is one (several times faster than torch's shifts and masks)."""
        from attnlab import native

        ext = native.loaded()
        if ext is not None:
            return ext.q5_0_dequant(self.blocks)  # type: ignore[no-any-return]
        return self.weight.to(torch.bfloat16)

    def row_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        from attnlab import native

        ext = native.loaded()
        if ext is not None:
            op, blocks = ext.q5_0_mm, self.blocks
            return lambda x: op(x, blocks)
        if Q8Linear.why_not(self.out_features, self.in_features) is not None:
            # A file's rows that q8_0's int4 halves cannot pack: the dense product.
            return lambda x: torch.mm(x, self.weight.to(torch.bfloat16).t())
        return self._as_q8().row_kernel()

    def _as_q8(self) -> Q8Linear:
        """The codes as a :class:`Q8Linear` (``q - 16``, the same scales: the same weight),
        the kernel without the native build; built on first use and again when the blocks
        change."""
        key = (self.blocks.data_ptr(), _version(self.blocks))
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


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (0 for an inference tensor, which has none)."""
    try:
        return t._version
    except RuntimeError:
        return 0


#: Every weight precision by name: ``"float32"`` (the ``nn.Linear`` as it is) and the
#: registered formats.
WEIGHT_DTYPES: tuple[str, ...] = ("float32", *WEIGHT_FORMATS)


def unpack_int4_t(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The codes that ``_convert_weight_to_int4pack_for_cpu`` packed, transposed: (K, N) uint8.

    The CPU packing (PyTorch 2.x) takes rows in tiles of 64: tile ``b`` is ``K * 32``
    bytes, byte ``(b, k, j)`` holding row ``64 b + j`` in its low nibble and row
    ``64 b + 32 + j`` in its high one; the last ``N % 64`` rows (a multiple of 16) are
    ``K * r / 2`` bytes, byte ``(k, j)`` holding rows ``2 j`` (low) and ``2 j + 1`` (high).
    Tested against the codes given to the packing (``tests/test_quant.py``).
    """
    N, K = out_features, in_features
    flat = packed.reshape(-1)
    n_main = N - N % _PACK_TILE
    half = _PACK_TILE // 2
    out = torch.empty(K, N, dtype=torch.uint8, device=packed.device)  # (K, N)
    if n_main:
        tiles = flat[: n_main * K // 2].view(n_main // _PACK_TILE, K, half)  # (N/64, K, 32)
        dst = out[:, :n_main].view(K, n_main // _PACK_TILE, _PACK_TILE).transpose(0, 1)
        torch.bitwise_and(tiles, 15, out=dst[..., :half])
        torch.bitwise_right_shift(tiles, 4, out=dst[..., half:])
    r = N - n_main
    if r:
        tail = flat[n_main * K // 2 :].view(K, r // 2)  # (K, r/2)
        dst = out[:, n_main:].view(K, r // 2, 2)
        torch.bitwise_and(tail, 15, out=dst[..., 0])
        torch.bitwise_right_shift(tail, 4, out=dst[..., 1])
    return out


def weight_format(dtype: str) -> type[WeightFormat] | None:
    """The registered format named ``dtype``; None for ``"float32"`` (``nn.Linear``).

    Raises:
        ValueError: an unknown name, listing the choices.
    """
    if dtype == "float32":
        return None
    if dtype not in WEIGHT_FORMATS:
        raise ValueError(f"`dtype` must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    return WEIGHT_FORMATS[dtype]


def holding(
    cls: type[WeightFormat], out_features: int, in_features: int, group_size: int = 32
) -> type[WeightFormat]:
    """``cls``, or the first of its fallbacks (:attr:`WeightFormat.fallback`) that can
    hold an (N, K) weight."""
    while cls.why_not(out_features, in_features, group_size) is not None:
        assert cls.fallback is not None, f"{cls.name} holds some shapes and names no fallback"
        cls = WEIGHT_FORMATS[cls.fallback]
    return cls


def quantize_linear(linear: nn.Module, dtype: str, *, group_size: int = 32) -> nn.Module:
    """``linear`` (an ``nn.Linear``) in weight precision ``dtype``.

    ``"float32"`` and modules that are not ``nn.Linear`` are returned unchanged. A shape
    the format cannot hold gets its fallback (int4: int8; see :meth:`WeightFormat.why_not`).

    Raises:
        ValueError: unknown ``dtype``.
    """
    cls = weight_format(dtype)
    if cls is None or not isinstance(linear, nn.Linear):
        return linear
    w, b = linear.weight, linear.bias
    cls = holding(cls, w.shape[0], w.shape[1], group_size)
    return cls.from_float(w, b, group_size=group_size)


@runtime_checkable
class BuildsFromLinears(Protocol):
    """A model that keeps structures built from its linear layers (the fused products of
    :mod:`attnlab.models.fast_decode`), to be rebuilt when those layers are replaced."""

    def invalidate_decode_plan(self) -> None:
        """Forget what was built from the linear layers."""


def quantize_model(
    model: nn.Module,
    dtype: str,
    *,
    group_size: int = 32,
    int8_names: Sequence[str] = ("lm_head",),
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by its ``dtype`` version, in place.

    A tied output head (``lm_head.weight is tok_embeddings.weight``) is untied: the
    embedding stays float32 for the lookup and the head gets its own quantised copy.
    Layers already in a :class:`WeightFormat` (e.g. taken from a GGUF file's codes) stay as
    they are. What the model built from its old layers is dropped
    (:class:`BuildsFromLinears`).

    Args:
        model: any module.
        dtype: one of :data:`WEIGHT_DTYPES`.
        group_size: int4 group size.
        int8_names: with ``dtype="int4"``, linears of these names get int8 instead (the
            output head: int4 there costs most of the logit error, see
            ``benchmarks/bench_pretrained.py``).

    Returns:
        ``model``.

    Raises:
        ValueError: unknown ``dtype``.
    """
    if weight_format(dtype) is None:
        return model
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        this = "int8" if dtype == "int4" and name in int8_names else dtype
        setattr(parent, leaf, quantize_linear(linear, this, group_size=group_size))
    if targets and isinstance(model, BuildsFromLinears):
        model.invalidate_decode_plan()
    return model


def fuse_rows(linears: Sequence[Any], *, share_float: bool = False) -> nn.Module | None:
    """One product for several linears of the same input: their rows stacked.

    A :class:`WeightFormat`'s parts are fused by its :meth:`~WeightFormat.fuse` (bf16 and
    int8: the parts' buffers become views of the fused storage; int4: the packs
    concatenate when every part has a multiple of 64 rows, the packing's tile).
    ``nn.Linear`` parts are fused only with ``share_float=True``: their parameters (the
    same ``nn.Parameter`` objects, so an optimizer holding them still works) then hold
    views of the fused weight, so in-place updates stay shared, but the parameters share
    one storage (safetensors refuses to save shared tensors: clone them first). Without
    it a float copy could go stale.

    Returns:
        The fused module, or None when the parts cannot be fused (mixed types, different
        input widths, biases on some parts only, a format's own reasons, float parts
        without ``share_float``).
    """
    first: Any = linears[0]
    if any(type(m) is not type(first) for m in linears):
        return None
    if len({m.in_features for m in linears}) != 1:
        return None
    biases = [getattr(m, "bias", None) for m in linears]
    has_bias = [b is not None for b in biases]
    if any(has_bias) and not all(has_bias):
        return None
    bias = torch.cat([b.detach() for b in biases]) if all(has_bias) else None  # type: ignore[union-attr]
    with torch.no_grad():
        if isinstance(first, WeightFormat):
            return type(first).fuse(linears, bias)
        if not isinstance(first, nn.Linear) or not share_float:
            return None
        parts = [m.weight.detach() for m in linears]
        # Pieces of one tensor (GPT-2's Conv1D c_attn, Phi-3's qkv_proj, a gate_proj
        # and up_proj side by side in the file) are that tensor again, not a copy,
        # when it has the layout wanted: column-major for fp32 (see `column_major`:
        # (K, sum N) memory, a (sum N, K) view), either for bf16 / fp16.
        w = _stacked_rows(parts)
        fp32 = first.weight.dtype == torch.float32
        if w is None or (fp32 and w.stride(0) != 1):
            w = torch.cat([p.t() for p in parts], dim=1).t() if fp32 else torch.cat(parts)
        if bias is not None:
            stacked = _stacked_rows([b.detach() for b in biases])  # type: ignore[union-attr]
            bias = bias if stacked is None else stacked
        fused = _FusedLinear(w, bias)
        for m, rows in zip(linears, _row_slices(linears), strict=True):
            m.weight.data = w[rows]  # the same Parameter, now a view
            if bias is not None:
                m.bias.data = bias[rows]
        return fused


def column_major(linear: object) -> None:
    """Store an fp32 ``nn.Linear``'s weight column-major, in place: the same ``Parameter``
    (and shape (N, K)), now a transposed view of a contiguous (K, N) tensor.

    A product of one row then reads the weight as ``mm(x, Wᵀ)`` with ``Wᵀ`` contiguous,
    which PyTorch's CPU BLAS streams at the memory's read bandwidth, where the row-major
    (N, K) layout takes a slower dot-product kernel; products of many rows run at the
    same speed either way. Only wide outputs (``N > K``) gain, so narrower ones stay
    row-major, and so do bf16 / fp16 weights, whose one-row products are as fast or
    faster row-major (all of it: ``benchmarks/bench_decode_bandwidth.py``). Tied weights
    (an embedding shared with the head) follow, being the same ``Parameter``; the
    embedding's row lookups read the strided rows. Other modules and already
    column-major weights are left as they are. Saving with safetensors then needs
    ``.contiguous()`` (it refuses views).
    """
    if (
        isinstance(linear, nn.Linear)
        and linear.out_features > linear.in_features
        and linear.weight.dtype == torch.float32
        and linear.weight.stride(0) != 1
    ):
        with torch.no_grad():
            linear.weight.data = linear.weight.detach().t().contiguous().t()


def _stacked_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose consecutive row blocks ``parts`` are (a view, no copy), or None.

    True when every part is a view of one storage with the same strides and trailing
    shape, each starting where the previous one's rows end.
    """
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in parts:
        if (
            t.untyped_storage().data_ptr() != storage
            or t.dtype != first.dtype
            or t.stride() != first.stride()
            or t.shape[1:] != first.shape[1:]
            or t.storage_offset() != offset
        ):
            return None
        offset += t.shape[0] * t.stride(0)
    shape = (sum(t.shape[0] for t in parts), *first.shape[1:])
    return first.as_strided(shape, first.stride(), first.storage_offset())


class _FusedLinear(nn.Module):
    """A float product over a weight that is not a parameter (its parts own the parameters)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) -> (..., N)."""
        return nn.functional.linear(x, self.weight, self.bias)


# --------------------------------------------------------------------------- one-row kernels


def row_product(linear: object) -> tuple[torch.dtype, Any] | None:
    """The bare product of a few rows that ``linear.forward`` runs, for the decode step.

    ``forward`` reshapes its input, converts it to the kernel's dtype and converts the
    product back: five tensor operations around one kernel, thirty layers over. The decode
    step of :mod:`attnlab.models.fast_decode` instead keeps its rows in the kernel's dtype
    and calls the kernel alone; the numbers are those of ``forward`` (the same kernel on
    the same bf16 rows).

    Returns:
        ``(dtype, fn)``: ``fn`` takes (M, K) rows in ``dtype`` and returns (M, N) in the
        kernel's output dtype (bfloat16 for the bf16 / int layers, ``dtype`` for float),
        bias added (in float32). None for other modules. Valid for fewer rows than the
        layer's ``dense_from_rows``.
    """
    bias = getattr(linear, "bias", None)
    if isinstance(linear, WeightFormat):
        fn, dtype = linear.row_kernel(), torch.bfloat16
    elif isinstance(linear, (nn.Linear, _FusedLinear)):
        w, b = linear.weight, linear.bias
        return w.dtype, lambda x: nn.functional.linear(x, w, b)
    else:
        return None
    if bias is None:
        return dtype, fn
    kernel = fn
    return dtype, lambda x: kernel(x) + bias


def _q8_0_bf16(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Q8_0 codes (N, K) and scales (N, K/32) as the bfloat16 weight: each ``d * q`` (exact
    in float32) rounded once; by the native build where there is one."""
    from attnlab import native

    ext = native.loaded()
    if ext is not None and codes.is_contiguous() and scales.is_contiguous():
        return ext.q8_0_dequant(codes, scales)  # type: ignore[no-any-return]
    N, K = codes.shape
    w = codes.view(N, K // 32, 32).float() * scales.float()[..., None]  # (N, K/32, 32)
    return w.view(N, K).to(torch.bfloat16)


def native_product(linear: object) -> NativeProduct | None:
    """:func:`row_product`'s kernel as the native decode step calls it, or None (a module
    it cannot call: the step then takes the Python loop)."""
    if isinstance(linear, WeightFormat):
        return linear.native_product()
    if isinstance(linear, (nn.Linear, _FusedLinear)):
        w = linear.weight
        return NativeProduct(NATIVE_LINEAR, w, None, 0, w.shape[0], linear.bias)
    return None
