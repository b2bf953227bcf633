"""Products over linear layers of any kind (``nn.Linear`` or a :class:`WeightFormat`):
several layers of one input fused into one product, an fp32 weight laid out for one-row
products, and the bare kernel of a few rows that the decode step calls.

Shape legend: N output features, K input features, M rows of input (B*T).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from attnlab.quant.base import WeightFormat, output_slices
from attnlab.quant.kinds import NATIVE_LINEAR, NativeProduct

__all__ = [
    "column_major",
    "decode_product",
    "fuse_linears",
    "fuse_rows",
    "native_product",
    "row_product",
]


def fuse_linears(linears: Sequence[Any], *, share_float: bool = False) -> nn.Module | None:
    """One product for several linears of the same input: their rows stacked.

    A :class:`WeightFormat`'s parts are fused by its :meth:`~WeightFormat.fuse` (bf16 and
    int8: the parts' buffers become views of the fused storage; int4: the codes and
    scales concatenate when the parts share a group size).
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
        w = _spanning_view(parts)
        fp32 = first.weight.dtype == torch.float32
        if w is None or (fp32 and w.stride(0) != 1):
            w = torch.cat([p.t() for p in parts], dim=1).t() if fp32 else torch.cat(parts)
        if bias is not None:
            stacked = _spanning_view([b.detach() for b in biases])  # type: ignore[union-attr]
            bias = bias if stacked is None else stacked
        fused = _FusedLinear(w, bias)
        for m, rows in zip(linears, output_slices(linears), strict=True):
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


def _spanning_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose consecutive row blocks ``parts`` are (a view of their common
    storage, no copy), or None.

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


def decode_product(linear: object) -> tuple[torch.dtype, Any] | None:
    """The bare product of a few rows that ``linear.forward`` runs, for the decode step.

    ``forward`` reshapes its input, converts it to the kernel's dtype and converts the
    product back: five tensor operations around one kernel, thirty layers over. The decode
    step of :mod:`attnlab.models.fast_decode` instead keeps its rows in the kernel's dtype
    and calls the kernel alone; the numbers are those of ``forward`` (the same kernel on
    the same rows).

    Returns:
        ``(dtype, fn)``: ``fn`` takes (M, K) rows in ``dtype`` and returns (M, N) in the
        kernel's output dtype (``dtype``: a format's :meth:`~WeightFormat.decode_dtype`),
        bias added (in float32). None for other modules. Valid for fewer rows than the
        layer's crossover (:meth:`~attnlab.quant.WeightFormat.runs_dense`).
    """
    bias = getattr(linear, "bias", None)
    if isinstance(linear, WeightFormat):
        fn, dtype = linear.decode_kernel(), linear.decode_dtype()
    elif isinstance(linear, (nn.Linear, _FusedLinear)):
        w, b = linear.weight, linear.bias
        return w.dtype, lambda x: nn.functional.linear(x, w, b)
    else:
        return None
    if bias is None:
        return dtype, fn
    kernel = fn
    return dtype, lambda x: kernel(x) + bias


def native_product(linear: object) -> NativeProduct | None:
    """:func:`decode_product`'s kernel as the native decode step calls it, or None (a module
    it cannot call: the step then takes the Python loop)."""
    if isinstance(linear, WeightFormat):
        return linear.native_product()
    if isinstance(linear, (nn.Linear, _FusedLinear)):
        w = linear.weight
        return NativeProduct(NATIVE_LINEAR, w, None, 0, w.shape[0], linear.bias)
    return None


#: :func:`fuse_linears` (its former name).
fuse_rows = fuse_linears
#: :func:`decode_product` (its former name).
row_product = decode_product
