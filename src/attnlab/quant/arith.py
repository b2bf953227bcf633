"""The arithmetic of a prompt's dense products on this CPU: bfloat16 or float32.

From a layer's ``dense_from_tokens`` rows on (a prompt), the weight formats dequantise
their weight and run one dense ``mm``. In bfloat16 that is the fastest product a CPU with
bf16 dot products has (AVX512-BF16, AMX: oneDNN's kernels). A CPU without them has no
fast bf16 ``mm``: on AVX-512 without BF16 (Skylake, Cascade Lake, Zen 3 has no AVX-512 at
all) oneDNN converts every operand to float32 inside its kernel, and on AVX2 alone
PyTorch's bf16 ``mm`` falls back to a loop tens of times slower than float32's
(``benchmarks/bench_prompt_arith.py``). There the weight is dequantised to float32 and
the product runs in float32, which is also exact where bf16 rounds: the activations are
not rounded and every dequantised weight is the stored value.

The choice is made once per process from the CPU's features (:func:`prompt_arithmetic`),
and shown by ``attnlab info``:

- ``ATTNLAB_PROMPT_DTYPE=bfloat16`` or ``float32`` decides it outright;
- otherwise bfloat16 when the CPU has bf16 dot products (x86 ``avx512_bf16`` or
  ``amx_bf16``, Arm ``bf16``) and ``ONEDNN_MAX_CPU_ISA``, if set, lets oneDNN use them;
- float32 otherwise.
"""

from __future__ import annotations

import functools
import os

import torch

from attnlab import native

__all__ = ["PROMPT_DTYPE_ENV", "prompt_arithmetic", "prompt_dtype"]

#: The environment variable that decides the prompt products' dtype outright.
PROMPT_DTYPE_ENV = "ATTNLAB_PROMPT_DTYPE"

_CHOICES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# The CPU flags of bf16 dot products (x86: AVX512-BF16, AMX-BF16; Arm: FEAT_BF16).
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) that keep its bf16 dot products.
_ONEDNN_BF16_CAPS = frozenset(
    {
        "AVX512_CORE_BF16",
        "AVX512_CORE_FP16",
        "AVX512_CORE_AMX",
        "AVX512_CORE_AMX_FP16",
        "AVX10_1_512",
        "AVX10_1_512_AMX",
        "AVX10_1_512_AMX_FP16",
        "AVX10_2_512",
        "AVX10_2_512_AMX_2",
        "ALL",
    }
)


@functools.cache
def prompt_arithmetic() -> tuple[torch.dtype, str]:
    """``(dtype, why)``: the dtype of this process's dense prompt products, and why.

    Raises:
        ValueError: ``ATTNLAB_PROMPT_DTYPE`` set to anything but ``bfloat16`` or
            ``float32``.
    """
    chosen = os.environ.get(PROMPT_DTYPE_ENV)
    if chosen:
        if chosen not in _CHOICES:
            raise ValueError(
                f"{PROMPT_DTYPE_ENV} must be one of {sorted(_CHOICES)}, got {chosen!r}"
            )
        return _CHOICES[chosen], f"{PROMPT_DTYPE_ENV}={chosen}"
    flags = set(native.cpu_flags().split())
    if not flags & _BF16_FLAGS:
        return torch.float32, (
            "the CPU has no bf16 dot products (avx512_bf16, amx_bf16): PyTorch's bf16 mm "
            "would convert or loop"
        )
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap and cap not in _ONEDNN_BF16_CAPS:
        return torch.float32, f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN from bf16 dot products"
    found = " / ".join(sorted(flags & _BF16_FLAGS))
    return torch.bfloat16, f"the CPU has bf16 dot products ({found})"


def prompt_dtype() -> torch.dtype:
    """The dtype of a prompt's dense products here (:func:`prompt_arithmetic`)."""
    return prompt_arithmetic()[0]
