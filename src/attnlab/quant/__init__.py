"""Weight precision for inference: bf16 and weight-only int8 / int4 / q8_0 / q5_0 linears.

Each format is a class (:class:`WeightFormat`, a module here each), registered by name in
:data:`WEIGHT_FORMATS`, that builds itself from a float weight or from its stored tensors
(a GGUF file's blocks as stored, for the types in its :attr:`~WeightFormat.gguf_blocks`,
read by its :meth:`~WeightFormat.gguf_codes`), fuses with its siblings into one product,
and is a drop-in for ``nn.Linear`` in a model that only runs forward: it takes and returns
the input's dtype (fp32 activations stay fp32), runs the product in bfloat16 against its
stored weights, and exposes ``weight`` (dequantised, float32) so that readers of the
weights (the explainer) see a plain matrix. Its :attr:`~WeightFormat.cli_help` is its
entry in the CLI's ``--dtype`` help (:func:`dtype_help`).

- :class:`BF16Linear` (``"bfloat16"``, :mod:`~attnlab.quant.bf16`): the weight rounded to
  bfloat16.
- :class:`Int8Linear` (``"int8"``, :mod:`~attnlab.quant.int8`): one int8 per weight and
  one scale per output row (symmetric), ``torch.ops.aten._weight_int8pack_mm``.
- :class:`Int4Linear` (``"int4"``, :mod:`~attnlab.quant.int4`): 4-bit codes in groups of
  ``group_size`` input columns, each group with a scale and a zero, held two a byte in
  GGUF's Q4_0 layout; GGUF's Q4_0, Q4_1 and Q4_K blocks as they are. Run by attnlab's
  own kernel (:mod:`attnlab.native`, integer products wherever there is AVX2) where it is
  built, else by PyTorch's int4 kernel (:func:`attnlab.quant.int4.native_q4`). GGUF's 5-,
  6- and 8-bit
  types go to :class:`Q5Linear` (Q5_0) and :class:`Q8Linear` (the others) instead
  (:attr:`WeightFormat.gguf_instead`).
- :class:`Q8Linear` (``"q8_0"``, :mod:`~attnlab.quant.q8_0`): int8 codes with one float16
  scale per 32 weights (llama.cpp's Q8_0), run by attnlab's own kernel
  (:mod:`attnlab.native`) or, without it, as two int4 halves by PyTorch's.
- :class:`Q5Linear` (``"q5_0"``, :mod:`~attnlab.quant.q5_0`): 5-bit codes with one
  float16 scale per 32 weights (llama.cpp's Q5_0 blocks), run by attnlab's own kernel or,
  without it, as a :class:`Q8Linear`.

Beside them, :class:`Float32Linear` (:mod:`~attnlab.quant.float32`) is ``nn.Linear`` whose
float32 prompts run on the machine's faster float32 GEMM; loaded models' plain linears
become it.

A new format is its module here (a registered subclass, imported by
:mod:`~attnlab.quant.registry`) plus its kernel in :mod:`attnlab.native`.

Both int kernels need bfloat16 activations, scales and zeros on the CPU (they accept fp32
inputs, but their fast path is bf16's). They are made for a few rows (decoding): from a
crossover number of rows of input on (a prompt), the int layers instead dequantise their
weight for that one call and run one dense ``mm`` in the prompt arithmetic's dtype
(:mod:`~attnlab.quant.arith`; int8: the codes converted, the per-row scale applied to the
product's columns; int4: the codes unpacked, ``q * scale + (zero - 8 scale)`` per
group); nothing is kept, so memory stays that of the codes. Each format's crossover is
measured on the machine at first use and cached (:mod:`~attnlab.quant.crossover`);
``benchmarks/bench_int_prefill.py`` shows the whole curve. Products of
several linears of one input, stacked, are built by :func:`fuse_linears`
(:mod:`~attnlab.quant.products`).

Shape legend: N output features (rows), K input features, M rows of input (B*T).
"""

from __future__ import annotations

# The registry first: it imports the formats in their order (that of WEIGHT_DTYPES).
# isort: off
from attnlab.quant.registry import (
    WEIGHT_DTYPES,
    BuildsFromLinears,
    GGUFHolding,
    dtype_help,
    gguf_blocks,
    gguf_format,
    gguf_holding,
    holding,
    quantize_linear,
    quantize_model,
    weight_format,
)

# isort: on
from attnlab.quant.base import WEIGHT_FORMATS, GGUFBlock, WeightFormat, register_format
from attnlab.quant.bf16 import BF16Linear
from attnlab.quant.embedding import HeldEmbedding
from attnlab.quant.float32 import Float32Linear, use_float32_gemm
from attnlab.quant.int4 import Int4Linear
from attnlab.quant.int8 import Int8Linear
from attnlab.quant.kinds import (
    NATIVE_INT4,
    NATIVE_INT8,
    NATIVE_LINEAR,
    NATIVE_Q4,
    NATIVE_Q5,
    NATIVE_Q8,
    NativeProduct,
)
from attnlab.quant.products import (
    column_major,
    decode_product,
    fuse_linears,
    fuse_rows,
    native_product,
    row_product,
)
from attnlab.quant.q5_0 import Q5Linear
from attnlab.quant.q8_0 import Q8Linear

__all__ = [
    "NATIVE_INT4",
    "NATIVE_INT8",
    "NATIVE_LINEAR",
    "NATIVE_Q4",
    "NATIVE_Q5",
    "NATIVE_Q8",
    "WEIGHT_DTYPES",
    "WEIGHT_FORMATS",
    "BF16Linear",
    "BuildsFromLinears",
    "Float32Linear",
    "GGUFBlock",
    "GGUFHolding",
    "HeldEmbedding",
    "Int4Linear",
    "Int8Linear",
    "NativeProduct",
    "Q5Linear",
    "Q8Linear",
    "WeightFormat",
    "column_major",
    "decode_product",
    "dtype_help",
    "fuse_linears",
    "fuse_rows",
    "gguf_blocks",
    "gguf_format",
    "gguf_holding",
    "holding",
    "native_product",
    "quantize_linear",
    "quantize_model",
    "register_format",
    "row_product",
    "use_float32_gemm",
    "weight_format",
]
