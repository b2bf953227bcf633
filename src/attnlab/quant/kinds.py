"""The products the native decode step calls (``attnlab/native/decode_step.cpp``).

The kinds are the C++ ``Kind`` enum's values; a format names its kind in
:meth:`attnlab.quant.WeightFormat.native_product`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "NATIVE_INT4",
    "NATIVE_INT8",
    "NATIVE_LINEAR",
    "NATIVE_Q5",
    "NATIVE_Q8",
    "NativeProduct",
]

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
