"""Weight precision for inference: bf16 and weight-only int8 / int4 linear layers.

Each class here is a drop-in for ``nn.Linear`` in a model that only runs forward: it
takes and returns the input's dtype (fp32 activations stay fp32), runs the product in
bfloat16 against its stored weights, and exposes ``weight`` (dequantised, float32) so
that readers of the weights (the explainer) see a plain matrix.

- :class:`BF16Linear`: the weight rounded to bfloat16.
- :class:`Int8Linear`: one int8 per weight and one scale per output row (symmetric),
  ``torch.ops.aten._weight_int8pack_mm``.
- :class:`Int4Linear`: 4-bit codes in groups of ``group_size`` input columns, each
  group with a scale and a zero, ``w = (q - 8) * scale + zero``; the CPU kernel
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``. GGUF's Q4_0 and Q4_1 blocks are this
  format with groups of 32 (Q4_0: ``zero = 0``; Q4_1: ``w = q*d + m``, so
  ``zero = m + 8d``) and are taken as they are, codes unchanged (:meth:`Int4Linear.from_codes`).

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

from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch
from torch import nn

__all__ = [
    "WEIGHT_DTYPES",
    "BF16Linear",
    "Int4Linear",
    "Int8Linear",
    "WeightDtype",
    "column_major",
    "fuse_rows",
    "quantize_linear",
    "quantize_model",
    "unpack_int4_t",
]

WeightDtype = Literal["float32", "bfloat16", "int8", "int4"]
WEIGHT_DTYPES: tuple[str, ...] = get_args(WeightDtype)

_PACK_TILE = 64  # rows per tile of the CPU int4 packing: packs of 64-row parts concatenate


def _as_2d(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k).to(torch.bfloat16)  # (M, K)


class BF16Linear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` stored in bfloat16 (the product in bf16, fp32 accumulation).

    Args:
        weight: (N, K) float weight, rounded to bfloat16.
        bias: (N,) or None; kept in float32.
    """

    weight_bf16: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_bf16", weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @property
    def weight(self) -> torch.Tensor:
        """The stored weight as float32 (N, K)."""
        return self.weight_bf16.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) -> (..., N), in ``x``'s dtype."""
        y = torch.mm(_as_2d(x, self.in_features), self.weight_bf16.t())  # (M, N)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16"


class Int8Linear(nn.Module):
    """Weight-only int8: ``W = q * scale[row]``, q in [-127, 127], one bf16 scale per row.

    Args:
        qweight: (N, K) int8 codes.
        scales: (N,) bfloat16 scales.
        bias: (N,) or None; kept in float32.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
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
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Quantise a float (N, K) weight: scale = max|row| / 127, rounded to bf16 first."""
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)  # (N,)
        # Codes from the bf16 scale the kernel will use, so the scale's rounding is absorbed.
        q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight, float32 (N, K)."""
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) -> (..., N), in ``x``'s dtype."""
        x2 = _as_2d(x, self.in_features)  # (M, K) bf16
        if x2.shape[0] >= self.dense_from_rows:
            # Codes in [-127, 127] are exact in bf16; W = diag(scale) q, so scale the columns.
            y = torch.mm(x2, self.qweight.to(torch.bfloat16).t()).mul_(self.scales)  # (M, N)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)  # (M, N)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(nn.Module):
    """Weight-only int4 in groups: ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``.

    ``g = k // group_size``; q in 0..15. The codes are packed once by
    ``_convert_weight_to_int4pack_for_cpu`` (needs N % 16 == 0 and K % group_size == 0).

    Args:
        packed: the packed codes (from :meth:`from_codes`).
        scales_and_zeros: (K / group_size, N, 2) bfloat16.
        group_size: input columns per group (32, 64, 128, ...).
        in_features: K.
        bias: (N,) or None; kept in float32.
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None
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

    @staticmethod
    def check_shape(out_features: int, in_features: int, group_size: int) -> str | None:
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
        why = cls.check_shape(N, K, group_size)
        if why is not None or group_size * scales.shape[1] != K:
            raise ValueError(f"cannot pack an int4 weight of shape {(N, K)}: {why}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 2
        )
        sz = torch.stack([scales.t(), zeros.t()], dim=-1)  # (K/gs, N, 2)
        return cls(packed, sz, group_size, K, bias)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = 32
    ) -> Int4Linear:
        """Quantise a float (N, K) weight per group: min/max over each group onto 0..15."""
        N, K = weight.shape
        why = cls.check_shape(N, K, group_size)
        if why is not None:
            raise ValueError(f"cannot pack an int4 weight of shape {(N, K)}: {why}")
        w = weight.detach().float().view(N, K // group_size, group_size)  # (N, K/gs, gs)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # (N, K/gs)
        scales = ((hi - lo) / 15.0).clamp_min(1e-12).to(torch.bfloat16).float()
        zeros = (lo + 8.0 * scales).to(torch.bfloat16).float()
        q = torch.round((w - zeros[..., None]) / scales[..., None] + 8.0).clamp_(0, 15)
        return cls.from_codes(q.view(N, K), scales, zeros, bias)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) -> (..., N), in ``x``'s dtype."""
        x2 = _as_2d(x, self.in_features)  # (M, K) bf16
        if x2.shape[0] >= self.dense_from_rows:
            y = torch.mm(x2, self._dequantized_t(torch.bfloat16))  # (M, N)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.packed, self.group_size, self.scales_and_zeros
            )  # (M, N)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int4, "
            f"group_size={self.group_size}"
        )


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


