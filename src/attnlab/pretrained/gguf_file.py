"""Read a GGUF file: metadata, tokenizer tables and weights dequantised to float32.

The header is parsed here (the format is small: gguf.md in llama.cpp), tensor data is
memory-mapped, and the block formats this project meets (Q4_0, Q4_1, Q8_0, MXFP4) are
dequantised here, vectorised over every block of a tensor at once (numpy). Any other
quantisation type (the K-quants, Q5_0, ...) falls back to ``gguf.quants.dequantize``,
which is vectorised numpy. The types a weight format holds as stored are read, not
dequantised, by that format (:meth:`GGUFContents.codes`,
:meth:`attnlab.quant.WeightFormat.gguf_codes`), whose module gives their block layout;
the sizes of every type come from the ``gguf`` package's table, and those of the types
read here from the formats' :attr:`~attnlab.quant.WeightFormat.gguf_blocks` (tested to
agree).

GGUF stores a 2-D weight with ``shape = [ne0, ne1]``: ``ne0`` is the contiguous (input)
dimension, so the torch tensor is ``(ne1, ne0)`` = ``(out_features, in_features)``, exactly
``nn.Linear.weight``'s layout.

``MXFP4`` (gpt-oss's experts; no weight format holds it): ``e: u8`` (an E8M0 exponent),
``qs: u8[16]``; weight ``j`` is ``E2M1(nibble_j) * 2**(e - 127)``, the E2M1 values ``0,
0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives (ggml stores them doubled,
``kvalues_mxfp4``, with ``2**(e - 128)``); weights ``0..15`` are the low nibbles of
``qs[0..15]`` and ``16..31`` the high ones.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import mmap
import struct
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnlab.pretrained.errors import ModelFileError, check_finite
from attnlab.quant import Int4Linear, Q5Linear, Q8Linear, gguf_blocks, gguf_format
from attnlab.quant.base import (
    GGUFBlock,
    f16_columns,
    fresh,
    fresh_copy,
    in_halves,
    native_kernels,
    nibbles,
)
from attnlab.quant.int4 import q4_k_parts

# Shape legend: N blocks, Q = 32 weights per block, R rows, K = row length (ne0).

QK = 32  # weights per block for Q4_0, Q4_1, Q8_0, MXFP4
QK_K = 256  # weights per super-block of the K-quants


class NonFiniteScalesError(ValueError):
    """The compiled reader of a type found blocks whose float16 scale is inf or NaN."""


#: The types the compiled kernels read into float32 (the same values as numpy's readers,
#: bit for bit): their kernel in :mod:`attnlab.native` and the weights a block. Each kernel
#: also counts the blocks whose scales are not finite, so that the loader's check of them
#: costs nothing beyond the reading (for Gemma 3's Q8_0 embedding a separate pass over its
#: 5.2M strided scales took 0.04 s).
_NATIVE_READERS = {
    "Q4_0": ("q4_blocks_float32", QK),
    "Q4_1": ("q4_blocks_float32", QK),
    "Q8_0": ("q8_0_blocks_float32", QK),
    "Q5_0": ("q5_0_blocks_float32", QK),
    "Q4_K": ("q4_k_blocks_float32", QK_K),
    "Q6_K": ("q6_k_blocks_float32", QK_K),
}


def reads_natively(type_name: str) -> bool:
    """Whether this process reads ``type_name``'s blocks with the compiled kernels."""
    return type_name in _NATIVE_READERS and native_kernels() is not None


