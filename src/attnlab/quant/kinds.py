"""The products the native decode step calls (``attnlab/native/decode_step.cpp``).

The kinds are the C++ ``Kind`` enum's values; a format names its kind in
:meth:`attnlab.quant.WeightFormat.native_product`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from attnlab.native import PRODUCT_KINDS

__all__ = [
    "NATIVE_INT4",
    "NATIVE_INT8",
    "NATIVE_LINEAR",
    "NATIVE_Q4",
    "NATIVE_Q5",
    "NATIVE_Q8",
    "NativeProduct",
]

# Product kinds of the native decode step, by attnlab.native's table (checked against the
# compiled module's at each build).
NATIVE_INT4, NATIVE_INT8, NATIVE_LINEAR, NATIVE_Q8, NATIVE_Q5, NATIVE_Q4 = (
    PRODUCT_KINDS[k] for k in ("int4", "int8", "linear", "q8_0", "q5_0", "q4")
)


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
