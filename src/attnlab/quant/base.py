"""The weight-format base class, its registry and the helpers its formats share.

Shape legend: N output features (weight rows), K input features, M rows of input (B*T),
R weight rows of a GGUF tensor, G blocks per weight row.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch import nn

from attnlab import native
from attnlab.quant import crossover
from attnlab.quant.arith import prompt_dtype
from attnlab.quant.kinds import NativeProduct

__all__ = [
    "WEIGHT_FORMATS",
    "GGUFBlock",
    "WeightFormat",
    "register_format",
]


class GGUFBlock(NamedTuple):
    """How a GGUF type stores its weights (``ggml-common.h``): ``values`` weights in
    ``nbytes`` bytes a block, each block starting with ``f16_scales`` float16 numbers whose
    finiteness decides its values' (checking those checks the values; 0: none such)."""

    values: int
    nbytes: int
    f16_scales: int = 0


def fresh(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised numpy array of ``shape`` and ``dtype`` in memory from PyTorch's
    allocator: where a loader writes a weight out of a file.

    numpy asks the kernel for transparent huge pages on every large array (``madvise``).
    Where those fault in slowly, as on the virtual machines this project is measured on,
    that dominated a load: Gemma 3's embedding, 670 MB of float32, took 1.2-1.4 s written
    into a numpy array and 0.36 s into this one; its 170 MB of Q8_0 codes 0.37 s and
    0.09 s. PyTorch's allocator leaves the pages as the system gives them. The array is a
    view of a tensor's storage (``torch.from_numpy`` of it shares that storage).
    """
    torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return torch.empty(shape, dtype=torch_dtype).numpy()


#: Outputs of at least this many bytes are written in two halves at once (:func:`in_halves`):
#: a thread costs tens of microseconds, a 4 MB output about a millisecond of page faults
#: (Gemma 3's float32 load, mostly outputs of 3-7 MB, 0.03-0.05 s faster than from 32 MB).
HALVES_FROM = 4 << 20


def in_halves(rows: int, nbytes: int, work: Callable[[int, int], object]) -> None:
    """``work(start, stop)`` over the rows ``[0, rows)``: for an output of ``nbytes`` of
    at least :data:`HALVES_FROM` on a machine of several cores, the second half in a helper
    thread while this one does the first, else all at once.

    numpy lets go of Python's lock inside a copy or an arithmetic loop, so the halves run
    on two cores, and most of what they cost is faulting in fresh pages, which the kernel
    does for both at once: Gemma 3's 670 MB float32 embedding in 0.29-0.36 s against
    0.47-0.54 s, its 170 MB of Q8_0 codes in 0.07 s against 0.12 s. With the other core
    busy the helper's half waits for it, as one thread's second half would have.
    """
    if nbytes < HALVES_FROM or rows < 2 or (os.cpu_count() or 1) < 2:
        work(0, rows)
        return
    half = rows // 2
    failed: list[BaseException] = []

    def second() -> None:
        try:
            work(half, rows)
        except BaseException as e:  # raised again in the caller's thread
            failed.append(e)

    helper = threading.Thread(target=second, name="attnlab-half", daemon=True)
    helper.start()
    try:
        work(0, half)
    finally:
        helper.join()
    if failed:
        raise failed[0]


def fresh_copy(src: np.ndarray, dtype: Any = None) -> np.ndarray:
    """``src`` copied into a C-contiguous :func:`fresh` array, converted to ``dtype`` if
    given (``np.ascontiguousarray`` or ``astype`` of a view of the file, without its huge
    pages); a large one in two halves at once (:func:`in_halves`)."""
    out = fresh(src.shape, src.dtype if dtype is None else dtype)
    if out.ndim == 0:
        np.copyto(out, src)
        return out
    in_halves(out.shape[0], out.nbytes, lambda a, b: np.copyto(out[a:b], src[a:b]))
    return out


def f16_columns(blocks: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` little-endian float16 values of every block (..., bytes), as
    (..., n) float32: read as float16 elements where a block is whole ones (every block
    type but MXFP4's 17 bytes), one strided pass, else their bytes copied first."""
    if blocks.shape[-1] % 2 == 0 and blocks.strides[-1] == 1:
        return blocks.view(np.float16)[..., :n].astype(np.float32)
    return np.ascontiguousarray(blocks[..., : 2 * n]).view(np.float16).astype(np.float32)


def nibbles(qs: np.ndarray, dtype: type = np.uint8) -> np.ndarray:
    """(..., B) packed bytes -> (..., 2B) in 0..15 as ``dtype``: the low nibbles, then the
    high ones (the 4- and 5-bit GGUF types' order within a block), written once."""
    half = qs.shape[-1]
    out = fresh((*qs.shape[:-1], 2 * half), dtype)
    np.bitwise_and(qs, 0x0F, out=out[..., :half], casting="unsafe")
    np.right_shift(qs, 4, out=out[..., half:], casting="unsafe")
    return out


def native_kernels() -> Any:
    """The compiled kernels when this process has built or loaded them
    (:func:`attnlab.native.loaded`; a model's load builds them), or None: the one place the
    formats ask for them, and never a build from inside a forward."""
    return native.loaded()


def native_rows_dtype(ext: Any) -> torch.dtype:
    """The dtype the decode kernels of the native module ``ext`` take their rows in, the
    same for every format so that a layer's products share their rows: float32 where its
    q4 and q5_0 kernels, as q8_0's always, code rows into 16-bit integers as they are (the
    module's ``Q4_INTEGER`` and ``Q5_INTEGER``: the ``avx2`` and ``avx512`` builds). There
    a float32 row costs nothing more, and no row or product is rounded to bfloat16 on the
    way (Gemma 3 int4's decode-path argmax agreement with float32 rose from 0.953 to 1.000
    on an AVX2 build). bfloat16 elsewhere: where bf16 dot products are q5_0's fast path
    (``avx512-bf16``), on the plain build (float32 rows not measured there) and without
    the module."""
    integer = getattr(ext, "Q4_INTEGER", False) and getattr(ext, "Q5_INTEGER", False)
    return torch.float32 if integer else torch.bfloat16


def output_slices(parts: Sequence[Any]) -> list[slice]:
    """The output rows of each part in their stacked product."""
    out, start = [], 0
    for m in parts:
        out.append(slice(start, start + m.out_features))
        start += m.out_features
    return out


def fuse_buffers(
    cls: Any, parts: Sequence[Any], names: Sequence[str], bias: torch.Tensor | None
) -> Any:
    """``cls`` built from the parts' buffers ``names`` (its constructor's arguments, in
    order) each concatenated over the output rows, ``bias`` last; each part's buffers then
    become views of the fused ones (no second copy)."""
    fused = cls(*(torch.cat([getattr(m, name) for m in parts]) for name in names), bias)
    for m, rows in zip(parts, output_slices(parts), strict=True):
        for name in names:
            setattr(m, name, getattr(fused, name)[rows])
    return fused


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (0 for an inference tensor, which has none)."""
    try:
        return t._version
    except RuntimeError:
        return 0


class WeightFormat(nn.Module):
    """A linear layer's weight in one stored format; the base of the formats here.

    A format is registered under its :attr:`name` (:data:`WEIGHT_FORMATS`,
    :func:`register_format`) and builds itself from a float weight (:meth:`from_float`)
    or from its stored tensors (:meth:`from_stored`: tensors whose first dimension is the
    weight's rows, so that a loader's renames, head permutations and row splits apply to
    them as to a weight). A GGUF tensor of a type in :attr:`gguf_blocks` is read into them
    as stored by :meth:`gguf_codes`. Siblings that read the same input stack their rows
    into one product (:meth:`fuse`). Its forward takes and returns the input's dtype and
    runs :meth:`product` on rows in :meth:`decode_dtype` (a prompt's, from the crossover
    on, in the prompt arithmetic's dtype).

    A new format is a subclass here (its block layout, reader, help line and products)
    plus, for the compiled decode step, its kernel in :mod:`attnlab.native`.
    """

    #: The registry key, e.g. ``"int4"``.
    name: ClassVar[str]
    #: What it is, in a few words: its entry in the CLI's ``--dtype`` help
    #: (:func:`attnlab.quant.dtype_help`).
    cli_help: ClassVar[str] = ""
    #: GGUF types whose blocks this format holds as stored (codes unchanged), with their
    #: layout; :meth:`gguf_codes` reads them.
    gguf_blocks: ClassVar[Mapping[str, GGUFBlock]] = MappingProxyType({})
    #: The names of :attr:`gguf_blocks` (set for each subclass).
    gguf_types: ClassVar[frozenset[str]] = frozenset()
    #: GGUF types this format would hold only by quantising their values again, by the
    #: format that holds them with less loss (a loader stores such tensors in that one).
    gguf_instead: ClassVar[Mapping[str, str]] = MappingProxyType({})
    #: The format a weight gets when this one cannot hold its shape (:meth:`why_not`).
    fallback: ClassVar[str | None] = None
    #: From how many rows of input on (a prompt) :meth:`forward` hands :meth:`product` its
    #: rows in the prompt arithmetic's dtype (:func:`attnlab.quant.arith.prompt_dtype`:
    #: float32 on a CPU without bf16 dot products) and the product runs dense in it; fewer
    #: rows go in :meth:`decode_dtype` to the format's decode kernel. None (the default): this
    #: machine's crossover, measured at first use (:mod:`attnlab.quant.crossover`); an
    #: int, set on a layer or a class, decides it.
    dense_from_tokens: int | None = None
    #: The crossover ``ATTNLAB_CROSSOVER=defaults`` uses (measured on an AMD EPYC with bf16
    #: dot products, ``benchmarks/bench_int_prefill.py``).
    default_dense_from: ClassVar[int] = 16
    #: Whether :meth:`rows` reads only the rows it is asked for (an embedding table held
    #: in this format then costs the codes' memory, not a float copy of the table).
    gathers_rows: ClassVar[bool] = False

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.gguf_types = frozenset(cls.gguf_blocks)

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
    def from_stored(
        cls, stored: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> WeightFormat:
        """Build from the format's stored tensors, each (N, ...) (see the class).

        Raises:
            ValueError: tensors of a shape this format cannot take.
        """
        raise NotImplementedError

    @classmethod
    def from_rows(
        cls, stored: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> WeightFormat:
        """:meth:`from_stored` (its former name)."""
        return cls.from_stored(stored, bias)

    @classmethod
    def weight_shape(cls, stored: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """The (N, K) weight that ``stored`` (as :meth:`from_stored` takes it) holds: the
        first tensor's shape, unless the format packs several weights a byte."""
        return tuple(stored[0].shape)

    @classmethod
    def rows_shape(cls, stored: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """:meth:`weight_shape` (its former name)."""
        return cls.weight_shape(stored)

    @classmethod
    def gguf_codes(
        cls, data: np.ndarray, type_name: str, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        """A GGUF tensor of a type in :attr:`gguf_blocks`, not dequantised: the tensors
        :meth:`from_stored` takes.

        Args:
            data: the tensor's bytes as stored in the file.
            type_name: its GGML type name.
            shape: the torch shape (R, K).

        Raises:
            ValueError: another type, a shape that is not 2-D with K a multiple of the
                block, or one the data does not fill.
        """
        raise NotImplementedError

    @classmethod
    def gguf_block_rows(
        cls, data: np.ndarray, type_name: str, shape: tuple[int, ...]
    ) -> np.ndarray:
        """``data`` as (R, G, bytes) uint8 blocks, checked as :meth:`gguf_codes` says."""
        block = cls.gguf_blocks.get(type_name)
        if block is None or len(shape) != 2 or shape[1] % block.values:
            raise ValueError(
                f"{cls.name} codes need a 2-D {'/'.join(cls.gguf_blocks)} tensor with rows "
                f"of whole blocks, got {type_name} {shape}"
            )
        R, K = shape
        return np.asarray(data).view(np.uint8).reshape(R, K // block.values, block.nbytes)

    @classmethod
    def fuse(cls, parts: Sequence[Any], bias: torch.Tensor | None) -> WeightFormat | None:
        """One module for ``parts`` (same class and input width) with their rows stacked,
        or None when they cannot be stacked; ``bias`` is theirs concatenated."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The weight as the product uses it, float32 (N, K)."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape of integers) of :attr:`weight`: (..., K) float32, each
        value as :attr:`weight` has it. What an embedding table held in this format looks
        up (:class:`attnlab.quant.HeldEmbedding`); here the whole weight is dequantised,
        a format with :attr:`gathers_rows` reads only the rows asked for."""
        return self.weight[ids]

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) bfloat16 -> (M, N); a dense product (from :attr:`dense_from_tokens`
        rows on) runs in ``x2``'s dtype, bfloat16 or float32."""
        raise NotImplementedError

    def decode_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The bare product of a few rows in :meth:`decode_dtype` (fewer than the format's
        dense crossover), bias not added: what the decode step calls
        (:func:`attnlab.quant.decode_product`)."""
        return self.product

    def decode_dtype(self) -> torch.dtype:
        """The dtype :meth:`decode_kernel` takes its rows in and gives its products in:
        bfloat16 here; the formats whose kernel is attnlab's own (``q4.h``, ``q8_0.h``,
        ``q5_0.h``) take :func:`native_rows_dtype`'s."""
        return torch.bfloat16

    def row_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`decode_kernel` (its former name)."""
        return self.decode_kernel()

    def native_product(self) -> NativeProduct | None:
        """What the native decode step (:mod:`attnlab.native`) calls for :meth:`decode_kernel`:
        the same kernel on the same tensors; None when it has no such call."""
        return None

    def runs_dense(self, rows: int) -> bool:
        """Whether a product of ``rows`` rows of input runs dense (:attr:`dense_from_tokens`);
        fewer than :data:`~attnlab.quant.crossover.FIRST_PROBE_ROWS` never measure."""
        n = self.dense_from_tokens
        if n is None:
            if rows < crossover.FIRST_PROBE_ROWS:
                return False
            n = crossover.dense_from(type(self), (self.out_features, self.in_features))
        return rows >= n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) -> (..., N), in ``x``'s dtype."""
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        dtype = prompt_dtype() if self.runs_dense(x2.shape[0]) else self.decode_dtype()
        y = self.product(x2.to(dtype)).to(x.dtype)  # (M, N)
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
        ValueError: the name is taken (or is ``"float32"``, the unquantised layer), or a
            GGUF type it holds as stored is another format's.
    """
    if cls.name == "float32" or cls.name in WEIGHT_FORMATS:
        raise ValueError(f"weight format name {cls.name!r} is already taken")
    for other in WEIGHT_FORMATS.values():
        if cls.gguf_types & other.gguf_types:
            raise ValueError(
                f"weight format {cls.name!r} holds GGUF types "
                f"{sorted(cls.gguf_types & other.gguf_types)} as stored, which {other.name!r} holds"
            )
    WEIGHT_FORMATS[cls.name] = cls
    return cls