def _native_read(blocks: np.ndarray, type_name: str) -> np.ndarray | None:
    """``type_name``'s blocks read by the compiled kernels (in two halves where the output
    is large, :func:`attnlab.quant.base.in_halves`), or None where this process has none.

    Raises:
        NonFiniteScalesError: some block's scale is inf or NaN.
    """
    ext = native_kernels()
    if ext is None:
        return None
    kernel_name, width = _NATIVE_READERS[type_name]
    kernel = getattr(ext, kernel_name)
    out = fresh((blocks.shape[0], width), np.float32)  # (N, width)
    raw, into = _readable(blocks), torch.from_numpy(out)
    bad: list[int] = []
    in_halves(out.shape[0], out.nbytes, lambda a, b: bad.append(kernel(raw[a:b], into[a:b])))
    if sum(bad):
        raise NonFiniteScalesError(
            f"non-finite quantisation scale(s) in {sum(bad)} of its {type_name} blocks"
        )
    return out


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks (N, 18) uint8 -> (N, 32) float32, ``(q - 8) * d``."""
    done = _native_read(blocks, "Q4_0")
    if done is not None:
        return done
    out = nibbles(blocks[:, 2:], np.float32)  # (N, Q)
    out -= 8.0
    out *= f16_columns(blocks, 1)  # (N, 1) broadcast
    return out


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (N, 20) uint8 -> (N, 32) float32, ``q * d + m`` (two roundings, as ggml)."""
    done = _native_read(blocks, "Q4_1")
    if done is not None:
        return done
    dm = f16_columns(blocks, 2)  # (N, 2): d, m
    out = nibbles(blocks[:, 4:], np.float32)  # (N, Q)
    out *= dm[:, :1]
    out += dm[:, 1:]
    return out


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (N, 34) uint8 -> (N, 32) float32, ``q * d``.

    One pass that writes the output once (the codes read in place, converted inside the
    multiply), not an int8 -> float32 copy and then a multiply over it: Gemma's 262k x 640
    embedding is Q8_0 (``benchmarks/bench_pretrained.py --only gemma3-load`` times the
    load). Where this process has the compiled kernels, their ``q8_0_blocks_float32``
    writes the same values (Gemma 3's 10 tensors, 677 MB, in 0.25 s here).
    """
    done = _native_read(blocks, "Q8_0")
    if done is not None:
        return done
    out = fresh((blocks.shape[0], QK), np.float32)  # (N, Q)
    codes = blocks[:, 2:].view(np.int8)

    def rows(a: int, b: int) -> None:
        np.multiply(codes[a:b], f16_columns(blocks[a:b], 1), out=out[a:b])

    in_halves(out.shape[0], out.nbytes, rows)
    return out


def _readable(blocks: np.ndarray) -> torch.Tensor:
    """``blocks`` (a view of the file's read-only map) as a tensor, for kernels that only
    read it."""
    with warnings.catch_warnings():  # PyTorch warns that the array is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(blocks)


def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks (N, 22) uint8 -> (N, 32) float32, ``(q - 16) * d``: q's low four bits
    the nibbles of bytes 6-21 (low ones first), its fifth bit weight ``j``'s bit of the
    little-endian uint32 in bytes 2-5 (:class:`~attnlab.quant.Q5Linear` holds the blocks as
    they are; this is a float32 model's reading, a third of the time of ``gguf``'s).

    Where this process has the compiled kernels (:func:`attnlab.native.loaded`), their
    ``q5_0_blocks_float32`` writes the same values in one pass (Gemma 3's 81 tensors in 0.11 s on
    one thread against 0.26 s here; equal bit for bit, tested)."""
    done = _native_read(blocks, "Q5_0")
    if done is not None:
        return done
    q = nibbles(blocks[:, 6:])  # (N, Q) in 0..15
    q |= np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little") << 4  # (N, Q): bit j
    out = fresh_copy(q, np.float32)
    out -= 16.0
    out *= f16_columns(blocks, 1)  # (N, 1) broadcast
    return out


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks (N, 144) uint8 -> (N, 256) float32, ``(d * sc) * q - dmin * m`` per
    32-weight sub-block (:func:`attnlab.quant.int4.q4_k_parts`): one rounding of the
    product and one of the difference, as ``gguf``'s reading (Gemma 3's 27 tensors in
    0.09 s against its 0.13 s, written into memory that faults in faster)."""
    done = _native_read(blocks, "Q4_K")
    if done is not None:
        return done
    codes, scales, mins = q4_k_parts(blocks, np.float32)  # (N, 256), (N, 8), (N, 8)
    out = codes.reshape(-1, 8, QK)  # (N, 8, Q), written in place
    out *= scales[:, :, None]
    out -= mins[:, :, None]
    return codes


_Q6_K_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks (N, 210) uint8 -> (N, 256) float32, ``(d * sc) * (q - 32)``.

    A block is ``ql`` (128 bytes), ``qh`` (64), 16 int8 scales ``sc`` (one per 16 weights)
    and ``d: f16`` last. Each half of 128 weights takes 64 bytes of ``ql`` and 32 of ``qh``:
    weight ``j``'s low four bits are the low nibbles of ``ql``'s 64 bytes for ``j < 64``,
    then their high nibbles; its top two bits are bits ``2 (j // 32)`` and up of
    ``qh[j % 32]``. ``d * sc`` is exact in float32 (11 bits times 8), so the one rounding
    is the product, as in ggml and ``gguf``.
    """
    done = _native_read(blocks, "Q6_K")
    if done is not None:
        return done
    n = blocks.shape[0]
    q = nibbles(blocks[:, :128].reshape(n, 2, 64))  # (N, 2, 128): low four bits
    top = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _Q6_K_SHIFTS) & 3  # (N, 2, 4, 32)
    q |= top.reshape(n, 2, 128) << 4
    out = fresh_copy(q, np.float32).reshape(n, 16, 16)  # (N, sub-blocks, 16)
    out -= 32.0
    d = f16_columns(blocks[:, 208:], 1)  # (N, 1): the block's last two bytes
    with np.errstate(invalid="ignore", over="ignore"):  # a bad d: the caller names it
        out *= (d * blocks[:, 192:208].view(np.int8))[:, :, None]  # (N, 16, 1) exact
    return out.reshape(n, 256)