def quantize_linear(linear: nn.Module, dtype: str, *, group_size: int = 32) -> nn.Module:
    """``linear`` (an ``nn.Linear``) in weight precision ``dtype``.

    ``"float32"`` returns it unchanged. An int4 request for a shape the kernel cannot pack
    falls back to int8 (see :meth:`Int4Linear.check_shape`).

    Raises:
        ValueError: unknown ``dtype``.
    """
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"`dtype` must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    if dtype == "float32" or not isinstance(linear, nn.Linear):
        return linear
    w, b = linear.weight, linear.bias
    if dtype == "bfloat16":
        return BF16Linear(w, b)
    if dtype == "int4" and Int4Linear.check_shape(w.shape[0], w.shape[1], group_size) is None:
        return Int4Linear.from_float(w, b, group_size=group_size)
    return Int8Linear.from_float(w, b)


def quantize_model(
    model: nn.Module,
    dtype: str,
    *,
    group_size: int = 32,
    prepared: dict[str, nn.Module] | None = None,
    int8_names: Sequence[str] = ("lm_head",),
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by its ``dtype`` version, in place.

    A tied output head (``lm_head.weight is tok_embeddings.weight``) is untied: the
    embedding stays float32 for the lookup and the head gets its own quantised copy.

    Args:
        model: any module.
        dtype: one of :data:`WEIGHT_DTYPES`.
        group_size: int4 group size.
        prepared: modules already quantised by name (e.g. int4 straight from GGUF blocks);
            they replace the linear of that name as they are.
        int8_names: with ``dtype="int4"``, linears of these names get int8 instead (the
            output head: int4 there costs most of the logit error, see
            ``benchmarks/bench_pretrained.py``).

    Returns:
        ``model``.

    Raises:
        ValueError: unknown ``dtype``.
    """
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"`dtype` must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    if dtype == "float32":
        return model
    prepared = prepared or {}
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        this = "int8" if dtype == "int4" and name in int8_names else dtype
        new = prepared.get(name) or quantize_linear(linear, this, group_size=group_size)
        setattr(parent, leaf, new)
    model.__dict__.pop("_decode_plan", None)  # a fast decode plan holds the old modules
    return model


def fuse_rows(linears: Sequence[Any], *, share_float: bool = False) -> nn.Module | None:
    """One product for several linears of the same input: their rows stacked.

    For :class:`BF16Linear` and :class:`Int8Linear` the parts' buffers then become views
    of the fused storage (no second copy). For :class:`Int4Linear` the packed codes
    concatenate when every part has a multiple of 64 rows (the packing's tile); the parts
    keep their own packs (int4 is small). ``nn.Linear`` parts are fused only with
    ``share_float=True``: their parameters (the same ``nn.Parameter`` objects, so an
    optimizer holding them still works) then hold views of the fused weight, so in-place
    updates stay shared, but the parameters share one storage (safetensors refuses to save
    shared tensors: clone them first). Without it a float copy could go stale.

    Returns:
        The fused module, or None when the parts cannot be fused (mixed types, int4 parts
        not aligned to the tile, different input widths or group sizes, float parts
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
    rows = [m.out_features for m in linears]
    starts = [sum(rows[:i]) for i in range(len(rows))]
    with torch.no_grad():
        if isinstance(first, nn.Linear):
            if not share_float:
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
            fused: Any = _FusedLinear(w, bias)
            for m, s, n in zip(linears, starts, rows, strict=True):
                m.weight.data = w[s : s + n]  # the same Parameter, now a view
                if bias is not None:
                    m.bias.data = bias[s : s + n]
            return fused
        if isinstance(first, BF16Linear):
            fused = BF16Linear.__new__(BF16Linear)
            nn.Module.__init__(fused)
            fused.in_features, fused.out_features = first.in_features, sum(rows)
            fused.register_buffer("weight_bf16", torch.cat([m.weight_bf16 for m in linears]))
            fused.register_buffer("bias", bias)
            for m, s, n in zip(linears, starts, rows, strict=True):
                m.weight_bf16 = fused.weight_bf16[s : s + n]
            return fused
        if isinstance(first, Int8Linear):
            fused = Int8Linear(
                torch.cat([m.qweight for m in linears]),
                torch.cat([m.scales for m in linears]),
                bias,
            )
            for m, s, n in zip(linears, starts, rows, strict=True):
                m.qweight = fused.qweight[s : s + n]
                m.scales = fused.scales[s : s + n]
            return fused
        if isinstance(first, Int4Linear):
            if any(n % _PACK_TILE for n in rows):
                return None
            if len({m.group_size for m in linears}) != 1:
                return None
            return Int4Linear(
                torch.cat([m.packed for m in linears]),
                torch.cat([m.scales_and_zeros for m in linears], dim=1),
                first.group_size,
                first.in_features,
                bias,
            )
    return None


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
    fn: Any
    if isinstance(linear, Int4Linear):
        op4 = torch.ops.aten._weight_int4pack_mm_for_cpu
        packed, gs, sz = linear.packed, linear.group_size, linear.scales_and_zeros
        fn = lambda x: op4(x, packed, gs, sz)  # noqa: E731
        dtype = torch.bfloat16
    elif isinstance(linear, Int8Linear):
        op8, q, s = torch.ops.aten._weight_int8pack_mm, linear.qweight, linear.scales
        fn = lambda x: op8(x, q, s)  # noqa: E731
        dtype = torch.bfloat16
    elif isinstance(linear, BF16Linear):
        wt = linear.weight_bf16.t()
        fn = lambda x: torch.mm(x, wt)  # noqa: E731
        dtype = torch.bfloat16
    elif isinstance(linear, (nn.Linear, _FusedLinear)):
        w, b = linear.weight, linear.bias
        return w.dtype, lambda x: nn.functional.linear(x, w, b)
    else:
        return None
    if bias is None:
        return dtype, fn
    kernel = fn
    return dtype, lambda x: kernel(x) + bias