# E2M1 codes 0..15 doubled (ggml's kvalues_mxfp4): the sign is bit 3.
_MXFP4_VALUES = np.array(
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32
)


def mxfp4_values(codes: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """E2M1 codes (uint8 0..15) times ``2**(e - 127)`` for their E8M0 exponents ``e``
    (uint8, broadcast against ``codes``), as float32.

    Every product is exact in float32 (a 4-bit value times a power of two) except where it
    passes float32's range (``e`` of 254 or more with a large value): that is inf, as in
    ggml, gguf-py and transformers, and the loaders refuse it.
    """
    out = _MXFP4_VALUES[codes]  # doubled values: hence e - 128
    with np.errstate(over="ignore"):
        scaled = np.ldexp(out, exponents.astype(np.int32) - 128)
    return scaled.astype(np.float32, copy=False)


def dequantize_mxfp4(blocks: np.ndarray) -> np.ndarray:
    """MXFP4 blocks (N, 17) uint8 -> (N, 32) float32 (:func:`mxfp4_values`); a block's
    first 16 weights are the low nibbles of its bytes, the next 16 the high ones."""
    return mxfp4_values(nibbles(blocks[:, 1:]), blocks[:, :1])  # (N, Q)


# The weight formats' readers of the types they hold as stored, by their former names.
int4_codes = Int4Linear.gguf_codes
q8_0_codes = Q8Linear.gguf_codes
q5_0_codes = Q5Linear.gguf_codes
#: GGUF types whose blocks read as the codes of a weight format, as row-aligned tensors
#: (:func:`attnlab.quant.gguf_format` answers for formats registered since).
CODE_READERS = {t: gguf_format(t).gguf_codes for t in gguf_blocks()}  # type: ignore[union-attr]

# The types dequantised here, by kernel; the block layout of those no format holds.
_BLOCK_KERNELS = {
    "Q4_0": dequantize_q4_0,
    "Q4_1": dequantize_q4_1,
    "Q8_0": dequantize_q8_0,
    "Q5_0": dequantize_q5_0,
    "Q4_K": dequantize_q4_k,
    "Q6_K": dequantize_q6_k,
    "MXFP4": dequantize_mxfp4,
}
# No float16 scale first: their values are checked (Q6_K's d is the block's last 2 bytes).
_OWN_BLOCKS = {
    "MXFP4": GGUFBlock(values=QK, nbytes=17),
    "Q6_K": GGUFBlock(values=QK_K, nbytes=210),
}


def _block(type_name: str) -> GGUFBlock | None:
    """``type_name``'s block layout, if a weight format holds it or it is read here."""
    return gguf_blocks().get(type_name) or _OWN_BLOCKS.get(type_name)


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantise one GGUF tensor's raw data to a float32 torch tensor of ``shape``.

    The kernels are numpy, not torch, on purpose: numpy's element-wise operations run on
    one thread, while torch's split across its thread pool, whose waiting on a machine
    whose few cores are shared costs more than the work.

    Args:
        data: the tensor's bytes as stored in the file (any numpy dtype; viewed as bytes).
        type_name: the GGML type name, e.g. ``"Q4_1"``.
        shape: the torch shape, outermost first (reverse of GGUF's ``ne`` order).

    Returns:
        A new float32 tensor of ``shape`` (it does not alias the memory-mapped file).

    Raises:
        NotImplementedError: for a type neither this module nor ``gguf`` can dequantise.
        NonFiniteScalesError: (a ``ValueError``) the compiled kernels read the type and
            some block's scale is inf or NaN (numpy's readings return such values, which
            :meth:`GGUFContents.tensor` then refuses by name).
    """
    if type_name in ("F32", "F16"):
        raw = np.asarray(data).view(np.uint8)
        values = raw.view(np.float32 if type_name == "F32" else np.float16)
        return torch.from_numpy(fresh_copy(values, np.float32)).reshape(shape)
    if type_name == "BF16":
        bits = np.asarray(data).view(np.uint8).view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32)).reshape(shape)
    block = _block(type_name)
    if type_name in _BLOCK_KERNELS and block is not None:  # (every kernel's type has one)
        blocks = np.asarray(data).view(np.uint8).reshape(-1, block.nbytes)  # (N, bytes)
        return torch.from_numpy(_BLOCK_KERNELS[type_name](blocks)).reshape(shape)  # (N, Q)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    out = gguf_dequantize(np.asarray(data), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation, back to the "rotate half" RoPE layout.

    llama.cpp's converter stores each head's rows of ``W_q``/``W_k`` interleaved
    (pairs ``(x0, x1), (x2, x3), ...`` rotate together), while the Hugging Face layout
    that ``attnlab.attention.RotaryEmbedding`` uses rotates ``x_i`` with ``x_{i + D/2}``.
    The converter did ``reshape(H, 2, D/2, C).swapaxes(1, 2)``; this is its inverse.

    Args:
        weight: (H*D, C) rows of one projection as stored in the GGUF file.
        n_heads: heads of this projection (query heads for q, key/value heads for k).

    Returns:
        (H*D, C) weight in "rotate half" layout.
    """
    rows, cols = weight.shape
    head_dim = rows // n_heads
    if weight.device.type == "cpu" and not weight.requires_grad:
        # The same permutation copied by numpy (one thread; see `dequantize`).
        w_np = weight.numpy().reshape(n_heads, head_dim // 2, 2, cols)  # (H, D/2, 2, C)
        return torch.from_numpy(np.ascontiguousarray(w_np.swapaxes(1, 2)).reshape(rows, cols))
    w = weight.reshape(n_heads, head_dim // 2, 2, cols)  # (H, D/2, 2, C)
    return w.transpose(1, 2).reshape(rows, cols)  # (H, 2, D/2, C) -> (H*D, C)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lies in the file.

    Attributes:
        name: GGUF tensor name, e.g. ``"blk.0.attn_q.weight"``.
        type_name: GGML type name, e.g. ``"Q4_1"``.
        shape: torch shape, outermost first (reverse of GGUF's ``ne``).
        offset: absolute byte offset of the data in the file.
        nbytes: size of the data in bytes.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFContents:
    """What one GGUF file holds: metadata read eagerly, tensors dequantised on request.

    Attributes:
        path: the file.
        metadata: every key/value pair except the big tokenizer arrays, as Python values.
        tokens: the vocabulary in id order (``tokenizer.ggml.tokens``; decoded on first
            use, :attr:`token_count` without decoding).
        token_types: llama.cpp token type per id (1 normal, 3 control, ...).
        merges: BPE merges as ``"left right"`` strings, in rank order (decoded on first use).
        scores: SentencePiece scores per id (``tokenizer.ggml.scores``), or empty.
        tensor_infos: name -> :class:`GGUFTensorInfo`, in file order.
    """

    path: Path
    metadata: dict[str, Any]
    _tokens: list[str] | _LazyStrings
    token_types: list[int]
    _merges: list[str] | _LazyStrings
    scores: list[float]
    tensor_infos: dict[str, GGUFTensorInfo]
    _data: np.ndarray  # the whole file, memory-mapped uint8

    @property
    def tokens(self) -> list[str]:
        """The vocabulary in id order (decoded on first use: :class:`_LazyStrings`)."""
        return _strings_of(self._tokens)

    @property
    def token_count(self) -> int:
        """How many tokens the vocabulary holds, without decoding it."""
        return len(self._tokens)

    @property
    def merges(self) -> list[str]:
        """The BPE merges in rank order (decoded on first use)."""
        return _strings_of(self._merges)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantised to float32 (a fresh tensor, not a view of the file).

        Raises:
            ModelFileError: no such tensor, a type that cannot be dequantised, or NaN / inf
                in its values or quantisation scales (named).
        """
        if name not in self.tensor_infos:
            raise ModelFileError(self.path, f"has no tensor {name!r}")
        info = self.tensor_infos[name]
        raw = self._data[info.offset : info.offset + info.nbytes]
        # The compiled readers check the scales as they read (NonFiniteScalesError).
        scales_checked = reads_natively(info.type_name) or self._check_block_scales(name, raw)
        try:
            out = dequantize(raw, info.type_name, info.shape)
        except NonFiniteScalesError as e:
            self._check_block_scales(name, raw)  # names the first such scale and its value
            raise ModelFileError(self.path, f"tensor {name!r} holds {e}") from None
        except NotImplementedError as e:
            raise ModelFileError(self.path, f"tensor {name!r}: {e}") from None
        if not scales_checked:
            check_finite(out, name, self.path)
        self._let_go(info)
        return out

    def codes(self, name: str) -> tuple[torch.Tensor, ...]:
        """Tensor ``name``'s blocks as codes, not dequantised: read by the weight format that
        holds its type as stored (:func:`attnlab.quant.gguf_format`,
        :meth:`~attnlab.quant.WeightFormat.gguf_codes`).

        Raises:
            ModelFileError: no such tensor, a type without codes here, or NaN / inf in its
                quantisation scales (named).
        """
        if name not in self.tensor_infos:
            raise ModelFileError(self.path, f"has no tensor {name!r}")
        info = self.tensor_infos[name]
        fmt = gguf_format(info.type_name)
        if fmt is None:
            raise ModelFileError(self.path, f"tensor {name!r}: no codes for type {info.type_name}")
        raw = self.raw(name)
        try:
            out = fmt.gguf_codes(raw, info.type_name, info.shape)
        except ValueError as e:  # a shape the blocks do not fit
            raise ModelFileError(self.path, f"tensor {name!r}: {e}") from None
        if not self._check_block_scales(name, raw):
            for t in out[1:]:  # codes are finite; the scales and zeros are checked
                check_finite(t, name, self.path, what="quantisation scale")
        self._let_go(info)
        return out

    def _let_go(self, info: GGUFTensorInfo) -> None:
        """Drop the process's pages of a tensor that has been read (``madvise`` with
        ``MADV_DONTNEED``): they count in its resident memory, beside the tensors made from
        them, until the file is closed. The file is mapped read-only, so nothing is lost:
        a later read of those bytes (a tied tensor read twice) faults them in again from
        the page cache. Gemma 3's int4 load peaked at 868 MB of resident memory with every
        page it had read still mapped, 647 MB without; it holds 496 MB after either."""
        mapped = getattr(self._data, "_mmap", None)
        if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
            return  # not a memory map (a test's array), or a system without madvise
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):  # advice only: never fails a load
            mapped.madvise(mmap.MADV_DONTNEED, start, info.offset + info.nbytes - start)

    def _check_block_scales(self, name: str, raw: np.ndarray) -> bool:
        """For a type whose blocks start with float16 scales (:attr:`GGUFBlock.f16_scales`:
        ``d``, Q4_1's ``m``, Q4_K's ``dmin``), check those and return True: the values
        (``d`` times an integer, plus or minus ``m``) are finite exactly when those are, a
        fraction of the values to check. False for other types.

        Raises:
            ModelFileError: a scale that is NaN or inf (named).
        """
        block = _block(self.tensor_infos[name].type_name)
        if block is None or not block.f16_scales:
            return False
        blocks = raw.reshape(-1, block.nbytes)  # (N, bytes)
        if block.nbytes % 2 == 0:
            # The scales where they lie, a strided float16 view that check_finite sums
            # without copying (a float32 copy of every scale first cost 0.1 s for Gemma 3's
            # 5.2M-block embedding).
            scales = blocks.view(np.float16)[:, : block.f16_scales]  # (N, scales)
        else:
            scales = f16_columns(blocks, block.f16_scales)
        check_finite(scales, name, self.path, what="quantisation scale")
        return True

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes as stored (a view of the memory-mapped file)."""
        if name not in self.tensor_infos:
            raise KeyError(f"tensor {name!r} is not in {self.path.name}")
        info = self.tensor_infos[name]
        return self._data[info.offset : info.offset + info.nbytes]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor dequantised to float32, by GGUF name, in file order."""
        return {name: self.tensor(name) for name in self.tensor_infos}


_BIG_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.scores",
)

# GGUF value types (gguf.md): id -> struct format; 8 = string, 9 = array.
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


def _decode_items(region: np.ndarray, lengths: np.ndarray) -> list[str] | None:
    """The strings of a run of GGUF string items (a u64 length, then that many bytes),
    decoded at once: each length field becomes one NUL, the whole run one ``decode``, and
    ``split`` cuts it at the NULs. None where that cannot tell the strings apart or is not
    UTF-8 (a NUL inside a string, a bad byte, a character cut at a string's end: a NUL
    cannot continue one), for the caller to find which string it was.

    Args:
        region: (S,) uint8, the items' bytes, exactly.
        lengths: (C,) int64, each item's length, in order (``sum(lengths) + 8 C == S``).
    """
    count = len(lengths)
    starts = np.cumsum(lengths + 8) - lengths  # (C,) each string's first byte in region
    inside = np.zeros(len(region) + 1, dtype=np.int8)  # +1 where a string starts, -1 after
    inside[starts] += 1
    inside[starts + lengths] -= 1
    text = np.zeros(int(lengths.sum()) + count, dtype=np.uint8)  # a NUL before each string
    is_text = np.ones(len(text), dtype=bool)
    is_text[starts - 8 - 7 * np.arange(count)] = False  # the NULs' places
    text[is_text] = region[np.cumsum(inside[:-1], dtype=np.int8).view(bool)]
    blob = text.tobytes()
    if blob.count(0) != count:  # a string holds a NUL
        return None
    try:
        return blob.decode("utf-8").split("\x00")[1:]
    except UnicodeDecodeError:
        return None


# The arrays of strings read lazily: their lengths when the header is read (to find what
# follows), their text on first use, in the tokenizer's thread beside the weights.
_LAZY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


class _LazyStrings:
    """A run of GGUF string items, decoded on first use (:meth:`get`; thread-safe).

    Gemma 3's vocabulary is 262,144 strings; decoding them took 0.06 s of a load's
    critical path, before the model's build could start. The header's parse reads only
    their lengths (where the next field is), and the tokenizer, built in a thread beside
    the weights, decodes them. A string that is not UTF-8 or holds a NUL is then refused,
    named, as the header's parse would have.
    """

    def __init__(
        self,
        buf: memoryview,
        pos: int,
        end: int,
        lengths: list[int] | np.ndarray,
        path: Path,
        field: str,
    ) -> None:
        self._buf, self._pos, self._end = buf, pos, end
        self._lengths, self._path, self._field = lengths, path, field
        self._items: list[str] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lengths)

    def get(self) -> list[str]:
        """The strings (decoded once)."""
        with self._lock:
            if self._items is None:
                region = np.frombuffer(
                    self._buf, dtype=np.uint8, count=self._end - self._pos, offset=self._pos
                )
                items = _decode_items(region, np.array(self._lengths, dtype=np.int64))
                if items is None:  # find the string at fault, and name it
                    cur = _Cursor(self._buf, self._path)
                    cur.pos, cur.field = self._pos, self._field
                    items = cur._strings_one_by_one(len(self._lengths))
                self._items = items
            return self._items


def _strings_of(value: list[str] | _LazyStrings) -> list[str]:
    return value.get() if isinstance(value, _LazyStrings) else value


#: Runs of at least this many strings are walked by the compiled kernels where this process
#: has them (a vocabulary: Gemma 3's 262,144 lengths in 2 ms against 0.04 s in Python).
_NATIVE_RUN_FROM = 1024
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ELEMENTS = 1 << 40  # per tensor; far above any real model's largest matrix
_MAX_DEPTH = 4  # arrays of arrays


class _Cursor:
    """Sequential little-endian reads from a bytes-like buffer, every read bounds-checked.

    Any read past the end, any length or count the rest of the file cannot hold, raises
    :class:`ModelFileError` naming the file and what was being read (``self.field``).
    """

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.field = "header"

    def fail(self, problem: str) -> ModelFileError:
        return ModelFileError(self.path, f"{self.field}: {problem}")

    @property
    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def need(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or nbytes > self.remaining:
            raise self.fail(
                f"{what} needs {nbytes} bytes at offset {self.pos}, the file has "
                f"{self.remaining} left (truncated or corrupt)"
            )

    def scalar(self, fmt: str, what: str = "value") -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str = "string") -> str:
        n = self.scalar("<Q", f"{what} length")
        self.need(n, f"{what} of length {n}")
        try:
            text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None
        self.pos += n
        return text

    def strings(self, count: int, lazy: bool = False) -> list[str] | _LazyStrings:
        """``count`` strings in a row (a vocabulary: 262k of them in Gemma's files);
        ``lazy``: their lengths now, their text on first use (:class:`_LazyStrings`).

        The lengths are read in one loop and the strings decoded together
        (:func:`_decode_items`), a third of the time of decoding each on its own; the
        tokenizer tables were most of the header's parse time. A run that is cut short, a
        length past the file's end, a string that is not UTF-8 or one holding a NUL byte
        takes :meth:`_strings_one_by_one`, which names the string at fault.
        """
        buf, pos = self.buf, self.pos
        lengths: list[int] | np.ndarray
        ext = native_kernels()
        if ext is not None and count >= _NATIVE_RUN_FROM:  # the compiled walk
            end, walked = ext.string_run(_readable(np.frombuffer(buf, np.uint8)), pos, count)
            if end < 0:  # one runs past the end: find it, and name it
                return self._strings_one_by_one(count)
            lengths, pos = walked.numpy(), end
        else:
            length_at = _U64.unpack_from
            lengths = [0] * count
            try:
                for i in range(count):
                    (n,) = length_at(buf, pos)
                    lengths[i] = n
                    pos += 8 + n
            except (struct.error, OverflowError):  # a length field past the end
                return self._strings_one_by_one(count)
        if pos > len(buf) or count == 0:
            return self._strings_one_by_one(count)
        if lazy:
            out_later = _LazyStrings(buf, self.pos, pos, lengths, self.path, self.field)
            self.pos = pos
            return out_later
        region = np.frombuffer(buf, dtype=np.uint8, count=pos - self.pos, offset=self.pos)
        out = _decode_items(region, np.array(lengths, dtype=np.int64))
        if out is None:
            return self._strings_one_by_one(count)
        self.pos = pos
        return out

    def _strings_one_by_one(self, count: int) -> list[str]:
        """:meth:`strings` with :meth:`string`'s checks string by string, in one loop."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length_at = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, f"string {i} length")
            (n,) = length_at(buf, pos)
            pos += 8
            if n > end - pos:
                self.pos = pos
                self.need(n, f"string {i} of length {n}")
            try:
                append(str(buf[pos : pos + n], "utf-8"))
            except UnicodeDecodeError:
                self.pos = pos
                raise self.fail(f"string {i} is not valid UTF-8") from None
            pos += n
        self.pos = pos
        return out

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 count, refused if the rest of the file cannot hold that many items."""
        n = self.scalar("<Q", what)
        if n * min_item_bytes > self.remaining:
            raise self.fail(
                f"{what} = {n} cannot fit in the {self.remaining} bytes left "
                f"(each needs at least {min_item_bytes})"
            )
        return int(n)

    def value(self, vtype: int, depth: int = 0, lazy: bool = False) -> Any:
        """One value of type ``vtype``; ``lazy``: an array of strings read lazily
        (:meth:`strings`)."""
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= _MAX_DEPTH:
                raise self.fail(f"arrays nested deeper than {_MAX_DEPTH}")
            item_type = self.scalar("<I", "array item type")
            if item_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[item_type]
                size = struct.calcsize(fmt)
                count = self.count("array length", size)
                if item_type == 7:
                    arr = [bool(b) for b in self.buf[self.pos : self.pos + count]]
                else:
                    arr = np.frombuffer(
                        self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos
                    ).tolist()
                self.pos += size * count
                return arr
            if item_type not in (_STRING, _ARRAY):
                raise self.fail(f"unknown array item type {item_type}")
            count = self.count("array length", 8 if item_type == _STRING else 12)
            if item_type == _STRING:
                return self.strings(count, lazy=lazy)
            return [self.value(item_type, depth + 1) for _ in range(count)]
        if vtype not in _SCALAR_FORMATS:
            raise self.fail(f"unknown value type {vtype}")
        return self.scalar(_SCALAR_FORMATS[vtype])


@functools.cache
def _ggml_types() -> tuple[Any, Mapping[Any, tuple[int, int]]]:
    """The ``gguf`` package's ``GGMLQuantizationType`` and ``GGML_QUANT_SIZES``: from
    ``gguf.constants`` when the package is imported already, else from that one module
    run on its own (it imports nothing beyond the standard library). Importing the package
    runs its ``__init__``, which imports its reader, writer, vocabulary and metadata
    modules (yaml among them): about 0.1 s of a command's start that a file whose types
    attnlab reads itself never needs. Only the types' names leave :func:`read_gguf`.

    Raises:
        ImportError: the ``gguf`` package is not installed.
    """
    import importlib.util
    import sys

    if "gguf" not in sys.modules:
        spec = importlib.util.find_spec("gguf")
        if spec is None:
            raise ImportError(
                "reading GGUF files needs the gguf package: pip install 'attnlab[pretrained]'"
            )
        for folder in spec.submodule_search_locations or ():
            own = importlib.util.spec_from_file_location(
                "attnlab._gguf_constants", Path(folder) / "constants.py"
            )
            if own is None or own.loader is None:
                continue
            module = importlib.util.module_from_spec(own)
            try:
                own.loader.exec_module(module)
            except (OSError, ImportError):  # laid out otherwise: the package below
                continue
            return module.GGMLQuantizationType, module.GGML_QUANT_SIZES
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGMLQuantizationType, GGML_QUANT_SIZES


def read_gguf(path: str | Path) -> GGUFContents:
    """Open a GGUF file (version 2 or 3) and read its metadata and tokenizer tables.

    The header is parsed here in one pass (the ``gguf`` package's reader builds a numpy
    view per string and takes seconds on a 49k-token vocabulary); tensor data stays
    memory-mapped until :meth:`GGUFContents.tensor` dequantises it. The file is untrusted:
    every length, count, type, dimension and offset is checked against the file's size
    before anything is read or allocated.

    Args:
        path: the ``.gguf`` file.

    Returns:
        A :class:`GGUFContents`.

    Raises:
        ModelFileError: (a ``ValueError``) a missing file, not GGUF version 2 or 3, or a
            header that is truncated or lies (names the field and the problem).
    """
    GGMLQuantizationType, GGML_QUANT_SIZES = _ggml_types()

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(path, "is missing (expected a .gguf file)")
    if path.stat().st_size < 24:
        raise ModelFileError(path, f"is {path.stat().st_size} bytes, too short for a GGUF header")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    size = len(data)
    cur = _Cursor(memoryview(data.data).cast("B"), path)
    magic = bytes(cur.buf[0:4])
    cur.pos = 4
    version = cur.scalar("<I", "version")
    if magic != b"GGUF" or version not in (2, 3):
        raise ModelFileError(
            path,
            f"is not a GGUF file of version 2 or 3 (magic {magic!r}, version {version}); "
            "re-convert it with a current llama.cpp",
        )
    cur.field = "tensor count"
    n_tensors = cur.count("tensor count", 8 + 4 + 8 + 4 + 8)
    cur.field = "key-value count"
    n_kv = cur.count("key-value count", 8 + 4)
    kv: dict[str, Any] = {}
    for i in range(n_kv):
        cur.field = f"key {i}"
        key = cur.string("key")
        cur.field = f"value of {key!r}"
        kv[key] = cur.value(cur.scalar("<I", "value type"), lazy=key in _LAZY_ARRAYS)
    raw_infos = []
    for i in range(n_tensors):
        cur.field = f"tensor {i}"
        name = cur.string("tensor name")
        cur.field = f"tensor {name!r}"
        n_dims = cur.scalar("<I", "dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise cur.fail(f"has {n_dims} dimensions, expected 1..{_MAX_DIMS}")
        ne = [int(cur.scalar("<Q", "dimension")) for _ in range(n_dims)]
        type_id = cur.scalar("<I", "ggml type")
        offset = int(cur.scalar("<Q", "data offset"))
        raw_infos.append((name, ne, type_id, offset))
    alignment = kv.get("general.alignment", 32)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or not 1 <= alignment <= 1 << 16
        or alignment & (alignment - 1)
    ):
        raise ModelFileError(path, f"general.alignment = {alignment!r} is not a power of two")
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    infos: dict[str, GGUFTensorInfo] = {}
    for name, ne, type_id, offset in raw_infos:
        where = f"tensor {name!r}"
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelFileError(path, f"{where}: unknown ggml type {type_id}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise ModelFileError(path, f"{where}: ggml type {qtype.name} has no known size")
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = math.prod(ne)  # Python ints: cannot overflow
        if n_elements > _MAX_ELEMENTS or any(n <= 0 for n in ne):
            raise ModelFileError(
                path, f"{where}: dimensions {ne} (product {n_elements}) are not a sane shape"
            )
        if ne[0] % block_size:
            raise ModelFileError(
                path,
                f"{where}: row length {ne[0]} is not a multiple of {qtype.name}'s "
                f"block of {block_size}",
            )
        nbytes = n_elements // block_size * type_size
        start = data_start + offset
        if offset % alignment or start + nbytes > size:
            raise ModelFileError(
                path,
                f"{where}: data at offset {offset} ({nbytes} bytes) lies past the end of "
                f"the file ({size} bytes) or off the {alignment}-byte alignment",
            )
        if name in infos:
            raise ModelFileError(path, f"{where} appears twice")
        infos[name] = GGUFTensorInfo(
            name=name,
            type_name=qtype.name,
            shape=tuple(reversed(ne)),
            offset=start,
            nbytes=nbytes,
        )
    # Overlapping tensors are no writer's output: one tensor's bytes read as another's
    # type give finite garbage the value checks cannot tell from weights.
    spans = sorted((i.offset, i.offset + i.nbytes, i.name) for i in infos.values())
    for (_, end_a, a), (begin_b, _, b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise ModelFileError(path, f"tensors {a!r} and {b!r} overlap in the data")
    metadata = {k: v for k, v in kv.items() if k not in _BIG_ARRAYS}
    tokens = kv.get("tokenizer.ggml.tokens", [])
    token_types = kv.get("tokenizer.ggml.token_type", [])
    merges = kv.get("tokenizer.ggml.merges", [])
    scores = kv.get("tokenizer.ggml.scores", [])
    for key, value in (
        ("tokenizer.ggml.tokens", tokens),
        ("tokenizer.ggml.token_type", token_types),
        ("tokenizer.ggml.merges", merges),
        ("tokenizer.ggml.scores", scores),
    ):
        if not isinstance(value, (list, _LazyStrings)):
            raise ModelFileError(path, f"{key} must be an array, got {type(value).__name__}")
    return GGUFContents(
        path=path,
        metadata=metadata,
        _tokens=tokens,
        token_types=token_types,
        _merges=merges,
        scores=scores,
        tensor_infos=infos,
        _data=data,
    )
